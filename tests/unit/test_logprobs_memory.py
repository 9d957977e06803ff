"""Peak memory of the learner's log-prob pass with Qwen2.5's 151,936-word head: the
chunked pass (learners/logprobs.py) stays far under the size of the full logits, and the
full-logits pass (``chunk_tokens=0``) does not, so the bound can fail.

Each measurement runs in a fresh process: a small warm-up pass, then the peak resident
size is reset to the current one (``/proc/self/clear_refs``) and measured again after
one forward and backward of 2,048 masked tokens. Float32; a tied head (as SmolLM2's) on a model of hidden size 32, so the
head's [tokens x vocabulary] logits are almost all the memory a pass needs."""

import json
import os
import subprocess
import sys
from pathlib import Path

VOCAB = 151_936
ROWS, PROMPT, RESPONSE = 4, 8, 512  # 4 x 512 = 2,048 masked tokens
TOKENS = ROWS * RESPONSE
CHUNK = 64  # positions whose logits exist at once: 64 x 151,936 x 4 B = 39 MB
FULL_LOGITS = TOKENS * VOCAB * 4  # one float32 copy of the whole logits: 1.24 GB
# The chunked pass keeps a few chunk-sized tensors (the first chunk's graph, a recomputed
# chunk's logits, log-softmax and their gradients), well under a quarter of one copy of
# the full logits; the full pass keeps at least the logits and their log-softmax.
BOUND = FULL_LOGITS // 4  # 311 MB


def _measure(chunk: int) -> int:
    """Bytes the peak resident memory grew by over one forward and backward."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from learners.logprobs import PassOptions, token_stats

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config)
    options = PassOptions(chunk_tokens=chunk)

    def step(rows: int, response: int) -> None:
        ids = torch.randint(0, VOCAB, (rows, PROMPT + response))
        mask = torch.zeros(rows, PROMPT + response - 1)
        mask[:, PROMPT - 1 :] = 1
        stats = token_stats(model, ids, torch.ones_like(ids), mask, options=options)
        (stats.logp * mask).sum().backward()

    step(1, 4)  # kernels and thread pools set up, the gradients allocated
    # The process's peak so far (imports, the model's initialisation) may be above what
    # the pass needs: reset it to the current resident size first (Linux: clear_refs 5).
    Path("/proc/self/clear_refs").write_text("5")
    before = _status_kib("VmRSS")
    step(ROWS, RESPONSE)
    return (_status_kib("VmHWM") - before) * 1024


def _status_kib(field: str) -> int:
    """A size in KiB from /proc/self/status (VmRSS: resident now; VmHWM: its peak)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise KeyError(field)


def _peak_growth(chunk: int) -> int:
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    cmd = [sys.executable, __file__, str(chunk)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=180, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_growth"]


def test_the_chunked_pass_stays_under_a_quarter_of_the_full_logits():
    growth = _peak_growth(CHUNK)
    assert 0 < growth < BOUND, f"peak grew by {growth / 2**20:.0f} MiB"


def test_the_full_logits_pass_exceeds_the_bound():
    """The same pass through the model's own head (``logprob_chunk_tokens: 0``): the
    [tokens x vocabulary] logits exist at once, so the bound above is not loose."""
    growth = _peak_growth(0)
    assert growth > FULL_LOGITS > BOUND, f"peak grew by {growth / 2**20:.0f} MiB"


if __name__ == "__main__":
    print(json.dumps({"peak_growth": _measure(int(sys.argv[1]))}))
