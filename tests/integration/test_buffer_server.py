"""The real buffer process: malformed input gets an error reply and the server keeps serving."""

import signal
import subprocess
import sys

import msgspec
import numpy as np
import pytest
import zmq

from verl_async import protocol as P
from verl_async.auth import GENERATOR, LEARNER, load_role_token
from verl_async.config import load_config, to_yaml
from verl_async.runtime import Endpoints, write_endpoints
from verl_async.transport import BufferClient, BufferRejected

from .conftest import ROOT


@pytest.fixture
def buffer_proc(tmp_path, free_port, tiny_model):
    cfg = load_config(
        ROOT / "configs/tiny.yaml",
        [
            f"data.path={ROOT / 'configs/data/max_digit.jsonl'}",
            "learner.groups_per_step=2",
            "staleness.max=0",
            "generators.group_size=1",  # the rollouts below have one sample each
        ],
    )
    (tmp_path / "config.yaml").write_text(to_yaml(cfg))
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    write_endpoints(
        tmp_path,
        Endpoints(
            buffer=endpoint, weights_host="127.0.0.1", weights_port=1, model_path=str(tiny_model)
        ),
    )
    proc = subprocess.Popen([sys.executable, "-m", "buffer", "--run-dir", str(tmp_path)], cwd=ROOT)
    # Up first (imports, the tokenizer, 2048 prompts rendered: seconds on 2 slow cores),
    # then every request of a test has its own 20 s.
    client = BufferClient(endpoint, timeout_s=120, credentials=load_role_token(tmp_path, LEARNER))
    try:
        client.request(P.GetStats())
    finally:
        client.close()
    yield endpoint, proc  # clients prove their role with the run's tokens (role())
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=20)


def role(tmp_path, endpoint: str, name: str) -> BufferClient:
    return BufferClient(endpoint, timeout_s=20, credentials=load_role_token(tmp_path, name))


def issued_rollout(group: P.PromptGroup, **fields) -> tuple[P.RolloutGroup, P.Frames]:
    """A one-sample rollout of ``group`` under its lease, naming its prompt as issued."""
    frames = P.Frames()
    z = frames.add(np.zeros(1, np.int32))
    g = P.RolloutGroup(
        group_id=group.group_id, prompt_id=group.prompt_id, generator_id=0, lease=group.lease,
        prompt_ids=frames.add(np.array(group.prompt_ids, np.int32)),
        response_ids=z, behav_logprobs=frames.add(np.zeros(1, np.float32)), token_versions=z,
        lengths=[1], scores=[[0.0]], failed=[0], data_source=group.data_source, gen_seconds=0.0,
    )  # fmt: skip
    return msgspec.structs.replace(g, **fields), frames


