import math

import msgspec
import numpy as np
import pytest

from verl_async import protocol as P


def _roundtrip(body, frames=None):
    parts = [bytes(b) for b in P.encode(body, request_id=7, frames=frames)]
    env, frames_in = P.decode(parts)
    assert env.request_id == 7
    assert env.version == P.PROTOCOL_VERSION
    return env.body, frames_in


def test_rollout_group_roundtrip_with_tensor_frames():
    frames = P.Frames()
    resp = np.array([4, 5, 6, 7, 2], np.int32)
    lp = np.array([-0.1, -0.2, -0.3, -0.4, -0.5], np.float32)
    body = P.PushRollouts(
        groups=[
            P.RolloutGroup(
                group_id=3,
                prompt_id=11,
                generator_id=0,
                lease=4,
                prompt_ids=frames.add(np.array([1, 3, 9], np.int32)),
                response_ids=frames.add(resp),
                behav_logprobs=frames.add(lp),
                token_versions=frames.add(np.array([0, 0, 1, 1, 1], np.int32)),
                lengths=[2, 3],
                scores=[[1.0, 0.0], [0.5, 0.25]],
                failed=[0, 1],
                data_source="gsm8k",
                gen_seconds=0.5,
            )
        ]
    )
    got, frames_in = _roundtrip(body, frames)
    assert got == body
    # NaN marks a source that is not routed to the group; it must survive msgpack.
    nan_body = P.PushRollouts(
        groups=[msgspec.structs.replace(body.groups[0], scores=[[float("nan")]])]
    )
    assert math.isnan(_roundtrip(nan_body, frames)[0].groups[0].scores[0][0])
    group = got.groups[0]
    np.testing.assert_array_equal(P.tensor(group.response_ids, frames_in), resp)
    np.testing.assert_array_equal(P.tensor(group.behav_logprobs, frames_in), lp)
    assert P.tensor(group.prompt_ids, frames_in).tolist() == [1, 3, 9]


@pytest.mark.parametrize(
    "body",
    [
        P.GetPrompts(generator_id=1, loaded_version=4, max_groups=8),
        P.PollVersion(generator_id=0, loaded_version=2, wait_s=1.0),
        P.GetBatch(step=5, rank=0, world_size=2, learner_version=5, wait_s=2.0),
        P.AnnounceWeights(
            update=P.WeightUpdate(
                version=3, params=[P.ParamSpec("w", "float32", (2, 3))], bucket_bytes=64
            )
        ),
        P.VersionStatus(
            target_version=3,
            update=P.WeightUpdate(
                version=3,
                params=[],
                bucket_bytes=64,
                memory=P.MemoryOffer(path="/proc/7/fd/3", token="ab" * 16, pid=7),
            ),
            stop=False,
        ),
        P.VersionStatus(target_version=3, update=None, stop=False),
        P.RenewLeases(leases=[3, 17]),
        P.Renewed(lost=[17]),
        P.Dropped(group_ids=[5], reason="lease expired"),
        P.Error(code="x", message="y"),
        P.Shutdown(),
    ],
)
def test_every_message_roundtrips(body):
    assert _roundtrip(body)[0] == body


@pytest.mark.parametrize(
    "parts",
    [
        [],
        [b"\xff\x00garbage"],
        [b"not msgpack at all"],
        [msgspec.msgpack.encode([1, 0, {"type": "NoSuchMessage"}])],
        [msgspec.msgpack.encode([1, 0, {"type": "GetPrompts", "generator_id": "zero"}])],
    ],
)
def test_malformed_input_raises_protocol_error(parts):
    with pytest.raises(P.ProtocolError):
        P.decode(parts)


def test_wrong_protocol_version_is_named():
    head = msgspec.msgpack.encode([99, 0, {"type": "Shutdown"}])
    with pytest.raises(P.ProtocolError, match="protocol version 99"):
        P.decode([head])


