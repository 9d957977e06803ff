"""The learner's checkpoints (learners/checkpoints/): written behind, committed, restored
to the same state through ``Checkpoints.save`` and ``Checkpoints.load``."""

import json
import pickle  # to plant a hostile DCP index: the system itself never unpickles
import random
import weakref

import pytest
import torch

from learners.checkpoints import writer as checkpointing
from learners.checkpoints.manager import Checkpoints
from learners.checkpoints.state import LearnerState
from learners.distributed import DataParallel
from learners.finite import NonFiniteWeights
from tests.slow_learner import SlowCheckpointer
from verl_async import protocol as P
from verl_async.checkpoint import (
    CheckpointError,
    commit,
    list_checkpoints,
    read_manifest,
    step_dir,
    verify,
)
from verl_async.schema import CheckpointConfig


def _trainer(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))
    return model, opt, sched


def _step(model, opt, sched, x):
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    sched.step()


class _Buffer:
    """The buffer's side of the barrier: records the cuts it was asked to take."""

    def __init__(self) -> None:
        self.cuts: list = []

    def send(self, message):
        self.cuts.append(message)
        return message

    def receive(self, cut) -> None:
        assert cut is self.cuts[-1]


def _checkpoints(run_dir, model, opt, sched, critic=None, files=None, meta=None) -> Checkpoints:
    """One learner rank's checkpoints (every step, the two newest kept)."""
    files = {"ledger.json": b"{}"} if files is None else files
    return Checkpoints(
        run_dir, CheckpointConfig(every_steps=1, keep_last=2, write_timeout_s=30.0),
        LearnerState(model, opt, sched, critic), DataParallel(), True, _Buffer(),
        lambda step: files, meta or {},
    )  # fmt: skip


def test_restore_continues_exactly_where_the_snapshot_was_taken(tmp_path):
    model, opt, sched = _trainer(0)
    x = torch.randn(16, 4)
    for _ in range(3):
        _step(model, opt, sched, x)
    files = {"ledger.json": b"{}", "rollouts.arrow": b"arrow"}
    checkpoints = _checkpoints(tmp_path, model, opt, sched, files=files, meta={"m": "x"})
    assert checkpoints.due(3) and checkpoints.save(3, 3, lambda: {"wall_s": 1.5}) > 0
    assert checkpoints.buffer.cuts == [P.SnapshotBuffer(step=3, version=3)]
    # Training goes on while the writer works: the snapshot holds copies, not views.
    # (The step draws no random numbers, so the next draws are the snapshot's.)
    _step(model, opt, sched, x)
    expected_rand = torch.rand(3)
    expected_py = random.random()
    _step(model, opt, sched, x)
    checkpoints.finish()
    checkpoints.close()

    ckpt = step_dir(tmp_path, 3)
    assert verify(ckpt) == []
    manifest = read_manifest(ckpt)
    assert set(manifest.files) == {
        "learner/model.safetensors",
        "learner/state.safetensors",
        "learner/trainer_state.json",
        "buffer/ledger.json",
        "buffer/rollouts.arrow",
    }
    assert not any(name.endswith((".pt", ".pkl")) for name in manifest.files)  # no pickle
    assert json.loads((ckpt / "learner/trainer_state.json").read_text())["version"] == 3

    fresh, fresh_opt, fresh_sched = _trainer(1)  # different init: everything must be loaded
    info = _checkpoints(tmp_path, fresh, fresh_opt, fresh_sched).load(ckpt)
    assert (info["step"], info["version"], info["wall_s"]) == (3, 3, 1.5)
    _step(fresh, fresh_opt, fresh_sched, x)
    assert torch.equal(torch.rand(3), expected_rand) and random.random() == expected_py
    _step(fresh, fresh_opt, fresh_sched, x)
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)
    assert fresh_sched.get_last_lr() == sched.get_last_lr()


def test_a_writer_error_surfaces_in_the_training_thread(tmp_path):
    (tmp_path / "missing").write_text("a file where a directory should be")
    writer = checkpointing.Checkpointer(tmp_path / "missing" / "x", 2, 30, {})
    writer.save(checkpointing.Snapshot(1, 1, {"learner/a.json": [b"{}"]}))
    with pytest.raises(OSError):
        writer.wait()


def test_writes_commit_in_order_and_slots_alternate(tmp_path):
    writer = SlowCheckpointer(tmp_path, keep_last=5, timeout_s=30, meta={}, delay_s=0.3)
    slots = []
    for step in (1, 2, 3):
        stager = writer.stager()
        slots.append(stager)
        files = {"learner/x.json": [b"{}"], "buffer/ledger.json": [str(step).encode()]}
        writer.save(checkpointing.Snapshot(step, step, files))
        if step == 2:
            assert writer.pending == 2  # queued behind the first, nobody waited
    assert slots[0] is slots[2] is not slots[1]
    assert writer.wait()
    committed = [read_manifest(step_dir(tmp_path, s)) for s in (1, 2, 3)]
    assert [m.created_unix for m in committed] == sorted(m.created_unix for m in committed)