def test_malformed_messages_get_errors_and_server_keeps_serving(buffer_proc, tmp_path):
    endpoint, proc = buffer_proc
    client = role(tmp_path, endpoint, GENERATOR)
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    load_role_token(tmp_path, GENERATOR).apply(raw)
    raw.connect(endpoint)
    for junk in ([b"\xc1garbage"], [b"\x93\x63\x00\xa1x"], [P.encode(P.Shutdown())[0][:-1]]):
        raw.send_multipart(junk)
        assert raw.poll(20_000), "no reply to a malformed message"
        env, _ = P.decode(raw.recv_multipart())
        assert isinstance(env.body, P.Error)
    raw.close()

    # A rollout for a group that was never issued is rejected, not stored.
    frames = P.Frames()
    z = frames.add(np.zeros(1, np.int32))
    bogus = P.RolloutGroup(
        group_id=99,
        prompt_id=0,
        generator_id=0,
        lease=1,
        prompt_ids=z,
        response_ids=z,
        behav_logprobs=frames.add(np.zeros(1, np.float32)),
        token_versions=z,
        lengths=[1],
        scores=[[0.0]],
        failed=[0],
        data_source="default",
        gen_seconds=0.0,
    )
    with pytest.raises(BufferRejected, match="never issued"):
        client.request(P.PushRollouts(groups=[bogus]), frames)

    # Still serving: admission at eta=0, B=2 hands version 0 exactly groups 0 and 1.
    reply, _ = client.request(P.GetPrompts(generator_id=0, loaded_version=0, max_groups=8))
    assert [g.group_id for g in reply.groups] == [0, 1]
    assert reply.blocked_by_admission

    # The sender's checks are the whole message's: a good group beside a group the sender
    # was never issued is not recorded either.
    good, frames = issued_rollout(reply.groups[0])
    bogus = msgspec.structs.replace(good, group_id=99)
    with pytest.raises(BufferRejected, match="group 99 was never issued"):
        client.request(P.PushRollouts(groups=[good, bogus]), frames)
    stats, _ = client.request(P.GetStats())
    assert stats.returned == 0
    with pytest.raises(BufferRejected, match="same group twice"):
        client.request(P.PushRollouts(groups=[good, good]), frames)
    # The prompt a rollout names is the one its group was issued with, or the group is
    # refused (alone) and issued again, first in line: what trained.jsonl and the
    # per-source metrics say comes from the buffer's own copy.
    group = reply.groups[0]
    for wrong, says in (
        ({"prompt_id": group.prompt_id + 1}, "it was issued for"),
        ({"data_source": "spoofed"}, "its prompt's is"),
    ):
        spoofed, spoofed_frames = issued_rollout(group, **wrong)
        dropped, _ = client.request(P.PushRollouts(groups=[spoofed]), spoofed_frames)
        [refusal] = dropped.refused
        assert refusal.group_id == group.group_id and says in refusal.reason, refusal
        ask = P.GetPrompts(generator_id=0, loaded_version=0, max_groups=1)
        [group] = client.request(ask)[0].groups
        assert group.group_id == reply.groups[0].group_id  # under a new lease
    good, frames = issued_rollout(group)
    ack, _ = client.request(P.PushRollouts(groups=[good]), frames)
    assert isinstance(ack, P.Ack)
    stats, _ = client.request(P.GetStats())
    assert stats.issued == 2 and stats.returned == 1 and stats.dropped_stale == 0
    assert stats.rollouts_refused == 2 and stats.groups_ended == 0
    assert proc.poll() is None
    client.close()


def test_snapshot_cut_is_taken_at_the_barrier_and_encoded_when_fetched(buffer_proc, tmp_path):
    from buffer.snapshot import LEDGER_FILE, ROLLOUTS_FILE, decode_state, rollouts_from_arrow

    endpoint, proc = buffer_proc
    learner = role(tmp_path, endpoint, LEARNER)
    writer = role(tmp_path, endpoint, LEARNER)  # the checkpoint writer's own socket
    generator = role(tmp_path, endpoint, GENERATOR)
    reply, _ = generator.request(P.GetPrompts(generator_id=0, loaded_version=0, max_groups=8))
    assert [g.group_id for g in reply.groups] == [0, 1]

    def rollout(group_id: int, reward: float):
        frames = P.Frames()
        g = P.RolloutGroup(
            group_id=group_id,
            prompt_id=reply.groups[group_id].prompt_id,
            generator_id=0,
            lease=reply.groups[group_id].lease,
            prompt_ids=frames.add(np.array(reply.groups[group_id].prompt_ids, np.int32)),
            response_ids=frames.add(np.array([5, 6, 7], np.int32)),
            behav_logprobs=frames.add(np.array([-0.1, -0.2, -0.3], np.float32)),
            token_versions=frames.add(np.zeros(3, np.int32)),
            lengths=[3],
            scores=[[reward]],
            failed=[0],
            data_source=reply.groups[group_id].data_source,
            gen_seconds=0.0,
        )
        return P.PushRollouts(groups=[g]), frames

    generator.request(*rollout(0, 1.0))
    with pytest.raises(BufferRejected, match=r"\(forbidden\).*not a generator"):
        generator.request(P.SnapshotBuffer(step=0, version=0))  # the learner's alone
    ack, _ = learner.request(P.SnapshotBuffer(step=0, version=0))
    assert isinstance(ack, P.Ack)
    generator.request(*rollout(1, 0.0))  # after the cut: not in this snapshot
    with pytest.raises(BufferRejected, match=r"\(forbidden\).*not a generator"):
        generator.request(P.FetchSnapshot(step=0))

    state, frames = writer.request(P.FetchSnapshot(step=0))
    files = {name: P.tensor(ref, frames).tobytes() for name, ref in state.files.items()}
    ledger = decode_state(files[LEDGER_FILE])
    stored = rollouts_from_arrow(files[ROLLOUTS_FILE])
    assert [g.group_id for g in stored] == [0] and stored[0].scores == [[1.0]]
    assert stored[0].responses[0].tolist() == [5, 6, 7]
    assert ledger.reissue == [1] and ledger.next_group == 2 and ledger.stored_groups == 1

    with pytest.raises(BufferRejected, match="no snapshot was taken at step 0"):
        writer.request(P.FetchSnapshot(step=0))  # a cut is fetched once
    stats, _ = learner.request(P.GetStats())
    assert stats.returned == 2 and proc.poll() is None
    for c in (learner, writer, generator):
        c.close()


