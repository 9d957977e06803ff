"""TRL's GRPOTrainer against verl-async on the same model, prompts, reward and settings.

    python benchmarks/peers.py [--preset tiny|smollm2|smollm2-short] [--steps N] [--out DIR]
                               [--window W] [--target R] [--plot PATH] [key=value ...]

Two whole commands run back to back, each timed from outside, start-up included:

  verl-async  ``verl-async train CONFIG`` with its config's placement (asynchronous,
              staleness bound and off-policy correction as configured), no checkpoints,
              no evaluation rounds and no TensorBoard (TRL does none of them here).
  trl         a fresh Python process (this script with ``--trl-worker``) that builds
              TRL's ``GRPOTrainer`` from the same config (``trl_mapping`` says how each
              setting is carried over), samples with transformers ``generate`` (no vLLM)
              on 2 torch threads and trains synchronously on the same cores.

Presets: ``tiny`` is configs/tiny.yaml (the tiny Llama verl-async builds locally, the
max_digit task, reward ``exact`` on the first word); ``smollm2`` is
configs/math_smollm2_cpu.yaml (models/smollm2-135m from ``make smollm2``, chat-templated
sums, ``correct`` math + 0.2 x ``just_number``); ``smollm2-short`` is the same model and
task made learner-bound (4 x 4 samples of at most 6 new tokens, two optimizer steps a
batch, 20 steps). ``model.lora.rank=R`` (and the other ``model.lora`` keys) on
the command line trains LoRA adapters on both sides: verl-async's ``model.lora``, TRL
with the same peft ``LoraConfig``. TRL scores with verl-async's own rule
scorer (``verl_async.rewards.worker.score_items``), one TRL reward function per source
with the source's weight, and gets the same prompts, rendered the same way (it checks
that the first ones tokenize to the ids verl-async's engine gets: ``prompt_check``).

For each system: the whole command's wall time; ``first step`` (seconds from the
command's start to the end of the first step); the training time from the end of the
first step to the end of the last; samples/s over the whole command and over the
training time; the first and last ``--window`` steps' mean reward; the time to the target
(the first step whose trailing ``--window``-step mean reward reaches ``--target``, as a
step and as seconds since the command started). A step is one batch of
groups_per_step x group_size samples (``algo.minibatches`` optimizer steps on each side).
Writes ``peers.json`` and the reward curves against wall-clock seconds and against steps
(``peers.png``, or ``--plot``); prints the settings, a Markdown table and a summary line.
CPU seconds (user and system) are the whole command's process tree's; for verl-async also
each role's, as each recorded them when it ended.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, machine, mean, rolling, run_train, time_to_target  # noqa: E402

from verl_async import lora  # noqa: E402
from verl_async.config import load_config  # noqa: E402
from verl_async.data import DEFAULT_SOURCE, PromptRecord, as_messages  # noqa: E402
from verl_async.protocol import ScoreItem  # noqa: E402
from verl_async.reward_config import ModelReward, RewardsConfig  # noqa: E402
from verl_async.rewards.rules import RuleScorerState  # noqa: E402
from verl_async.rewards.scorer import routed  # noqa: E402
from verl_async.rewards.worker import math_timeout_s, score_items  # noqa: E402
from verl_async.schema import RunConfig


@dataclass(frozen=True)
class Preset:
    config: str
    window: int  # trailing mean of the time-to-target figure
    target: float
    needs: str = ""  # a path that must exist
    make: str = ""  # the command that makes it
    overrides: tuple[str, ...] = ()  # given to both runs before the command line's
    steps: int = 0  # the default of --steps (0: the config's trainer.total_steps)


PRESETS = {
    "tiny": Preset("configs/tiny.yaml", window=20, target=0.6),
    "smollm2": Preset(
        "configs/math_smollm2_cpu.yaml",
        window=5,
        target=0.9,
        needs="models/smollm2-135m",
        make="make smollm2",
    ),
    # Learner-bound: short answers, so training, not sampling, is the slow stage (4 prompts
    # x 4 samples of at most 6 tokens, two optimizer steps a batch).
    "smollm2-short": Preset(
        "configs/math_smollm2_cpu.yaml",
        window=5,
        target=0.9,
        needs="models/smollm2-135m",
        make="make smollm2",
        overrides=(
            "generators.group_size=4",
            "learner.groups_per_step=4",
            "generators.max_new_tokens=6",
            "generators.max_inflight_groups=12",
            "algo.minibatches=2",
        ),
        steps=20,
    ),
}
# What the verl-async command leaves out, because the TRL run does none of it.
VERL_OVERRIDES = ["checkpoint.every_steps=0", "eval.every_steps=0", "trainer.loggers=[]"]
TORCH_THREADS = 2
LOSS_TYPES = {  # algo.loss_agg_mode -> TRL loss_type with the same per-minibatch aggregation
    "token-mean": "bnpo",  # sum(mask * loss) / sum(mask) over the minibatch
    "seq-mean-token-mean": "grpo",  # mean over rows of each row's token mean
    "seq-mean-token-sum-norm": "dr_grpo",  # sum(mask * loss) / (rows * max_new_tokens)
}


# ----------------------------------------------------------------------------- the mapping


def trl_mapping(cfg: RunConfig, steps: int) -> list[tuple[str, Any, str]]:
    """``GRPOConfig`` keyword arguments for a TRL run of ``steps`` verl-async steps, as
    (TRL key, value, where it comes from) triples; ``dict((k, v) for k, v, _ in ...)``
    gives the keyword arguments.

    One verl-async step trains on groups_per_step x group_size samples in
    ``algo.minibatches`` optimizer steps. In TRL that is one generation batch of the same
    size (``steps_per_generation`` = minibatches, per-device batch = samples /
    minibatches, no gradient accumulation), so ``max_steps`` = steps x minibatches
    optimizer steps. The loss follows verl-async's: PPO clip [1 - clip_eps, 1 +
    clip_eps_high], dual clip as TRL's ``delta`` (capping the unclipped ratio at
    clip_ratio_c is the same loss when clip_ratio_c > 1 + clip_eps_high), the same
    per-minibatch aggregation, group-std advantages, no KL, one pass per batch.
    Raises ``SystemExit`` for settings TRL has no counterpart for (``check_matchable``).
    """
    check_matchable(cfg)
    g, lr, algo = cfg.generators, cfg.learner, cfg.algo
    samples = lr.groups_per_step * g.group_size
    high = algo.clip_eps if algo.clip_eps_high is None else algo.clip_eps_high
    warm = "constant_with_warmup" if lr.warmup_steps else "constant"
    return [
        ("num_generations", g.group_size, "generators.group_size"),
        ("per_device_train_batch_size", samples // algo.minibatches,
         "groups_per_step x group_size / algo.minibatches"),
        ("gradient_accumulation_steps", 1,
         "one optimizer step per minibatch (micro-batches give the same gradient)"),
        ("steps_per_generation", algo.minibatches, "algo.minibatches"),
        ("max_steps", steps * algo.minibatches, "steps x algo.minibatches (optimizer steps)"),
        ("num_iterations", 1, "each batch is trained on once"),
        ("learning_rate", lr.lr, "learner.lr"),
        ("lr_scheduler_type", warm, "learner.warmup_steps (linear warm-up, then constant)"),
        ("warmup_steps", lr.warmup_steps * algo.minibatches, "learner.warmup_steps x minibatches"),
        ("weight_decay", lr.weight_decay, "learner.weight_decay"),
        ("max_grad_norm", lr.grad_clip, "learner.grad_clip"),
        ("gradient_checkpointing", lr.gradient_checkpointing, "learner.gradient_checkpointing"),
        ("seed", lr.seed, "learner.seed"),
        ("data_seed", cfg.data.shuffle_seed, "data.shuffle_seed"),
        ("temperature", g.temperature, "generators.temperature"),
        ("top_p", g.top_p, "generators.top_p"),
        ("top_k", g.top_k, "generators.top_k (0: off on both sides)"),
        ("max_completion_length", g.max_new_tokens, "generators.max_new_tokens"),
        ("epsilon", algo.clip_eps, "algo.clip_eps"),
        ("epsilon_high", high, "algo.clip_eps_high (empty: clip_eps)"),
        ("delta", algo.clip_ratio_c, "algo.clip_ratio_c (dual clip)"),
        ("beta", 0.0, "no KL term (algo.kl off)"),
        ("loss_type", LOSS_TYPES[algo.loss_agg_mode], f"algo.loss_agg_mode {algo.loss_agg_mode}"),
        ("scale_rewards", "group" if algo.normalize_adv_std else "none",
         "algo.normalize_adv_std"),
        ("reward_weights", [s.weight for s in cfg.rewards.sources], "rewards.sources[*].weight"),
        ("use_vllm", False, "TRL samples with transformers generate"),
        ("use_cpu", True, "CPU machine"),
        ("bf16", cfg.model.dtype == "bfloat16", f"model.dtype {cfg.model.dtype}"),
        ("fp16", cfg.model.dtype == "float16", f"model.dtype {cfg.model.dtype}"),
        ("logging_steps", 1, "a reward per step"),
        ("save_strategy", "no", "checkpoint.every_steps=0 on the verl-async side too"),
        ("report_to", "none", "trainer.loggers=[] on the verl-async side too"),
        ("disable_tqdm", True, "no progress bar"),
    ]  # fmt: skip


def check_matchable(cfg: RunConfig) -> None:
    """Stop (``SystemExit``) on a config whose training TRL's GRPOTrainer cannot reproduce."""
    g, algo = cfg.generators, cfg.algo
    samples = cfg.learner.groups_per_step * g.group_size
    high = algo.clip_eps if algo.clip_eps_high is None else algo.clip_eps_high
    if samples % algo.minibatches:
        raise SystemExit(f"{samples} samples per step do not split into {algo.minibatches}")
    if algo.adv_estimator != "grpo" or algo.uses_reference or algo.entropy_coeff:
        raise SystemExit("only grpo without KL or entropy bonus has a TRL counterpart here")
    if algo.loss_agg_mode not in LOSS_TYPES or (
        algo.loss_agg_mode == "seq-mean-token-sum-norm"
        and algo.loss_scale_factor not in (None, g.max_new_tokens)
    ):
        raise SystemExit(f"algo.loss_agg_mode {algo.loss_agg_mode} has no TRL loss_type here")
    if algo.clip_ratio_c is not None and algo.clip_ratio_c <= 1 + high:
        raise SystemExit(
            "TRL's delta equals the dual clip only when clip_ratio_c > 1 + clip_eps_high"
        )


