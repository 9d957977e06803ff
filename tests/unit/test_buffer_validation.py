"""The buffer against hostile input: every rejection pinned, valid input still accepted.

Three layers, all without a network: the pure validators (protocol.tensor / vector,
ledger.check_issued, rollouts.unpack_rollout, the server's request checks), the rate-limited
rejection log, and ``BufferServer._dispatch`` (behind ``RouterSocket.decode``) driven
in-process with the replies captured.
Hypothesis throws random bytes and structurally wrong messages at each layer; the
strategies here (``hostile_messages``) are also what tests/integration/test_buffer_fuzz.py
fires at a live run.
"""

from __future__ import annotations

import itertools
import logging
import math

import msgspec
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from buffer.evaluation import EvalRounds
from buffer.leases import Leases
from buffer.ledger import Issued, LedgerError, PromptLedger, check_issued
from buffer.polls import MAX_PARKED_PER_CLIENT
from buffer.requests import (
    check_announce,
    check_eval_results,
    check_get_batch,
    check_loaded,
    check_non_negative,
    check_wait,
)
from buffer.rollouts import RolloutLimits, unpack_rollout
from buffer.server import BufferServer
from verl_async import protocol as P
from verl_async.data import PromptRecord
from verl_async.ratelimit import RateLimitedLog
from verl_async.staleness import Admission

NAN = math.nan
INT64 = st.integers(-(2**63), 2**63 - 1)
REQUEST_ID = st.integers(0, 2**64 - 1)

# ----------------------------------------------------------------------------- builders


def make_group(
    k: int = 5,
    n: int = 2,
    tokens: int = 3,
    generator_id: int = 0,
    frames: P.Frames | None = None,
    lease: int = 0,
    **arrays,
) -> tuple[P.RolloutGroup, P.Frames]:
    """A valid group of ``n`` samples of ``tokens`` tokens each, with fields overridable:
    arrays by keyword (prompt, resp, lp, ver as numpy arrays), the rest via replace().
    Lease 0 is none (``Harness.push`` sends such a group under the lease it was issued with)."""
    frames = frames or P.Frames()
    total = n * tokens
    prompt = arrays.get("prompt", np.array([1, 2], np.int32))
    resp = arrays.get("resp", np.arange(total, dtype=np.int32) % 7)
    lp = arrays.get("lp", np.full(total, -0.5, np.float32))
    ver = arrays.get("ver", np.full(total, 1, np.int32))
    group = P.RolloutGroup(
        group_id=k,
        prompt_id=0,
        generator_id=generator_id,
        lease=lease,
        prompt_ids=frames.add(prompt),
        response_ids=frames.add(resp),
        behav_logprobs=frames.add(lp),
        token_versions=frames.add(ver),
        lengths=[tokens] * n,
        scores=[[1.0] * n],
        failed=[0],
        data_source="default",
        gen_seconds=0.1,
    )
    return group, frames


def received(frames: P.Frames) -> list[bytes]:
    """The frames as the buffer gets them (bytes, after the envelope)."""
    return [bytes(b) for b in frames.buffers]


LIMITS = RolloutLimits(num_sources=1, group_size=2, vocab_size=32, max_response_tokens=6)
VERSIONS = (1, 3)  # tokens may carry versions 1..3 (loaded when issued .. newest announced)


def unpack(group: P.RolloutGroup, frames: P.Frames | list, limits=LIMITS, versions=VERSIONS):
    wire = received(frames) if isinstance(frames, P.Frames) else frames
    return unpack_rollout(group, wire, limits, versions)


def replace(group: P.RolloutGroup, **fields) -> P.RolloutGroup:
    return msgspec.structs.replace(group, **fields)


# ----------------------------------------------------------------------------- tensors


def test_tensor_rejects_refs_that_do_not_fit_the_frames():
    frames = [bytes(8)]
    cases = [
        (P.TensorRef("complex128", (1,), 1), "unknown tensor dtype 'complex128'"),
        (P.TensorRef("int32", (1,), 2), "tensor frame 2 missing (1 frames)"),
        (P.TensorRef("int32", (1,), 0), "tensor frame 0 missing (1 frames)"),
        (P.TensorRef("int32", (3,), 1), "tensor frame 1 holds 8 bytes; shape (3,) of int32 at offset 0 needs 12"),
        (P.TensorRef("int32", (1,), 1, -4), "tensor frame 1 holds 8 bytes; shape (1,) of int32 at offset -4 needs 0"),
        (P.TensorRef("int32", (1,), 1, 8), "tensor frame 1 holds 8 bytes; shape (1,) of int32 at offset 8 needs 12"),
        (P.TensorRef("int32", (2, -1), 1), "tensor shape (2, -1) has a negative dimension"),
        (P.TensorRef("int32", (1,) * 33, 1), "tensor has 33 dimensions, at most 32"),
        (P.TensorRef("int32", (0, 2**62), 1), "tensor shape (0, 4611686018427387904) is too large"),
    ]  # fmt: skip
    for ref, message in cases:
        with pytest.raises(P.ProtocolError) as err:
            P.tensor(ref, frames)
        assert str(err.value) == message
    assert P.tensor(P.TensorRef("int32", (2,), 1, 0), frames).tolist() == [0, 0]


def test_vector_wants_one_dimension_of_the_right_dtype():
    frames = [np.arange(4, dtype=np.int32).tobytes()]
    assert P.vector(P.TensorRef("int32", (4,), 1), frames, "int32", "ids").tolist() == [0, 1, 2, 3]
    cases = [
        (P.TensorRef("float32", (4,), 1), "ids must be a 1-D int32 tensor, got 'float32' of shape (4,)"),
        (P.TensorRef("int32", (2, 2), 1), "ids must be a 1-D int32 tensor, got 'int32' of shape (2, 2)"),
        (P.TensorRef("int32", (1,) * 40, 1), "ids must be a 1-D int32 tensor, got 'int32' of shape <40 dimensions>"),
        (P.TensorRef("int32", (5,), 1), "ids: tensor frame 1 holds 16 bytes; shape (5,) of int32 at offset 0 needs 20"),
    ]  # fmt: skip
    for ref, message in cases:
        with pytest.raises(P.ProtocolError) as err:
            P.vector(ref, frames, "int32", "ids")
        assert str(err.value) == message


