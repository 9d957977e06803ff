"""``start_engine``: the ``RolloutEngine`` that ``generators.engine`` names, started.

Each engine's module is imported only when it is chosen: the transformers engine brings
torch into the process, the vLLM one its engine processes.
"""

from __future__ import annotations

from generators.interface import RolloutEngine
from verl_async.schema import RunConfig


def start_engine(
    cfg: RunConfig, model_path: str, seed: int, tensor_parallel_size: int = 1
) -> RolloutEngine:
    """The engine of ``cfg.generators.engine`` on ``model_path`` (call it inside the event
    loop that will use it). ``tensor_parallel_size``: vLLM workers the engine spans; the
    transformers engine runs on one device (verl_async/placement.py checks)."""
    if cfg.generators.engine == "hf":
        from generators.hf_engine import start_hf_engine

        return start_hf_engine(cfg, model_path, seed)
    from generators.vllm_engine import start_vllm_engine

    return start_vllm_engine(cfg, model_path, seed, tensor_parallel_size)
