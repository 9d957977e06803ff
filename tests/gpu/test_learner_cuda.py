"""Learner device path on CUDA: pinned collation, async copy, loss, optimizer step."""

import numpy as np
import pytest
import torch

from learners.batching import collate
from verl_async import protocol as P
from verl_async.algos import policy_loss, token_logprobs
from verl_async.config import TinyModelConfig
from verl_async.tiny_model import build_tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _batch_message():
    frames = P.Frames()
    body = P.Batch(
        step=0,
        group_ids=[0],
        sample_group=[0, 0],
        prompt_lengths=[3, 3],
        response_lengths=[2, 1],
        scores=[[1.0], [0.0]],
        failed=[0],
        data_sources=["default"],
        prompt_ids=frames.add(np.array([1, 3, 9, 1, 3, 8], np.int32)),
        response_ids=frames.add(np.array([13, 2, 7], np.int32)),
        behav_logprobs=frames.add(np.array([-1.0, -2.0, -1.5], np.float32)),
        token_versions=frames.add(np.zeros(3, np.int32)),
        dropped_stale=0,
        buffer_size=0,
        gen_tokens_per_s=0.0,
        wait_s=0.0,
    )
    return body, [bytes(b) for b in frames.buffers]


def test_update_on_cuda_from_pinned_batch(tmp_path):
    from transformers import AutoModelForCausalLM

    path = build_tiny_model(tmp_path / "m", TinyModelConfig())
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda()
    body, frames = _batch_message()
    batch = collate(body, frames, pad_id=0, pin=True)
    assert batch.input_ids.is_pinned()
    batch = batch.to(torch.device("cuda"))
    before = [p.detach().clone() for p in model.parameters()]
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    logp = token_logprobs(logits, batch.input_ids[:, 1:])
    adv = torch.tensor([[1.0], [-1.0]], device="cuda")
    out = policy_loss(
        logp, logp.detach(), batch.behav_logprobs, adv, batch.loss_mask, "decoupled", 0.2, 2.0
    )
    out.loss.backward()
    torch.optim.AdamW(model.parameters(), lr=1e-2).step()
    assert torch.isfinite(out.loss)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