def test_decode_turns_deep_nesting_and_bad_utf8_into_protocol_errors():
    # b"\xa1\x80": a one-byte string that is not UTF-8, found by the property test below;
    # it raised UnicodeDecodeError out of decode() and so out of the buffer's loop.
    for head in (
        b"\x91" * 100_000,
        b"\x81\xa1a" * 50_000,
        b"\xa1\x80",
        bytes([0x93, P.PROTOCOL_VERSION, 1]) + b"\x81\xa4type\xa1\x80",
    ):
        with pytest.raises(P.ProtocolError, match="malformed message"):
            P.decode([head])


refs = st.builds(
    P.TensorRef,
    dtype=st.sampled_from(["int32", "float32", "uint8", "bool", "int64", "float16", "x", ""]),
    shape=st.lists(st.integers(-3, 2**40), max_size=40).map(tuple),
    frame=st.integers(-2, 4),
    offset=st.integers(-(2**40), 2**40),
)


@given(ref=refs, frames=st.lists(st.binary(max_size=64), max_size=3))
def test_tensor_raises_nothing_but_protocol_errors(ref, frames):
    try:
        array = P.tensor(ref, frames)
    except P.ProtocolError:
        return
    assert array.shape == ref.shape and array.dtype == np.dtype(ref.dtype)


@given(parts=st.lists(st.binary(max_size=300), min_size=1, max_size=3))
def test_decode_raises_nothing_but_protocol_errors(parts):
    try:
        env, frames = P.decode(parts)
    except P.ProtocolError:
        return
    assert env.version == P.PROTOCOL_VERSION and frames == parts[1:]


# ----------------------------------------------------------------------------- issuance


def test_check_issued_names_who_the_group_belongs_to():
    group, _ = make_group(k=5, generator_id=0, lease=9)
    issued = Issued(0, 1, b"A", lease=9)
    check_issued(group, issued, b"A")
    cases = [
        (None, b"A", group, "group 5 is not in flight (never issued, or already returned)"),
        (issued, b"B", group, "group 5 was issued to generator 0 on another connection"),
        (issued, b"A", replace(group, generator_id=7), "group 5 was issued to generator 0, not generator 7"),
        (issued, b"A", replace(group, lease=0), "group 5 was issued under lease 9, not lease 0"),
        (issued, b"A", replace(group, lease=8), "group 5 was issued under lease 9, not lease 8"),
    ]  # fmt: skip
    for issued, client, g, message in cases:
        with pytest.raises(LedgerError) as err:
            check_issued(g, issued, client)
        assert str(err.value) == message


def _ledger(b=2, eta=1, steps=4, n=16, leases: Leases | None = None) -> PromptLedger:
    prompts = [PromptRecord(f"p{i}", str(i), prompt_ids=(1, 2)) for i in range(n)]
    return PromptLedger(prompts, Admission(b, eta), steps, seed=0, leases=leases)


def test_check_returnable_says_why_a_group_cannot_come_back():
    ledger = _ledger()
    groups, _ = ledger.issue(0, 0, 4, client=b"A")
    assert [g.group_id for g in groups] == [0, 1, 2, 3]
    assert [g.lease for g in groups] == [1, 2, 3, 4]  # a new lease for every issue
    assert ledger.in_flight[2] == Issued(0, 0, b"A", lease=3)
    stored = unpack(*make_group(k=0, ver=np.zeros(6, np.int32)), versions=(0, 0))
    ledger.record_return(stored)
    cases = [
        ([99], "group 99 was never issued"),
        ([-1], "group -1 was never issued"),
        ([0], "group 0 was already returned"),
        ([1, 2, 1], "a message returns the same group twice: [1]"),
        ([*range(10), *range(10)], "a message returns the same group twice: [0, 1, 2, 3, 4, 5, 6, 7] and 2 more"),
    ]  # fmt: skip
    for ids, message in cases:
        with pytest.raises(LedgerError) as err:
            ledger.check_returnable(ids)
        assert str(err.value) == message
    ledger.check_returnable([1, 2, 3])
    ledger.restore(0, 0, 4, [stored], [1, 2, 3])
    with pytest.raises(LedgerError, match="group 2 waits to be issued again"):
        ledger.check_returnable([2])


# ----------------------------------------------------------------------------- rollouts


def test_a_valid_group_is_unpacked_into_views_of_its_samples():
    group, frames = make_group(k=5, n=2, tokens=3)
    stored = unpack(group, frames)
    assert (stored.group_id, stored.generator_id, stored.data_source) == (5, 0, "default")
    assert [r.tolist() for r in stored.responses] == [[0, 1, 2], [3, 4, 5]]
    assert [v.tolist() for v in stored.token_versions] == [[1, 1, 1], [1, 1, 1]]
    assert stored.prompt_ids.tolist() == [1, 2] and stored.scores == [[1.0], [1.0]]
    # A source not routed to the group's data scores NaN for every sample: still valid.
    unrouted = unpack(replace(group, scores=[[NAN, NAN]]), frames)
    assert all(math.isnan(s[0]) for s in unrouted.scores)
    # Unknown limits are not checked: any group size, token id and length.
    loose = RolloutLimits(num_sources=1)
    big, big_frames = make_group(k=6, n=3, tokens=9, resp=np.full(27, 10**6, np.int32))
    assert len(unpack(big, big_frames, limits=loose).responses) == 3


