"""The rollout buffer: one process, one ROUTER socket, one asyncio (uvloop) event loop.

Socket pattern. ROUTER bound on ``buffer.host:port`` (loopback by default); every client
is a DEALER that sends ``Envelope(request_id, body)`` and gets exactly one reply with the
same request_id. Long polls (``PollVersion``, ``GetBatch``) are parked and answered as
soon as they can be, or at their deadline, so clients never spin.

Nothing is dropped: ROUTER_MANDATORY makes a send to a vanished peer fail (logged)
instead of silently discarding; queues are bounded per connection and frames by
``buffer.max_message_mb`` (verl_async/transport/limits.py), far above what clients keep
outstanding. A message that does not decode gets an ``Error`` reply and a log line; the
loop goes on. Only the run's roles get in (its key set's clients, or holders of its role
tokens; verl_async/auth.py), and each request comes only from the role ``ROLES`` gives it:
a generator cannot take the learner's checkpoint cut or announce weights, nor the learner
return rollouts (answered ``Error("forbidden")`` by the socket). The socket chores
(set-up, limits, admission, roles, decode-or-``Error``, replies to vanished peers, close)
are ``verl_async.transport.server.RouterSocket``'s; the loop and the handlers are here.

Dispatch. Each request type the buffer serves has one handler (``_handler_table``) that
checks every field of the request, then acts; other types get ``Error("unexpected")``.

Hostile input. Every field a peer sends is checked before any state changes (pure
functions in buffer/requests.py, buffer/ledger.py and buffer/rollouts.py): a wrong
message gets ``Error(code, message)`` naming what was wrong, and nothing it carried is
recorded. A rollout is taken only on the connection its group was issued to, under the
lease it was issued with, while that lease lasts (buffer/leases.py: a group neither
returned nor renewed for ``buffer.lease_timeout_s`` is issued again, and one connection
holds a bounded number); a rollout under a lease that ended is answered ``Dropped``,
never ``Error``: its generator was slow, not wrong. The groups of one push are judged
one by one (buffer/intake.py): one whose content is refused is named in ``Dropped`` and
issued again, the others are recorded; only the checks about the sender still make the
whole message an ``Error`` (that module says which, and why). No message can raise out of
the loop (an unexpected exception is a bug: it is logged with its traceback and answered
``Error("internal")``), and rejections and expired leases are logged through
``RateLimitedLog`` (verl_async/ratelimit.py), so a flood costs a few lines.

Shutdown: ``Shutdown`` from the learner answers every poll with ``stop`` from then on
(generators exit on it); SIGTERM from the launcher ends the loop (or, started by
``verl-async buffer``, the loop ends ``exit_after_stop_s`` after Shutdown), and the
socket closes with linger=0.

Roles started on their own (``verl-async generator|learner --buffer ADDR``) ask
``GetRun`` for the run's config and endpoints (``RunInfo``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from buffer.batches import StepBatches, step_message
from buffer.evaluation import EvalRounds
from buffer.filtering import FilterRule, GroupFilter
from buffer.intake import Intake
from buffer.ledger import LedgerError, PromptLedger
from buffer.polls import MAX_PARKED, Parked, ParkedPolls
from buffer.requests import (
    ROLES,
    Peers,
    check_announce,
    check_eval_results,
    check_generator_id,
    check_get_batch,
    check_loaded,
    check_non_negative,
    check_wait,
)
from buffer.rollouts import RolloutLimits
from buffer.snapshot import Cuts, restore_ledger
from buffer.sync_epochs import SyncEpochs
from buffer.telemetry import AdmissionClock, TokenRate
from verl_async import protocol as P
from verl_async.ratelimit import RateLimitedLog, short
from verl_async.transport.server import Request, RouterSocket, ServerOptions

log = logging.getLogger("verl_async.buffer")

Reply = tuple[P.Body | None, P.Frames | None]
"""A handler's reply and its tensor frames; (None, None): parked, answered later."""


