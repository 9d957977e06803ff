"""Tool calling in the standard form through real processes: buffer, generator, learner.

The tiny model learns ``configs/tiny_tools.yaml``: the secret digit of each prompt is told
only by the environment's ``lookup`` tool, which the model must call in the hermes form
(``<tool_call>{json}</tool_call>``, parsed by vLLM's parser) and whose ``role: tool``
answer it must copy. Synchronous, so the bars hold by a margin over seeds whatever the
machine's speed (``benchmarks/margins.py --suite tools``; tests/integration/learning.py).
"""

from pathlib import Path

from .conftest import processes_mentioning, run_cli
from .learning import Case, Check, failed, rows, tool_use

CONFIG = "configs/tiny_tools.yaml"
LEARN_STEPS, WINDOW = 200, 20


def measure(run_dir: Path) -> list[Check]:
    return tool_use(run_dir, WINDOW, 0.5)


CASES = {"hf": Case(CONFIG, (f"trainer.total_steps={LEARN_STEPS}",), measure)}


def test_tiny_model_learns_to_call_a_tool_and_use_its_answer(tmp_path):
    run_dir = tmp_path / "run"
    res = run_cli(CASES["hf"].args(run_dir), timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    metrics = rows(run_dir / "metrics.jsonl")
    assert len(metrics) == LEARN_STEPS
    checks = CASES["hf"].measure(run_dir)
    assert not failed(checks), failed(checks)
    for r in metrics:
        # The tool never fails; the model's malformed calls are counted, never fatal.
        assert r["multiturn/tool_errors"] == 0 and r["multiturn/tool_timeouts"] == 0
        assert r["multiturn/tool_parse_errors"] >= 0 and r["multiturn/turns_max"] <= 3
        assert r["multiturn/versions_spanned_max"] == 0  # synchronous
    assert not processes_mentioning(str(run_dir)), "processes outlived the run"