def _rejections():
    """(group, frames, exact message) for every way a group can be wrong."""
    g, f = make_group(k=5)  # 2 samples x 3 tokens, in one packed frame of 104 bytes
    ref = g.response_ids
    as_float = P.TensorRef("float32", ref.shape, ref.frame, ref.offset)
    as_matrix = P.TensorRef("int32", (2, 3), ref.frame, ref.offset)
    sizes = "response_ids, behav_logprobs and token_versions hold"
    lp_ref = "group 5: behav_logprobs: tensor frame 1 holds 104 bytes; shape (6,) of float32"
    yield (
        replace(g, response_ids=as_float),
        f,
        "group 5: response_ids must be a 1-D int32 tensor, got 'float32' of shape (6,)",
    )
    yield (
        replace(g, token_versions=as_matrix),
        f,
        "group 5: token_versions must be a 1-D int32 tensor, got 'int32' of shape (2, 3)",
    )
    yield (
        replace(g, prompt_ids=P.TensorRef("int32", (2,), 3)),
        f,
        "group 5: prompt_ids: tensor frame 3 missing (1 frames)",
    )
    yield (
        replace(g, behav_logprobs=P.TensorRef("float32", (6,), 1, 10**6)),
        f,
        f"{lp_ref} at offset 1000000 needs 1000024",
    )
    yield (
        replace(g, behav_logprobs=P.TensorRef("float32", (6,), 1, -16)),
        f,
        f"{lp_ref} at offset -16 needs 8",
    )
    yield (
        replace(g, lengths=[2, 2, 2], scores=[[1.0] * 3]),
        f,
        "group 5: 3 samples, the run samples 2 per group",
    )
    yield replace(g, lengths=[7, -1]), f, "group 5: negative sample length"
    yield (
        replace(g, lengths=[3, 4]),
        f,
        f"group 5: lengths add up to 7 tokens; {sizes} 6, 6 and 6",
    )
    yield (
        *make_group(k=5, lp=np.full(5, -0.5, np.float32)),
        f"group 5: lengths add up to 6 tokens; {sizes} 6, 5 and 6",
    )
    yield (*make_group(k=5, tokens=7), "group 5: a sample of 7 tokens, the run allows 6")
    yield (
        *make_group(k=5, resp=np.array([0, 1, 2, 3, 4, 40], np.int32)),
        "group 5: response_ids holds token ids 0..40, the vocabulary has 32",
    )
    yield (
        *make_group(k=5, prompt=np.array([-1, 2], np.int32)),
        "group 5: prompt_ids holds token ids -1..2, the vocabulary has 32",
    )
    for bad in (NAN, 0.5, -np.inf, np.inf):
        lp = np.array([-0.5, -0.1, bad, -1.0, -2.0, -0.3], np.float32)
        yield (*make_group(k=5, lp=lp), "group 5: behav_logprobs must be finite and <= 0")
    for low, high in ((0, 1), (1, 4)):
        ver = np.array([1, 1, low, 2, 3, high], np.int32)
        yield (
            *make_group(k=5, ver=ver),
            f"group 5: token versions {low}..{max(high, 3)} are outside 1..3 "
            "(loaded when issued .. newest announced)",
        )
    two_sources = "group 5: scores of 2 sources and failed counts of 1"
    yield replace(g, scores=[[1.0] * 2] * 2), f, f"{two_sources}, the run has 1 reward sources"
    no_failed = "group 5: scores of 1 sources and failed counts of 0"
    yield replace(g, failed=[]), f, f"{no_failed}, the run has 1 reward sources"
    yield replace(g, scores=[[1.0]]), f, "group 5: source 0 scored 1 samples of 2"
    yield replace(g, scores=[[1.0, NAN]]), f, "group 5: source 0 left some samples unscored (NaN)"
    # 1e39 is a float64 and no float32: the learner would train on an infinity.
    for bad in (math.inf, -math.inf, 1e39, -1e39):
        yield (
            replace(g, scores=[[1.0, bad]]),
            f,
            "group 5: source 0 has a score that is not a finite float32",
        )
    yield replace(g, failed=[3]), f, "group 5: source 0 failed 3 samples of 2"
    yield replace(g, failed=[-1]), f, "group 5: source 0 failed -1 samples of 2"


@pytest.mark.parametrize(("group", "frames", "message"), list(_rejections()), ids=itertools.count())
def test_each_wrong_group_is_rejected_with_a_message_naming_the_field(group, frames, message):
    with pytest.raises(P.ProtocolError) as err:
        unpack(group, frames)
    assert str(err.value) == message


def test_a_group_with_no_samples_is_rejected_even_when_the_group_size_is_unknown():
    group, frames = make_group(k=5, n=0)
    with pytest.raises(P.ProtocolError, match="^group 5: no samples$"):
        unpack(replace(group, scores=[[]]), frames, limits=RolloutLimits())


@st.composite
def random_groups(draw, group_ids=None) -> tuple[P.RolloutGroup, list[bytes]]:
    """Structurally anything: plausible groups with one field bent, or noise."""
    group_ids = st.integers(-5, 300) if group_ids is None else group_ids
    n, tokens = draw(st.integers(0, 9)), draw(st.integers(0, 7))

    def column(elements, dtype) -> np.ndarray:
        return np.array(draw(st.lists(elements, min_size=n * tokens, max_size=n * tokens)), dtype)

    group, frames = make_group(
        k=draw(group_ids),
        n=n,
        tokens=tokens,
        generator_id=draw(st.sampled_from([0, 1, -1, 2**40])),
        resp=column(st.integers(-(2**31), 2**31 - 1), np.int32),
        lp=column(st.floats(width=32), np.float32),
        ver=column(st.integers(-3, 6), np.int32),
    )
    fields = {
        "lengths": st.lists(st.integers(-2, 9), max_size=10),
        "scores": st.lists(st.lists(st.floats(), max_size=10), max_size=3),
        "failed": st.lists(st.integers(-2, 10), max_size=3),
        "response_ids": refs,
        "prompt_ids": refs,
        "behav_logprobs": refs,
        "token_versions": refs,
    }
    bent = draw(st.lists(st.sampled_from(sorted(fields)), unique=True, max_size=3))
    group = replace(group, **{name: draw(fields[name]) for name in bent})
    wire = draw(st.one_of(st.just(received(frames)), st.lists(st.binary(max_size=96), max_size=3)))
    return group, wire


@settings(max_examples=300)
@given(case=random_groups())
def test_unpack_raises_only_protocol_errors_and_what_it_accepts_is_sound(case):
    group, wire = case
    try:
        stored = unpack(group, wire)
    except P.ProtocolError:
        return
    assert len(stored.responses) == LIMITS.group_size
    for resp, lp, ver in zip(
        stored.responses, stored.behav_logprobs, stored.token_versions, strict=True
    ):
        assert resp.dtype == np.int32 and lp.dtype == np.float32 and ver.dtype == np.int32
        assert len(resp) == len(lp) == len(ver) <= LIMITS.max_response_tokens
        assert ((resp >= 0) & (resp < LIMITS.vocab_size)).all()
        assert np.isfinite(lp).all() and (lp <= 0).all()
        assert ((ver >= VERSIONS[0]) & (ver <= VERSIONS[1])).all()


# ----------------------------------------------------------------------------- requests


def _raises(check, *args) -> str:
    with pytest.raises(P.ProtocolError) as err:
        check(*args)
    return str(err.value)


def batch_req(step=1, rank=0, world_size=1, learner_version=None, wait_s=2.0) -> P.GetBatch:
    version = step if learner_version is None else learner_version
    return P.GetBatch(
        step=step, rank=rank, world_size=world_size, learner_version=version, wait_s=wait_s
    )


