"""The critic and the reference on the tiny model: layout, learning, frozen weights."""

import msgspec
import torch

from learners.critic import (
    CriticStats,
    critic_update,
    critic_values,
    load_critic,
    load_reference,
    reference_logprobs,
    value_fit,
)
from learners.update import UpdateHooks, policy_update, prox_pass
from verl_async.launch.tiny_model import build_tiny_model
from verl_async.schema import AlgoConfig, KLConfig, RunConfig, TinyModelConfig

from .test_policy_update import _batch


def _cfg(**algo) -> RunConfig:
    cfg = RunConfig()
    return msgspec.structs.replace(cfg, algo=msgspec.structs.replace(cfg.algo, **algo))


def test_critic_values_align_with_targets_and_fit_returns(tmp_path):
    path = build_tiny_model(tmp_path / "m", TinyModelConfig())
    torch.manual_seed(0)
    critic = load_critic(str(path))
    assert critic.config.num_labels == 1
    batch = _batch()
    values = critic_values(critic, batch.input_ids, batch.attention_mask)
    assert values.shape == batch.loss_mask.shape  # [N, T-1]: V before each target token
    returns = torch.tensor([1.0, 0.0, 1.0, 0.0])[:, None] * batch.loss_mask
    cfg = _cfg(minibatches=2)
    cfg = msgspec.structs.replace(cfg, critic=msgspec.structs.replace(cfg.critic, lr=1e-2))
    opt = torch.optim.AdamW(critic.parameters(), lr=cfg.critic.lr)
    losses = []
    for _ in range(15):
        with torch.no_grad():
            old = critic_values(critic, batch.input_ids, batch.attention_mask)
        hooks = UpdateHooks(lambda loss: loss.backward(), lambda: 0.0)
        stats = critic_update(
            critic, opt, batch, old, returns, cfg.algo, hooks,
            cliprange_value=cfg.critic.cliprange_value,
        )  # fmt: skip
        losses.append(stats.vf_loss)
    assert losses[-1] < 0.2 * losses[0], losses
    assert 0 <= stats.vf_clipfrac <= 1
    # No dropout before the head: two no-grad passes in train mode agree.
    critic.train()
    with torch.no_grad():
        ids, mask = batch.input_ids, batch.attention_mask
        torch.testing.assert_close(
            critic_values(critic, ids, mask), critic_values(critic, ids, mask)
        )


def test_kl_loss_to_the_reference_starts_at_zero_and_leaves_the_reference_alone(tmp_path):
    from transformers import AutoModelForCausalLM

    path = build_tiny_model(tmp_path / "m", TinyModelConfig())
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ref = load_reference(str(path), torch.device("cpu"), torch.float32)
    assert not any(p.requires_grad for p in ref.parameters())
    before = [p.clone() for p in ref.parameters()]
    batch = _batch()
    logp_ref = reference_logprobs(ref, batch, temperature=1.0)
    logp_prox, _ = prox_pass(model, batch, 1.0)
    torch.testing.assert_close(logp_ref, logp_prox)  # the reference is the initial policy
    algo = msgspec.structs.replace(
        AlgoConfig(), minibatches=1, kl=KLConfig(loss_coef=1.0, loss_type="low_var_kl")
    )
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    batch.logp_ref = logp_ref
    hooks = UpdateHooks(backward=lambda loss: loss.backward(), clip_grad=lambda: 0.0)
    first = policy_update(model, opt, batch, adv, algo, hooks)
    second = policy_update(model, opt, batch, adv, algo, hooks)
    assert abs(first.kl_loss) < 1e-6  # identical weights: k3 is 0
    assert second.kl_loss > 1e-4  # one step later the policy has moved
    for a, b in zip(ref.parameters(), before, strict=True):
        assert torch.equal(a, b)


def test_warmup_steps_compute_losses_without_moving_the_actor(tmp_path):
    from transformers import AutoModelForCausalLM

    path = build_tiny_model(tmp_path / "m", TinyModelConfig())
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    before = [p.clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    hooks = UpdateHooks(backward=lambda loss: loss.backward(), clip_grad=lambda: 0.0)
    stats = policy_update(model, opt, _batch(), adv, AlgoConfig(), hooks, step=False)
    assert stats.loss != 0 and stats.grad_norm == 0
    for a, b in zip(model.parameters(), before, strict=True):
        assert torch.equal(a, b)


def test_value_fit_reads_only_kept_tokens():
    values = torch.tensor([[0.5, 9.0], [1.0, 0.0]])  # [N, T]: 9.0 is padding
    returns = torch.tensor([[1.0, -7.0], [1.0, 0.0]])
    mask = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    stats = value_fit(CriticStats(0.0, 0.0, 0.0, 0.0, 0.0), values, returns, mask)
    # Kept: values (0.5, 1, 0) against returns (1, 1, 0).
    assert stats.values_mean == 0.5
    assert abs(stats.values_mse - 0.25 / 3) < 1e-7  # float32
    assert abs(stats.returns_var - 2 / 9) < 1e-7  # mean 2/3: (1/9 + 1/9 + 4/9) / 3
    # Returns all alike: no variance to explain, and an exact guess errs nothing.
    same = value_fit(stats, torch.ones(1, 2), torch.ones(1, 2), torch.ones(1, 2))
    assert same.returns_var == 0.0 and same.values_mse == 0.0
