"""Non-finite numbers in the learner (learners/finite.py): an optimizer step whose loss or
gradient norm is not finite is skipped and leaves weights and optimizer state bit for bit
as they were; weights or optimizer state that are not finite are never published nor
checkpointed. The tiny model, real AdamW, the learner's own publish and checkpoint code."""

import logging
import math
from types import SimpleNamespace

import msgspec
import numpy as np
import pytest
import torch

from learners.advantages import estimate
from learners.checkpoints.manager import Checkpoints
from learners.checkpoints.state import LearnerState
from learners.critic import critic_update, critic_values, load_critic
from learners.distributed import DataParallel
from learners.finite import NonFiniteWeights, SkipLog, guarded_step, nonfinite_names
from learners.trainer import Learner
from learners.update import UpdateHooks, policy_update
from verl_async.checkpoint import list_checkpoints, step_dir
from verl_async.launch.tiny_model import build_tiny_model
from verl_async.schema import AlgoConfig, RunConfig, TinyModelConfig

from .test_policy_update import _batch

ADV = torch.tensor([1.0, -1.0, 0.5, -0.5])
ALGO = msgspec.structs.replace(AlgoConfig(), minibatches=2)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("m"), TinyModelConfig())


def _trained(model_dir):
    """The tiny model and its AdamW after one good update (moments and step counts set)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    stats = _update(model, opt, ADV)
    assert (stats.optimizer_steps, stats.skipped_nonfinite_loss) == (2, 0)
    return model, opt


def _update(model, opt, adv, backward=None):
    hooks = UpdateHooks(
        backward=backward or (lambda loss: loss.backward()),
        clip_grad=lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0),
    )
    return policy_update(model, opt, _batch(), adv, ALGO, hooks)


def _snapshot(model, opt) -> list[torch.Tensor]:
    """Every weight and every optimizer state tensor (moments, step counts), copied."""
    state = [t.clone() for t in model.state_dict().values()]
    return state + [v.clone() for s in opt.state.values() for v in s.values()]


def _unchanged(before: list[torch.Tensor], model, opt) -> bool:
    after = _snapshot(model, opt)
    return len(after) == len(before) and all(
        torch.equal(a, b) for a, b in zip(after, before, strict=True)
    )


def _reward_of_1e39(batch) -> torch.Tensor:
    """GRPO advantages of a group where one reward was 1e39: what collate's float32 cast
    makes of a score a float64 held."""
    with np.errstate(over="ignore"):
        rewards = torch.from_numpy(np.asarray([1e39, 0.0, 1.0, 0.0]).astype(np.float32))
    group = torch.zeros(4, dtype=torch.long)
    return estimate(ALGO, rewards, group, batch.loss_mask).advantages


def _inf_gradient(model):
    def backward(loss):
        loss.backward()
        model.lm_head.weight.grad[0, 0] = math.inf  # the loss stays finite

    return backward


# case -> (optimizer steps taken, skipped for the loss, skipped for the gradient) of the
# update's two minibatches
CASES = {
    "reward 1e39": (0, 2, 0),
    "inf gradient": (0, 0, 2),
    "nan in one minibatch": (1, 1, 0),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_step_that_is_not_finite_is_skipped_and_changes_nothing(model_dir, case):
    model, opt = _trained(model_dir)
    before = _snapshot(model, opt)
    adv, backward = ADV, None
    if case == "reward 1e39":
        adv = _reward_of_1e39(_batch())
        assert torch.isnan(adv).all()  # the group's baseline is NaN: so is every advantage
    elif case == "inf gradient":
        backward = _inf_gradient(model)
    else:
        adv = torch.tensor([1.0, math.nan, 0.5, -0.5])
    stats = _update(model, opt, adv, backward)
    steps, loss_skips, grad_skips = CASES[case]
    assert stats.optimizer_steps == steps
    assert (stats.skipped_nonfinite_loss, stats.skipped_nonfinite_grad) == (loss_skips, grad_skips)
    assert math.isfinite(stats.loss) == (case == "inf gradient")
    assert _unchanged(before, model, opt) == (steps == 0), "skipped steps changed the state"
    assert all(torch.isfinite(t).all() for t in _snapshot(model, opt))
    assert all(p.grad is None for p in model.parameters())  # nothing carried to the next step
    # The next good batch trains as usual.
    before = _snapshot(model, opt)
    stats = _update(model, opt, ADV)
    assert (stats.optimizer_steps, stats.skipped_nonfinite_loss) == (2, 0)
    assert not _unchanged(before, model, opt)


def test_the_critic_skips_a_step_whose_value_loss_is_not_finite(model_dir):
    torch.manual_seed(0)
    critic = load_critic(str(model_dir))
    opt = torch.optim.AdamW(critic.parameters(), lr=1e-2)
    batch = _batch()
    with torch.no_grad():
        old = critic_values(critic, batch.input_ids, batch.attention_mask)

    def update(returns):
        clip = lambda: torch.nn.utils.clip_grad_norm_(critic.parameters(), 1.0)  # noqa: E731
        hooks = UpdateHooks(lambda loss: loss.backward(), clip)
        return critic_update(
            critic, opt, batch, old, returns * batch.loss_mask, ALGO, hooks, cliprange_value=0.5
        )

    assert update(torch.ones(4, 1)).skipped_nonfinite_loss == 0
    before = _snapshot(critic, opt)
    stats = update(torch.full((4, 1), math.inf))
    assert (stats.skipped_nonfinite_loss, stats.skipped_nonfinite_grad) == (2, 0)
    assert _unchanged(before, critic, opt)
    assert update(torch.ones(4, 1)).skipped_nonfinite_loss == 0
    assert not _unchanged(before, critic, opt)


class _Optimizer:
    def __init__(self) -> None:
        self.steps = self.zeroed = 0

    def step(self) -> None:
        self.steps += 1

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.zeroed += 1


def test_a_loss_that_is_not_finite_on_another_rank_skips_the_step_here_too():
    """Under FSDP2 the loss is each rank's own; ``any_rank`` (a collective in the learner)
    says whether it was NaN anywhere, and every rank then skips alike."""
    opt, asked = _Optimizer(), []

    def another_rank_had_nan(flag: bool) -> bool:
        asked.append(flag)
        return True

    assert guarded_step(opt, lambda: 0.5, 1.25, another_rank_had_nan) == (0.5, "nonfinite_loss")
    assert (opt.steps, opt.zeroed, asked) == (0, 1, [False])
    assert guarded_step(opt, lambda: 0.5, 1.25, lambda flag: flag) == (0.5, None)
    norm, skip = guarded_step(opt, lambda: math.nan, 1.25)
    assert math.isnan(norm) and skip == "nonfinite_grad"
    assert (opt.steps, opt.zeroed) == (1, 3)


def test_the_first_skip_of_each_kind_is_logged_and_the_rest_only_counted(caplog):
    skips = SkipLog()
    actor = SimpleNamespace(skipped_nonfinite_loss=2, skipped_nonfinite_grad=0)
    critic = SimpleNamespace(skipped_nonfinite_loss=0, skipped_nonfinite_grad=1)
    with caplog.at_level(logging.WARNING, logger="verl_async.learner"):
        skips.report(3, actor, critic)
        skips.report(4, actor, critic)
        skips.report(5, SimpleNamespace(skipped_nonfinite_loss=0, skipped_nonfinite_grad=1))
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3, lines
    assert lines[0].startswith("step 3: the actor skipped 2 optimizer step(s) whose loss")
    assert "(skipped_steps/nonfinite_loss)" in lines[0]
    assert lines[1].startswith("step 3: the critic skipped 1 optimizer step(s) whose gradient")
    assert "(critic/skipped_steps/nonfinite_grad)" in lines[1]
    assert lines[2].startswith("step 5: the actor skipped 1")


def test_nonfinite_names_are_exact():
    """A tensor whose finite values add up past float32's range is finite: not named."""
    big = torch.full((4,), 3e38)
    assert not torch.isfinite(big.sum())
    tensors = {
        "ok": torch.ones(3),
        "big": big,
        "nan": torch.tensor([0.0, math.nan]),
        "inf": torch.tensor([-math.inf]).to(torch.bfloat16),
        "ids": torch.tensor([1, 2]),  # not floating point
        "empty": torch.zeros(0),
    }
    assert nonfinite_names(tensors.items()) == ["nan", "inf"]
    assert nonfinite_names([]) == []