def test_stop_ends_the_writer_and_nothing_outlives_a_write(tmp_path):
    """At exit the writer thread ends, and no written snapshot is kept alive by it: the
    learner's buffer fetch closes over the learner, whose weight-sync group must be shut
    down before interpreter teardown (a gloo group destroyed there can abort the process)."""

    class Owner:  # stands in for the learner captured by the buffer fetch
        pass

    owner = Owner()
    alive = weakref.ref(owner)
    writer = checkpointing.Checkpointer(tmp_path, keep_last=2, timeout_s=30, meta={})
    fetch = lambda o=owner: {"buffer/ledger.json": [b"{}"]}  # noqa: E731
    writer.save(checkpointing.Snapshot(1, 1, {"learner/a.json": [b"{}"]}, fetch))
    del owner, fetch
    assert writer.wait()
    assert alive() is None
    thread = writer.thread
    assert thread.is_alive()  # long-lived: it waits for the next snapshot
    writer.stop()
    assert not thread.is_alive() and writer.thread is None
    assert verify(step_dir(tmp_path, 1)) == []


def test_pruned_checkpoint_is_recycled_in_place_and_never_passes_for_one(tmp_path):
    writer = checkpointing.Checkpointer(tmp_path, keep_last=2, timeout_s=30, meta={})
    inodes = {}
    for step in range(1, 6):
        writer.stager()
        files = {
            "learner/model.bin": [bytes([step]) * 4096],
            # shrinks each time: an overwritten file must be cut to its new length
            "learner/state.json": [json.dumps({"step": step, "pad": "x" * (50 - step)}).encode()],
        }
        if step <= 2:
            files["learner/only_early.json"] = [b"{}"]  # the spare still holds it at step 5
        writer.save(checkpointing.Snapshot(step, step, files))
        assert writer.wait()
        inodes[step] = (step_dir(tmp_path, step) / "learner/model.bin").stat().st_ino
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["spare", "step_00000004", "step_00000005"]
    assert not (tmp_path / "checkpoints/spare/manifest.json").exists()
    assert [c.name for c in list_checkpoints(tmp_path)] == ["step_00000004", "step_00000005"]
    for step in (4, 5):
        ckpt = step_dir(tmp_path, step)
        assert verify(ckpt) == []
        assert (ckpt / "learner/model.bin").read_bytes() == bytes([step]) * 4096
        state = json.loads((ckpt / "learner/state.json").read_text())
        assert state["step"] == step and len(state["pad"]) == 50 - step
        assert sorted(read_manifest(ckpt).files) == ["learner/model.bin", "learner/state.json"]
        assert not (ckpt / "learner/only_early.json").exists()  # a stray of the spare, removed
    # step 1 became the spare at step 3's prune, and step 4 was written into its files
    assert inodes[4] == inodes[1] and inodes[5] == inodes[2]


def test_staged_files_are_valid_safetensors_with_every_dtype_aligned(tmp_path):
    from safetensors.torch import load_file

    tensors = {
        "a_u8": torch.arange(3, dtype=torch.uint8),
        "b_f32": torch.randn(2, 3),
        "c_i64": torch.tensor(7),  # 0-dim
        "d_bf16": torch.randn(5).to(torch.bfloat16),
        "e_bool": torch.tensor([True, False]),
    }
    stager = checkpointing.Stager()
    path = tmp_path / "x.safetensors"
    path.write_bytes(b"".join(bytes(c) for c in stager.stage("x", tensors, {"k": "v"})))
    back = load_file(path)
    assert set(back) == set(tensors)
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name
    first = stager.files["x"]
    stager.stage("x", {**tensors, "b_f32": torch.zeros(2, 3)})
    assert stager.files["x"] is first  # same shapes: the buffer is reused
    stager.stage("x", {**tensors, "b_f32": torch.zeros(4)})
    assert stager.files["x"] is not first  # new shapes: laid out again


