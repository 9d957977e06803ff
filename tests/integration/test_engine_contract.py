"""The contract of ``generators.interface.RolloutEngine``: the same checks on both engines.

One engine per kind (vLLM, transformers) on the tiny model serves every check of this
module (vLLM start-up is ~20 s on CPU), on one event loop of the module's own, a member of
a real gloo weight-sync group whose learner end (rank 0) is this process. Checks read the
engine's version and compare against ``Rig.models``, the weights of each version pushed,
so they hold in any order; the last one shuts the engine down.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import inspect
import os
import threading
from dataclasses import dataclass, field

import msgspec
import pytest
import torch

from generators.interface import RolloutEngine, Sample, Sampling
from learners.logprobs import logits_of
from tests.weight_sync_helpers import send_weights
from verl_async import protocol as P
from verl_async.algos import token_logprobs
from verl_async.config import load_config
from verl_async.weight_sync import param_specs

from .conftest import ENGINES, ROOT, hf_wave_held_until_abort, start_engine_in_group

TEMPERATURE = 0.7
PROMPTS = [[1, 3, 5], [1, 3, 5, 9, 7, 4, 13], [1, 8, 2, 6, 4]]  # lengths 3, 7, 5
SEQUENCE = [1, 3, 5, 9, 7, 4, 13, 8, 2]  # a fixed token sequence for prompt_logprobs
BUCKET = 1 << 20


@dataclass
class Rig:
    kind: str
    cfg: object
    loop: asyncio.AbstractEventLoop
    engine: RolloutEngine
    learner_group: object  # rank 0 of the weight-sync group
    models: dict[int, torch.nn.Module] = field(default_factory=dict)  # version -> weights
    closed: bool = False

    def run(self, coro):
        return self.loop.run_until_complete(coro)


def _model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


@pytest.fixture(scope="module", params=ENGINES)
def rig(request, tiny_model):
    cfg = load_config(ROOT / "configs/tiny.yaml", [])
    loop, engine, group = start_engine_in_group(request.param, cfg, tiny_model)
    rig = Rig(request.param, cfg, loop, engine, group, {0: _model(tiny_model)})
    yield rig
    if not rig.closed:
        rig.run(engine.leave_weight_sync())
        engine.shutdown()
    rig.learner_group.close()
    loop.run_until_complete(asyncio.sleep(0.1))  # let cancelled tasks finish
    loop.close()


def _learner_logprobs(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    """The learner's log-probs of ``response`` after ``prompt`` at TEMPERATURE."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = logits_of(model, ids, torch.ones_like(ids), TEMPERATURE)
    return token_logprobs(logits, ids[:, 1:])[0, len(prompt) - 1 :]


def _sequence_logprobs(model, ids: list[int]) -> torch.Tensor:
    """Log-prob of each of ids[1:] given its prefix, temperature 1 (``prompt_logprobs``)."""
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    return torch.tensor([logp[i - 1, ids[i]].item() for i in range(1, len(ids))])


def _set_mode(rig: Rig, mode: str) -> None:
    """Both engines read ``weights.mode`` from their config at each update: switching it
    saves starting an engine per mode."""
    weights = msgspec.structs.replace(rig.cfg.weights, mode=mode)
    rig.engine.cfg = msgspec.structs.replace(rig.cfg, weights=weights)


def _next_weights(rig: Rig) -> tuple[int, torch.nn.Module]:
    """The next version: the current weights moved far enough that log-probs tell them apart."""
    version = rig.engine.loaded_version
    model = copy.deepcopy(rig.models[version])
    gen = torch.Generator().manual_seed(version)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    rig.models[version + 1] = model
    return version + 1, model


async def _push(rig: Rig, version: int, model: torch.nn.Module) -> float:
    """Broadcast ``model`` from the learner's end while the engine applies the update."""
    return await push_tensors(rig, version, {k: v.detach() for k, v in model.state_dict().items()})


async def push_tensors(rig: Rig, version: int, tensors: dict[str, torch.Tensor]) -> float:
    """Broadcast ``tensors`` as version ``version`` while the engine applies the update;
    the seconds ``apply_update`` took."""
    specs = param_specs(tensors.items())
    sender = threading.Thread(target=send_weights, args=(rig.learner_group, tensors, specs, BUCKET))
    sender.start()
    seconds = await rig.engine.apply_update(
        P.WeightUpdate(
            version=version, params=specs, bucket_bytes=BUCKET, memory=rig.learner_group.offer
        )
    )
    await asyncio.to_thread(sender.join, 60)
    return seconds


def _check_sample(s: Sample, how: Sampling) -> None:
    """Shape of a sample: one log-prob and one version per token, within budget."""
    assert 1 <= len(s.token_ids) <= how.max_tokens
    assert len(s.logprobs) == len(s.versions) == len(s.token_ids)
    assert s.versions == sorted(s.versions)


def test_both_engines_implement_the_interface(rig):
    assert isinstance(rig.engine, RolloutEngine)
    methods = [n for n, v in vars(RolloutEngine).items() if inspect.isfunction(v) and n[0] != "_"]
    assert {"sample", "apply_update", "shutdown"} <= set(methods)
    for name in methods:
        wanted, got = getattr(RolloutEngine, name), getattr(type(rig.engine), name)
        assert inspect.signature(got).parameters.keys() == (
            inspect.signature(wanted).parameters.keys()
        ), name
        assert inspect.iscoroutinefunction(got) == inspect.iscoroutinefunction(wanted), name


