"""Role binding on a real buffer socket (loopback TCP, the run's role tokens): each request
is served only from the role the buffer's list gives it, a client without a role's token
gets nothing but the run's description and counters, a client with a wrong token is not
admitted, and ids and world sizes are those of the run's shape."""

from __future__ import annotations

import asyncio

import pytest

from buffer.evaluation import EvalRounds
from buffer.ledger import PromptLedger
from buffer.requests import GENERATOR_ONLY, LEARNER_ONLY, Peers
from buffer.server import BufferServer
from verl_async import protocol as P
from verl_async.auth import (
    GENERATOR,
    LEARNER,
    RoleToken,
    guest,
    load_role_token,
    load_role_tokens,
    write_role_tokens,
)
from verl_async.data import PromptRecord
from verl_async.staleness import Admission
from verl_async.transport import AsyncBufferClient, BufferRejected, BufferUnavailable
from verl_async.transport.server import ServerOptions

B, STEPS = 2, 3


def _update(version: int = 1) -> P.WeightUpdate:
    return P.WeightUpdate(version=version, params=[], bucket_bytes=1)


# One well-formed request of each kind the list gives to a role (what it asks does not
# matter: the socket refuses it before the buffer looks at it).
REQUESTS = {
    P.GetBatch: P.GetBatch(step=0, rank=0, world_size=1, learner_version=0, wait_s=0),
    P.AnnounceWeights: P.AnnounceWeights(update=_update()),
    P.SyncStatus: P.SyncStatus(),
    P.SnapshotBuffer: P.SnapshotBuffer(step=0, version=0),
    P.FetchSnapshot: P.FetchSnapshot(step=0),
    P.StartEval: P.StartEval(round=0, step=0, version=0),
    P.GetEval: P.GetEval(round=0),
    P.Shutdown: P.Shutdown(),
    P.GetPrompts: P.GetPrompts(generator_id=0, loaded_version=0, max_groups=1),
    P.PushRollouts: P.PushRollouts(groups=[]),
    P.RenewLeases: P.RenewLeases(leases=[1]),
    P.PollVersion: P.PollVersion(generator_id=0, loaded_version=0, wait_s=0),
    P.JoinSync: P.JoinSync(generator_id=0),
    P.PushEval: P.PushEval(round=0, results=[]),
}


def test_every_request_but_the_run_s_description_belongs_to_one_role():
    assert set(LEARNER_ONLY).isdisjoint(GENERATOR_ONLY)
    assert set(LEARNER_ONLY) | set(GENERATOR_ONLY) == set(REQUESTS)
    replies = {P.Prompts, P.Ack, P.Dropped, P.Renewed, P.VersionStatus, P.Batch, P.BufferState}
    replies |= {P.NotReady, P.Stats, P.Error, P.RunInfo, P.SyncEpoch, P.Scores, P.EvalReport}
    replies |= {P.TokenLogprobs}
    # the reward processes' and teachers' requests (their servers' own role tables)
    scoring = {P.ScoreRules, P.ScoreConversations, P.ScoreTokens}
    requests = set(P.Body.__args__) - replies - scoring
    assert requests - set(REQUESTS) == {P.GetStats, P.GetRun}


def test_each_request_is_served_only_from_its_role(tmp_path, free_port):
    async def scenario() -> None:
        write_role_tokens(tmp_path)
        prompts = [PromptRecord(f"p{i}", "", prompt_ids=(10 + i,)) for i in range(B * STEPS)]
        ledger = PromptLedger(prompts, Admission(B, 1), STEPS, seed=0)
        server = BufferServer(
            ledger,
            1,
            f"tcp://127.0.0.1:{free_port()}",
            evals=EvalRounds([]),
            options=ServerOptions(load_role_tokens(tmp_path)),
            peers=Peers(generators=1, learner_ranks=1),
        )
        serving = asyncio.create_task(server.serve())

        def client(credentials, timeout_s: float = 20.0) -> AsyncBufferClient:
            return AsyncBufferClient(server.endpoint, timeout_s, credentials)

        learner = client(load_role_token(tmp_path, LEARNER))
        generator = client(load_role_token(tmp_path, GENERATOR))
        nobody = client(guest())
        try:
            for kind, body in REQUESTS.items():
                owner = LEARNER if kind in LEARNER_ONLY else GENERATOR
                others = [
                    (n, c) for n, c in ((LEARNER, learner), (GENERATOR, generator)) if n != owner
                ]
                for name, other in [*others, ("guest", nobody)]:
                    with pytest.raises(BufferRejected, match=rf"\(forbidden\).* not a {name}"):
                        await other.request(body)
            # Each role is served what is its own, and everyone the run's counters.
            reply, _ = await generator.request(REQUESTS[P.GetPrompts])
            assert isinstance(reply, P.Prompts) and reply.groups
            assert isinstance((await learner.request(P.SyncStatus()))[0], P.SyncEpoch)
            for c in (learner, generator, nobody):
                assert isinstance((await c.request(P.GetStats()))[0], P.Stats)
            # Ids and world sizes the run does not have are refused, by any client.
            with pytest.raises(BufferRejected, match="generator_id 1: the run has 1 generator"):
                await generator.request(P.JoinSync(generator_id=1))
            with pytest.raises(BufferRejected, match="world_size 2: the run has 1 learner"):
                await learner.request(
                    P.GetBatch(step=0, rank=0, world_size=2, learner_version=0, wait_s=0)
                )
            # A wrong token is not admitted: no reply at all.
            forged = client(RoleToken(LEARNER, "0" * 64), timeout_s=2.0)
            with pytest.raises(BufferUnavailable):
                await forged.request(P.GetStats())
            forged.close()
            assert server.stopping is False  # nobody but the learner could stop it
        finally:
            for c in (learner, generator, nobody):
                c.close()
            server.terminated = True
            await serving

    asyncio.run(scenario())
