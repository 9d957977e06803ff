"""What one peer can make a socket hold (verl_async/transport/limits.py): a frame over the
server's limit costs its sender the connection, queues are bounded both ways, a message
that does not decode is decoded once, and what the buffer keeps pins no frame's bytes."""

from __future__ import annotations

import logging

import msgspec
import numpy as np
import zmq
from zmq.utils.monitor import recv_monitor_message

from buffer.rollouts import RolloutLimits, unpack_rollout
from verl_async import protocol as P
from verl_async.transport.client import dealer_socket
from verl_async.transport.limits import QUEUE_MESSAGES
from verl_async.transport.server import RouterSocket, ServerOptions

from .test_buffer_validation import make_group

LIMIT = 1 << 20
WAIT_MS = 20_000  # generous: the verdicts below wait for events, never for time to pass


def _wait_for_event(monitor: zmq.Socket, event: int) -> bool:
    """True once ``event`` is seen on ``monitor`` (False after WAIT_MS without it)."""
    while monitor.poll(WAIT_MS):
        if recv_monitor_message(monitor)["event"] == event:
            return True
    return False


def _served(router: RouterSocket, client: zmq.Socket, rid: int) -> list[P.Envelope]:
    """Drain ``router`` (answering each request Ack) until ``client``'s request ``rid`` is
    answered; return the envelopes the router took meanwhile, with their frame sizes."""
    client.send_multipart(P.encode(P.GetStats(), rid))
    poller = zmq.Poller()
    poller.register(router.sock, zmq.POLLIN)
    poller.register(client, zmq.POLLIN)
    taken = []
    while True:
        assert poller.poll(WAIT_MS) or router.readable(), "nothing came"
        for request in router.drain():
            taken.append((request.envelope, [len(f) for f in request.frames]))
            router.reply(request.identity, request.envelope.request_id, P.Ack())
        if client.poll(0):
            env, _ = P.decode(client.recv_multipart())
            assert env.request_id == rid
            return taken


def test_a_frame_over_the_limit_costs_its_sender_the_connection_not_the_server(free_port):
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    ctx = zmq.Context()
    router = RouterSocket(
        ctx, endpoint, ServerOptions(max_message_bytes=LIMIT), logging.getLogger("test")
    )
    big, other = dealer_socket(ctx, endpoint, None), dealer_socket(ctx, endpoint, None)
    big_monitor = big.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
    try:
        assert _served(router, big, 1) == [(P.Envelope(P.PROTOCOL_VERSION, 1, P.GetStats()), [])]
        # A request whose tensor frame is one byte over the limit: libzmq drops the
        # connection as the frame comes in, before it is in memory whole.
        big.send_multipart([*P.encode(P.GetStats(), 2), b"\0" * (LIMIT + 1)])
        assert _wait_for_event(big_monitor, zmq.EVENT_DISCONNECTED), "the sender kept its link"
        taken = _served(router, other, 3)  # the server goes on serving everyone else
        assert all(max(sizes, default=0) <= LIMIT for _, sizes in taken), taken
        assert 2 not in [env.request_id for env, _ in taken]
        # A frame at the limit is taken (the limit is the largest frame served).
        assert _wait_for_event(big_monitor, zmq.EVENT_CONNECTED)  # reconnected by itself
        big.send_multipart([*P.encode(P.GetStats(), 4), b"\0" * LIMIT])
        taken = _served(router, other, 5)
        while 4 not in [env.request_id for env, _ in taken]:
            taken += _served(router, other, 5)
        assert [sizes for env, sizes in taken if env.request_id == 4] == [[LIMIT]]
    finally:
        big.disable_monitor()
        big_monitor.close(linger=0)
        for sock in (big, other):
            sock.close(linger=0)
        router.close()


def test_every_socket_of_the_kit_has_bounded_queues(free_port):
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    ctx = zmq.Context()
    router = RouterSocket(ctx, endpoint, ServerOptions(), logging.getLogger("test"))
    dealer = dealer_socket(ctx, endpoint, None)
    try:
        for sock in (router.sock, dealer):
            assert sock.getsockopt(zmq.SNDHWM) == sock.getsockopt(zmq.RCVHWM) == QUEUE_MESSAGES
        assert router.sock.getsockopt(zmq.MAXMSGSIZE) == ServerOptions().max_message_bytes
    finally:
        dealer.close(linger=0)
        router.close()


def test_a_message_that_does_not_decode_is_decoded_once(monkeypatch):
    """A malformed envelope costs one failed pass, whatever version it claims."""
    passes = []
    typed = P._decoder

    class Counting:
        def decode(self, data):
            passes.append("typed")
            return typed.decode(data)

    untyped = msgspec.msgpack.decode

    def counting_untyped(data, *args, **kwargs):
        passes.append("untyped")
        return untyped(data, *args, **kwargs)

    monkeypatch.setattr(P, "_decoder", Counting())
    monkeypatch.setattr(msgspec.msgpack, "decode", counting_untyped)
    head = msgspec.msgpack.encode([P.PROTOCOL_VERSION, 1, {"type": "NoSuchMessage"}])
    passes.clear()
    for frame in (head, b"\x93\x63\x00\xa1x", b"\x91" * 100_000):
        try:
            P.decode([frame])
        except P.ProtocolError:
            pass
        else:
            raise AssertionError("a malformed message decoded")
    assert passes == ["typed"] * 3
    with_version = msgspec.msgpack.encode([P.PROTOCOL_VERSION + 1, 1, {"type": "GetStats"}])
    for version in (0, 1, 127, 128, 300, 70_000, 2**33, -1, -200):
        raw = bytearray(msgspec.msgpack.encode([version, 1, "x"]))
        got = P._peek_version(bytes(raw))
        assert got == version, (version, got)
    try:
        P.decode([with_version])
    except P.ProtocolError as exc:
        assert f"protocol version {P.PROTOCOL_VERSION + 1} is not" in str(exc)


def _root(array: np.ndarray):
    """What ``array``'s memory belongs to, following views to the end."""
    while isinstance(array, np.ndarray) and array.base is not None:
        array = array.base
    return array


def test_what_the_buffer_stores_pins_no_received_frame():
    """A group's arrays are copied out of a received frame they share (the packed frame of
    small tensors, or one a peer padded), so storing a few hundred bytes never keeps a
    large frame alive; an array that spans its frame is kept as it came (no copy)."""
    frames = P.Frames()
    group, frames = make_group(k=5, n=2, tokens=3, frames=frames)
    received = [zmq.Frame(bytes(p)) for p in frames.buffers]  # as a socket hands them over
    padded = received[0].bytes + b"\0" * (1 << 20)  # a peer pads the packed frame
    received[0] = zmq.Frame(padded)
    limits = RolloutLimits(num_sources=1, group_size=2, vocab_size=100, max_response_tokens=8)
    stored = unpack_rollout(group, received, limits, (0, 1))
    for arrays in (stored.responses, stored.behav_logprobs, stored.token_versions):
        for a in arrays:
            root = _root(a)
            assert isinstance(root, np.ndarray) and root.nbytes < 1024, type(root)
    big = np.arange(1 << 16, dtype=np.int32)  # 256 KiB: a frame of its own
    own = P.Frames()
    ref = own.add(big)
    parts = [zmq.Frame(bytes(p)) for p in own.buffers]
    kept = P.tensor(ref, parts, keep=True)
    assert np.array_equal(kept, big) and not kept.flags.owndata  # spans its frame: a view
