"""Pinned host memory for offloaded bytes: a pool of large slabs, never a pinned
allocation per tensor (pinning costs milliseconds per call: pytorch/pytorch#186162).

Each slab is carved front to back; a slab whose blocks have all come back is carved
again from its start. A training step offloads in forward order and gets its memory
back during backward, so from the second step on the pool allocates nothing. A block
comes back with the event of the last copy that reads it: it is reused only once that
copy has run. The pool never reserves more than ``limit`` bytes; a request it cannot
meet gets None (the caller keeps the tensor on the device).
"""

from __future__ import annotations

from typing import Any

import torch

from .streams import Backend

__all__ = ["HostPool", "HostBlock"]

_ALIGN = 512  # bytes: any dtype's alignment, and DMA friendly
SLAB = 64 * 2**20


class _Slab:
    __slots__ = ("tensor", "top", "live")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.top = 0  # bytes carved
        self.live = 0  # blocks carved and not yet back


class HostBlock:
    """``nbytes`` of pinned memory: ``tensor`` (uint8) is it."""

    __slots__ = ("slab", "tensor", "nbytes")

    def __init__(self, slab: _Slab, offset: int, nbytes: int) -> None:
        self.slab = slab
        self.nbytes = nbytes
        self.tensor = slab.tensor.narrow(0, offset, nbytes)


class HostPool:
    """Pinned slabs of one backend, at most ``limit`` bytes in all (None: no limit).

    Example::

        >>> from gradient_scope._budget.hostpool import HostPool
        >>> from gradient_scope._budget.streams import HostCopyStandIn
        >>> pool = HostPool(HostCopyStandIn(), limit=4096, slab=4096)
        >>> a, b = pool.alloc(1000), pool.alloc(1000)
        >>> pool.live, pool.reserved, pool.alloc(4000) is None     # no room left
        (2000, 4096, True)
        >>> pool.free(a); pool.free(b)
        >>> pool.alloc(4000).nbytes, pool.reserved                # the slab, carved again
        (4000, 4096)
    """

    def __init__(self, backend: Backend, limit: int | None, slab: int = SLAB) -> None:
        self.backend = backend
        self.limit = limit
        self.slab = slab if limit is None else max(min(slab, limit), 1)
        self.slabs: list[_Slab] = []
        self.reserved = 0  # bytes of all slabs
        self.live = 0  # bytes of blocks handed out and not yet back
        self.waiting: list[tuple[HostBlock, Any]] = []  # back, but a copy may still read them

    def alloc(self, nbytes: int) -> HostBlock | None:
        """A block of ``nbytes``, or None when ``limit`` leaves no room."""
        need = -(-nbytes // _ALIGN) * _ALIGN
        block = self._carve(need, nbytes)
        if block is None and self.waiting:
            self.drain()  # wait for the copies still reading returned blocks, then retry
            block = self._carve(need, nbytes)
        if block is None:
            size = max(self.slab, need)
            if self.limit is not None and self.reserved + size > self.limit:
                if self.limit - self.reserved < need:
                    return None
                size = self.limit - self.reserved
            slab = _Slab(self.backend.host_empty(size))
            self.slabs.append(slab)
            self.reserved += size
            block = self._take(slab, need, nbytes)
        self.live += nbytes
        return block

    def _carve(self, need: int, nbytes: int) -> HostBlock | None:
        self._reap()
        for slab in self.slabs:
            if slab.live == 0:
                slab.top = 0
            if slab.tensor.numel() - slab.top >= need:
                return self._take(slab, need, nbytes)
        return None

    @staticmethod
    def _take(slab: _Slab, need: int, nbytes: int) -> HostBlock:
        block = HostBlock(slab, slab.top, nbytes)
        slab.top += need
        slab.live += 1
        return block

    def free(self, block: HostBlock, event: Any = None) -> None:
        """``block`` comes back; ``event``: the last copy reading it (None: none)."""
        self.live -= block.nbytes
        if event is None or self.backend.done(event):
            block.slab.live -= 1
        else:
            self.waiting.append((block, event))

    def _reap(self) -> None:
        still = []
        for block, event in self.waiting:
            if self.backend.done(event):
                block.slab.live -= 1
            else:
                still.append((block, event))
        self.waiting = still

    def drain(self) -> None:
        """Wait for every copy that reads a returned block; then they are free."""
        for block, event in self.waiting:
            self.backend.synchronize(event)
            block.slab.live -= 1
        self.waiting = []

    def trim(self) -> None:
        """Give back every slab with no block in use."""
        self.drain()
        kept = [s for s in self.slabs if s.live]
        self.reserved = sum(s.tensor.numel() for s in kept)
        self.slabs = kept