def test_get_batch_checks_name_the_wrong_field():
    check_get_batch(batch_req(step=3, rank=1, world_size=2), 4, None)
    check_get_batch(batch_req(step=3, learner_version=0), 4, 1)
    cases = [
        (batch_req(step=-1), None, "GetBatch.step = -1 is negative"),
        (batch_req(step=2, learner_version=-2), None, "GetBatch.learner_version = -2 is negative"),
        (batch_req(step=4), None, "step 4 is past the run's last step 3"),
        (batch_req(step=10**12), None, "step 1000000000000 is past the run's last step 3"),
        (batch_req(world_size=0), None, "world_size 0 is outside 1..4096"),
        (batch_req(world_size=4097), None, "world_size 4097 is outside 1..4096"),
        (batch_req(rank=2, world_size=2), None, "rank 2 is outside 0..1"),
        (batch_req(rank=-1, world_size=2), None, "rank -1 is outside 0..1"),
        (batch_req(step=1, learner_version=3), None, "learner_version 3 at step 1: the learner trains step s with version s"),
        (batch_req(step=1, wait_s=NAN), None, "wait_s nan is outside 0..300 seconds"),
        (batch_req(step=1, wait_s=math.inf), None, "wait_s inf is outside 0..300 seconds"),
        (batch_req(step=1, wait_s=-1.0), None, "wait_s -1.0 is outside 0..300 seconds"),
        (batch_req(step=1, world_size=1), 2, "step 1 was cut for 2 ranks, this request says 1"),
    ]  # fmt: skip
    for req, cut_for, message in cases:
        assert _raises(check_get_batch, req, 4, cut_for) == message


def test_other_request_checks_name_the_wrong_field():
    update = P.WeightUpdate(
        version=4, params=[P.ParamSpec("w", "bfloat16", (2, 3))], bucket_bytes=1
    )
    check_announce(update, 3)
    check_announce(msgspec.structs.replace(update, version=3), 3)  # re-sent after a restore
    assert _raises(check_announce, msgspec.structs.replace(update, version=5), 3) == (
        "version 5 announced while the newest is 3: versions go up one at a time"
    )
    assert _raises(check_announce, msgspec.structs.replace(update, version=2), 3) == (
        "version 2 announced while the newest is 3: versions go up one at a time"
    )
    assert _raises(check_announce, msgspec.structs.replace(update, bucket_bytes=0), 3) == (
        "bucket_bytes 0 is not positive"
    )
    bad_shape = [P.ParamSpec("layer.w", "float32", (2, -3))]
    assert _raises(check_announce, msgspec.structs.replace(update, params=bad_shape), 3) == (
        "parameter 'layer.w' has a negative dimension"
    )
    assert _raises(check_loaded, 4, 3) == (
        "loaded_version 4 was never announced (the newest version is 3)"
    )
    check_loaded(3, 3)
    assert _raises(check_wait, 301.0) == "wait_s 301.0 is outside 0..300 seconds"
    check_wait(0.0)
    req = P.GetPrompts(generator_id=0, loaded_version=0, max_groups=-3)
    fields = ("generator_id", "loaded_version", "max_groups")
    assert _raises(check_non_negative, req, *fields) == "GetPrompts.max_groups = -3 is negative"


def _eval(**fields) -> P.PushEval:
    res = P.EvalResult(
        group_id=0,
        data_source="d",
        scores=[[1.0, 0.0]],
        failed=[0],
        response_lengths=[3, 4],
        versions=[1, 2],
        example="x",
    )
    return P.PushEval(round=0, results=[msgspec.structs.replace(res, **fields)])


def test_eval_result_checks():
    check_eval_results(_eval(), 1, 2)
    check_eval_results(_eval(scores=[[NAN, NAN]]), 1, 2)
    where = "evaluation prompt 0"
    cases = [
        (_eval(scores=[[1.0, 0.0], [1.0, 0.0]]), f"{where}: scores of 2 sources and failed counts of 1, the run has 1 reward sources"),
        (_eval(scores=[[1.0]]), f"{where}: scores or versions do not match 2 samples"),
        (_eval(versions=[1]), f"{where}: scores or versions do not match 2 samples"),
        (_eval(versions=[1, 3]), f"{where}: a version outside 0..2"),
        (_eval(response_lengths=[3, -4]), f"{where}: a negative length or an impossible failed count"),
        (_eval(failed=[3]), f"{where}: a negative length or an impossible failed count"),
        (_eval(scores=[[1.0, -math.inf]]), f"{where}: an infinite score"),
    ]  # fmt: skip
    for body, message in cases:
        assert _raises(check_eval_results, body, 1, 2) == message


# ----------------------------------------------------------------------------- the log


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_rejection_log_writes_a_burst_then_one_summary_per_window(caplog):
    clock = FakeClock()
    rejections = RateLimitedLog(
        logging.getLogger("test.rejections"), burst=3, window_s=10.0, clock=clock
    )
    with caplog.at_level(logging.WARNING, logger="test.rejections"):
        for i in range(1000):
            rejections.log("GetBatch" if i % 2 else "undecodable", "rejected %d: %s", i, "x" * 5000)
        rejections.flush()  # the window is not over: nothing more yet
        assert len(caplog.records) == 3
        assert (
            caplog.records[0].getMessage()
            == "rejected 0: " + "x" * 400 + "... (4600 more characters)"
        )
        clock.now += 10.0
        rejections.flush()
        assert len(caplog.records) == 4
        assert caplog.records[3].getMessage() == (
            "997 more rejected messages in the last 10s were not logged "
            "(499 GetBatch, 498 undecodable)"
        )
        rejections.log("GetBatch", "rejected again")  # a new window: logged in full
        clock.now += 60.0
        rejections.flush()  # nothing suppressed: no summary
    assert [r.getMessage() for r in caplog.records[4:]] == ["rejected again"]


# ----------------------------------------------------------------------------- the server


