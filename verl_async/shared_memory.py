"""The memory file a weight-sync group's same-host updates go through (weight_sync.py
says when): learner rank 0 makes one per epoch and announces it (``MemoryOffer``) through
the buffer; a member opens it and keeps it only after checking that it is that file.

A member trusts nothing it did not check on the descriptor it opened: the offer names a
path, and ``/proc/<pid>/fd/<n>`` can lead anywhere if the process behind the pid is not
the learner (a pid reused after the learner died, a path someone else wrote). The offer
itself comes over the buffer's authenticated connections, which is what makes its pid
and token the learner's; the weight-sync store, which any local process can write,
carries none of it.
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
import stat
from collections.abc import Iterable

import torch

from verl_async.device_memory import DeviceMemory
from verl_async.protocol import MemoryOffer

log = logging.getLogger("verl_async.weight_sync")

MEMFD_NAME = "verl-async-weights"
_MEMFD_TARGET = f"/memfd:{MEMFD_NAME}"  # how /proc/<pid>/fd/<n> names such a file


class SharedMemory:
    """The same-host channel of a gloo group: a memory file of rank 0's, open here as
    ``fd`` (rank 0: the file itself, read-write; a member: the file it accepted, read-only).
    Rank 0 keeps the size of the largest update sent (its pages are written over, not
    allocated again); the file goes away with rank 0's process, so a crash leaves nothing
    behind, and with the last descriptor a member holds of it."""

    def __init__(self, fd: int, offer: MemoryOffer | None = None) -> None:
        self.fd: int | None = fd
        self.offer = offer  # rank 0: what it announces (path, token, pid)

    @classmethod
    def create(cls) -> SharedMemory | None:
        """Rank 0: a new memory file holding a random token; None where Linux's
        ``memfd_create`` is missing."""
        if not hasattr(os, "memfd_create"):
            return None
        fd = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC)
        token = secrets.token_hex(16)
        os.pwrite(fd, token.encode(), 0)
        pid = os.getpid()
        return cls(fd, MemoryOffer(path=f"/proc/{pid}/fd/{fd}", token=token, pid=pid))

    @classmethod
    def accept(cls, offer: MemoryOffer) -> SharedMemory | None:
        """Member: open ``offer``'s file, or None (and a log line saying why) unless it is
        learner rank 0's memory file: the path names the pid the learner announced, what
        was opened is a memory file of our name owned by this user, and it holds the
        token. The checks look at the descriptor opened, not the path again, so nothing
        can be swapped in between; the offer itself came over the buffer's authenticated
        channel, which is what makes the pid and the token the learner's."""
        fd_part = offer.path.removeprefix(f"/proc/{offer.pid}/fd/")
        if not (fd_part.isascii() and fd_part.isdigit()):
            return _refuse(offer, f"the path is not /proc/{offer.pid}/fd/<n>")
        try:
            fd = os.open(offer.path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            return _refuse(offer, f"it does not open here ({exc.strerror})")
        try:
            why = _not_learners_memory(fd, offer.token)
        except OSError as exc:
            why = f"it cannot be checked ({exc.strerror})"
        if why:
            os.close(fd)
            return _refuse(offer, why)
        return cls(fd)

    def reserve(self, nbytes: int) -> None:
        """Rank 0: allocate the file's pages for an update of ``nbytes`` now (what is in
        them is written over)."""
        if hasattr(os, "posix_fallocate"):
            os.posix_fallocate(self.fd, 0, nbytes)

    def write(self, buffers: Iterable[torch.Tensor]) -> int:
        """Rank 0: the packed buckets one after another from offset 0; returns bytes."""
        offset = 0
        for buf in buffers:
            view = memoryview(buf.detach().cpu().numpy()).cast("B")
            while view:
                n = os.pwrite(self.fd, view, offset)
                view, offset = view[n:], offset + n
        return offset

    def read_into(self, buf: torch.Tensor, offset: int) -> None:
        """Member: fill ``buf`` with the file's bytes from ``offset``."""
        view = memoryview(buf.numpy()).cast("B")
        while view:
            n = os.preadv(self.fd, [view], offset)
            if n <= 0:
                raise RuntimeError(f"the weight update in shared memory ended at byte {offset}")
            view, offset = view[n:], offset + n

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _not_learners_memory(fd: int, token: str) -> str:
    """Why the open file ``fd`` is not rank 0's memory file ("" when it is)."""
    target = os.readlink(f"/proc/self/fd/{fd}")
    if target.removesuffix(" (deleted)") != _MEMFD_TARGET:
        return f"it is {target[:80]!r}, not a memory file named {MEMFD_NAME!r}"
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
        return f"it belongs to uid {st.st_uid}, not this process's {os.getuid()}"
    if not hmac.compare_digest(os.pread(fd, len(token), 0), token.encode()):
        return "it does not hold the announced token"
    return ""


def _refuse(offer: MemoryOffer, why: str) -> None:
    log.warning(
        "weight updates go over the network: the shared memory offered at %r is refused: %s",
        offer.path[:80], why,
    )  # fmt: skip
    return None


Memory = SharedMemory | DeviceMemory  # a gloo group's same-host channel


def new_memory(device: torch.device | None, nbytes: int = 0) -> Memory | None:
    """Rank 0's same-host channel of a gloo group: a device buffer on a CUDA ``device``
    (offered once ``nbytes`` are reserved), else a memory file."""
    if device is not None and torch.device(device).type == "cuda":
        return DeviceMemory.create(torch.device(device), nbytes)
    return SharedMemory.create()


def accept_memory(offer: MemoryOffer) -> Memory | None:
    """A member: the offered memory opened and checked, or None (logged)."""
    return DeviceMemory.accept(offer) if offer.cuda is not None else SharedMemory.accept(offer)
