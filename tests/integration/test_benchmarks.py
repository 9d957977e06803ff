"""Each benchmark script runs end to end at tiny sizes and writes its documented output.

No timing is asserted (this machine is shared and noisy): only that the script finishes,
prints its table and a summary line, and that its JSON holds the fields BENCHMARKS.md uses.
The scripts that start several runs or engines are marked ``bench``: they leave ``make
test`` (which proves the system, not its measuring scripts) and run with ``make
test-bench``, before a benchmark's figures are taken and whenever a script changes.
"""

import json
import os
import subprocess
import sys

import pytest
import yaml

from .conftest import ROOT


def _run(script: str, args: list[str], timeout: float = 400) -> str:
    res = subprocess.run(
        [sys.executable, f"benchmarks/{script}", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    lines = res.stdout.strip().splitlines()
    assert lines[-1].startswith("summary: "), res.stdout[-2000:]
    return res.stdout


@pytest.mark.bench
def test_margins(tmp_path):
    """One learning case at two seeds, cut to 25 steps: the sweep's report, not a bar."""
    out = _run("margins.py", ["--suite", "estimators", "--cases", "rloo", "--seeds", "1,2",
                              "--out", str(tmp_path), "trainer.total_steps=25"])  # fmt: skip
    (report,) = tmp_path.glob("estimators-quiet-*/margins.json")
    result = json.loads(report.read_text())
    (check,) = result["cases"]["rloo"]["checks"].values()
    assert len(check["values"]) == 2 and check["bound"] == 0.1
    assert "summary: 1 checks over 2 seeds" in out


# Run by cpu_hog.py: exits 3 when its parent's other child is the loop, pinned to core 1.
FIND_HOG = """
import os, sys
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        stat = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        cmd = open(f"/proc/{pid}/cmdline").read()
    except (OSError, ValueError):
        continue
    if int(stat[1]) == os.getppid() and "while True" in cmd:
        sys.exit(3 if os.sched_getaffinity(int(pid)) == {1} else 4)
sys.exit(5)
"""


def test_cpu_hog_runs_the_command_beside_a_busy_loop():
    res = subprocess.run([sys.executable, "benchmarks/cpu_hog.py", "--", sys.executable, "-c",
                          FIND_HOG], cwd=ROOT, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert res.returncode == 3, (res.returncode, res.stderr)  # the command's own exit code
    assert "beside a busy loop on core 1" in res.stdout.splitlines()[-1]


@pytest.mark.bench
def test_transport(tmp_path):
    out = _run(
        "transport.py", ["--sizes", "8192,65536", "--counts", "64,16", "--out", str(tmp_path)]
    )
    rows = json.loads((tmp_path / "transport.json").read_text())
    assert [r["size"] for r in rows] == [8192, 65536]
    for r in rows:
        assert r["ours_rollouts_per_s"] > 0 and r["raw_msgs_per_s"] > 0 and r["ratio"] > 0
    assert "| 8 KiB | 64 |" in out


@pytest.mark.bench
def test_weight_sync(tmp_path):
    out = _run(
        "weight_sync.py",
        ["--layers", "1", "--hidden", "128", "--intermediate", "256", "--repeats", "1"]
        + ["--bucket-mb", "1", "--out", str(tmp_path)],
    )
    result = json.loads((tmp_path / "weight_sync.json").read_text())
    assert len(result["ours_s"]) == len(result["raw_s"]) == 1
    assert result["logprob_gap_after_push"] < 1e-3  # the push took effect
    assert "raw broadcast" in out


@pytest.mark.bench
def test_weight_delta(tmp_path, tiny_model):
    out = _run(
        "weight_delta.py",
        ["--model", str(tiny_model), "--steps", "2", "--lr", "1e-5", "--bucket-mb", "1"]
        + ["--tokens", "8", "--out", str(tmp_path)],
    )
    rows = json.loads((tmp_path / "weight_delta.json").read_text())["rows"]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows[0]["delta_bytes"] == rows[0]["bf16_bytes"] == rows[0]["float32_bytes"] // 2
    assert all(r["delta_bytes"] <= r["bf16_bytes"] for r in rows[1:])
    assert "bf16 words changed" in out


@pytest.mark.bench
def test_pipeline(tmp_path):
    out = _run(
        "pipeline.py",
        [
            "--steps",
            "4",
            "--stage-steps",
            "2",
            "--out",
            str(tmp_path),
            "--plot",
            str(tmp_path / "p.png"),
        ],
    )
    result = json.loads((tmp_path / "pipeline.json").read_text())
    assert result["stages"]["generation_samples_per_s"] > 0
    assert result["stages"]["training_samples_per_s"] > 0
    assert result["sync"]["staleness_max"] == 0 and result["async"]["staleness_max"] <= 2
    assert result["sync"]["samples"] == result["async"]["samples"] == 4 * 64
    assert (tmp_path / "p.png").stat().st_size > 0
    assert "overlap efficiency" in out


@pytest.mark.bench
def test_checkpoint(tmp_path):
    out = _run("checkpoint.py", ["--steps", "6", "--repeats", "1", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "checkpoint.json").read_text())
    assert result["off"]["steps"] == result["every"]["steps"] == 6
    assert "checkpoint_s" not in result["off"]
    assert result["every"]["checkpoint_s"] > 0 and result["every"]["checkpoint_mib"] > 0
    assert len(result["off"]["run_step_s"]) == len(result["every"]["run_step_s"]) == 1
    assert "checkpoint every 1 step(s)" in out and "median pair ratio" in out


@pytest.mark.bench
def test_checkpoint_alternating_blocks(tmp_path):
    out = _run(
        "checkpoint.py",
        ["--steps", "10", "--repeats", "1", "--alternate", "2", "--out", str(tmp_path)],
    )
    # The learner checkpointed at the barriers of odd blocks only: steps_done 2, 3, 6, 7, 10.
    rows = [json.loads(x) for x in (tmp_path / "alt0" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "checkpoint_s" in r] == [1, 2, 5, 6, 9]
    res = json.loads((tmp_path / "checkpoint.json").read_text())["alternate"]
    # Counted: steps whose barriers before and after agree (2, 6 with; 4, 8 without).
    assert (res["every_steps"], res["off_steps"]) == (2, 2)
    assert len(res["adjacent_ratios"]) == 3 and res["every_step_s"] > 0 < res["off_step_s"]
    assert "alternating blocks of 2 steps" in out


@pytest.mark.bench
def test_staleness_sweep(tmp_path):
    _run(
        "staleness_sweep.py",
        ["--etas", "0,1", "--corrections", "tis", "--steps", "3", "--out", str(tmp_path)]
        + ["--plot", str(tmp_path / "s.png")],
    )
    cells = json.loads((tmp_path / "sweep.json").read_text())
    assert [(c["eta"], c["correction"]) for c in cells] == [(0, "tis"), (1, "tis")]
    assert all(c["staleness_max"] <= c["eta"] and c["dropped_stale"] == 0 for c in cells)
    assert all(c["samples"] == 3 * 64 for c in cells)
    assert (tmp_path / "s.png").stat().st_size > 0


@pytest.mark.bench
def test_staleness_sweep_multiturn_with_tool_latency(tmp_path):
    """Section 14's command at tiny size: the generator imports benchmarks.latency_env."""
    env = (
        "multiturn.environments=[{env: benchmarks.latency_env:LatencyEnv, args: "
        "{max_attempts: 3, feedback: wrong, right_reward: 0.0, wrong_reward: -0.25}}]"
    )
    out = _run(
        "staleness_sweep.py",
        ["--config", "configs/tiny_multiturn.yaml", "--etas", "0,2", "--corrections"]
        + ["decoupled", "--steps", "3", "--target", "0.5", "--out", str(tmp_path), env],
    )
    cells = json.loads((tmp_path / "sweep.json").read_text())
    assert [(c["eta"], c["correction"]) for c in cells] == [(0, "decoupled"), (2, "decoupled")]
    assert all(1 <= c["turns_mean"] <= 3 and len(c["step_wall_s"]) == 3 for c in cells)
    assert cells[0]["versions_spanned_max"] == 0  # eta = 0: one version per episode
    assert "| turns | versions spanned mean/max |" in out
    config = yaml.safe_load((tmp_path / "eta2-decoupled-s0" / "config.yaml").read_text())
    assert config["multiturn"]["environments"][0]["env"] == "benchmarks.latency_env:LatencyEnv"


@pytest.mark.bench
def test_learner_scaling(tmp_path):
    _run(
        "learner_scaling.py",
        ["--steps", "3", "--repeats", "1", "--skip", "0", "--cases", "one,two"]
        + ["--out", str(tmp_path)],
    )
    results = json.loads((tmp_path / "learner_scaling.json").read_text())
    assert [r["steps"] for r in results["one"] + results["two"]] == [3, 3]
    assert all(r["tokens_per_s"] > 0 for r in results["one"] + results["two"])


@pytest.mark.parametrize(
    ("lora_rank", "flags", "sharding"),
    [(0, [], "one rank, Accelerate, not sharded"), (8, [], "one rank, Accelerate, not sharded"),
     (0, ["--fsdp2", "--fused-head"], "FSDP2 at one rank")],
)  # fmt: skip
def test_gpu_script_code_path_on_cpu(tmp_path, lora_rank, flags, sharding):
    """The CUDA benchmark's code (the one-rank learner's step, or FSDP2 at one rank, with
    the chunked or the fused head; gather, bucketed send) on CPU with gloo; with LoRA only
    the adapters are published. Each timed step reports its phases."""
    _run(
        "gpu.py",
        ["--device", "cpu", "--layers", "1", "--hidden", "128", "--intermediate", "256"]
        + ["--vocab", "64", "--seq-len", "16", "--samples", "8", "--steps", "2"]
        + ["--lora-rank", str(lora_rank), "--out", str(tmp_path), *flags],
    )
    result = json.loads((tmp_path / "gpu.json").read_text())
    assert result["tokens_per_step"] == 8 * 16 and result["lora_rank"] == lora_rank
    assert result["sharding"] == sharding
    assert result["options"]["fused_head"] == ("--fused-head" in flags)
    # float32: the whole model, or the layer's four adapters (A: r x 128; B: 128 x r for q
    # and o, 64 x r for k and v, whose one key-value head is 64 wide)
    adapters = 4 * (lora_rank * 128) + 2 * (128 * lora_rank) + 2 * (64 * lora_rank)
    assert result["publish_bytes"] == (4 * adapters if lora_rank else 4 * result["params"])
    assert len(result["step_s"]) == len(result["phases_s"]) == 2
    for split in result["phases_s"]:  # each phase ran, within its step's wall time
        assert all(split[k] > 0 for k in ("prox", "forward", "backward", "optimizer"))
    assert all(sum(p[k] for k in ("prox", "forward", "backward", "optimizer")) <= wall
               for p, wall in zip(result["phases_s"], result["step_s"], strict=True))  # fmt: skip


def test_gpu_check_dry_run(tmp_path):
    """The GPU lease's one script runs its whole plan at tiny sizes on the CPU: the
    same-device weight channel (a memory file here) delivers every byte, the one-device
    loop trains, every learner variant (the production path, FSDP2 at one rank, the fused
    head among them), the device-side delta check and the profile finish with their
    figures."""
    out = _run("gpu_check.py", ["--dry-run", "--out", str(tmp_path)], timeout=1500)
    assert "parts passed" in out.splitlines()[-1]
    results = {r["part"]: r for r in json.loads((tmp_path / "results.json").read_text())}
    assert all(r["rc"] == 0 for r in results.values()), results
    assert results["ipc"]["figures"]["identical"] is True
    assert results["ipc"]["figures"]["route"] == "memory"
    e2e = results["e2e-tiny"]["figures"]
    assert e2e["steps"] == 8 and e2e["rollout_logp_diff_max"] < 1e-3
    variants = [p for p in results if p.startswith("learner-tiny-")]
    assert {"learner-tiny-chunked", "learner-tiny-fsdp2", "learner-tiny-fused-head"} <= set(
        variants
    )
    assert list(results)[2:4] == ["learner-tiny-chunked", "learner-tiny-fsdp2"]  # first
    for p in variants:
        figures = results[p]["figures"]
        assert len(figures["step_s"]) == 3 and figures["step_s_median"] > 0
        assert set(figures["phases_median_s"]) == {"prox", "forward", "backward", "optimizer", "gc"}
        assert figures["mfu"] is None  # no peak known for a CPU
    assert results["learner-tiny-chunked"]["figures"]["sharding"].startswith("one rank")
    assert results["learner-tiny-fsdp2"]["figures"]["sharding"] == "FSDP2 at one rank"
    assert results["learner-tiny-fused-head"]["figures"]["options"]["fused_head"] is True
    delta = results["delta-device"]["figures"]
    assert delta["identical"] is True and delta["kind"] == "bitmap" and delta["copy_s"] > 0
    profile = results["profile"]["figures"]["profile"]
    assert profile["launches"] == 0 and profile["device_s"] is None and profile["host_s"] > 0
    summary = (tmp_path / "summary.md").read_text()
    assert summary.count("| learner-tiny-") == len(variants)


def _json_lines(script: str, args: list[str], timeout: float = 600) -> list[dict]:
    """Run a script that prints its figures as JSON lines; return those lines."""
    res = subprocess.run(
        [sys.executable, f"benchmarks/{script}", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    return [json.loads(x) for x in res.stdout.splitlines() if x.startswith("{")]


@pytest.mark.bench
def test_learner_kernels_before_and_after(tmp_path):
    """The log-prob pass's arms (the model's own head, chunks, padding-free) at tiny
    sizes: each reports its memory growth and the positions it computed."""
    args = ["--layers", "1", "--rows", "4", "--response-len", "4", "--prompt-len", "8"]
    args += ["--group-size", "1", "--steps", "1", "--rounds", "1"]
    out = subprocess.run(
        [sys.executable, "benchmarks/learner_kernels.py", *args,
         "--logprob-chunk-tokens", "4", "--padding-free"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "padding-free" in out.stdout and "chunk" in out.stdout


@pytest.mark.bench
def test_learner_options_memory_and_compile():
    cases = _json_lines("learner_options.py", ["memory", "--layers", "1", "--rows", "2"])
    assert [c["case"] for c in cases] == [
        "plain", "checkpointing", "compile", "compile+checkpointing"
    ]  # fmt: skip
    assert all(c["peak_mib"] >= c["held_mib"] > 0 for c in cases)
    steady = _json_lines("learner_options.py", ["compile", "--tiny", "--steps", "4"])[-1]
    assert steady["steady_eager_s"] > 0 and steady["steady_compiled_s"] > 0


@pytest.mark.bench
def test_learner_ops():
    (row,) = _json_lines("learner_ops.py", ["--steps", "2", "--groups", "2"])
    assert row["model"] == "tiny" and row["host_syncs"] == 1  # the metrics, read once
    assert row["ops_per_layer"] > 0 and row["step_s_max"] >= row["step_s_median"] > 0


@pytest.mark.gpu
@pytest.mark.skipif(
    not __import__("torch").cuda.is_available(), reason="needs CUDA (benchmarks/gpu.py)"
)
def test_gpu_script_on_cuda(tmp_path):
    _run("gpu.py", ["--layers", "2", "--hidden", "256", "--steps", "1", "--out", str(tmp_path)])
    assert json.loads((tmp_path / "gpu.json").read_text())["device"] != "cpu"


@pytest.mark.bench
def test_rewards(tmp_path):
    out = _run("rewards.py", ["--repeats", "1", "--prefill", "1", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "rewards.json").read_text())
    assert [r["arm"] for r in result["runs"]] == ["without", "with"]
    assert all(r["tokens_per_s"] > 0 and r["rm_failed"] == 0 for r in result["runs"])
    assert result["ratio"] > 0 and "with a reward model" in out


@pytest.mark.bench
def test_estimators(tmp_path):
    val = ROOT / "configs/data/max_digit_val.jsonl"
    out = _run(
        "estimators.py",
        ["--cases", "gae", "--steps", "3", "--window", "2", "--seeds", "3", "--val", str(val)]
        + ["--set", "gae:learner.lr=0.002", "--out", str(tmp_path)],
    )
    result = json.loads((tmp_path / "estimators.json").read_text())
    (res,) = result["runs"]
    assert res["case"] == "gae" and res["seed"] == 3 and res["steps"] == 3
    assert res["step_s_median"] > 0 and res["peak_rss_mib"] > 0 and len(res["curve"]) == 3
    # The held-out prompts were scored before the first step and after the last.
    assert 0 <= res["eval_first"] <= 1 and 0 <= res["eval_final"] <= 1
    (case,) = result["cases"]
    assert case["seeds"] == [3] and case["eval_final"] == [res["eval_final"]]
    # --set reached this case's run, and the seed went in as learner.seed.
    run_config = yaml.safe_load((tmp_path / "gae/seed3/config.yaml").read_text())
    assert run_config["learner"]["lr"] == 0.002 and run_config["learner"]["seed"] == 3
    assert (tmp_path / "estimators.png").is_file()
    assert "gae: step time 1.00x gae" in out and "held-out" in out


@pytest.mark.bench
def test_generation_cpu_on_the_tiny_model(tmp_path, tiny_model):
    out = _run(
        "generation_cpu.py",
        ["--model", str(tiny_model), "--prompts", "4", "--max-tokens", "4"]
        + ["--only", "hf", "engine-hf-cpu0", "vllm-project-pin", "--out", str(tmp_path)],
    )
    table = json.loads((tmp_path / "generation_cpu.json").read_text())
    assert [r["setting"] for r in table] == ["hf", "engine-hf-cpu0", "vllm-project-pin"]
    assert all(r["tokens"] == 16 for r in table), table  # 4 prompts x 4 tokens, eos ignored
    assert "| vllm-project-pin |" in out


def test_plot_run(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    rows = [
        {"step": i, "reward_mean": i / 4, "reward/correct": i / 5, "multiturn/tool_calls": i / 3}
        for i in range(4)
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "eval.jsonl").write_text(json.dumps({"step": 0, "eval/reward/correct": 0.5}) + "\n")
    res = subprocess.run(
        [
            sys.executable,
            "benchmarks/plot_run.py",
            str(run),
            str(tmp_path / "c.png"),
            "--metric",
            "multiturn/tool_calls",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.bench
def test_peers(tmp_path):
    """TRL's GRPOTrainer and verl-async, 3 steps each of the tiny default."""
    out = _run("peers.py", ["--preset", "tiny", "--steps", "3", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "peers.json").read_text())
    assert [r["system"] for r in result["runs"]] == ["verl-async", "trl"]
    for run in result["runs"]:
        assert run["steps"] == 3 and len(run["curve"]["reward"]) == 3, run["system"]
    # TRL got exactly the token ids verl-async's engine got
    assert result["prompt_check"]["identical"] == result["prompt_check"]["checked"] > 0
    assert (tmp_path / "peers.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| trl |" in out


@pytest.mark.bench
def test_startup(tmp_path):
    out = _run("startup.py", ["--repeats", "1", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "startup.json").read_text())
    assert 0 < result["current"]["first_step_s"] <= result["current"]["total_s"]
    assert "learner first step" in out  # the milestones the roles marked


@pytest.mark.bench
def test_soak(tmp_path):
    out = _run("soak.py", ["--minutes", "0.4", "--every", "3", "--out", str(tmp_path / "run")])
    result = json.loads((tmp_path / "run" / "soak.json").read_text())
    assert result["steps"] > 0
    assert {"buffer", "generators", "learners"} <= set(result["roles"])
    assert all(s["late_mib"] > 0 for s in result["roles"].values())
    assert "generators:" in out


@pytest.mark.bench
def test_agent_throughput(tmp_path):
    out_file = tmp_path / "throughput.json"
    out = _run("agent_throughput.py", ["--groups", "2", "--rounds", "1", "--out", str(out_file)])
    result = json.loads(out_file.read_text())
    for path in ("env", "agent"):
        assert result[path]["samples_per_s"] > 0 and result[path]["turns_per_episode"] >= 1
    assert result["ratio_samples"] > 0 and "agent /" in out


def test_distillation_replot_compares_each_arm_with_rl_alone_of_its_seed(tmp_path):
    """The tables and verdicts from a saved distillation.json (--replot runs nothing)."""

    def run(arm, seed, scores, walls, kl=()):
        curve = [
            {"step": 10 * i, "score": s, "wall_s": w}
            for i, (s, w) in enumerate(zip(scores, walls, strict=True))
        ]
        kl = list(kl)
        return {
            "arm": arm,
            "seed": seed,
            "steps": 30,
            "curve": curve,
            "reverse_kl": kl,
            "eval_first": scores[0],
            "eval_final": scores[-1],
            "eval_best": max(scores),
            "reverse_kl_first10": kl[0] if kl else None,
            "reverse_kl_last10": kl[-1] if kl else None,
            "reward_first10": 0.1,
            "reward_last10": 0.7,
            "step_s_median": 0.2,
            "load_mean": 2.0,
        }

    runs = [
        run("rl", 1, [0.0, 0.5, 0.8, 0.8], [0, 5, 10, 15]),
        run("distill", 1, [0.0, 0.8, 0.8, 0.8], [0, 12, 14, 16], [2.0, 0.5]),
        run("distill+task", 1, [0.0, 0.5, 0.7, 0.7], [0, 4, 8, 12], [2.0, 1.0]),
        run("rl", 2, [0.0, 0.4, 0.5, 0.6], [0, 5, 10, 15]),
        run("distill", 2, [0.0, 0.4, 0.5, 0.8], [0, 3, 6, 9], [2.0, 0.1]),
    ]
    teacher = {"steps": 30, "score": 0.8}
    saved = tmp_path / "saved.json"
    saved.write_text(json.dumps({"machine": "test", "teacher": teacher, "runs": runs}))
    out = _run(
        "distillation.py",
        ["--replot", str(saved), "--fraction", "0.6", "--out", str(tmp_path / "out")],
        timeout=120,
    )
    assert "| distill | 1 | yes (10 vs 20) | no (12 s vs 10 s) |" in out
    assert "| distill+task | 1 | no (— vs 20) | no (— s vs 10 s) |" in out
    # RL alone of seed 2 never reached 0.8: the distillation run that did wins both ways.
    assert "| distill | 2 | yes (30 vs —) | yes (9 s vs — s) |" in out
    assert "| distill | 1 | 0.000 → 0.800 (0.800) | 10 (12) | 10 (12) | 2.000 → 0.500 |" in out
    # --fraction 0.6 (a score of 0.48) is recomputed from the curves: 20 (10 s) for rl seed 2.
    assert "| rl | 2 | 0.000 → 0.600 (0.600) | — (—) | 20 (10) |" in out
    assert out.strip().endswith(
        "summary: of 3 distillation runs, 2 reached the teacher's held-out 0.800 in fewer "
        "steps than RL alone of their seed, 1 in less wall-clock (test)"
    )
    assert (tmp_path / "out/distillation.png").read_bytes()[:4] == b"\x89PNG"