# ----------------------------------------------------------------------------- publish, checkpoint


class _Sync:
    """Rank 0's weight sync: records the versions it was asked to send."""

    def __init__(self) -> None:
        self.versions: list[int] = []

    def publish(self, update, buckets) -> None:
        self.versions.append(update.version)
        for _ in buckets:
            pass


class _Buffer:
    def send(self, message):
        return message

    def receive(self, cut) -> None:
        return None


def _learner(tmp_path, model, optimizer):
    """The learner's publish and checkpoint methods over a real model, optimizer and
    checkpoint writer (one rank, no buffer process: its files are two placeholders)."""
    cfg = RunConfig()
    cfg = msgspec.structs.replace(
        cfg, checkpoint=msgspec.structs.replace(cfg.checkpoint, every_steps=1, keep_last=5)
    )
    files = {"ledger.json": b"{}", "rollouts.arrow": b""}
    checkpoints = Checkpoints(
        tmp_path, cfg.checkpoint, LearnerState(model, optimizer), DataParallel(), True,
        _Buffer(), lambda step: files, {},
    )  # fmt: skip
    learner = SimpleNamespace(
        cfg=cfg, raw_model=model, dp=DataParallel(), version=3, steps_done=3, sync=_Sync(),
        checkpoints=checkpoints, acc=SimpleNamespace(device=torch.device("cpu")),
    )  # fmt: skip
    learner.published = lambda: Learner.published(learner)
    learner.checkpoint_info = lambda: {"wall_s": 0.0}
    return learner