SAMPLERS = {"vllm": "vLLM's continuous batching", "hf": "the transformers engine's waves"}


def unmatched(cfg: RunConfig) -> list[str]:
    """What the TRL run cannot do the way verl-async does it, for this config."""
    g, algo = cfg.generators, cfg.algo
    notes = [
        f"Asynchrony: verl-async trains on samples up to staleness.max={cfg.staleness.max} "
        "versions old while generation goes on; TRL generates, then trains (on-policy, eta 0).",
        f"Off-policy correction (algo.correction={algo.correction}, is_cap={algo.is_cap}): TRL "
        "has none without vLLM, and needs none: it samples with the weights it trains, so "
        "pi_behav = pi_prox. On both sides the PPO ratio is taken against the weights at the "
        "start of the step.",
        f"Placement: verl-async runs generators on {cfg.placement.generators} and learners on "
        f"{cfg.placement.learners}; TRL runs both stages in one process on "
        f"{TORCH_THREADS} torch threads.",
        f"Sampler: {SAMPLERS[g.engine]} (verl-async, generators.engine={g.engine}) against "
        "transformers generate (TRL); same temperature, top_p, top_k and length cap, "
        "different random streams, so the samples differ.",
        "Prompt order: verl-async's per-epoch permutation (data.shuffle_seed) against TRL's "
        "seeded sampler; the same prompt set, a different order.",
        "Minibatches: verl-async splits the batch in order, TRL shuffles the rows first.",
        "Advantages: (r - mean) / (std + eps) with eps 1e-6 in verl-async, 1e-4 in TRL "
        "(unbiased group std on both sides).",
        f"Engine settings (max_inflight_groups={g.max_inflight_groups}"
        + (f", kv_cache_mb={g.kv_cache_mb}" if g.engine == "vllm" else "")
        + f", max_model_len={g.max_model_len}) have no TRL counterpart: "
        "generate samples the whole generation batch at once (prompts longer than "
        "max_model_len - max_new_tokens are left out on both sides).",
        f"Left out of the verl-async run because TRL does none of it here: {VERL_OVERRIDES} "
        f"(the config has checkpoint.every_steps={cfg.checkpoint.every_steps}, "
        f"eval.every_steps={cfg.eval.every_steps}, trainer.loggers={cfg.trainer.loggers}).",
    ]
    if cfg.learner.warmup_steps:
        notes.append(
            "Warm-up: verl-async's factor is min(1, (s + 1) / W) per learner step, "
            "TRL's rises from 0 per optimizer step."
        )
    if cfg.learner.weight_decay:
        notes.append("Weight decay: TRL exempts biases and norm weights, verl-async does not.")
    if g.stop:
        notes.append(f"Stop strings {g.stop}: TRL stops at EOS only.")
    if any(s.data_sources for s in cfg.rewards.sources):
        notes.append("A sample no source is routed to: reward 0 in verl-async, NaN in TRL.")
    return notes


