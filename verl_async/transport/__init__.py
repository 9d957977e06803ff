"""The ZeroMQ transport kit: every verl-async socket is built from these pieces.

- ``client.py``: ``dealer_socket`` (a client's DEALER, set up once) and ``AsyncDealer``,
  the asyncio request client (request ids, one reader task, deadlines).
- ``server.py``: ``RouterSocket``, a server's ROUTER (set-up, CurveZMQ guard, draining
  with decode-or-``Error`` replies, replies to peers that may be gone, close).
- ``buffer_client.py``: the buffer's clients, ``BufferClient`` (blocking, learner) and
  ``AsyncBufferClient`` (asyncio, generators), importable from here.

The rate-limited log the servers use is ``verl_async.ratelimit`` (auth.py needs it too,
and auth.py is imported by this kit).
"""

from verl_async.transport.buffer_client import (
    AsyncBufferClient,
    BufferClient,
    BufferRejected,
    BufferUnavailable,
)

__all__ = ["AsyncBufferClient", "BufferClient", "BufferRejected", "BufferUnavailable"]
