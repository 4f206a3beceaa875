"""Pinned host memory for offloaded bytes: a pool of large slabs, never a pinned
allocation per tensor (pinning costs milliseconds per call: pytorch/pytorch#186162).

RULES H1..H4: what the pool holds and what it reports.

H1. [ slabs are carved per step ] Each slab is carved front to back; a slab whose blocks
    have all come back is carved again from its start. A training step offloads in
    forward order and gets its memory back during backward, so from the second step on
    the pool allocates nothing. A block comes back with the event of the last copy that
    reads it: it is reused only once that copy has run.
H2. [ a block's bytes as the plan counts them ] A block of ``n`` bytes takes
    :func:`footprint` ``(n)`` bytes of its slab (aligned for any dtype and for DMA). The
    planner counts an offloaded item's host bytes the same way (``_budget.planner``
    K6 [ kept values may be offloaded ]), and ``live`` counts them: what the plan
    offloads is what the pool holds.
H3. [ pinned sizes as the allocator reserves them ] A slab is asked of the backend at
    the size its allocator really reserves (``Backend.pinned_size``: CUDA's caching host
    allocator rounds a pinned allocation up to a power of two), so ``reserved`` is what
    the host really holds and never more than ``limit``.
H4. [ one slab for a bounded pool ] A bounded pool holds one slab, of the bytes the
    plans expect (:meth:`HostPool.expect`) up to its :attr:`HostPool.capacity`; it is
    replaced by a larger one only when none of its blocks is in use. Blocks whose
    footprints sum to at most the capacity, carved in one step, are always placed. A
    request it cannot meet gets None (the caller keeps the tensor on the device and says
    so).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .streams import Backend

__all__ = ["HostPool", "HostBlock", "footprint", "SLAB"]

_ALIGN = 512  # bytes: any dtype's alignment, and DMA friendly
SLAB = 64 * 2**20


def footprint(nbytes: int) -> int:
    """H2 [ a block's bytes as the plan counts them ]: the bytes a block of ``nbytes`` takes in the pool.

    Example::

        >>> footprint(1), footprint(512), footprint(513), footprint(0)
        (512, 512, 1024, 0)
    """
    return -(-nbytes // _ALIGN) * _ALIGN


class _Slab:
    __slots__ = ("tensor", "top", "live")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.top = 0  # bytes carved
        self.live = 0  # blocks carved and not yet back


class HostBlock:
    """``nbytes`` of pinned memory: ``tensor`` (uint8) is it; it takes ``footprint`` bytes
    of its slab (H2 [ a block's bytes as the plan counts them ])."""

    __slots__ = ("slab", "tensor", "nbytes", "footprint")

    def __init__(self, slab: _Slab, offset: int, nbytes: int, taken: int) -> None:
        self.slab = slab
        self.nbytes = nbytes
        self.footprint = taken
        self.tensor = slab.tensor.narrow(0, offset, nbytes)


class HostPool:
    """Pinned slabs of one backend, at most ``limit`` bytes in all (None: no limit).

    Example::

        >>> from gradient_scope._budget.hostpool import HostPool
        >>> from gradient_scope._budget.streams import HostCopyStandIn
        >>> pool = HostPool(HostCopyStandIn(), limit=5000)
        >>> pool.capacity  # H3 [ pinned sizes as the allocator reserves them ]: one 4096-byte slab
        4096
        >>> a, b = pool.alloc(1000), pool.alloc(1000)
        >>> pool.live, pool.reserved, pool.alloc(3000) is None  # H2 [ a block's bytes as the plan counts them ]
        (2048, 4096, True)
        >>> pool.free(a); pool.free(b)
        >>> pool.alloc(4000).nbytes, pool.reserved                # the slab, carved again
        (4000, 4096)
    """

    def __init__(self, backend: Backend, limit: int | None, slab: int = SLAB) -> None:
        self.backend = backend
        self.limit = limit
        self.capacity: float = math.inf if limit is None else _usable(backend, limit)
        self.slab = slab if limit is None else int(min(slab, self.capacity))
        self.slabs: list[_Slab] = []
        # bytes of all slabs, as the backend reserves them
        # (H3 [ pinned sizes as the allocator reserves them ])
        self.reserved = 0
        # footprints of blocks handed out and not yet back
        # (H2 [ a block's bytes as the plan counts them ])
        self.live = 0
        self.waiting: list[tuple[HostBlock, Any]] = []  # back, but a copy may still read them

    def expect(self, nbytes: int) -> None:
        """Plans will offload about ``nbytes`` (footprints) per step: size new slabs for it
        (a bounded pool's one slab grows to the most any plan expects,
        H4 [ one slab for a bounded pool ])."""
        if self.limit is None:
            self.slab = min(max(nbytes, 1 << 20), SLAB)
        else:
            self.slab = int(min(max(self.slab, nbytes), self.capacity))

    def alloc(self, nbytes: int) -> HostBlock | None:
        """A block of ``nbytes``, or None when ``limit`` leaves no room
        (H4 [ one slab for a bounded pool ])."""
        need = footprint(nbytes)
        block = self._carve(need, nbytes)
        if block is None and self.waiting:
            self.drain()  # wait for the copies still reading returned blocks, then retry
            block = self._carve(need, nbytes)
        if block is None:
            slab = self._grow(need)
            if slab is None:
                return None
            block = self._take(slab, need, nbytes)
        self.live += need
        return block

    def _grow(self, need: int) -> _Slab | None:
        want = max(self.slab, need)
        if self.limit is not None:  # H4 [ one slab for a bounded pool ]: one slab, replaced only when idle
            if need > self.capacity or any(s.live for s in self.slabs):
                return None
            self.trim()
            want = int(min(want, self.capacity))
        size = self.backend.pinned_size(want)  # H3 [ pinned sizes as the allocator reserves them ]
        if self.limit is not None and self.reserved + size > self.limit:
            return None
        slab = _Slab(self.backend.host_empty(size))
        self.slabs.append(slab)
        self.reserved += size
        return slab

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
        block = HostBlock(slab, slab.top, nbytes, need)
        slab.top += need
        slab.live += 1
        return block

    def free(self, block: HostBlock, event: Any = None) -> None:
        """``block`` comes back; ``event``: the last copy reading it (None: none)."""
        self.live -= block.footprint
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
        self.reserved = sum(self.backend.pinned_size(s.tensor.numel()) for s in kept)
        self.slabs = kept


def _usable(backend: Backend, limit: int) -> int:
    """H3 [ pinned sizes as the allocator reserves them ], H4 [ one slab for a bounded pool ]: the
    most bytes one slab can offer within ``limit``: the largest size, in
    whole footprints, that the backend reserves within it."""
    lo, hi = 0, limit // _ALIGN  # in units of _ALIGN; pinned_size grows with the size
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if backend.pinned_size(mid * _ALIGN) <= limit:
            lo = mid
        else:
            hi = mid - 1
    return lo * _ALIGN
