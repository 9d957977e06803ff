"""The learner's optimizer state, allocated before the first step (learners/setup.py:
allocate_state), trains exactly as a fresh optimizer does; memory it frees is reused
without page faults (keep_freed_memory)."""

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


# A fresh interpreter each (mallopt changes the whole process): a step's worth of tensors
# (256 + 64 MiB) allocated and freed four times over; the page faults of filling the last
# say whether the memory freed before was kept (reused as it is) or given back (every
# page faulted in again). The first rounds fault in either case: glibc places the
# aligned blocks torch asks for beside the freed ones until the heap has room for both.
_REUSE = """
import resource, sys, torch
from learners.setup import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else False
for _ in range(4):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    x, y = torch.ones(64 << 20), torch.ones(16 << 20)  # float32: 256 and 64 MiB
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    del x, y
print(kept, faults)
"""


def test_kept_memory_is_reused_without_page_faults():
    import subprocess
    import sys

    def faults(mode: str) -> tuple[str, int]:
        out = subprocess.run(
            [sys.executable, "-c", _REUSE, mode], capture_output=True, text=True, check=True
        ).stdout.split()
        return out[0], int(out[1])

    pages = (320 << 20) // 4096
    kept, with_keep = faults("keep")
    _, without = faults("off")
    assert kept == "True"
    assert without > pages // 2, without  # given back, faulted in again
    assert with_keep < pages // 20, with_keep  # reused


def test_liger_without_its_package_is_one_error_naming_the_key():
    """``learner.liger`` on a machine without liger-kernel: the learner says what to
    install instead of failing on an import deep in its setup."""
    import importlib.util

    from learners.setup import apply_liger
    from verl_async.config_base import ConfigError

    if importlib.util.find_spec("liger_kernel") is not None:
        pytest.skip("liger-kernel is installed here")
    with pytest.raises(ConfigError, match=r"^bad value for 'learner.liger': the liger-kernel"):
        apply_liger(torch.nn.Linear(2, 2))
