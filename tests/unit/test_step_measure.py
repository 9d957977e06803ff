"""benchmarks/step_measure.py's FLOP count of an update, pinned on a model small enough
to count by hand, and its phase timer's split of a step."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def measure():
    spec = importlib.util.spec_from_file_location(
        "step_measure", ROOT / "benchmarks/step_measure.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["step_measure"] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("step_measure", None)


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False,
    )  # fmt: skip
    return LlamaForCausalLM(config), config


def test_the_flops_of_an_update_counted_by_hand(measure):
    model, config = _llama()
    shape = measure.ModelShape.of(model, config)
    # q 8x8, k and v 4x8 (one key-value head of 4), o 8x8, gate and up 16x8, down 8x16
    assert shape.matrix_params == 64 + 32 + 32 + 64 + 128 + 128 + 128 == 576
    assert (shape.head_params, shape.embedding_params, shape.attn_width) == (80, 80, 8)
    assert shape.all_params == 576 + 80 + 80 + 3 * 8  # and three norms
    rows, response = [3, 5], 4
    # Weights: (6 + 2 x 1/2 for the pi_prox pass) x (576 x 8 tokens + 80 x 4 responses);
    # attention: 2 x 8 x S(S+1) per row forward (3 x 4 and 5 x 6 pairs x 2), x (3 + 1/2).
    weights = 7 * (576 * 8 + 80 * 4)
    attention = 3.5 * (2 * 8 * 3 * 4 + 2 * 8 * 5 * 6)
    assert measure.step_flops(shape, rows, response, 2, lora=False) == weights + attention
    lora = 5 * (576 * 8 + 80 * 4) + attention  # frozen weights: no weight gradient
    assert measure.step_flops(shape, rows, response, 2, lora=True) == lora
    # The former count: the embedding and the norms as matrices, no attention.
    assert measure.old_step_flops(shape, 8, response, 2, lora=False) == 7 * (680 * 8 + 80 * 4)


def test_the_phase_timer_splits_a_step_by_what_ran(measure):
    """A forward without and with gradient, a backward and an optimizer step, each
    timed to its own phase (host clocks on a CPU)."""
    model, _ = _llama()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    timer = measure.PhaseTimer(cuda=False)
    timer.attach(model, optimizer)
    ids = torch.randint(0, 10, (2, 6))
    with torch.no_grad():
        model(input_ids=ids)
    loss = model(input_ids=ids).logits.sum()
    timer.wrap("backward", torch.Tensor.backward)(loss)
    optimizer.step()
    assert [phase for phase, _, _ in timer.spans] == ["prox", "forward", "backward", "optimizer"]
    split = timer.read()
    assert set(split) == set(measure.PHASES) and all(v > 0 for v in split.values())
    assert timer.read() == dict.fromkeys(measure.PHASES, 0.0)  # read once per step