class Harness:
    """A BufferServer on an inproc endpoint, driven through ``router.decode`` and
    ``_dispatch`` directly (no event loop, no client sockets); replies are captured
    instead of sent."""

    ids = itertools.count()

    def __init__(self, limits: RolloutLimits = LIMITS, leases: Leases | None = None) -> None:
        self.server = BufferServer(
            _ledger(leases=leases),
            max_staleness=1,
            endpoint=f"inproc://buffer-validation-{next(self.ids)}",
            num_sources=1,
            evals=EvalRounds([]),
            limits=limits,
        )
        self.replies: list[tuple[bytes, int, P.Body]] = []
        self.server.router.reply = lambda identity, rid, body, frames=None: self.replies.append(
            (identity, rid, body)
        )

    def send_raw(self, identity: bytes, parts: list[bytes]) -> list:
        start = len(self.replies)
        decoded = self.server.router.decode([zmq.Frame(identity), *(zmq.Frame(p) for p in parts)])
        if decoded is not None:  # undecodable or forbidden: the router answered it
            self.server._dispatch(decoded)
        self.server._serve_parked()
        return self.replies[start:]

    def request(self, identity: bytes, body: P.Body, frames: P.Frames | None = None) -> P.Body:
        replies = self.send_raw(identity, [bytes(b) for b in P.encode(body, 7, frames)])
        assert len(replies) == 1, replies
        assert replies[0][:2] == (identity, 7)
        return replies[0][2]

    def push(self, identity: bytes, *groups: P.RolloutGroup, frames: P.Frames) -> P.Body:
        """Push ``groups``; one without a lease (0) goes under the lease its group is in
        flight under, and one naming prompt 0 (``make_group``'s) names the prompt it was
        issued for, as a generator's copy does (the tests whose subject is not leases or
        prompts)."""
        lg = self.server.ledger

        def as_issued(g: P.RolloutGroup) -> P.RolloutGroup:
            if g.group_id not in lg.in_flight:
                return g
            lease = g.lease or lg.in_flight[g.group_id].lease
            prompt_id = g.prompt_id or lg.issued_prompt(g.group_id)[0]
            return replace(g, lease=lease, prompt_id=prompt_id)

        groups = [as_issued(g) for g in groups]
        return self.request(identity, P.PushRollouts(groups=groups), frames)

    def state(self) -> tuple:
        """Everything a message could change."""
        s, lg = self.server, self.server.ledger
        return (
            dict(lg.in_flight),
            list(lg.reissue),
            dict(lg.leases.deadline),
            dict(lg.leases.held),
            sorted(lg.leases.lapsed),
            sorted(lg.returned),
            lg.next_group,
            lg.consumed_steps,
            s.target_version,
            s.update,
            [(p.identity, p.body) for p in s.parked],
            s.stopping,
            sorted(s.cuts.cuts),
            sorted(s.batches.steps),
            sorted(s.evals.rounds),
            s.rate.total,
        )

    def close(self) -> None:
        self.server.router.close()


@pytest.fixture
def harness():
    h = Harness()
    yield h
    h.close()


def _issue_four(h: Harness, version: int = 1) -> None:
    """Generator 0 on connection A holds groups 0..3, issued at ``version`` (announced;
    admission at eta=1, B=2 allows k < 4 at version 0, k < 6 at version 1)."""
    if version:
        update = P.WeightUpdate(version=version, params=[], bucket_bytes=1)
        assert isinstance(h.request(b"L", P.AnnounceWeights(update=update)), P.Ack)
    reply = h.request(b"A", P.GetPrompts(generator_id=0, loaded_version=version, max_groups=4))
    assert [g.group_id for g in reply.groups] == [0, 1, 2, 3]


def _ipc(**changes) -> P.CudaIpc:
    """A CUDA IPC handle of the shape ``UntypedStorage._share_cuda_`` gives (64-byte handles)."""
    fields = dict(
        device=0, handle=b"h" * 64, size=1 << 20, offset=0, ref_counter_handle=b"r" * 64,
        ref_counter_offset=0, event_handle=b"e" * 64, event_sync_required=True,
    )  # fmt: skip
    return P.CudaIpc(**{**fields, **changes})


def _error(body: P.Body, code: str = "rejected") -> str:
    assert isinstance(body, P.Error), body
    assert body.code == code
    return body.message


def test_rollouts_come_back_only_from_the_connection_they_went_to(harness):
    h = harness
    _issue_four(h)
    before = h.state()
    g0, frames = make_group(k=0)
    assert _error(h.push(b"B", g0, frames=frames)) == (
        "group 0 was issued to generator 0 on another connection"
    )
    g1, frames = make_group(k=1, generator_id=3)
    assert (
        _error(h.push(b"A", g1, frames=frames))
        == "group 1 was issued to generator 0, not generator 3"
    )
    g9, frames = make_group(k=9)
    assert _error(h.push(b"A", g9, frames=frames)) == "group 9 was never issued"
    # The sender's checks are the whole message's: a good group beside a group the sender
    # does not hold, or beside itself, is not recorded either.
    frames = P.Frames()
    good, _ = make_group(k=0, frames=frames)
    stranger, _ = make_group(k=9, frames=frames)
    assert _error(h.push(b"A", good, stranger, frames=frames)) == "group 9 was never issued"
    assert _error(h.push(b"A", good, good, frames=frames)) == (
        "a message returns the same group twice: [0]"
    )
    assert h.state() == before
    assert isinstance(h.push(b"A", good, frames=frames), P.Ack)
    assert _error(h.push(b"A", good, frames=frames)) == "group 0 was already returned"
    assert sorted(h.server.ledger.returned) == [0]


