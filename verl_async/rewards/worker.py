"""The scoring process: rule rewards run here, never on a generator's event loop.

    python -m verl_async.rewards.worker --run-dir DIR --endpoint ipc:///tmp/x.sock

Socket pattern. A ROUTER bound on ENDPOINT (``verl_async.transport.server.RouterSocket``:
bounded queues, frames up to ``--max-message-bytes``, decoding, ``Error`` replies); the
one client is the parent's ``scorer.RuleScorer``, a DEALER. Each ``ScoreRules`` gets one
``Scores`` reply with the same request id. An item whose function raises anything,
``BaseException`` included (``SystemExit``, ``KeyboardInterrupt``, ``RecursionError``,
``MemoryError``), or returns what is not a finite float32, gets its source's
``default_score`` and ``errors[i] = repr(exc)``; the other items and the process are
unaffected. A message
that does not decode (``Error("protocol")``) or is not a ``ScoreRules``
(``Error("unexpected")``) is answered by the router and the process keeps serving; a frame
over the limit costs its sender the connection. No handshake and no credentials: ENDPOINT
is an ipc path in a directory only the generator's user can enter, so the file system
decides who connects. Shutdown: SIGTERM (``Terminated``, which no item's ``except``
keeps), or the parent's death; linger 0.

The sources are ``rewards.sources`` of ``DIR/config.yaml``, or, when the parent sets it,
the JSON ``RewardsConfig`` in ``$VERL_ASYNC_REWARDS_JSON`` (so the parent's list and the
``ScoreItem.source`` indices it sends are the same list by construction).

A hang or a crash here (a user function that sleeps, calls ``os._exit`` or segfaults) is
the parent's business: ``scorer.RuleScorer`` kills this process and starts a fresh one.
It exits on SIGTERM and when its parent dies. No torch, no transformers: it starts fast.
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import signal
import sys
from pathlib import Path

import msgspec
import zmq

from verl_async import protocol as P
from verl_async.config import load_config
from verl_async.reward_config import FunctionReward, MathReward, ModelReward, RewardsConfig
from verl_async.rewards.rules import RuleScorerState
from verl_async.runtime import die_with_parent, report_exit
from verl_async.transport.limits import MAX_MESSAGE_BYTES
from verl_async.transport.server import RouterSocket, ServerOptions

ENV_REWARDS = "VERL_ASYNC_REWARDS_JSON"
POLL_MS = 500  # how often the loop looks at its parent while idle
log = logging.getLogger("verl_async.rewards")


class Terminated(BaseException):
    """SIGTERM, raised wherever the main thread is (a user function included): the one
    BaseException that ends the process instead of costing an item its score."""


def load_rewards(run_dir: str) -> RewardsConfig:
    """The parent's rewards config (environment) if given, else the run's config.yaml."""
    raw = os.environ.get(ENV_REWARDS)
    if raw:
        return msgspec.json.decode(raw, type=RewardsConfig)
    return load_config(Path(run_dir) / "config.yaml").rewards


def math_timeout_s(rewards: RewardsConfig) -> int:
    """math-verify's per-operation timeout: a quarter of the request's, 1..5 whole seconds,
    so one adversarial answer cannot use up the whole group's deadline alone."""
    return max(1, min(5, int(rewards.timeout_s / 4)))


def score_items(
    items: list[P.ScoreItem], rewards: RewardsConfig, state: RuleScorerState
) -> P.Scores:
    """One score per item; a failing item gets its source's default and an error string."""
    scores: list[float] = []
    errors: list[str] = []
    for item in items:
        if not 0 <= item.source < len(rewards.sources):
            scores.append(0.0)
            errors.append(f"source index {item.source} out of range")
            continue
        source = rewards.sources[item.source]
        try:
            scores.append(state.score(source, item))
            errors.append("")
        except Terminated:
            raise
        except BaseException as exc:  # a user function may raise anything; the run goes on
            scores.append(source.default_score)
            errors.append(describe(exc))
    return P.Scores(scores=scores, errors=errors)


def describe(exc: BaseException) -> str:
    """``repr(exc)``, at most 2000 characters; the type's name when even that raises."""
    try:
        return repr(exc)[:2000]
    except Exception:
        return f"{type(exc).__name__} (its repr raised)"


def warm_up(rewards: RewardsConfig, state: RuleScorerState) -> None:
    """Import what the sources need now (sympy, user modules) rather than in a request."""
    for source in rewards.sources:
        try:
            if isinstance(source, MathReward):
                state.math.module()
            elif isinstance(source, FunctionReward):
                state.function(source.function)
        except Terminated:
            raise
        except BaseException as exc:  # the request will report it per item
            log.warning("reward source '%s' failed to load: %s", source.name, describe(exc))


def serve(
    endpoint: str, rewards: RewardsConfig, max_message_bytes: int = MAX_MESSAGE_BYTES
) -> None:
    """Answer requests until the parent goes away (or SIGTERM ends the process)."""
    parent = os.getppid()
    state = RuleScorerState(math_timeout_s(rewards))
    options = ServerOptions(max_message_bytes=max_message_bytes)
    router = RouterSocket(
        zmq.Context(), endpoint, options, log, serves=(P.ScoreRules,), name="the scoring process"
    )
    rule_sources = [s.name for s in rewards.sources if not isinstance(s, ModelReward)]
    log.info("scoring process up on %s; rule sources %s", endpoint, rule_sources)
    try:
        warm_up(rewards, state)
        while os.getppid() == parent:  # belt and braces beside PR_SET_PDEATHSIG
            router.rejections.flush()  # the summary of a flood, when its window ends
            if not router.sock.poll(POLL_MS):
                continue
            for request in router.drain():  # what does not decode is answered there
                scores = score_items(request.envelope.body.items, rewards, state)
                router.reply(request.identity, request.envelope.request_id, scores)
    except Terminated:
        log.info("stopped: SIGTERM")
    finally:
        router.close()


def _on_sigterm(signum: int, frame: object) -> None:
    # Unwinds through a user function that is running (unless it swallows BaseException;
    # the parent's SIGKILL covers that).
    raise Terminated


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="verl-async rule-reward scoring process")
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--endpoint", required=True, help="ZMQ endpoint to bind (ipc://...)")
    parser.add_argument(
        "--max-message-bytes",
        type=int,
        default=MAX_MESSAGE_BYTES,
        help="largest frame taken; a larger one costs its sender the connection",
    )
    args = parser.parse_args(argv)
    faulthandler.enable()  # a segfault in a user function leaves its stack in the log
    die_with_parent()
    signal.signal(signal.SIGTERM, _on_sigterm)
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s rewards %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )
    with report_exit(log):
        serve(args.endpoint, load_rewards(args.run_dir), args.max_message_bytes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