def test_sample_stamps_each_token_and_carries_the_loaded_weights_logprobs(rig):
    how = Sampling(max_tokens=6, temperature=TEMPERATURE)

    async def scenario():
        return await asyncio.gather(*(rig.engine.sample(p, how) for p in PROMPTS for _ in range(4)))

    samples = rig.run(scenario())
    version = rig.engine.loaded_version
    for i, s in enumerate(samples):
        prompt = PROMPTS[i // 4]
        _check_sample(s, how)
        assert s.prompt_ids == prompt
        assert s.versions == [version] * len(s.token_ids)
        expected = _learner_logprobs(rig.models[version], prompt, s.token_ids)
        torch.testing.assert_close(torch.tensor(s.logprobs), expected, atol=2e-4, rtol=0)
    assert len({tuple(s.token_ids) for s in samples}) > 3  # sampled, not greedy


def test_many_concurrent_requests_all_finish_within_their_budgets(rig):
    budgets = [1, 3, 8, 16]
    hows = [Sampling(max_tokens=b, temperature=1.0) for b in budgets]

    async def scenario():
        calls = [rig.engine.sample(PROMPTS[i % 3], hows[i % 4]) for i in range(64)]
        return await asyncio.wait_for(asyncio.gather(*calls), 120)

    samples = rig.run(scenario())
    assert len(samples) == 64
    for i, s in enumerate(samples):
        _check_sample(s, hows[i % 4])


def test_an_update_moves_the_version_and_the_logprobs_to_the_pushed_weights(rig):
    _set_mode(rig, "keep")
    old_version = rig.engine.loaded_version
    version, model = _next_weights(rig)
    old = _sequence_logprobs(rig.models[old_version], SEQUENCE)
    new = _sequence_logprobs(model, SEQUENCE)
    assert (new - old).abs().max() > 0.05  # the two versions are told apart

    async def scenario():
        before = torch.tensor(await rig.engine.prompt_logprobs(SEQUENCE))
        changed = rig.engine.version_changed
        seconds = await _push(rig, version, model)
        after = torch.tensor(await rig.engine.prompt_logprobs(SEQUENCE))
        sample = await rig.engine.sample(PROMPTS[0], Sampling(max_tokens=6, temperature=1.0))
        return before, changed.is_set(), seconds, after, sample

    before, changed, seconds, after, sample = rig.run(scenario())
    # Engine and test share this host: the update went through shared memory, and the
    # log-probs show it arrived whole.
    memory = rig.learner_group.memory
    assert memory is not None and os.fstat(memory.fd).st_size > 0
    torch.testing.assert_close(before, old, atol=1e-4, rtol=0)
    assert changed and rig.engine.loaded_version == version
    assert isinstance(seconds, float) and seconds > 0
    assert not rig.engine.weights_lost
    torch.testing.assert_close(after, new, atol=1e-4, rtol=0)
    assert sample.versions == [version] * len(sample.token_ids)


def _sampling_started(rig: Rig) -> bool:
    """Requests are being decoded (the only look inside an engine: to time the update)."""
    if rig.kind == "hf":
        return rig.engine.lock.locked()  # a wave holds it
    return rig.engine.llm.output_processor.get_num_unfinished_requests() > 0


@pytest.mark.parametrize("mode", ["keep", "abort"])
def test_a_request_in_flight_across_an_update_ends_on_the_new_version(rig, mode):
    _set_mode(rig, mode)
    how = Sampling(max_tokens=40, temperature=TEMPERATURE)
    old = rig.engine.loaded_version
    version, model = _next_weights(rig)
    resubmitted = rig.engine.resubmitted

    # hf, abort: the wave's first token waits for the swap, so the update cuts every
    # request on any machine. vLLM: pushed a few tokens in (its engine core runs in a
    # process of its own; the cut is counted, the spans checked, whatever it caught).
    hf_abort = rig.kind == "hf" and mode == "abort"
    held = hf_wave_held_until_abort(rig.engine) if hf_abort else contextlib.nullcontext()

    async def scenario():
        with held:
            tasks = [asyncio.create_task(rig.engine.sample(PROMPTS[0], how)) for _ in range(16)]
            while not _sampling_started(rig):
                await asyncio.sleep(0.001)
            if not hf_abort:
                await asyncio.sleep(0.05)  # a few tokens in
            await _push(rig, version, model)
        samples = await asyncio.wait_for(asyncio.gather(*tasks), 120)
        return samples, await rig.engine.sample(PROMPTS[0], how)

    samples, later = rig.run(scenario())
    assert rig.engine.loaded_version == version
    for s in samples:
        _check_sample(s, how)
        assert set(s.versions) <= {old, version}
    assert later.versions == [version] * len(later.token_ids)
    if mode == "abort":  # cut, then continued from the prefix under the new weights
        assert rig.engine.resubmitted > resubmitted
        spanned = [s for s in samples if set(s.versions) == {old, version}]
        assert spanned, "no request spanned the update"
        assert all(s.versions[-1] == version for s in spanned)
    else:  # none cut (vLLM resumes them under the new weights; hf finishes its wave first)
        assert rig.engine.resubmitted == resubmitted


def test_leave_and_shutdown_return(rig):
    """Last in the module: the engine is gone afterwards."""
    rig.run(asyncio.wait_for(rig.engine.leave_weight_sync(timeout_s=5.0), 30))
    rig.engine.shutdown()
    rig.closed = True
