"""The ZeroMQ transport kit: every verl-async socket is built from these pieces.

- ``client.py``: ``dealer_socket`` (a client's DEALER, set up once) and ``AsyncDealer``,
  the asyncio request client (request ids, one reader task, deadlines); the buffer's,
  the reward models' and the scoring process's clients are built on it.
- ``server.py``: ``RouterSocket``, a server's ROUTER (set-up, admission, role checks,
  draining with decode-or-``Error`` replies, refusing types the server does not serve,
  replies to peers that may be gone, close). The buffer, the reward-model processes and
  a generator's scoring process each hold one.
- ``guard.py``: who a server admits and under which role (CurveZMQ keys or the run's
  role tokens, checked by a ZAP handler; verl_async/auth.py loads the credentials).
- ``limits.py``: the queue bounds and the frame-size limit every socket gets.
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
