"""asyncio client of one reward-model process (``python -m reward_model``).

Pattern: one DEALER socket connected to the process's ROUTER, one reader task that
resolves a future per request id, so many coroutines share the socket
(``verl_async.transport.client.AsyncDealer``). No handshake: ZMQ connects by itself and
reconnects after the process restarts; a request made while it is down waits for the
connection within its deadline and is never delivered after it, so a restarted process
does not first score what nobody waits for any more. Every call has a deadline of
``timeout_s``: on expiry it raises
``RewardModelUnavailable`` naming the endpoint, and the late reply (if any) is dropped by
request id, so the client keeps working once the process answers again. Bounded queues
(transport/limits.py), linger 0 at close. The socket presents the generator's
credentials (verl_async/auth.py); a server that refuses them never answers, so calls fail
with ``RewardModelUnavailable``.
"""

from __future__ import annotations

from verl_async import protocol as P
from verl_async.transport.client import AsyncDealer


class RewardModelError(RuntimeError):
    """A reward-model request gave no scores."""


class RewardModelUnavailable(RewardModelError):
    """The reward-model process did not answer in time (down, restarting, or overloaded)."""


class RewardModelRejected(RewardModelError):
    """The reward-model process answered with an ``Error`` reply."""


class RewardModelClient(AsyncDealer):
    """``await score(conversations)`` -> one float per conversation (see the module doc;
    ``AsyncDealer``'s docstring: socket pattern, HWM, handshake, shutdown)."""

    def unavailable(self, waited_s: float) -> RewardModelUnavailable:
        return RewardModelUnavailable(
            f"no reply from the reward model at {self.endpoint} within {waited_s:g}s; "
            "is its process alive?"
        )

    def bad_reply(self, exc: P.ProtocolError) -> RewardModelRejected:
        return RewardModelRejected(f"{self.endpoint}: {exc}")

    async def score(self, conversations: list[list[dict[str, str]]]) -> list[float]:
        reply, _ = await self.request(P.ScoreConversations(conversations=conversations))
        if isinstance(reply, P.Error):
            raise RewardModelRejected(
                f"reward model at {self.endpoint} rejected the request ({reply.code}): "
                f"{reply.message}"
            )
        if not isinstance(reply, P.Scores) or len(reply.scores) != len(conversations):
            raise RewardModelRejected(
                f"reward model at {self.endpoint} sent {type(reply).__name__} with "
                f"{len(getattr(reply, 'scores', []))} scores for {len(conversations)} conversations"
            )
        return [float(s) for s in reply.scores]
