"""The learner's optimizer state, allocated before the first step (learners/setup.py:
allocate_state), trains exactly as a fresh optimizer does."""

import pytest
import torch

from learners.setup import adamw, allocate_state


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_a_preallocated_optimizer_trains_bit_for_bit_as_a_fresh_one(weight_decay):
    runs = []
    for allocate in (False, True):
        model = _model()
        opt = adamw(model, lr=1e-2, weight_decay=weight_decay)
        if allocate:
            before = [p.clone() for p in model.parameters()]
            allocate_state(opt)
            assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
            assert all(p.grad is None for p in model.parameters())
            states = list(opt.state.values())
            assert len(states) == 4 and all(float(s["step"]) == 0 for s in states)
            assert all(not s["exp_avg"].any() and not s["exp_avg_sq"].any() for s in states)
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            x = torch.randn(4, 5, generator=g)
            model(x).pow(2).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        runs.append(([p.detach().clone() for p in model.parameters()], opt.state_dict()))
    (fresh, fresh_state), (pre, pre_state) = runs
    for a, b in zip(fresh, pre, strict=True):
        assert torch.equal(a, b)
    for k, v in fresh_state["state"].items():
        for name, t in v.items():
            assert torch.equal(t, pre_state["state"][k][name]), name
    assert fresh_state["param_groups"] == pre_state["param_groups"]


def test_only_trainable_parameters_get_state_and_a_loaded_state_stays():
    model = _model()
    model[0].requires_grad_(False)  # frozen, like a LoRA run's base
    opt = adamw(model, lr=1e-2, weight_decay=0.0)
    allocate_state(opt)
    assert len(opt.state) == 2 and model[0].weight.grad is None
    opt.state[model[2].weight]["step"].fill_(7)
    allocate_state(opt)  # state present (e.g. restored): left alone
    assert float(opt.state[model[2].weight]["step"]) == 7
