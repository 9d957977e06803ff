"""A generator's vLLM engine in a process of its own, for test_engine_lifetime.py.

    python -m tests.integration.vllm_generator MODEL PORT

starts the engine as a generator does (``generators.engines.start_engine``, its engine core
in a child process), joins the weight-sync group whose rank 0 is the test (rank 1, gloo,
on loopback PORT), says ``joined`` and receives one update, which the test starts and
holds: this process is SIGKILLed while the engine's worker waits in the broadcast.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from tests.integration.conftest import ROOT, start_test_engine
from verl_async import protocol as P
from verl_async.config import load_config
from verl_async.weight_sync import param_specs, without_tied


async def main(model_path: Path, port: int) -> None:
    from transformers import AutoModelForCausalLM

    cfg = load_config(ROOT / "configs/tiny.yaml")
    engine = start_test_engine("vllm", cfg, model_path, seed=0)
    await engine.join_weight_sync("127.0.0.1", port, 2, 1, "gloo")
    print("joined", flush=True)
    model = AutoModelForCausalLM.from_pretrained(model_path)
    specs = param_specs(without_tied(model, model.state_dict()).items())
    await engine.apply_update(P.WeightUpdate(version=1, params=specs, bucket_bytes=1 << 20))
    print("received", flush=True)  # never, unless the test lets the broadcast finish


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1]), int(sys.argv[2])))