class BufferServer:
    def __init__(
        self,
        ledger: PromptLedger,
        max_staleness: int,
        endpoint: str,
        num_sources: int = 1,
        evals: EvalRounds | None = None,
        prompts_skipped: int = 0,
        limits: RolloutLimits | None = None,
        run_info: P.RunInfo | None = None,
        exit_after_stop_s: float | None = None,
        options: ServerOptions | None = None,
        max_parked: int = MAX_PARKED,
        peers: Peers | None = None,
        filter_rule: FilterRule | None = None,
    ) -> None:
        self.ledger = ledger
        # DAPO's dynamic sampling (buffer/filtering.py); None: every group is kept.
        self.filter = None if filter_rule is None else GroupFilter(filter_rule)
        self.run_info = run_info  # answers GetRun (roles started on their own)
        # Started by ``verl-async buffer``: leave the loop this long after Shutdown (the
        # generators have then been told to stop); under ``train`` the launcher ends it.
        self.exit_after_stop_s = exit_after_stop_s
        self.stopped_at: float | None = None
        self.num_sources = num_sources  # reward sources: the width of every group's scores
        self.rejections = RateLimitedLog(log)
        self.lease_log = RateLimitedLog(log, what="expired leases")  # a line per holder, bounded
        self.evals = evals or EvalRounds([])
        self.peers = peers or Peers()  # how many generators and learner ranks the run has
        self.prompts_skipped = prompts_skipped
        self.max_staleness = max_staleness
        self.endpoint = endpoint
        self.update: P.WeightUpdate | None = None
        # A batch was served before any weights were announced: the learner is on its first
        # step, and generators on its cores defer to it until it announces (``_get_prompts``).
        self.first_batch_out = False
        self.sync = SyncEpochs()
        self.target_version = 0
        self.batches = StepBatches(ledger, max_staleness)  # the steps handed to the learner
        self.parked = ParkedPolls(max_total=max_parked)  # long polls (buffer/polls.py)
        self.versions_changed = False  # parked version polls may be answerable now
        self.rate = TokenRate()
        self.admission_blocked = 0
        # What a returned group must look like; fields left None are not checked.
        limits = dataclasses.replace(limits or RolloutLimits(), num_sources=num_sources)
        self.intake = Intake(ledger, limits, self.filter, self.rate, self.rejections)
        self.clock = AdmissionClock()
        self.cuts = Cuts(ledger)  # checkpoint cuts waiting for their files to be fetched
        self.stopping = False  # Shutdown received: answer everyone with stop
        self.terminated = False  # SIGTERM: leave the loop
        # One log window for the socket's lines (undecodable, forbidden, lost) and the
        # handlers'.
        self.router = RouterSocket(
            zmq.asyncio.Context(), endpoint, options or ServerOptions(), log, ROLES, self.rejections
        )
        self.handlers = self._handler_table()

    # ------------------------------------------------------------------ main loop

    async def serve(self) -> None:
        """Wait for input with asyncio; then drain every ready message without awaiting.

        The asyncio socket is only used to sleep until the socket is readable. Receives
        and sends (both non-blocking) go through a plain shadow of the same socket
        (``RouterSocket.raw``), so a burst of small messages costs no event-loop round trip
        each."""
        ticker = asyncio.create_task(self._tick())
        try:
            while not self.terminated:
                if await self.router.sock.poll(100):
                    self._drain()
                if self._linger_over():
                    log.info("run finished: the buffer exits")
                    break
        finally:
            ticker.cancel()
            self.router.close()

    def _linger_over(self) -> bool:
        return (
            self.exit_after_stop_s is not None
            and self.stopped_at is not None
            and time.monotonic() - self.stopped_at >= self.exit_after_stop_s
        )

    def _drain(self) -> None:
        for request in self.router.drain():  # undecodable and forbidden ones answered there
            self._dispatch(request)
        self._serve_parked()

    def _dispatch(self, request: Request) -> None:
        """One decoded message: handle, reply. Never raises: whatever a peer sends gets it
        an ``Error`` reply and costs the log at most one (rate-limited) line."""
        identity, env = request.identity, request.envelope
        try:
            reply, frames_out = self.handle(request)
        except Exception as exc:  # noqa: BLE001 (the loop outlives any one message)
            reply, frames_out = self._error_reply(identity, env.body, exc), None
        if reply is not None:
            self.router.reply(identity, env.request_id, reply, frames_out)

    def _error_reply(self, identity: bytes, body: P.Body, exc: Exception) -> P.Error:
        """The ``Error`` for a request that raised, logged (rate-limited). A rejection is
        the peer's fault; anything else is a bug of ours, logged with its traceback."""
        name = type(body).__name__
        if isinstance(exc, LedgerError | P.ProtocolError):
            self.rejections.log(name, "rejected %s from %s: %s", name, identity.hex(), str(exc))
            return P.Error(code="rejected", message=short(str(exc)))
        self.rejections.log(
            "internal", "%s from %s failed", name, identity.hex(), level=logging.ERROR, exc_info=exc
        )
        return P.Error(code="internal", message=short(f"{type(exc).__name__}: {exc}"))

    # ------------------------------------------------------------------ handlers

    def handle(self, request: Request) -> Reply:
        """The reply to one request, by its type's handler (``_handler_table``). Leases that
        ran out are taken back first, so none counts against the connection asking."""
        self._expire_leases()
        body = request.envelope.body
        handler = self.handlers.get(type(body))
        if handler is None:
            what = f"{type(body).__name__} is not a request the buffer serves"
            return P.Error(code="unexpected", message=what), None
        return handler(body, request)

    def _handler_table(self) -> dict[type, Callable[[Any, Request], Reply]]:
        """Each request the buffer serves, and the one method that checks and carries it out."""
        table: dict[type, Callable[[Any, Request], Reply]] = {
            P.GetPrompts: self._get_prompts,
            P.PushRollouts: self._push_rollouts,
            P.RenewLeases: self._renew_leases,
            P.PollVersion: self._poll_version,
            P.GetBatch: self._get_batch,
            P.AnnounceWeights: self._announce_weights,
            P.JoinSync: self._join_sync,
            P.SyncStatus: self._sync_status,
            P.GetStats: lambda body, request: (self.stats(), None),
            P.StartEval: self._start_eval,
            P.PushEval: self._push_eval,
            P.GetEval: self._get_eval,
            P.SnapshotBuffer: self._snapshot_buffer,
            P.FetchSnapshot: self._fetch_snapshot,
            P.Shutdown: self._shutdown,
        }
        if self.run_info is not None:  # a buffer that knows its run directory
            table[P.GetRun] = lambda body, request: (self.run_info, None)
        return table

    def _get_prompts(self, body: P.GetPrompts, request: Request) -> Reply:
        check_non_negative(body, "generator_id", "loaded_version", "max_groups")
        check_generator_id(body.generator_id, self.peers)
        check_loaded(body.loaded_version, self.target_version)
        self.ledger.leases.check_request(request.identity, body.max_groups)
        return self._issue(request.identity, body), None

    def _issue(self, identity: bytes, req: P.GetPrompts) -> P.Prompts:
        if self.stopping:
            return P.Prompts(groups=[], blocked_by_admission=False, exhausted=True)
        if req.defer_to_learner and self.learner_on_first_step():
            return P.Prompts(
                groups=[],
                blocked_by_admission=False,
                exhausted=self.ledger.exhausted,
                eval_version=self.evals.pending_version(),
                deferred=True,
            )
        evals = self.evals.wanted(req.max_groups, req.loaded_version) if req.evaluate else 0
        room = max(req.max_groups - evals, 0)
        groups, blocked = self.ledger.issue(
            req.generator_id, req.loaded_version, room, client=identity
        )
        refused = blocked and not groups
        if groups:
            self.rate.begin()  # generation starts now: the engines' start-up is not in the rate
        self.admission_blocked += int(refused)
        self.clock.observe(
            req.generator_id, refused, self.ledger.in_flight_of(req.generator_id), time.monotonic()
        )
        eval_round, eval_groups = (
            self.evals.take(req.max_groups, req.loaded_version, identity)
            if req.evaluate
            else (-1, [])
        )
        return P.Prompts(
            groups=groups,
            blocked_by_admission=blocked,
            exhausted=self.ledger.exhausted,
            eval_groups=eval_groups,
            eval_round=eval_round,
            eval_version=self.evals.pending_version(),
        )

    def learner_on_first_step(self) -> bool:
        """Whether the learner holds its first batch and has announced no weights yet.
        Generators that share its CPU cores get nothing meanwhile: on a 2-core host the
        SmolLM2 recipe's first step took 12-14 s beside sampling against 8 s alone. A
        learner that waits for several batches before its first step takes none of them
        until then (so never waits on this), and a resumed one announces before its first."""
        return self.first_batch_out and self.update is None

    def _push_rollouts(self, body: P.PushRollouts, request: Request) -> Reply:
        """Each group taken, dropped or refused on its own (buffer/intake.py)."""
        reply = self.intake.push(request.identity, body.groups, request.frames, self.target_version)
        return reply, None

    def _renew_leases(self, body: P.RenewLeases, request: Request) -> Reply:
        leases = self.ledger.leases
        leases.check_renewal(body.leases)
        return P.Renewed(lost=leases.renew(request.identity, body.leases)), None

    def _poll_version(self, body: P.PollVersion, request: Request) -> Reply:
        check_non_negative(body, "generator_id", "loaded_version")
        check_generator_id(body.generator_id, self.peers)
        check_loaded(body.loaded_version, self.target_version)
        check_wait(body.wait_s)
        return self._answer_or_park(body, request)

    def _get_batch(self, body: P.GetBatch, request: Request) -> Reply:
        cut = self.batches.steps.get(body.step)
        total = self.ledger.total_groups // self.ledger.admission.groups_per_step
        cut_for = None if cut is None else len(cut.shards)
        check_get_batch(body, total, cut_for, self.peers.learner_ranks)
        return self._answer_or_park(body, request)

    def _answer_or_park(self, body: P.PollVersion | P.GetBatch, request: Request) -> Reply:
        """A long poll: answered now if it can be, else parked until it can be
        (``_serve_parked``) or its deadline comes (``_tick``)."""
        self.parked.check(request.identity, body)
        ready = self._try_answer(body)
        if ready is not None:
            return ready
        deadline = time.monotonic() + body.wait_s
        self.parked.add(Parked(request.identity, request.envelope.request_id, body, deadline))
        return None, None

    def _announce_weights(self, body: P.AnnounceWeights, request: Request) -> Reply:
        check_announce(body.update, self.target_version)
        self.sync.check_announced(body.update.epoch)
        self.update = body.update
        self.target_version = body.update.version
        self.sync.announced(body.update.epoch)
        self.versions_changed = True
        return P.Ack(), None

    def _join_sync(self, body: P.JoinSync, request: Request) -> Reply:
        """A generator's engine is up: the epoch to join; if the id was seen before, its
        old process is gone and what it held is issued again now."""
        check_non_negative(body, "generator_id")
        check_generator_id(body.generator_id, self.peers)
        epoch, restart = self.sync.join(body.generator_id)
        if restart:
            ids = self.ledger.take_back(body.generator_id)
            log.warning(
                "generator %d started again: it joins weight-sync epoch %d; the %d groups "
                "its previous process held go to the next generator that asks: %s",
                body.generator_id, epoch, len(ids), ids,
            )  # fmt: skip
        return P.SyncEpoch(current=self.sync.current, wanted=epoch), None

    def _sync_status(self, body: P.SyncStatus, request: Request) -> Reply:
        self.sync.status(body.formed, body.regroup)
        return P.SyncEpoch(current=self.sync.current, wanted=self.sync.wanted), None

    def _start_eval(self, body: P.StartEval, request: Request) -> Reply:
        check_non_negative(body, "round", "step", "version")
        self.evals.start(body)
        return P.Ack(), None

    def _push_eval(self, body: P.PushEval, request: Request) -> Reply:
        check_eval_results(body, self.num_sources, self.target_version)
        self.evals.record(body, request.identity)
        return P.Ack(), None

    def _get_eval(self, body: P.GetEval, request: Request) -> Reply:
        check_non_negative(body, "round")
        return self.evals.report(body.round), None

    def _snapshot_buffer(self, body: P.SnapshotBuffer, request: Request) -> Reply:
        check_non_negative(body, "step", "version")
        self.take_cut(body.step, body.version)
        return P.Ack(), None

    def _fetch_snapshot(self, body: P.FetchSnapshot, request: Request) -> Reply:
        check_non_negative(body, "step")
        return self.cuts.files(body.step)

    def _shutdown(self, body: P.Shutdown, request: Request) -> Reply:
        self.stopping = self.versions_changed = True
        self.stopped_at = self.stopped_at or time.monotonic()
        return P.Ack(), None

    def _expire_leases(self) -> None:
        """Issue again the groups whose lease ran out; a log line per holder (rate-limited)."""
        leases = self.ledger.leases
        for expired in self.ledger.expire_leases():
            self.lease_log.log("lease", "%s", expired.line(leases.timeout_s, leases.max_s))

    # ------------------------------------------------------------------ long polls

    def _try_answer(self, body: P.PollVersion | P.GetBatch):
        if isinstance(body, P.PollVersion):
            regrouped = self.sync.current > body.sync_epoch and self.update is not None
            if self.target_version > body.loaded_version or self.stopping or regrouped:
                return self._version_status(), None
            return None
        return self._batch_shard(body)

    def _batch_shard(self, req: P.GetBatch):
        step = self.batches.get(req)
        if step is None:
            return None
        step.served.add(req.rank)
        self.first_batch_out = True
        counts = {"buffer_size": len(self.ledger.returned), "prompts_skipped": self.prompts_skipped}
        return step_message(step, req.rank, self.num_sources, **counts)

    def _serve_parked(self) -> None:
        """Answer the parked polls that can be answered now: the learner's batch polls
        (a few) after every drain, the generators' version polls only when what answers
        them changed (an announcement, a shutdown)."""
        polls = self.parked.batch_polls()
        if self.versions_changed:
            self.versions_changed = False
            polls = itertools.chain(self.parked.version_polls(), polls)
        for number, p in polls:
            try:
                ready = self._try_answer(p.body)
            except Exception as exc:  # noqa: BLE001 (e.g. its step was dropped meanwhile)
                ready = self._error_reply(p.identity, p.body, exc), None
            if ready is None:
                continue
            self.parked.take(number)
            reply, frames = ready
            self.router.reply(p.identity, p.request_id, reply, frames)

    async def _tick(self) -> None:
        """Every 50 ms: end the log windows, take back expired leases (whether or not their
        holders still send anything), answer the long polls whose deadline has come."""
        while True:
            await asyncio.sleep(0.05)
            self.rejections.flush()
            self.lease_log.flush()
            if self.filter is not None:
                self.filter.past_bound_log.flush()
            self._expire_leases()
            if self.stopping:
                expired = self.parked.take_all()
            else:
                expired = self.parked.expired(time.monotonic())
            if not expired:
                continue
            for p in expired:
                self.router.reply(p.identity, p.request_id, self._timeout_reply(p.body))
            # Sends can consume the edge of ZMQ's edge-triggered fd: serve what arrived.
            if self.router.readable():
                self._drain()

    def _version_status(self) -> P.VersionStatus:
        return P.VersionStatus(
            target_version=self.target_version,
            update=self.update,
            stop=self.stopping,
            eval_version=self.evals.pending_version(),
        )

    def _timeout_reply(self, body: P.PollVersion | P.GetBatch) -> P.Body:
        if isinstance(body, P.PollVersion):
            return self._version_status()
        if self.stopping:
            return P.Error(code="stopping", message="the buffer is shutting down")
        return P.NotReady(step=body.step, missing_groups=self.ledger.missing_for(body.step))

    # ------------------------------------------------------------------ checkpoints

    def take_cut(self, step: int, version: int) -> None:
        """The checkpoint barrier (buffer/snapshot.py): the state as of ``step`` (no clocks:
        the generator timing starts again from zero in a resumed buffer)."""
        self.cuts.take(
            step,
            {t: batch.consumed for t, batch in self.batches.steps.items()},
            version=version,
            max_staleness=self.max_staleness,
            dropped_stale=self.batches.dropped_stale_total,
            admission_blocked=self.admission_blocked,
            filter_in_a_row=0 if self.filter is None else self.filter.in_a_row,
        )

    def restore(self, ckpt_dir: Path) -> None:
        """Continue from the buffer files of a checkpoint (before serving anyone)."""
        state = restore_ledger(self.ledger, ckpt_dir)
        self.target_version = state.version
        self.batches.dropped_stale_total = state.dropped_stale
        self.admission_blocked = state.admission_blocked
        if self.filter is not None:
            self.filter.in_a_row = state.filter_in_a_row

    def stats(self) -> P.Stats:
        lg = self.ledger
        blocked_s, idle_s = self.clock.totals(time.monotonic())
        return P.Stats(
            issued=lg.next_group,
            returned=len(lg.returned),
            consumed=lg.start,  # every group before it was trained or dropped
            stored_groups=len(lg.returned),
            target_version=self.target_version,
            dropped_stale=self.batches.dropped_stale_total,
            admission_blocked=self.admission_blocked,
            leases_expired=lg.leases.expired_total,
            leases_renewed=lg.leases.renewed_total,
            renewals_refused=lg.leases.refused_total,
            rollouts_dropped=self.intake.dropped,
            rollouts_refused=self.intake.refused,
            groups_ended=self.intake.ended,
            generator_restarts=self.sync.restarts,
            gen_tokens_per_s=self.rate.rate(),
            gen_blocked_s=blocked_s,
            gen_idle_s=idle_s,
            teacher_groups=self.intake.teacher_waits.groups,
            teacher_s=self.intake.teacher_waits.seconds,
            teacher_busy_s=self.intake.teacher_waits.busy_s,
        )