# ----------------------------------------------------------------------------- rewards


def completion_text(completion: str | list[dict]) -> str:
    """TRL hands a completion as a string, or (chat prompts) as messages: the last content."""
    return completion if isinstance(completion, str) else completion[-1]["content"]


def reward_functions(rewards: RewardsConfig) -> tuple[list, list[float]]:
    """One TRL reward function per reward source, scoring with verl-async's own scorer
    (``score_items``: the rule, and the source's default_score when it raises), and the
    sources' weights. A sample a source is not routed to gets None (TRL's 'not scored').
    Sources verl-async normalises, and reward models, have no counterpart here."""
    for src in rewards.sources:
        if isinstance(src, ModelReward) or src.normalize != "none":
            raise SystemExit(f"reward source '{src.name}': only rule sources without normalize")
    state = RuleScorerState(math_timeout_s(rewards))
    funcs = [_source_reward(rewards, i, state) for i in range(len(rewards.sources))]
    return funcs, [src.weight for src in rewards.sources]


def _source_reward(rewards: RewardsConfig, index: int, state: RuleScorerState):
    source = rewards.sources[index]

    def reward(prompts, completions, ground_truth, data_source=None, extra_info=None, **_):
        items, rows = [], []
        for i, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
            ds = data_source[i] if data_source else DEFAULT_SOURCE
            if not routed(source, ds):
                continue
            extra = json.loads(extra_info[i]) if extra_info and extra_info[i] else {}
            items.append(
                ScoreItem(source=index, prompt=prompt, response=completion_text(completion),
                          ground_truth=ground_truth[i], data_source=ds, extra_info=extra)
            )  # fmt: skip
            rows.append(i)
        out: list[float | None] = [None] * len(prompts)
        for i, score in zip(rows, score_items(items, rewards, state).scores, strict=True):
            out[i] = score
        return out

    reward.__name__ = source.name
    return reward