def test_tensor_ref_checks_frame_and_size():
    frames = [np.arange(4, dtype=np.int32).tobytes()]
    with pytest.raises(P.ProtocolError, match="missing"):
        P.tensor(P.TensorRef("int32", (4,), 2), frames)
    with pytest.raises(P.ProtocolError, match="holds 16 bytes"):
        P.tensor(P.TensorRef("int32", (5,), 1), frames)
    with pytest.raises(P.ProtocolError, match="negative dimension"):
        P.tensor(P.TensorRef("int32", (-1,), 1), frames)
    with pytest.raises(P.ProtocolError, match="at offset 8 needs 24"):
        P.tensor(P.TensorRef("int32", (4,), 1, 8), frames)
    with pytest.raises(P.ProtocolError, match="dtype"):
        P.tensor(P.TensorRef("object", (4,), 1), frames)


def test_small_tensors_share_one_aligned_frame_and_large_ones_travel_alone():
    frames = P.Frames()
    a = np.arange(3, dtype=np.int32)  # 12 bytes
    b = np.linspace(0, 1, 5, dtype=np.float32)  # 20 bytes
    big = np.arange(P.Frames.SMALL // 4, dtype=np.int32)  # exactly SMALL bytes
    c = np.array([[7, 8]], dtype=np.int64)
    refs = [frames.add(x) for x in (a, b, big, c)]
    assert [r.frame for r in refs] == [1, 1, 2, 1]
    assert [r.offset for r in refs] == [0, 16, 0, 48]  # 16-byte aligned
    parts = [bytes(x) for x in frames.buffers]
    assert len(parts) == 2 and len(parts[0]) == 64 and len(parts[1]) == P.Frames.SMALL
    for ref, x in zip(refs, (a, b, big, c), strict=True):
        np.testing.assert_array_equal(P.tensor(ref, parts), x)


def test_no_pickle_dtype_can_be_framed():
    with pytest.raises(P.ProtocolError):
        P.Frames().add(np.array([object()], dtype=object))


def test_collate_aligns_response_logprobs_with_targets():
    from learners.batching import collate
    from tests.gpu.test_learner_cuda import _batch_message

    body, frames = _batch_message()
    b = collate(body, frames, pad_id=0)
    assert b.input_ids.tolist() == [[1, 3, 9, 13, 2], [1, 3, 8, 7, 0]]
    # target position t predicts token t+1: responses start at position prompt_len - 1 = 2
    assert b.loss_mask.tolist() == [[0, 0, 1, 1], [0, 0, 1, 0]]
    assert b.behav_logprobs[0, 2:].tolist() == [-1.0, -2.0]
    assert b.behav_logprobs[1, 2].item() == -1.5
    assert b.attention_mask.tolist() == [[1] * 5, [1, 1, 1, 1, 0]]


def test_a_memory_offer_decodes_strictly():
    """The offer a generator hands its engine: a field the protocol does not name is a
    malformed message, not ignored."""
    offer = P.MemoryOffer(path="/proc/7/fd/3", token="ab" * 16, pid=7)
    update = P.WeightUpdate(version=1, params=[], bucket_bytes=64, memory=offer)
    raw = msgspec.to_builtins(P.Envelope(P.PROTOCOL_VERSION, 1, P.AnnounceWeights(update=update)))
    assert P.decode([msgspec.msgpack.encode(raw)])[0].body.update.memory == offer
    raw[2]["update"]["memory"]["uid"] = 0
    with pytest.raises(P.ProtocolError, match="malformed"):
        P.decode([msgspec.msgpack.encode(raw)])


def test_a_device_memory_offer_travels_whole():
    """A CUDA IPC offer's handles are bytes: they cross msgpack (the buffer) and the plain
    values an engine's workers are handed (``to_builtins``, base64) unchanged."""
    ipc = P.CudaIpc(
        device=0, handle=bytes(range(64)), size=1 << 20, offset=512, ref_counter_handle=b"\0" * 64,
        ref_counter_offset=3, event_handle=b"", event_sync_required=False,
    )  # fmt: skip
    offer = P.MemoryOffer(path="", token="ab" * 16, pid=7, cuda=ipc)
    update = P.WeightUpdate(version=1, params=[], bucket_bytes=64, memory=offer)
    raw = msgspec.msgpack.encode(
        P.Envelope(P.PROTOCOL_VERSION, 1, P.AnnounceWeights(update=update))
    )
    assert P.decode([raw])[0].body.update.memory == offer
    assert msgspec.convert(msgspec.to_builtins(offer), P.MemoryOffer) == offer
