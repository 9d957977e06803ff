"""LoRA runs (``model.lora``) on both engines: the adapter pushed is the adapter served.

The learner's end is this process: a peft model (``lora.apply``) whose adapter is set at
random per version, broadcast as the learner publishes it (``lora.adapter_state``: the
adapter alone, by peft's saved names) over a real gloo weight-sync group to a real engine
on the tiny model. The transformers engine copies the adapter into its own peft model; the
vLLM engine writes it as an adapter directory and serves one adapter per version
(generators/vllm_adapters.py). One engine per kind serves the module; checks compare with
``Rig.models``, the learner's model of each version pushed, in file order.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from generators.interface import Sampling
from verl_async import lora
from verl_async.config import load_config

from .conftest import ENGINES, ROOT, start_engine_in_group
from .test_engine_contract import (
    PROMPTS,
    SEQUENCE,
    TEMPERATURE,
    Rig,
    _learner_logprobs,
    _sampling_started,
    _sequence_logprobs,
    _set_mode,
    push_tensors,
)

RANK = 8


@dataclass
class LoraRig(Rig):
    path: Path | None = None  # the tiny model: every learner model of the module loads it


def _base(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def _learner(rig: LoraRig, version: int) -> torch.nn.Module:
    """The learner's peft model at ``version``: its adapter set at random (lora_B too, so it
    moves the log-probs, as after some training)."""
    model = lora.apply(_base(rig.path), rig.cfg.model.lora).eval()
    gen = torch.Generator().manual_seed(version)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if lora.is_adapter(name):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    rig.models[version] = model
    return model


@pytest.fixture(scope="module", params=ENGINES)
def rig(request, tiny_model):
    cfg = load_config(
        ROOT / "configs/tiny.yaml",
        [f"model.lora.rank={RANK}", f"generators.engine={request.param}"],
    )
    loop, engine, group = start_engine_in_group(request.param, cfg, tiny_model)
    rig = LoraRig(request.param, cfg, loop, engine, group, {0: _base(tiny_model)})
    rig.path = tiny_model
    yield rig
    rig.run(engine.leave_weight_sync())
    engine.shutdown()
    rig.learner_group.close()
    loop.run_until_complete(asyncio.sleep(0.1))  # let cancelled tasks finish
    loop.close()


async def _push(rig: Rig, version: int) -> float:
    """Broadcast the adapter of ``rig.models[version]`` while the engine applies it."""
    return await push_tensors(rig, version, lora.adapter_state(rig.models[version].state_dict()))


def _engine_logprobs(rig: Rig) -> torch.Tensor:
    return torch.tensor(rig.run(rig.engine.prompt_logprobs(SEQUENCE)))


async def _loaded_adapters(rig: Rig, want: set[int]) -> set[int]:
    """vLLM's loaded adapter ids (a list over its wire), once they are ``want`` (unloading
    runs in the background) or after 30 s."""
    deadline = asyncio.get_running_loop().time() + 30
    while (ids := set(await rig.engine.llm.list_loras())) != want:
        if asyncio.get_running_loop().time() > deadline:
            break
        await asyncio.sleep(0.05)
    return ids


def test_before_any_push_the_engine_serves_the_base_model(rig):
    assert rig.engine.loaded_version == 0
    base = _sequence_logprobs(rig.models[0], SEQUENCE)
    torch.testing.assert_close(_engine_logprobs(rig), base, atol=1e-4, rtol=0)
    if rig.kind == "vllm":
        assert not rig.run(rig.engine.llm.list_loras())  # version 0: no adapter


def test_a_pushed_adapter_gives_the_learner_s_logprobs(rig):
    model = _learner(rig, 1)
    expected = _sequence_logprobs(model, SEQUENCE)
    assert (expected - _sequence_logprobs(rig.models[0], SEQUENCE)).abs().max() > 0.05
    rig.run(_push(rig, 1))
    assert rig.engine.loaded_version == 1 and not rig.engine.weights_lost
    torch.testing.assert_close(_engine_logprobs(rig), expected, atol=1e-4, rtol=0)
    how = Sampling(max_tokens=6, temperature=TEMPERATURE)
    sample = rig.run(rig.engine.sample(PROMPTS[1], how))
    assert sample.versions == [1] * len(sample.token_ids)
    learner = _learner_logprobs(model, PROMPTS[1], sample.token_ids)
    torch.testing.assert_close(torch.tensor(sample.logprobs), learner, atol=2e-4, rtol=0)


def test_a_second_push_moves_to_the_new_adapter_and_requests_in_flight_keep_theirs(rig):
    """keep mode: requests running across the update finish on the adapter they started
    with (vLLM binds it per request; the transformers engine finishes its wave first), so
    their tokens are stamped with that version and carry its log-probs."""
    _set_mode(rig, "keep")
    old = rig.engine.loaded_version
    assert old >= 1, "runs after the first push"
    version = old + 1
    model = _learner(rig, version)
    how = Sampling(max_tokens=40, temperature=TEMPERATURE)
    resubmitted = rig.engine.resubmitted

    async def scenario():
        tasks = [asyncio.create_task(rig.engine.sample(PROMPTS[0], how)) for _ in range(16)]
        while not _sampling_started(rig):
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.05)  # a few tokens in
        await _push(rig, version)
        running = sum(not t.done() for t in tasks)
        samples = await asyncio.wait_for(asyncio.gather(*tasks), 120)
        return running, samples, await rig.engine.sample(PROMPTS[0], how)

    running, samples, later = rig.run(scenario())
    if rig.kind == "vllm":  # nothing paused: requests ran on through the update
        assert running > 0, "no request spanned the update"
    assert rig.engine.resubmitted == resubmitted
    for s in samples:
        assert s.versions == [old] * len(s.token_ids)
        expected = _learner_logprobs(rig.models[old], PROMPTS[0], s.token_ids)
        torch.testing.assert_close(torch.tensor(s.logprobs), expected, atol=2e-4, rtol=0)
    assert later.versions == [version] * len(later.token_ids)
    expected = _learner_logprobs(model, PROMPTS[0], later.token_ids)
    torch.testing.assert_close(torch.tensor(later.logprobs), expected, atol=2e-4, rtol=0)
    new = _sequence_logprobs(model, SEQUENCE)
    assert (new - _sequence_logprobs(rig.models[old], SEQUENCE)).abs().max() > 0.05
    torch.testing.assert_close(_engine_logprobs(rig), new, atol=1e-4, rtol=0)
    if rig.kind == "vllm":  # the old adapter is unused now: unloaded, its directory gone
        assert rig.run(_loaded_adapters(rig, {version + 1})) == {version + 1}
        assert set(rig.engine.adapters.loaded) == {version}
        assert not any((root / f"v{old}").exists() for root in rig.engine.adapters.roots)
        assert all((root / f"v{version}").is_dir() for root in rig.engine.adapters.roots)


def test_abort_mode_continues_requests_in_flight_on_the_new_adapter(rig):
    """abort mode: requests running across the update are cut and go on from their prefix
    on the new adapter; each token is stamped with the adapter that sampled it."""
    _set_mode(rig, "abort")
    old = rig.engine.loaded_version
    version = old + 1
    _learner(rig, version)
    how = Sampling(max_tokens=40, temperature=TEMPERATURE)
    resubmitted = rig.engine.resubmitted

    async def scenario():
        tasks = [asyncio.create_task(rig.engine.sample(PROMPTS[0], how)) for _ in range(16)]
        while not _sampling_started(rig):
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.05)
        await _push(rig, version)
        return await asyncio.wait_for(asyncio.gather(*tasks), 120)

    samples = rig.run(scenario())
    assert rig.engine.resubmitted > resubmitted
    spanned = [s for s in samples if set(s.versions) == {old, version}]
    assert spanned, "no request spanned the update"
    for s in samples:
        assert s.versions == sorted(s.versions) and set(s.versions) <= {old, version}
    for s in spanned:  # each part's log-probs are its own adapter's
        cut = s.versions.index(version)
        for v, part in ((old, slice(0, cut)), (version, slice(cut, None))):
            expected = _learner_logprobs(rig.models[v], PROMPTS[0], s.token_ids)[part]
            torch.testing.assert_close(torch.tensor(s.logprobs[part]), expected, atol=2e-4, rtol=0)
    if rig.kind == "vllm":
        assert rig.run(_loaded_adapters(rig, {version + 1})) == {version + 1}