def dataset_rows(records: list[PromptRecord], templated: bool) -> list[dict]:
    """TRL dataset rows: the prompt as chat messages when verl-async renders it with the
    chat template (TRL then applies the same template), the string as it is otherwise."""
    return [
        {
            "prompt": as_messages(rec.prompt) if templated else rec.prompt,
            "ground_truth": rec.ground_truth,
            "data_source": rec.data_source,
            "extra_info": json.dumps(rec.extra_info) if rec.extra_info else "",
        }
        for rec in records
    ]


# ----------------------------------------------------------------------------- results


def summarize(system: str, rows: list[dict], wall_s: float, args) -> dict:
    """The figures of one run from its step rows ({"t": seconds since the command started,
    "reward": mean reward, "samples"}) and the whole command's seconds."""
    rewards, times = [r["reward"] for r in rows], [r["t"] for r in rows]
    samples = sum(r["samples"] for r in rows)
    train_s = times[-1] - times[0] if len(rows) > 1 else None
    step, seconds = time_to_target(rewards, times, args.window, args.target)
    return {
        "system": system,
        "steps": len(rows),
        "samples": samples,
        "wall_s": wall_s,
        "first_step_s": times[0],
        "train_s": train_s,
        "samples_per_s": samples / wall_s,
        "train_samples_per_s": (samples - rows[0]["samples"]) / train_s if train_s else None,
        "reward_first": mean(rewards[: args.window]),
        "reward_final": mean(rewards[-args.window :]),
        "target_step": step,
        "target_s": seconds,
        "curve": {"step": list(range(len(rows))), "t": times, "reward": rewards},
    }