def test_the_critic_and_its_optimizer_are_restored_with_the_actor(tmp_path):
    model, opt, sched = _trainer(0)
    critic, critic_opt, _ = _trainer(2)
    x = torch.randn(16, 4)
    for _ in range(2):
        _step(model, opt, sched, x)
        critic(x).pow(2).mean().backward()
        critic_opt.step()
        critic_opt.zero_grad()
    checkpoints = _checkpoints(tmp_path, model, opt, sched, critic=(critic, critic_opt))
    checkpoints.save(2, 2, lambda: {"wall_s": 0.0, "kl_ctrl": {"value": 0.3}})
    checkpoints.finish()
    checkpoints.close()
    ckpt = step_dir(tmp_path, 2)
    assert verify(ckpt) == []
    assert {"learner/critic.safetensors", "learner/critic_state.safetensors"} <= set(
        read_manifest(ckpt).files
    )

    fresh, fresh_opt, fresh_sched = _trainer(1)
    fresh_critic, fresh_critic_opt, _ = _trainer(3)
    fresh_critic_pair = (fresh_critic, fresh_critic_opt)
    info = _checkpoints(tmp_path, fresh, fresh_opt, fresh_sched, fresh_critic_pair).load(ckpt)
    assert info["kl_ctrl"] == {"value": 0.3}
    for a, b in zip(critic.parameters(), fresh_critic.parameters(), strict=True):
        assert torch.equal(a, b)
    # The optimizer state came back too: the next step is the same step.
    for c, o in ((critic, critic_opt), (fresh_critic, fresh_critic_opt)):
        c(x).pow(2).mean().backward()
        o.step()
    for a, b in zip(critic.parameters(), fresh_critic.parameters(), strict=True):
        assert torch.equal(a, b)
    # A run without a critic cannot take this checkpoint (nor the other way round).
    with pytest.raises(ValueError, match="written with a critic"):
        _checkpoints(tmp_path, fresh, fresh_opt, fresh_sched).load(ckpt)


def _committed(tmp_path, model, opt, sched):
    checkpoints = _checkpoints(tmp_path, model, opt, sched)
    checkpoints.save(1, 1, lambda: {"wall_s": 0.0})
    checkpoints.finish()
    checkpoints.close()
    return step_dir(tmp_path, 1)


def test_an_altered_weight_file_is_refused_and_nothing_is_loaded(tmp_path):
    model, opt, sched = _trainer(0)
    ckpt = _committed(tmp_path, model, opt, sched)
    weights = ckpt / "learner" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x40  # one bit of the last tensor: still a valid safetensors file
    weights.write_bytes(bytes(data))
    fresh, fresh_opt, fresh_sched = _trainer(1)
    before = [p.detach().clone() for p in fresh.parameters()]
    with pytest.raises(CheckpointError, match="model.safetensors: sha256 differs"):
        _checkpoints(tmp_path, fresh, fresh_opt, fresh_sched).load(ckpt)
    assert all(torch.equal(a, b) for a, b in zip(before, fresh.parameters(), strict=True))


class _Planted:
    """What a planted DCP ``.metadata`` does when unpickled: touch a file."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (type(self.marker).touch, (self.marker,))


def test_a_planted_shard_index_is_never_unpickled(tmp_path):
    """DCP's .metadata is a pickle: a replaced one must fail verification before DCP
    reads it (on the code before this check, loading ran the planted code)."""
    ckpt = step_dir(tmp_path, 1)
    shards = ckpt / "learner" / "shards"
    shards.mkdir(parents=True)
    state = {"step": 1, "version": 1, "wall_s": 0.0, "optimizer_groups": [],
             "python_rng": list(random.getstate()[1]), "scheduler": None}  # fmt: skip
    (ckpt / "learner" / "trainer_state.json").write_text(json.dumps(state))
    (shards / ".metadata").write_bytes(b"the index the writer wrote")
    commit(ckpt, 1, 1)
    marker = tmp_path / "unpickled"
    (shards / ".metadata").write_bytes(pickle.dumps(_Planted(marker)))
    model, opt, sched = _trainer(0)
    with pytest.raises(CheckpointError, match="learner/shards/.metadata"):
        _checkpoints(tmp_path, model, opt, sched).load(ckpt)
    assert not marker.exists()


def test_a_verified_checkpoint_that_is_not_finite_is_not_resumed_from(tmp_path):
    """The manifest vouches for the bytes, not for the numbers: a checkpoint committed
    with a NaN weight (by hand here; the save path refuses to write one) is refused by
    load instead of being trained on."""
    from safetensors.torch import load_file, save_file

    model, opt, sched = _trainer(0)
    _step(model, opt, sched, torch.randn(16, 4))
    ckpt = _committed(tmp_path, model, opt, sched)
    weights = ckpt / "learner" / "model.safetensors"
    tensors = load_file(weights)
    tensors["2.bias"][1] = float("nan")
    save_file(tensors, weights)
    commit(ckpt, 1, 1)  # the manifest now vouches for the NaN
    assert verify(ckpt) == []
    fresh, fresh_opt, fresh_sched = _trainer(1)
    with pytest.raises(
        NonFiniteWeights, match=r"refusing to resume from step_00000001: model\.2\.bias"
    ):
        _checkpoints(tmp_path, fresh, fresh_opt, fresh_sched).load(ckpt)