def test_wrong_requests_get_errors_and_change_nothing(harness):
    h = harness
    _issue_four(h)
    before = h.state()
    cases = [
        (P.GetPrompts(generator_id=-1, loaded_version=0, max_groups=1), "GetPrompts.generator_id = -1 is negative"),
        (P.GetPrompts(generator_id=0, loaded_version=9, max_groups=1), "loaded_version 9 was never announced (the newest version is 1)"),
        (P.PollVersion(generator_id=0, loaded_version=0, wait_s=NAN), "wait_s nan is outside 0..300 seconds"),
        (batch_req(step=0, world_size=0), "world_size 0 is outside 1..4096"),
        (batch_req(step=4), "step 4 is past the run's last step 3"),
        (P.AnnounceWeights(update=P.WeightUpdate(version=7, params=[], bucket_bytes=1)), "version 7 announced while the newest is 1: versions go up one at a time"),
        (P.AnnounceWeights(update=P.WeightUpdate(version=2, params=[], bucket_bytes=1, memory=P.MemoryOffer(path="/tmp/x", token="ab" * 16, pid=7))), "memory offer path '/tmp/x' is not /proc/7/fd/<n>"),
        (P.AnnounceWeights(update=P.WeightUpdate(version=2, params=[], bucket_bytes=1, memory=P.MemoryOffer(path="/proc/7/fd/3", token="XY", pid=7))), "memory offer token is not 16 to 64 lowercase hex digits"),
        (P.AnnounceWeights(update=P.WeightUpdate(version=2, params=[], bucket_bytes=1, memory=P.MemoryOffer(path="/proc/7/fd/3", token="ab" * 16, pid=7, cuda=_ipc()))), "device memory offer with a path, or a negative number"),
        (P.AnnounceWeights(update=P.WeightUpdate(version=2, params=[], bucket_bytes=1, memory=P.MemoryOffer(path="", token="ab" * 16, pid=7, cuda=_ipc(size=-1)))), "device memory offer with a path, or a negative number"),
        (P.AnnounceWeights(update=P.WeightUpdate(version=2, params=[], bucket_bytes=1, memory=P.MemoryOffer(path="", token="ab" * 16, pid=7, cuda=_ipc(handle=b"")))), "device memory offer with an empty or oversized handle"),
        (P.AnnounceWeights(update=P.WeightUpdate(version=2, params=[], bucket_bytes=1, memory=P.MemoryOffer(path="", token="ab" * 16, pid=7, cuda=_ipc(event_handle=b"x" * 4096)))), "device memory offer with an empty or oversized handle"),
        (P.AnnounceWeights(update=P.WeightUpdate(version=2, params=[], bucket_bytes=1, memory=P.MemoryOffer(path="", token="XY", pid=7, cuda=_ipc()))), "memory offer token is not 16 to 64 lowercase hex digits"),
        (P.SnapshotBuffer(step=-2, version=0), "SnapshotBuffer.step = -2 is negative"),
        (P.SnapshotBuffer(step=3, version=0), "snapshot at step 3, but only 0 steps were consumed"),
        (P.FetchSnapshot(step=0), "no snapshot was taken at step 0"),
        (P.StartEval(round=0, step=0, version=0), "evaluation asked for, but the buffer holds no validation prompts"),
        (P.GetEval(round=-1), "GetEval.round = -1 is negative"),
        (P.PushEval(round=0, results=[]), "evaluation round 0 is not running"),
    ]  # fmt: skip
    for body, message in cases:
        assert _error(h.request(b"X", body)) == message
    for body in (P.Ack(), P.NotReady(step=0, missing_groups=0), P.ScoreRules(items=[])):
        assert _error(h.request(b"X", body), "unexpected") == (
            f"{type(body).__name__} is not a request the buffer serves"
        )
    assert h.state() == before


def test_undecodable_input_gets_a_protocol_error_with_request_id_zero(harness):
    h = harness
    for parts in ([b""], [b"\xc1garbage"], [b"\x91" * 100_000], [P.encode(P.Shutdown())[0][:-1]]):
        [(identity, rid, body)] = h.send_raw(b"X", parts)
        assert (identity, rid) == (b"X", 0)
        assert _error(body, "protocol").startswith("malformed message")
    wrong_version = msgspec.msgpack.encode(P.Envelope(1, 5, P.Shutdown()))
    [(_, _, body)] = h.send_raw(b"X", [wrong_version])
    assert _error(body, "protocol") == f"protocol version 1 is not {P.PROTOCOL_VERSION}"
    assert not h.server.stopping


def test_a_bug_in_a_handler_is_answered_and_logged_not_raised(harness, monkeypatch, caplog):
    h = harness

    def broken():
        raise KeyError("boom")

    monkeypatch.setattr(h.server, "stats", broken)
    with caplog.at_level(logging.ERROR, logger="verl_async.buffer"):
        assert _error(h.request(b"X", P.GetStats()), "internal") == "KeyError: 'boom'"
    assert "GetStats from 58 failed" in caplog.text and "Traceback" in caplog.text


def _wire(body: P.Body, rid: int) -> list[bytes]:
    return [bytes(b) for b in P.encode(body, rid)]


def test_long_polls_are_bounded_and_steps_are_consumed_in_order(harness):
    h = harness
    _issue_four(h)
    assert h.send_raw(b"L", _wire(batch_req(step=1), 11)) == []  # parked
    # Step 1's groups come in before step 0's: its poll goes on waiting (the old code
    # consumed out of order here, and the LedgerError escaped the event loop).
    for k in (2, 3):
        g, frames = make_group(k=k)
        assert isinstance(h.push(b"A", g, frames=frames), P.Ack)
    assert len(h.server.parked) == 1 and h.server.ledger.consumed_steps == 0
    for k in (0, 1):
        g, frames = make_group(k=k)
        assert isinstance(h.push(b"A", g, frames=frames), P.Ack)
    replies = h.send_raw(b"L", _wire(batch_req(step=0), 12))
    assert [(rid, body.group_ids) for _, rid, body in replies] == [(12, [0, 1]), (11, [2, 3])]
    # Every rank of a step agrees on the world size it was cut for.
    assert _error(h.request(b"L", batch_req(step=1, world_size=2))) == (
        "step 1 was cut for 1 ranks, this request says 2"
    )
    # One connection cannot park more than a handful of polls.
    poll = P.PollVersion(generator_id=0, loaded_version=1, wait_s=300.0)
    for i in range(MAX_PARKED_PER_CLIENT):
        assert h.send_raw(b"F", _wire(poll, 100 + i)) == []
    assert _error(h.request(b"F", poll)) == (
        f"{MAX_PARKED_PER_CLIENT} long polls of this connection are waiting already "
        f"(at most {MAX_PARKED_PER_CLIENT})"
    )
    assert len(h.server.parked) == MAX_PARKED_PER_CLIENT


def test_generators_on_the_learners_cores_get_nothing_during_its_first_step(harness):
    """``defer_to_learner``: from the moment the learner is served its first batch until it
    announces weights, such a request is answered ``deferred`` and changes nothing; one
    without the flag is served as ever. Before that batch is served nothing is deferred, so
    a learner that waits for several batches never waits on a deferring generator."""
    h = harness

    def ask(n: int, defer: bool = True, loaded: int = 0) -> P.Prompts:
        req = P.GetPrompts(
            generator_id=0, loaded_version=loaded, max_groups=n, defer_to_learner=defer
        )
        return h.request(b"A", req)

    first = ask(2)
    assert [g.group_id for g in first.groups] == [0, 1] and not first.deferred
    for k in (0, 1):
        g, frames = make_group(k=k, ver=np.zeros(6, np.int32))
        assert isinstance(h.push(b"A", g, frames=frames), P.Ack)
    assert not ask(1).deferred  # step 0 is complete but nobody took it yet
    assert isinstance(h.request(b"L", batch_req(step=0)), P.Batch)
    before = h.state()
    held = ask(4)
    assert held.deferred and not held.groups and not held.blocked_by_admission
    assert h.state() == before
    assert [g.group_id for g in ask(1, defer=False).groups] == [3]
    update = P.WeightUpdate(version=1, params=[], bucket_bytes=1)
    assert isinstance(h.request(b"L", P.AnnounceWeights(update=update)), P.Ack)
    after = ask(1, loaded=1)  # (admission at eta 1 wants version 1 loaded for group 4)
    assert [g.group_id for g in after.groups] == [4] and not after.deferred