def _num(value: float | None, fmt: str = ".1f") -> str:
    return "—" if value is None else format(value, fmt)


def results_table(results: list[dict], window: int, target: float) -> str:
    """The Markdown table of the runs."""
    lines = [
        f"| system | whole command, s | first step, s | training, s | samples/s (command) | "
        f"samples/s (training) | reward first → final ({window} steps) | "
        f"target {target} (trailing {window}) at step | at s | CPU user / system, s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['system']} | {r['wall_s']:.1f} | {r['first_step_s']:.1f} | "
            f"{_num(r['train_s'])} | {r['samples_per_s']:.1f} | "
            f"{_num(r['train_samples_per_s'])} | {r['reward_first']:.3f} → "
            f"{r['reward_final']:.3f} | {_num(r['target_step'], 'd')} | {_num(r['target_s'])} | "
            f"{_num(r.get('cpu_user_s'))} / {_num(r.get('cpu_sys_s'))} |"
        )
    for r in results:
        if r.get("learner_parts"):
            parts = ", ".join(f"{k} {v}" for k, v in r["learner_parts"].items())
            lines.append(f"\n{r['system']} learner, median per step: {parts}")
        for role, cpu in (r.get("role_cpu") or {}).items():
            lines.append(
                f"\n{r['system']} {role}: user {cpu['user_s']:.1f} s, system {cpu['sys_s']:.1f} s"
                f" (its child processes: {cpu['children_user_s']:.1f} / "
                f"{cpu['children_sys_s']:.1f} s)"
            )
    return "\n".join(lines)


def mapping_table(mapping: list[tuple[str, Any, str]]) -> str:
    lines = ["| TRL GRPOConfig | value | from the verl-async config |", "|---|---|---|"]
    lines += [f"| `{key}` | `{value}` | {source} |" for key, value, source in mapping]
    return "\n".join(lines)


