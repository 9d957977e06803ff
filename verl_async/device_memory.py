"""The same-GPU channel of a weight-sync group: CUDA IPC (weight_sync.py says when).

When generators share learner rank 0's GPU (``placement.colocate``, a one-GPU machine),
NCCL cannot join them (it refuses two ranks on one device) and a trip through host
memory would cost two PCIe copies per update. Instead rank 0 allocates one device buffer
per epoch, large enough for an update, and exports its CUDA IPC handle; each member on
the same GPU opens the handle once and, at each update, copies the buckets out of that
buffer with device-to-device copies. The weight-sync group itself is gloo: its
collectives carry the header and the "every member has read it" count, never the bytes.

The offer (``MemoryOffer`` with ``cuda`` set) travels as the memory file's does: from the
learner through the buffer's authenticated connections, never through the weight-sync
store. A member accepts it only if the buffer it opened holds the announced token in its
first bytes (rank 0 writes it there before it exports the handle; the epoch's first
update overwrites it only after every member has agreed).

This path needs a CUDA device: the CPU tests check the offer's format and the refusals,
and ``benchmarks/gpu_check.py`` runs it on a GPU.
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
from collections.abc import Iterable

import torch

from verl_async.protocol import CudaIpc, MemoryOffer

log = logging.getLogger("verl_async.weight_sync")

TOKEN_BYTES = 16


class DeviceMemory:
    """Rank 0's device buffer (``buffer``, owned) or a member's view of it (opened from the
    offer). ``offer`` is rank 0's announcement, None until ``reserve`` has allocated."""

    def __init__(
        self, device: torch.device, buffer: torch.Tensor | None, offer: MemoryOffer | None
    ) -> None:
        self.device = device
        self.buffer = buffer  # uint8 [size] on ``device``
        self.offer = offer

    @classmethod
    def create(cls, device: torch.device, nbytes: int = 0) -> DeviceMemory | None:
        """Rank 0: a channel on ``device`` (None unless it is a CUDA device); with
        ``nbytes`` its buffer is allocated and offered at once, else at ``reserve``."""
        if device.type != "cuda" or not torch.cuda.is_available():
            return None
        out = cls(device, None, None)
        if nbytes:
            out.reserve(nbytes)
        return out

    def reserve(self, nbytes: int) -> None:
        """Rank 0: allocate the buffer for updates of ``nbytes`` and make its offer. Once
        offered its size is fixed: an update that does not fit is an error in ``write``."""
        if self.buffer is not None:
            return
        token = secrets.token_hex(TOKEN_BYTES)
        size = max(nbytes, TOKEN_BYTES * 2)
        self.buffer = torch.empty(size, dtype=torch.uint8, device=self.device)
        self.buffer[: len(token)].copy_(
            torch.frombuffer(bytearray(token.encode()), dtype=torch.uint8)
        )
        torch.cuda.synchronize(self.device)
        shared = self.buffer.untyped_storage()._share_cuda_()
        device, handle, size_bytes, offset_bytes, ref_handle, ref_offset, event, sync = shared
        ipc = CudaIpc(
            device=int(device), handle=bytes(handle), size=int(size_bytes),
            offset=int(offset_bytes), ref_counter_handle=bytes(ref_handle),
            ref_counter_offset=int(ref_offset), event_handle=bytes(event or b""),
            event_sync_required=bool(sync),
        )  # fmt: skip
        self.offer = MemoryOffer(path="", token=token, pid=os.getpid(), cuda=ipc)

    @classmethod
    def accept(cls, offer: MemoryOffer) -> DeviceMemory | None:
        """Member: open the offered device buffer, or None (and a log line saying why)
        unless this process sees that GPU and the buffer holds the token."""
        ipc = offer.cuda
        if ipc is None or not torch.cuda.is_available():
            return _refuse(offer, "this process has no CUDA device")
        if ipc.device >= torch.cuda.device_count():
            return _refuse(offer, f"this process does not see cuda:{ipc.device}")
        device = torch.device("cuda", ipc.device)
        try:
            # CUDA must be initialised in this process, with a context on the handle's
            # device, before a handle is opened: ``_new_shared_cuda`` does neither (the
            # rebuild of a shared CUDA tensor in torch.multiprocessing initialises CUDA
            # first), and a member spawned fresh has not touched CUDA yet.
            torch.cuda.init()
            with torch.cuda.device(device):  # this process's current device stays its own
                torch.empty(1, device=device)  # makes the device's context now
                storage = torch.UntypedStorage._new_shared_cuda(
                    ipc.device, ipc.handle, ipc.size, ipc.offset, ipc.ref_counter_handle,
                    ipc.ref_counter_offset, ipc.event_handle or None, ipc.event_sync_required,
                )  # fmt: skip
        except Exception as exc:  # a handle of another GPU or process space: CUDA's error
            return _refuse(offer, f"its handle does not open here ({str(exc)[:120]})")
        view = torch.empty(0, dtype=torch.uint8, device=device).set_(storage)
        head = bytes(view[: len(offer.token)].cpu().numpy())
        if not hmac.compare_digest(head, offer.token.encode()):
            return _refuse(offer, "it does not hold the announced token")
        return cls(device, view, None)

    def write(self, buffers: Iterable[torch.Tensor]) -> int:
        """Rank 0: the packed buckets one after another from offset 0, copied on the
        device and finished before this returns; returns bytes."""
        offset = 0
        for buf in buffers:
            n = buf.numel()
            if offset + n > self.buffer.numel():
                raise RuntimeError(
                    f"a weight update of more than {self.buffer.numel()} bytes, the size "
                    "of the device buffer offered this epoch"
                )
            self.buffer[offset : offset + n].copy_(buf.view(-1).view(torch.uint8))
            offset += n
        torch.cuda.synchronize(self.device)
        return offset

    def read_into(self, buf: torch.Tensor, offset: int) -> None:
        """Member: fill ``buf`` (on any device) with the buffer's bytes from ``offset``,
        finished before this returns (rank 0 may overwrite them once all have read)."""
        n = buf.numel()
        if offset + n > self.buffer.numel():
            raise RuntimeError(f"the weight update in device memory ended at byte {offset}")
        buf.copy_(self.buffer[offset : offset + n])
        torch.cuda.synchronize(self.device)

    def close(self) -> None:
        self.buffer = None


def _refuse(offer: MemoryOffer, why: str) -> None:
    log.warning(
        "weight updates go over the network: the device memory offered by pid %d is "
        "refused: %s", offer.pid, why,
    )  # fmt: skip
    return None