def _committed(tmp_path) -> list[str]:
    return [p.name for p in list_checkpoints(tmp_path)]


@pytest.mark.parametrize("poisoned", ["weight", "optimizer moment"])
def test_what_is_not_finite_is_never_published_nor_checkpointed(tmp_path, poisoned):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(5, 4)).square().mean().backward()
    opt.step()
    learner = _learner(tmp_path, model, opt)
    # Finite: published and written (the set-up can tell a refusal from doing nothing).
    Learner.publish_weights(learner)
    Learner.checkpoint(learner)
    learner.checkpoints.finish()
    assert learner.sync.versions == [4] and _committed(tmp_path) == ["step_00000003"]

    with torch.no_grad():
        if poisoned == "weight":
            model[2].weight[1, 0] = math.nan
        else:
            opt.state[model[0].bias]["exp_avg"][3] = -math.inf
    learner.steps_done = 4
    if poisoned == "weight":
        with pytest.raises(NonFiniteWeights, match=r"refusing to publish weights version 5: 2\."):
            Learner.publish_weights(learner)
        assert learner.sync.versions == [4] and learner.version == 4
    else:  # the generators get weights only: those are finite
        Learner.publish_weights(learner)
        assert learner.sync.versions == [4, 5]
    name = "model.2.weight" if poisoned == "weight" else "model_optim.0.bias.exp_avg"
    with pytest.raises(NonFiniteWeights, match=rf"refusing to checkpoint step 4: {name} hold"):
        Learner.checkpoint(learner)
    learner.checkpoints.finish()
    assert _committed(tmp_path) == ["step_00000003"]
    assert not step_dir(tmp_path, 4).exists()
    learner.checkpoints.close()