def plot(results: list[dict], path: Path, title: str, window: int, target: float) -> None:
    """Reward (thin: per step; thick: trailing mean) against seconds since the command
    started, and against steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for res in results:
        curve = res["curve"]
        smooth = rolling(curve["reward"], window)
        for ax, x in zip(axes, (curve["t"], curve["step"]), strict=True):
            (line,) = ax.plot(x, smooth, lw=2, label=res["system"])
            ax.plot(x, curve["reward"], lw=0.8, alpha=0.3, color=line.get_color())
    for ax, xlabel in zip(axes, ("seconds since the command started", "step"), strict=True):
        ax.axhline(target, color="grey", ls=":", lw=1)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(f"reward (trailing mean of {window} steps; thin: per step)")
    axes[1].legend(loc="lower right")
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------- verl-async


def verl_rows(run_dir: Path, rows: list[dict], t0: float, wall_s: float) -> list[dict]:
    """Step rows with seconds since the command started: the learner marks its first step
    in startup.jsonl (wall clock); later steps follow by the learner's own ``wall_s``."""
    from verl_async.launch.startup import read_marks

    marks = [
        m["t"] for m in read_marks(run_dir) if (m["role"], m["event"]) == ("learner", "first step")
    ]
    first = min((t for t in marks if t >= t0), default=None)
    base = first - t0 if first is not None else wall_s - (rows[-1]["wall_s"] - rows[0]["wall_s"])
    return [
        {"t": base + r["wall_s"] - rows[0]["wall_s"], "reward": r["reward_mean"],
         "samples": r["samples"]}
        for r in rows
    ]  # fmt: skip


def children_cpu() -> tuple[float, float]:
    """(user, system) CPU seconds of this process's ended and waited-for descendants."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime, usage.ru_stime


def role_cpu(run_dir: Path) -> dict[str, dict]:
    """Each role's CPU seconds (its own, and its ended children's: a vLLM engine's), as
    the roles recorded them when they ended (``mark_cpu``: startup.jsonl event "cpu")."""
    from verl_async.launch.startup import read_marks

    return {
        m["role"]: {k: m[k] for k in ("user_s", "sys_s", "children_user_s", "children_sys_s")}
        for m in read_marks(run_dir)
        if m.get("event") == "cpu"
    }


PARTS = ("step_s", "learner_wait_s", "timing/prox_s", "timing/forward_s", "timing/backward_s",
         "timing/optimizer_s", "weight_sync_s", "weight_sync_mb", "padding_fraction",
         "shared_prefix_fraction")  # fmt: skip


def learner_parts(run_dir: Path) -> dict[str, float]:
    """Medians over the steps after the first two (warm-up) of the learner's step and its
    parts (metrics.jsonl: docs/metrics.md)."""
    import statistics

    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    rows = rows[2:] or rows
    return {k: round(statistics.median(r[k] for r in rows), 4) for k in PARTS if k in rows[0]}


def run_verl(config: Path, steps: int, out: Path, overrides: list[str]) -> tuple[list[dict], float]:
    run_dir = out / "verl-async"
    shutil.rmtree(run_dir, ignore_errors=True)
    t0 = time.time()
    rows, wall_s = run_train(
        config, run_dir, [f"trainer.total_steps={steps}", *VERL_OVERRIDES, *overrides]
    )
    return verl_rows(run_dir, rows, t0, wall_s), wall_s


# ----------------------------------------------------------------------------- TRL


def run_trl(config: Path, steps: int, out: Path, overrides: list[str]) -> tuple[list[dict], float]:
    """This script with ``--trl-worker`` in a process of its own, timed from outside."""
    work = out / "trl"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--trl-worker", "--config", str(config),
           "--steps", str(steps), "--out", str(work), *overrides]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(TORCH_THREADS),
           "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}  # fmt: skip
    t0, mono = time.time(), time.monotonic()
    with open(work / "log.txt", "w") as log:
        res = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    wall_s = time.monotonic() - mono
    if res.returncode != 0:
        tail = (work / "log.txt").read_text()[-3000:]
        raise SystemExit(f"the TRL run failed (exit {res.returncode}):\n{tail}")
    lines = (work / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines if line]
    return [{**r, "t": r["time"] - t0} for r in rows], wall_s


def step_recorder(path: Path, minibatches: int, samples: int):
    """A TRL callback that appends one row per verl-async-sized step (every
    ``minibatches`` optimizer steps): wall-clock time and the batch's mean reward, which
    TRL logs at the optimizer step that generated the batch."""
    from transformers import TrainerCallback

    class StepRecorder(TrainerCallback):
        def __init__(self) -> None:
            self.reward: dict[str, float] = {}
            self.written = 0

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                self.reward = {k: v for k, v in logs.items() if k.startswith("reward")}
            step = state.global_step
            if step % minibatches or step // minibatches <= self.written or not self.reward:
                return
            self.written = step // minibatches
            row = {"step": self.written - 1, "time": time.time(), "samples": samples,
                   "reward": self.reward["reward"], **self.reward}  # fmt: skip
            with open(path, "a") as f:
                f.write(json.dumps(row) + "\n")

    return StepRecorder()


def model_dir(cfg: RunConfig, work: Path) -> Path:
    """The model verl-async trains: ``model.path``, or the tiny model built (or copied
    from ~/.cache/verl-async/tiny) the way the launcher builds it into a run directory."""
    if cfg.model.path:
        return (ROOT / cfg.model.path).resolve()
    from verl_async.launch.tiny_model import build_tiny_model

    return build_tiny_model(work / "model", cfg.model.tiny)


def trl_prompts(cfg: RunConfig, tokenizer) -> tuple[list[dict], list[tuple[int, ...]]]:
    """TRL dataset rows of the prompts verl-async trains on (those ``render_prompts``
    keeps, rendered the same way), and the token ids verl-async gives the first ones."""
    from verl_async.data import load_prompts, max_prompt_tokens, render_prompts

    records = load_prompts(ROOT / cfg.data.path)
    kept, _ = render_prompts(records, tokenizer, cfg.data.chat_template, max_prompt_tokens(cfg))
    templated = bool(cfg.data.chat_template and getattr(tokenizer, "chat_template", None))
    return dataset_rows(kept, templated), [rec.prompt_ids for rec in kept[:8]]


def prompt_check(trainer, rows: list[dict], want: list[tuple[int, ...]]) -> dict:
    """Whether TRL tokenizes the first prompts to the ids verl-async's engine receives."""
    try:
        got = trainer._tokenize_prompts([r["prompt"] for r in rows[: len(want)]])[0]
    except Exception as exc:  # a private TRL method: report, do not fail the run
        return {"checked": 0, "error": repr(exc)}
    same = [tuple(int(t) for t in g) == w for g, w in zip(got, want, strict=True)]
    return {"checked": len(same), "identical": sum(same), "first_verl": list(want[0]),
            "first_trl": [int(t) for t in got[0]]}  # fmt: skip


