"""A learner-side broadcast reaches a running vLLM engine: its logprobs follow the new weights."""

import asyncio
import threading

import torch

from generators.engine import Engine, start_engine
from verl_async import protocol as P
from verl_async.config import load_config
from verl_async.weight_sync import join_group, param_specs, send_weights

from .conftest import ROOT

SEQUENCE = [1, 3, 5, 9, 7, 4, 13, 8, 2]  # <bos> max 0 4 2 ... a fixed token sequence


def hf_logprobs(model, ids):
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    return torch.tensor([logp[i - 1, ids[i]].item() for i in range(1, len(ids))])


async def vllm_logprobs(engine: Engine, ids):
    return torch.tensor(await engine.prompt_logprobs(ids))


async def scenario(tiny_model, port):
    from transformers import AutoModelForCausalLM

    cfg = load_config(ROOT / "configs/tiny.yaml", ["weights.bucket_mb=1"])
    learner = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    engine = Engine(start_engine(cfg, str(tiny_model), seed=0), cfg)
    try:
        holder = {}
        joiner = threading.Thread(
            target=lambda: holder.setdefault("g", join_group("127.0.0.1", port, 0, 2, "gloo", 60))
        )
        joiner.start()
        await engine.join_weight_sync("127.0.0.1", port, 2, 1, "gloo")
        joiner.join(60)
        before = await vllm_logprobs(engine, SEQUENCE)
        old = hf_logprobs(learner, SEQUENCE)

        # One real optimizer step of the learner on the fixed sequence.
        opt = torch.optim.AdamW(learner.parameters(), lr=1e-2)
        logits = learner(torch.tensor([SEQUENCE])).logits[0, :-1]
        loss = torch.nn.functional.cross_entropy(logits, torch.tensor(SEQUENCE[1:]))
        loss.backward()
        opt.step()
        new = hf_logprobs(learner, SEQUENCE)

        tensors = {k: v.detach() for k, v in learner.state_dict().items()}
        specs = param_specs(tensors.items())
        update = P.WeightUpdate(version=1, params=specs, bucket_bytes=1 << 20)
        sender = threading.Thread(target=send_weights, args=(holder["g"], tensors, specs, 1 << 20))
        sender.start()
        await engine.apply_update(update)
        sender.join(60)
        after = await vllm_logprobs(engine, SEQUENCE)
        return old, before, new, after, engine.loaded_version
    finally:
        engine.shutdown()


def test_push_changes_generator_logprobs_to_the_learners(tiny_model, free_port):
    old, before, new, after, version = asyncio.run(scenario(tiny_model, free_port()))
    assert version == 1
    torch.testing.assert_close(before, old, atol=1e-4, rtol=0)  # same weights to start
    assert (new - old).abs().max() > 0.05  # the optimizer step really moved the logprobs
    torch.testing.assert_close(
        after, new, atol=1e-4, rtol=0
    )  # float32: bf16 tolerance is far looser
    assert (after - old).abs().max() > 0.05  # and the engine no longer samples the old policy
