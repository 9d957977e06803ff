"""Tool calling in the standard form through real processes: buffer, generator, learner.

The tiny model learns ``configs/tiny_tools.yaml``: the secret digit of each prompt is told
only by the environment's ``lookup`` tool, which the model must call in the hermes form
(``<tool_call>{json}</tool_call>``, parsed by vLLM's parser) and whose ``role: tool``
answer it must copy. Synchronous, so the bars hold by a margin over seeds whatever the
machine's speed (``benchmarks/margins.py --suite tools``; tests/integration/learning.py).
"""

from pathlib import Path

from .conftest import processes_mentioning
from .learning import Case, Check, tool_use, train_and_check

CONFIG = "configs/tiny_tools.yaml"
LEARN_STEPS, WINDOW = 200, 20


def measure(run_dir: Path) -> list[Check]:
    return tool_use(run_dir, WINDOW, 0.5)


CASES = {"hf": Case(CONFIG, (f"trainer.total_steps={LEARN_STEPS}",), measure)}


def test_tiny_model_learns_to_call_a_tool_and_use_its_answer(tmp_path):
    run_dir = tmp_path / "run"
    metrics = train_and_check(CASES["hf"], run_dir, LEARN_STEPS, timeout=900)
    for r in metrics:
        # The tool never fails; the model's malformed calls are counted, never fatal.
        assert r["multiturn/tool_errors"] == 0 and r["multiturn/tool_timeouts"] == 0
        assert r["multiturn/tool_parse_errors"] >= 0 and r["multiturn/turns_max"] <= 3
        assert r["multiturn/versions_spanned_max"] == 0  # synchronous
    assert not processes_mentioning(str(run_dir)), "processes outlived the run"