# ----------------------------------------------------------------------------- hostile input

# Frames whose every message is wrong for a buffer that issued nothing to the sender:
# noise, broken envelopes, replies sent as requests, requests with a field out of range,
# and rollouts for groups it does not hold (plausible ids, duplicates, huge lists).

SMALL = st.integers(-(2**31), 2**31)
BAD_WAIT = st.sampled_from([NAN, math.inf, -math.inf, -1.0, 1e9])
TOO_MANY = st.integers(10**6, 2**62)  # a step, version or size no run reaches


def _envelope(body: P.Body, rid: int) -> bytes:
    return msgspec.msgpack.encode(P.Envelope(P.PROTOCOL_VERSION, rid, body))


@st.composite
def wrong_get_batch(draw) -> P.GetBatch:
    req = batch_req(
        step=draw(st.integers(0, 20)),
        rank=draw(st.integers(0, 3)),
        world_size=draw(st.integers(4, 8)),
        learner_version=0,
        wait_s=draw(st.floats(0, 5)),
    )
    bent = draw(
        st.sampled_from(
            [
                {"step": draw(st.integers(-(2**63), -1))},
                {"step": draw(TOO_MANY)},
                {"world_size": draw(st.sampled_from([0, -1, 4097, 2**62]))},
                {"rank": draw(st.sampled_from([-1, 8, 2**40]))},
                {"wait_s": draw(BAD_WAIT)},
                {"learner_version": draw(st.sampled_from([-1, 10**6]))},
            ]
        )
    )
    return msgspec.structs.replace(req, **bent)


def wrong_requests() -> st.SearchStrategy[P.Body]:
    """Requests with at least one field no client sends (each gets an Error)."""
    negative = st.integers(-(2**63), -1)
    update = st.builds(
        P.WeightUpdate,
        version=st.one_of(negative, TOO_MANY),
        params=st.lists(
            st.builds(
                P.ParamSpec,
                st.text(max_size=8),
                st.just("float32"),
                st.lists(SMALL, max_size=3).map(tuple),
            ),
            max_size=3,
        ),
        bucket_bytes=SMALL,
    )
    eval_result = st.builds(
        P.EvalResult,
        group_id=SMALL,
        data_source=st.text(max_size=5),
        scores=st.lists(st.lists(st.floats(), max_size=3), max_size=3),
        failed=st.lists(SMALL, max_size=3),
        response_lengths=st.lists(SMALL, max_size=3),
        versions=st.lists(SMALL, max_size=3),
        example=st.text(max_size=10),
    )
    return st.one_of(
        wrong_get_batch(),
        st.builds(
            P.PollVersion,
            generator_id=SMALL,
            loaded_version=st.one_of(negative, TOO_MANY),
            wait_s=st.floats(0, 5),
        ),
        st.builds(
            P.PollVersion,
            generator_id=st.integers(0, 3),
            loaded_version=st.just(0),
            wait_s=BAD_WAIT,
        ),
        st.builds(P.GetPrompts, generator_id=negative, loaded_version=SMALL, max_groups=SMALL),
        st.builds(
            P.GetPrompts,
            generator_id=SMALL,
            loaded_version=st.one_of(negative, TOO_MANY),
            max_groups=SMALL,
        ),
        st.builds(
            P.GetPrompts,
            generator_id=st.integers(0, 3),
            loaded_version=st.just(0),
            max_groups=negative,
        ),
        st.builds(P.AnnounceWeights, update=update),
        st.builds(P.SnapshotBuffer, step=st.one_of(negative, TOO_MANY), version=SMALL),
        st.builds(P.FetchSnapshot, step=SMALL),  # no cut is ever taken in these runs
        st.builds(P.StartEval, round=SMALL, step=SMALL, version=SMALL),  # no validation set
        st.builds(P.GetEval, round=SMALL),
        st.builds(P.PushEval, round=SMALL, results=st.lists(eval_result, max_size=3)),
        wrong_renewals(),
    )


def wrong_renewals() -> st.SearchStrategy[P.RenewLeases]:
    """Renewals no generator sends: a lease number never granted (< 1), or more leases
    than any connection may hold (thousands; the bound is twice max_inflight_groups)."""
    never = st.lists(SMALL, max_size=4).flatmap(
        lambda ok: st.integers(-(2**63), 0).map(lambda bad: [*ok, bad])
    )
    flood = st.integers(1, 2**40).map(lambda start: list(range(start, start + 5000)))
    return st.builds(P.RenewLeases, leases=st.one_of(never, flood))


def replies_as_requests() -> st.SearchStrategy[P.Body]:
    return st.one_of(
        st.builds(P.Ack),
        st.builds(P.Error, code=st.text(max_size=8), message=st.text(max_size=20)),
        st.builds(P.NotReady, step=SMALL, missing_groups=SMALL),
        st.builds(P.Scores, scores=st.lists(st.floats(), max_size=3)),
        st.builds(P.VersionStatus, target_version=SMALL, update=st.none(), stop=st.booleans()),
        st.builds(
            P.Prompts,
            groups=st.just([]),
            blocked_by_admission=st.booleans(),
            exhausted=st.booleans(),
        ),
        st.builds(P.ScoreConversations, conversations=st.just([])),
    )


@st.composite
def stranger_rollouts(draw, group_ids, group_size: int) -> list[bytes]:
    """PushRollouts of plausible groups (the run's size, well-formed tensors) for ids the
    sender was never issued: in flight to someone else, returned, consumed or unknown;
    sometimes the same id twice, sometimes thousands of groups."""
    frames = P.Frames()
    ids = draw(st.lists(group_ids, min_size=1, max_size=3))
    if draw(st.booleans()):
        ids.append(ids[0])  # a duplicate in one message
    if draw(st.integers(0, 9)) == 0:
        ids = [ids[0] + i for i in range(2000)]  # a huge message
    proto, _ = make_group(
        k=0, n=group_size, tokens=2, frames=frames, ver=np.zeros(2 * group_size, np.int32)
    )
    generator_id = draw(st.sampled_from([0, 0, 1, -1]))
    lease = draw(st.integers(0, 6))  # none, or one of the leases the buffer granted
    groups = [replace(proto, group_id=k, generator_id=generator_id, lease=lease) for k in ids]
    rid = draw(REQUEST_ID)
    return [_envelope(P.PushRollouts(groups=groups), rid), *received(frames)]


