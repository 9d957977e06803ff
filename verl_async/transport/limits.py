"""How much one peer can make a verl-async socket hold: the limits, in one place.

- **Queues.** Every socket queues at most ``QUEUE_MESSAGES`` messages per connection
  and direction (ZMQ_SNDHWM, ZMQ_RCVHWM; ZeroMQ counts whole messages). Real clients keep
  a handful of requests outstanding, so they never meet it. A client that sends faster
  than the server reads is slowed by TCP once its connection's queue is full (nothing is
  dropped); a client that never reads its replies loses those past the bound (the
  server's send never blocks, ``RouterSocket.reply``, and the loss is logged).
- **Message size.** A server drops the connection of a client that sends a frame larger
  than its ``max_message_bytes`` (ZMQ_MAXMSGSIZE, checked by libzmq as the frame comes in,
  before it is ever in memory whole); the client sees a request that gets no reply. The
  limit is per frame: a message's tensors travel in frames of their own, and the number of
  frames is bounded by what the server accepts in its envelope, not by libzmq. Clients set
  no size limit: they talk only to the server they chose (authenticated by its key with
  a key set), and a checkpoint's buffer files come back as one frame.

Worst case per admitted connection: ``QUEUE_MESSAGES`` messages of frames up to
``max_message_bytes`` each; the servers admit only clients with a role's credential
(verl_async/transport/guard.py).
"""

from __future__ import annotations

import zmq

QUEUE_MESSAGES = 1000
MAX_MESSAGE_BYTES = 256 * 2**20  # buffer.max_message_mb's default


def bounded(sock: zmq.Socket, max_message_bytes: int | None = None) -> None:
    """Set ``sock``'s queue bounds, its frame limit (``None``: none) and linger 0."""
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, QUEUE_MESSAGES)
    sock.setsockopt(zmq.RCVHWM, QUEUE_MESSAGES)
    if max_message_bytes is not None:
        sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
