"""Samples per second through the environment path and the agent endpoint path, side by
side on one engine.

    python benchmarks/agent_throughput.py [--env-config configs/tiny_tools.yaml]
        [--agent-config configs/tiny_agent.yaml] [--model PATH] [--engine hf|vllm]
        [--groups 48] [--rounds 3] [--out runs/agent_throughput.json]

The same task both ways, in one process with one engine, through the generator's own
rollout kinds (generators/rollouts.py): ``--env-config``'s episodes as environment episodes
(an environment and its tools, the tool calls parsed by the generator) and
``--agent-config``'s as agent episodes (an agent program with the openai client calling
the generator's chat endpoint over HTTP, every call recorded token for token). Each round runs ``--groups`` groups of ``generators.group_size``
episodes through each path, ``generators.max_inflight_groups`` groups in flight (the
generator's own concurrency), env first then agent, so machine noise falls on both; what
counts is the sum over rounds. No buffer, no learner, no weight updates: only the rollout
path, which is what differs. Prints samples/s, episodes/s, model calls and sampled tokens
per episode for each path, and the agent path's samples/s over the environment path's.

``--model``: a Hugging Face model directory in place of the configs' tiny model (the
configs' ``model.tiny`` is built otherwise); ``--engine``: in place of
``generators.engine``; ``key=value`` overrides apply to both configs. SmolLM2 on the
same task, its sums as secrets (``lookup`` tells the answer), with the shipped template::

    python benchmarks/agent_throughput.py --model models/smollm2-135m --engine vllm \
        data.path=configs/data/arith_2d_train.parquet data.chat_template=true \
        multiturn.tool_template=chatml_tools generators.max_new_tokens=32 \
        multiturn.max_episode_tokens=512 generators.max_model_len=512
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import msgspec

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from generators.engines import start_engine  # noqa: E402
from generators.interface import Sampling  # noqa: E402
from generators.rollouts import Rollouts  # noqa: E402
from verl_async import protocol as P  # noqa: E402
from verl_async.config import load_config  # noqa: E402
from verl_async.data import load_prompts, render_prompts  # noqa: E402


def groups_of(cfg, tokenizer, n: int) -> list[P.PromptGroup]:
    """The first ``n`` prompts of ``cfg.data.path`` as the buffer issues them."""
    records, _ = render_prompts(
        load_prompts(ROOT / cfg.data.path)[:n], tokenizer, cfg.data.chat_template, 10**6
    )
    return [
        P.PromptGroup(group_id=i, prompt_id=i, epoch=0, prompt_ids=list(r.prompt_ids),
                      prompt=r.prompt, ground_truth=r.ground_truth, data_source=r.data_source)
        for i, r in enumerate(records)
    ]  # fmt: skip


def with_engine(cfg, engine: str):
    """``cfg`` with ``generators.engine`` set to ``engine`` (as it is when empty)."""
    if not engine:
        return cfg
    return msgspec.structs.replace(
        cfg, generators=msgspec.structs.replace(cfg.generators, engine=engine)
    )


async def run_path(run_group, groups, cfg, how: Sampling) -> dict:
    """Every group through ``run_group``, at most ``max_inflight_groups`` at once."""
    slots = asyncio.Semaphore(cfg.generators.max_inflight_groups)
    n = cfg.generators.group_size

    async def one(group):
        async with slots:
            return await run_group(group, n, how)

    t0 = time.perf_counter()
    results = await asyncio.gather(*(one(g) for g in groups))
    seconds = time.perf_counter() - t0
    trajectories = [t for r in results for t in r]
    sampled = sum(sum(t.loss_mask) for t in trajectories)
    turns = sum(t.stats.turns for t in trajectories)
    return {
        "seconds": seconds,
        "samples": len(trajectories),
        "episodes": len(groups) * n,
        "turns": turns,
        "sampled_tokens": sampled,
    }


async def main_async(args) -> dict:
    env_cfg, agent_cfg = (with_engine(load_config(ROOT / c, args.overrides), args.engine)
                          for c in (args.env_config, args.agent_config))  # fmt: skip
    model = args.model
    if not model:
        from verl_async.launch.tiny_model import build_tiny_model

        model = str(build_tiny_model(Path(tempfile.mkdtemp()) / "model", env_cfg.model.tiny))
    engine = start_engine(env_cfg, model, seed=0)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    how = Sampling.training(env_cfg)
    envs = Rollouts(env_cfg, engine, tokenizer)
    agents = Rollouts(agent_cfg, engine, tokenizer)
    await agents.start()

    def env_group(group, n, how):
        return envs.of(group.data_source).run_group(group, n, how)

    def agent_group(group, n, how):
        return agents.of(group.data_source).run_group(group, n, how)

    groups = groups_of(env_cfg, tokenizer, args.groups)
    # A warm-up group each (first renders, the parser's import, the engine's first wave).
    await run_path(env_group, groups[:1], env_cfg, how)
    await run_path(agent_group, groups[:1], agent_cfg, how)
    totals = {"env": [], "agent": []}
    for r in range(args.rounds):
        for name, path, cfg in (("env", env_group, env_cfg), ("agent", agent_group, agent_cfg)):
            result = await run_path(path, groups, cfg, how)
            totals[name].append(result)
            print(f"round {r} {name:5s} {result['samples'] / result['seconds']:7.1f} samples/s "
                  f"({result['seconds']:.1f} s)", flush=True)  # fmt: skip
    await agents.stop()
    engine.shutdown()
    summary = {}
    for name, runs in totals.items():
        seconds = sum(x["seconds"] for x in runs)
        episodes_n = sum(x["episodes"] for x in runs)
        summary[name] = {
            "samples_per_s": sum(x["samples"] for x in runs) / seconds,
            "episodes_per_s": episodes_n / seconds,
            "turns_per_episode": sum(x["turns"] for x in runs) / episodes_n,
            "sampled_tokens_per_episode": sum(x["sampled_tokens"] for x in runs) / episodes_n,
            "seconds": seconds,
        }
    summary["ratio_samples"] = summary["agent"]["samples_per_s"] / summary["env"]["samples_per_s"]
    summary["ratio_episodes"] = (
        summary["agent"]["episodes_per_s"] / summary["env"]["episodes_per_s"]
    )
    summary["setup"] = {
        "env_config": args.env_config, "agent_config": args.agent_config,
        "model": args.model or "tiny", "engine": agent_cfg.generators.engine,
        "groups": args.groups, "rounds": args.rounds,
    }  # fmt: skip
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--env-config", default="configs/tiny_tools.yaml")
    parser.add_argument("--agent-config", default="configs/tiny_agent.yaml")
    parser.add_argument("--model", default="")
    parser.add_argument("--engine", choices=["hf", "vllm"], default="")
    parser.add_argument("--groups", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("overrides", nargs="*", help="key=value, applied to both configs")
    args = parser.parse_args()
    summary = asyncio.run(main_async(args))
    for name in ("env", "agent"):
        s = summary[name]
        print(f"{name:5s} {s['samples_per_s']:7.1f} samples/s  {s['episodes_per_s']:7.1f} "
              f"episodes/s  {s['turns_per_episode']:.2f} calls/episode  "
              f"{s['sampled_tokens_per_episode']:.1f} sampled tokens/episode")  # fmt: skip
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=1))
    print(f"summary: agent / env {summary['ratio_samples']:.2f} (samples/s), "
          f"{summary['ratio_episodes']:.2f} (episodes/s)")  # fmt: skip


if __name__ == "__main__":
    main()