@st.composite
def noisy_rollouts(draw, group_ids) -> list[bytes]:
    group, wire = draw(random_groups(group_ids))
    return [_envelope(P.PushRollouts(groups=[group]), draw(REQUEST_ID)), *wire]


@st.composite
def broken_envelopes(draw) -> list[bytes]:
    """A real encoding cut short or with bytes after it (either never decodes), or a
    well-formed envelope of another protocol version."""
    body = draw(st.one_of(st.just(P.Shutdown()), st.just(P.GetStats()), wrong_requests()))
    head = _envelope(body, draw(REQUEST_ID))
    how = draw(st.sampled_from(["cut", "tail", "version"]))
    if how == "cut":
        head = head[: draw(st.integers(0, len(head) - 1))]
    elif how == "tail":
        head += draw(st.binary(min_size=1, max_size=8))
    else:
        version = draw(st.integers(-(2**63), 2**63 - 1).filter(lambda v: v != P.PROTOCOL_VERSION))
        head = msgspec.msgpack.encode(P.Envelope(version, 1, body))
    return [head, *draw(st.lists(st.binary(max_size=16), max_size=2))]


def hostile_messages(group_ids=None, group_size: int = 2):
    """Multipart messages (lists of frames) every one of which the buffer must reject."""
    group_ids = st.integers(-3, 300) if group_ids is None else group_ids
    return st.one_of(
        st.lists(st.binary(max_size=200), min_size=1, max_size=4),
        broken_envelopes(),
        st.builds(lambda b, r: [_envelope(b, r)], replies_as_requests(), REQUEST_ID),
        st.builds(lambda b, r: [_envelope(b, r)], wrong_requests(), REQUEST_ID),
        stranger_rollouts(group_ids, group_size),
        noisy_rollouts(group_ids),
    )


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(messages=st.lists(hostile_messages(st.integers(-3, 8)), min_size=1, max_size=5))
def test_hostile_messages_get_one_error_each_and_change_nothing(messages):
    """The stranger's plausible rollouts are valid in every field (version 0, the run's
    group size): only the ledger's issuance and connection checks stand in their way."""
    h = Harness(leases=Leases(max_per_client=8))
    try:
        _issue_four(h, version=0)
        g, frames = make_group(k=0, ver=np.zeros(6, np.int32))
        assert isinstance(h.push(b"A", g, frames=frames), P.Ack)  # 0 returned, 1..3 in flight
        before = h.state()
        for parts in messages:
            replies = h.send_raw(b"stranger", parts)
            assert len(replies) == 1, (parts[:1], replies)
            identity, _, body = replies[0]
            assert identity == b"stranger" and isinstance(body, P.Error), body
            assert body.code in ("protocol", "rejected", "unexpected"), body
            assert len(body.message) < 500
            assert h.state() == before
    finally:
        h.close()


def test_an_episode_group_may_start_from_its_environment_s_prompt_and_no_other_group_may():
    """An environment's ``reset`` (or the tools' schemas) gives its episodes a prompt of
    their own: the ids they continued are what the learner trains on; index and data
    source stay the buffer's. A single-turn group's prompt is the issued one or refused."""
    record = PromptRecord("p", "1", prompt_ids=(1, 2))
    stats = P.EpisodeStats(1, 0, 0, 0, 0.0, 0, "", 0, False, 0.0)
    own = np.array([3, 4, 5], np.int32)
    group, frames = make_group(prompt=own)
    episodes = replace(group, episodes=[stats, stats])
    limits = RolloutLimits(num_sources=1, group_size=2, vocab_size=32, max_response_tokens=6)
    wire = received(frames)
    stored = unpack_rollout(episodes, wire, limits, VERSIONS, issued=(0, record))
    assert stored.prompt_ids.tolist() == [3, 4, 5] and stored.data_source == record.data_source
    with pytest.raises(P.ProtocolError, match="are not the 2 tokens it was issued with"):
        unpack_rollout(group, wire, limits, VERSIONS, issued=(0, record))
    # The prompt fits in an episode.
    long_prompt, frames = make_group(prompt=np.arange(7, dtype=np.int32))
    long_prompt = replace(long_prompt, episodes=[stats, stats])
    with pytest.raises(P.ProtocolError, match="an episode's prompt of 7 tokens, the run allows 6"):
        unpack_rollout(long_prompt, received(frames), limits, VERSIONS, issued=(0, record))


# ----------------------------------------------------------------------------- teacher log-probs


def test_teacher_logprobs_are_required_exactly_when_teacher_processes_score():
    """With teacher processes (``RolloutLimits.teacher_logprobs``) a group must carry one
    finite log-prob <= 0 per sampled token and 0 on observation tokens; without, none."""
    import dataclasses

    limits = dataclasses.replace(LIMITS, teacher_logprobs=True)
    group, frames = make_group(0)
    with pytest.raises(P.ProtocolError, match="teacher_logprobs missing"):
        unpack(group, frames, limits)
    good = np.full(6, -1.25, np.float32)
    scored = replace(group, teacher_logprobs=frames.add(good), teacher_s=0.5, teacher_busy_s=0.1)
    stored = unpack(scored, frames, limits)
    assert [t.tolist() for t in stored.teacher_logprobs] == [[-1.25] * 3] * 2
    with pytest.raises(P.ProtocolError, match="no teacher process scores"):
        unpack(scored, frames)
    bad_values = {
        "holds 5 values, lengths add up to 6": np.full(5, -1.0, np.float32),
        "must be finite and <= 0": np.array([-1, -1, 0.5, -1, -1, -1], np.float32),
        "must be finite and <= 0 ": np.array([-1, np.nan, -1, -1, -1, -1], np.float32),
    }
    for message, values in bad_values.items():
        with pytest.raises(P.ProtocolError, match=message.strip()):
            unpack(replace(group, teacher_logprobs=frames.add(values)), frames, limits)
    for wait, busy in ((float("nan"), 0.0), (0.1, 0.5), (-1.0, -2.0)):
        late = replace(scored, teacher_s=wait, teacher_busy_s=busy)
        with pytest.raises(P.ProtocolError, match="teacher_s and teacher_busy_s"):
            unpack(late, frames, limits)
    mask = np.array([1, 0, 1, 1, 1, 1], np.uint8)
    at_observation = replace(scored, loss_mask=frames.add(mask), teacher_logprobs=frames.add(good))
    with pytest.raises(P.ProtocolError, match="nonzero at an observation token"):
        unpack(at_observation, frames, limits)