def trl_worker(args) -> None:
    """Train with TRL's GRPOTrainer in this process (``--trl-worker``); one row per step
    goes to ``OUT/metrics.jsonl``."""
    import warnings

    import torch

    torch.set_num_threads(TORCH_THREADS)
    # TRL checks the installed vLLM's version at import; it does not use vLLM here.
    warnings.filterwarnings("ignore", message="TRL currently supports vLLM")
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    cfg = load_config(args.config, args.override)
    path = model_dir(cfg, args.out)
    tokenizer = AutoTokenizer.from_pretrained(path)
    rows, want = trl_prompts(cfg, tokenizer)
    funcs, _ = reward_functions(cfg.rewards)
    kwargs = {key: value for key, value, _ in trl_mapping(cfg, args.steps)}
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype[cfg.model.dtype])
    samples = cfg.learner.groups_per_step * cfg.generators.group_size
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=funcs,
        args=GRPOConfig(output_dir=str(args.out / "trainer"), **kwargs),
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        callbacks=[step_recorder(args.out / "metrics.jsonl", cfg.algo.minibatches, samples)],
        # model.lora: the same adapter (rank, alpha, dropout, modules) through TRL's peft
        peft_config=lora.peft_config(cfg.model.lora) if lora.enabled(cfg) else None,
    )
    check = prompt_check(trainer, rows, want)
    (args.out / "prompt_check.json").write_text(json.dumps(check, indent=1))
    print(f"prompt ids identical to verl-async's: {check.get('identical')}/{check['checked']}")
    trainer.train()


