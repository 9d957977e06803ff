"""The transformers engine (``generators.engine: hf``) on the tiny model: a wave batches
prompts of different lengths and its log-probs are the learner's; a weight swap in
``abort`` mode cuts the running wave, and every token is stamped with the version that
computed it (checked against each version's own log-probs, token by token)."""

import asyncio
import contextlib
import threading

import pytest
import torch

from generators.hf_engine import start_hf_engine
from generators.interface import Sampling
from learners.logprobs import logits_of
from tests.weight_sync_helpers import send_weights
from verl_async import protocol as P
from verl_async.algos import token_logprobs
from verl_async.config import load_config
from verl_async.weight_sync import join_group, param_specs

from .conftest import ROOT, hf_wave_held_until_abort

TEMPERATURE = 0.7
PROMPTS = [[1, 3, 5], [1, 3, 5, 9, 7, 4, 13], [1, 8, 2, 6, 4]]  # <bos> max 0 4 ... lengths 3, 7, 5


def _learner(tiny_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)


def _logprobs(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    """The learner's log-probs of ``response`` after ``prompt`` at TEMPERATURE."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = logits_of(model, ids, torch.ones_like(ids), TEMPERATURE)
    return token_logprobs(logits, ids[:, 1:])[0, len(prompt) - 1 :]


def test_one_wave_batches_prompts_of_different_lengths_and_matches_the_learner(tiny_model):
    cfg = load_config(ROOT / "configs/tiny.yaml", [])
    how = Sampling(max_tokens=6, temperature=TEMPERATURE)

    async def scenario():
        engine = start_hf_engine(cfg, str(tiny_model), seed=0)
        try:
            samples = await asyncio.gather(
                *(engine.sample(p, how) for p in PROMPTS for _ in range(4))
            )
            return samples, engine.waves
        finally:
            engine.shutdown()

    samples, waves = asyncio.run(scenario())
    assert waves == 1  # twelve requests, three prompt lengths, one left-padded batch
    # Each prompt's four samples share its prefill, then sample on their own.
    learner = _learner(tiny_model)
    for i, s in enumerate(samples):
        prompt = PROMPTS[i // 4]
        assert s.prompt_ids == prompt and 1 <= len(s.token_ids) <= 6
        assert s.versions == [0] * len(s.token_ids)
        expected = _logprobs(learner, prompt, s.token_ids)
        torch.testing.assert_close(torch.tensor(s.logprobs), expected, atol=1e-4, rtol=0)
    assert len({tuple(s.token_ids) for s in samples}) > 3  # sampled, not greedy
    assert all(len({tuple(s.token_ids) for s in samples[i : i + 4]}) > 1 for i in (0, 4, 8))


@pytest.mark.parametrize("mode", ["abort", "keep"])
def test_a_swap_mid_wave_stamps_every_token_with_the_version_that_computed_it(
    tiny_model, free_port, mode
):
    cfg = load_config(ROOT / "configs/tiny.yaml", [f"weights.mode={mode}"])
    how = Sampling(max_tokens=40, temperature=TEMPERATURE)
    port = free_port()
    old = _learner(tiny_model)
    new = _learner(tiny_model)
    with torch.no_grad():  # a different policy, far enough that log-probs tell them apart
        for p in new.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    tensors = {k: v.detach() for k, v in new.state_dict().items()}
    specs = param_specs(tensors.items())

    async def scenario():
        engine = start_hf_engine(cfg, str(tiny_model), seed=0)
        holder = {}
        joiner = threading.Thread(
            target=lambda: holder.setdefault("g", join_group("127.0.0.1", port, 0, 2, "gloo", 60))
        )
        joiner.start()
        await engine.join_weight_sync("127.0.0.1", port, 2, 1, "gloo")
        joiner.join(60)
        # abort: the wave's first token waits for the swap, so it cuts every request
        held = hf_wave_held_until_abort(engine) if mode == "abort" else contextlib.nullcontext()
        try:
            with held:
                tasks = [asyncio.create_task(engine.sample(PROMPTS[0], how)) for _ in range(16)]
                while not engine.lock.locked():  # the first wave is running
                    await asyncio.sleep(0.001)
                sender = threading.Thread(
                    target=send_weights, args=(holder["g"], tensors, specs, 1 << 20)
                )
                sender.start()
                update = P.WeightUpdate(version=1, params=specs, bucket_bytes=1 << 20)
                await engine.apply_update(update)
                sender.join(60)
                return await asyncio.gather(*tasks), engine.resubmitted
        finally:
            await engine.leave_weight_sync()
            holder["g"].close()
            engine.shutdown()

    samples, resubmitted = asyncio.run(scenario())
    for s in samples:
        assert s.versions == sorted(s.versions) and set(s.versions) <= {0, 1}
        model_of = {0: old, 1: new}
        for version in set(s.versions):
            # each token's log-prob is that of the version it is stamped with
            at = [i for i, v in enumerate(s.versions) if v == version]
            expected = _logprobs(model_of[version], PROMPTS[0], s.token_ids)[at]
            torch.testing.assert_close(torch.tensor(s.logprobs)[at], expected, atol=1e-4, rtol=0)
    if mode == "abort":
        assert resubmitted > 0
        assert any(set(s.versions) == {0, 1} for s in samples), "no request spanned the swap"
    else:  # the swap waited for the wave: each request sampled by one version
        assert resubmitted == 0 and all(len(set(s.versions)) == 1 for s in samples)


def test_a_dead_wave_loop_fails_its_requests_instead_of_leaving_them_waiting(tiny_model):
    cfg = load_config(ROOT / "configs/tiny.yaml", [])
    how = Sampling(max_tokens=6, temperature=TEMPERATURE)

    def broken():
        raise RuntimeError("a bug in the wave loop")

    async def scenario():
        engine = start_hf_engine(cfg, str(tiny_model), seed=0)
        engine._take = broken
        try:
            with pytest.raises(RuntimeError, match="a bug in the wave loop"):
                await asyncio.wait_for(engine.sample(PROMPTS[0], how), 30)
            with pytest.raises(RuntimeError, match="wave loop is not running"):
                await engine.sample(PROMPTS[0], how)
        finally:
            engine.shutdown()

    asyncio.run(scenario())
