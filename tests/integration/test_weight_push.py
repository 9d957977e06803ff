"""A learner-side broadcast reaches running engines (vLLM and transformers): their logprobs
follow the new weights."""

import asyncio
import threading

import pytest
import torch

from tests.weight_sync_helpers import send_weights
from verl_async import protocol as P
from verl_async.config import load_config
from verl_async.weight_sync import join_group, param_specs

from .conftest import ENGINES, ROOT, start_test_engine

SEQUENCE = [1, 3, 5, 9, 7, 4, 13, 8, 2]  # <bos> max 0 4 2 ... a fixed token sequence


def hf_logprobs(model, ids):
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    return torch.tensor([logp[i - 1, ids[i]].item() for i in range(1, len(ids))])


async def engine_logprobs(engine, ids):
    return torch.tensor(await engine.prompt_logprobs(ids))


async def scenario(tiny_model, port, count: int, kind: str):
    """``count`` engines (weight-sync ranks 1..count) and the learner (rank 0) in this process."""
    from transformers import AutoModelForCausalLM

    cfg = load_config(ROOT / "configs/tiny.yaml", ["weights.bucket_mb=1"])
    learner = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    engines = [start_test_engine(kind, cfg, tiny_model, seed=i) for i in range(count)]
    try:
        holder = {}
        joiner = threading.Thread(
            target=lambda: holder.setdefault(
                "g", join_group("127.0.0.1", port, 0, 1 + count, "gloo", 60)
            )
        )
        joiner.start()
        await asyncio.gather(
            *(
                e.join_weight_sync("127.0.0.1", port, 1 + count, 1 + i, "gloo")
                for i, e in enumerate(engines)
            )
        )
        joiner.join(60)
        before = [await engine_logprobs(e, SEQUENCE) for e in engines]
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
        # With the learner's memory file, as the buffer relays it: both engines read it.
        group = holder["g"]
        update = P.WeightUpdate(version=1, params=specs, bucket_bytes=1 << 20, memory=group.offer)
        sender = threading.Thread(target=send_weights, args=(holder["g"], tensors, specs, 1 << 20))
        sender.start()
        await asyncio.gather(
            *(e.apply_update(update) for e in engines)
        )  # one broadcast, both receive
        sender.join(60)
        assert group.memory_agreed and group.memory is not None  # the shared-memory route
        after = [await engine_logprobs(e, SEQUENCE) for e in engines]
        return old, before, new, after, [e.loaded_version for e in engines]
    finally:
        for e in engines:
            e.shutdown()


@pytest.mark.parametrize("kind", ENGINES)
def test_one_push_changes_both_generators_logprobs_to_the_learners(tiny_model, free_port, kind):
    old, before, new, after, versions = asyncio.run(
        scenario(tiny_model, free_port(), count=2, kind=kind)
    )
    assert versions == [1, 1]
    assert (new - old).abs().max() > 0.05  # the optimizer step really moved the logprobs
    for b, a in zip(before, after, strict=True):
        torch.testing.assert_close(b, old, atol=1e-4, rtol=0)  # same weights to start
        # float32: bf16 tolerance is far looser
        torch.testing.assert_close(a, new, atol=1e-4, rtol=0)
        assert (a - old).abs().max() > 0.05  # and the engine no longer samples the old policy