# ----------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--steps", type=int, help="steps of each run (default: the config's)")
    parser.add_argument("--out", type=Path, help="output directory (default: runs/peers-PRESET)")
    parser.add_argument("--window", type=int, help="trailing mean of the time to target")
    parser.add_argument("--target", type=float, help="reward of the time to target")
    parser.add_argument(
        "--plot", type=Path, help="PNG of the reward curves (default: OUT/peers.png)"
    )
    parser.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--config", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("override", nargs="*", help="dotted.key=value for both runs")
    args = parser.parse_args(argv)
    preset = PRESETS[args.preset]
    args.config = args.config or ROOT / preset.config
    args.window = args.window or preset.window
    args.target = preset.target if args.target is None else args.target
    args.out = (args.out or ROOT / f"runs/peers-{args.preset}").resolve()
    if not args.trl_worker:  # the worker gets them on its command line already
        args.override = [*preset.overrides, *args.override]
    args.plot = args.plot or args.out / "peers.png"
    if preset.needs and not (ROOT / preset.needs).exists() and not args.trl_worker:
        raise SystemExit(f"{preset.needs} is missing: run `{preset.make}` first")
    return args


def report(args, cfg: RunConfig, mapping: list, results: list[dict]) -> None:
    title = f"{args.preset}: TRL GRPOTrainer vs verl-async, {results[0]['steps']} steps"
    summary = {"preset": args.preset, "config": str(args.config), "machine": machine(),
               "window": args.window, "target": args.target, "overrides": args.override,
               "verl_overrides": VERL_OVERRIDES, "torch_threads_trl": TORCH_THREADS,
               "mapping": [list(m) for m in mapping], "unmatched": unmatched(cfg),
               "prompt_check": _read_json(args.out / "trl/prompt_check.json"), "runs": results}  # fmt: skip
    (args.out / "peers.json").write_text(json.dumps(summary, indent=1, default=str))
    plot(results, args.plot, title, args.window, args.target)
    print(f"\n{mapping_table(mapping)}\n\nNot matched exactly:")
    for note in summary["unmatched"]:
        print(f"- {note}")
    print(f"\n{results_table(results, args.window, args.target)}\n")
    print(f"results: {args.out / 'peers.json'}, curves: {args.plot}")
    verl, trl = results
    print(
        f"summary: {args.preset}, {verl['steps']} steps: whole command verl-async "
        f"{verl['wall_s']:.1f} s, TRL {trl['wall_s']:.1f} s (TRL / verl-async "
        f"{trl['wall_s'] / verl['wall_s']:.2f}x); samples/s over the command "
        f"{verl['samples_per_s']:.1f} and {trl['samples_per_s']:.1f} ({machine()})"
    )


def _read_json(path: Path) -> Any:
    return json.loads(path.read_text()) if path.is_file() else None


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.trl_worker:
        trl_worker(args)
        return
    cfg = load_config(args.config, args.override)
    steps = args.steps or PRESETS[args.preset].steps or cfg.trainer.total_steps
    mapping = trl_mapping(cfg, steps)  # refuses an unmatched config before anything runs
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for system, run in (("verl-async", run_verl), ("trl", run_trl)):
        print(f"{system}: {steps} steps of {args.config.name} ...", flush=True)
        user0, sys0 = children_cpu()
        rows, wall_s = run(args.config, steps, args.out, args.override)
        user1, sys1 = children_cpu()
        res = summarize(system, rows, wall_s, args)
        res["cpu_user_s"], res["cpu_sys_s"] = user1 - user0, sys1 - sys0
        if system == "verl-async":
            res["role_cpu"] = role_cpu(args.out / "verl-async")
            res["learner_parts"] = learner_parts(args.out / "verl-async")
        results.append(res)
        print(f"{system}: {res['steps']} steps, whole command {wall_s:.1f} s, first step "
              f"{res['first_step_s']:.1f} s", flush=True)  # fmt: skip
    report(args, cfg, mapping, results)


if __name__ == "__main__":
    main()