def test_a_restarted_generator_gets_its_groups_reissued_and_a_new_sync_epoch(buffer_proc, tmp_path):
    """JoinSync under a known generator id: what the old process held is issued again at
    once (its late rollout is refused), and a new weight-sync epoch is wanted once the
    current one is complete; the learner's announcement over it makes it current."""
    endpoint, _ = buffer_proc
    old, new = role(tmp_path, endpoint, GENERATOR), role(tmp_path, endpoint, GENERATOR)
    learner = role(tmp_path, endpoint, LEARNER)
    first = lambda c: c.request(P.JoinSync(generator_id=0))[0]  # noqa: E731
    assert first(old) == P.SyncEpoch(current=0, wanted=0)  # the start of the run
    # The learner has not yet reported epoch 0 complete: a restart now joins it too.
    assert first(new) == P.SyncEpoch(current=0, wanted=0)
    assert learner.request(P.SyncStatus(formed=0))[0] == P.SyncEpoch(current=0, wanted=0)

    reply, _ = old.request(P.GetPrompts(generator_id=0, loaded_version=0, max_groups=8))
    held = [g.group_id for g in reply.groups]
    old_lease = reply.groups[0].lease
    assert held == [0, 1]
    assert first(new) == P.SyncEpoch(current=0, wanted=1)  # restarted: epoch 1 is wanted
    assert learner.request(P.GetStats())[0].generator_restarts == 2
    # Issued again at once (buffer.lease_timeout_s is 300 s in this config).
    reply, _ = new.request(P.GetPrompts(generator_id=0, loaded_version=0, max_groups=8))
    assert [g.group_id for g in reply.groups] == held
    late, frames = issued_rollout(reply.groups[0], lease=old_lease)
    # The old process's rollout of a group now issued to the new one is not taken.
    assert old.request(P.PushRollouts(groups=[late]), frames)[0] == P.Dropped(
        group_ids=[0], reason="lease expired"
    )

    # The learner asks (no news), then announces over epoch 1: it is current.
    assert learner.request(P.SyncStatus())[0] == P.SyncEpoch(current=0, wanted=1)
    update = P.WeightUpdate(version=0, params=[], bucket_bytes=1, epoch=1)
    with pytest.raises(BufferRejected, match="epoch 2"):
        learner.request(
            P.AnnounceWeights(
                update=P.WeightUpdate(**{**msgspec.structs.asdict(update), "epoch": 2})
            )
        )
    learner.request(P.AnnounceWeights(update=update))
    status, _ = new.request(P.PollVersion(generator_id=0, loaded_version=0, wait_s=5.0))
    assert status.update.epoch == 1  # answered at once: a generator of epoch 0 must rejoin
    assert learner.request(P.SyncStatus(formed=1, regroup=True))[0] == P.SyncEpoch(
        current=1, wanted=2
    )
    for c in (old, new, learner):
        c.close()
