"""The offload engine: saved tensors and kept inputs to pinned host memory after forward,
and back before backward needs them.

RULES O1..O7: how offloaded bytes travel.

O1. [ a storage is offloaded whole ] A storage is offloaded whole, once per step and
    version: every saved view of it shares the host copy and is rebuilt with its own
    dtype, shape, strides and offset (a kernel may choose its path by strides: the
    values autograd gets are bitwise the ones it saved).
O2. [ copies out run on side streams ] Copies run on side streams, one per direction and
    device. A copy out waits for an event recorded on the stream that is current when
    the tensor is packed (queried then, never cached); its source is kept for the side
    stream with ``record_stream``, so the allocator does not reuse it before the copy
    has run.
O3. [ copies back and their consumers ] A copy back runs on the copy-back stream into
    memory allocated there. The consumer -- whatever stream is current when autograd
    unpacks, or a replay reads -- waits for the copy's event itself (the wait is issued
    outside the side stream's context) and marks the memory with ``record_stream``.
O4. [ copies back are prefetched ] Copies back are prefetched in the order the previous
    step's backward asked for them (the first step: the reverse of forward order), from
    the start of backward, as long as the bytes fetched and not yet used stay within
    ``window``.
O5. [ kept inputs are offloaded in place ] An input a block keeps for replay is
    offloaded in place: its storage's bytes go to the host and the storage is resized to
    0, but only when the block's own aliases are the only holders of the storage (its
    use count says so). A replay that finds it empty asks the freed-storage handlers;
    the engine regrows it and copies the prefetched bytes in before the replay reads it.
O6. [ host memory comes from the pool ] Host memory comes from the pool
    (``_budget.hostpool``) and goes back with the event of the last copy that reads it.
    A copy the pool has no room for leaves the tensor on the device, and its bytes are
    counted (``refused``): the budget says so. A packed tensor that dies -- the graph
    freed after backward, or dropped by an exception in forward or backward -- first
    waits for its copies: nothing stays in flight, nothing is held.
O7. [ unpack checks versions ] A packed tensor checks at unpack that the tensor it was
    made from (or its base) was not written since, as autograd does: PyTorch's in-place
    error otherwise. One made from a tensor autograd would keep itself (a saved input,
    not a view) whose data was swapped since (``.data = ...``) gives that tensor's new
    data, as autograd does.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Hashable
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from .._base.errors import inplace_error
from .._base.torch_compat import storage_id, storage_use_count, without_python_dispatch, without_torch_function
from .._save.pack import may_be_new_output
from .hostpool import HostBlock, HostPool
from .streams import Backend, backend_for, backend_of

__all__ = ["Offloader", "Offloaded", "HostCopy", "evict", "restore", "restore_offloaded", "engines", "evicted_bytes"]

Tensor = torch.Tensor


class _Quiet:
    """No grad, no torch function or dispatch mode: the engine's own tensor work is
    invisible to the program and to any mode (a recorder, a report) around it."""

    def __enter__(self) -> None:
        self.stack = [torch.no_grad(), without_torch_function(), without_python_dispatch()]
        for c in self.stack:
            c.__enter__()

    def __exit__(self, *exc: object) -> None:
        for c in reversed(self.stack):
            c.__exit__(None, None, None)


def _bytes_of(storage: torch.UntypedStorage, device: torch.device) -> Tensor:
    """A uint8 tensor over the whole of ``storage``."""
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


class HostCopy:
    """The bytes of one storage on the host (O1 [ a storage is offloaded whole ]), and their way
    back (O3 [ copies back and their consumers ])."""

    __slots__ = (
        "engine",
        "key",
        "seq",
        "block",
        "nbytes",
        "device",
        "backend",
        "out_event",
        "back_event",
        "value",
        "users",
        "served",
        "storage",
        "__weakref__",
    )

    def __init__(self, engine: Offloader, key: Hashable, seq: int, block: HostBlock, device: torch.device,
                 backend: Backend, out_event: Any) -> None:  # fmt: skip
        self.engine = engine
        self.key = key
        self.seq = seq  # forward order within the step
        self.block = block
        self.nbytes = block.nbytes
        self.device = device
        self.backend = backend
        self.out_event = out_event
        self.back_event: Any = None
        self.value: Tensor | None = None  # the bytes back on the device, until served
        self.users = 0  # live packed tensors of it
        self.served = 0  # of them, served from ``value``
        # O5 [ kept inputs are offloaded in place ]: the storage emptied in place
        self.storage: torch.UntypedStorage | None = None

    def fetch(self) -> Tensor:
        """The bytes on the device, for the consumer stream current now
        (O3 [ copies back and their consumers ], O4 [ copies back are prefetched ])."""
        engine = self.engine
        with engine.lock:
            engine.consume(self)
            if self.value is None:
                engine.copy_back(self)
            value, event = self.value, self.back_event
            self.served += 1
            if self.served >= self.users:
                self.value = None  # the consumer holds it now
                self.served = 0
                engine.in_flight -= self.nbytes
        assert value is not None
        _to_consumer(self, value, event)
        return value

    def __del__(self) -> None:
        # O6 [ host memory comes from the pool ]: wait for the copies that read or write the
        # host block, then give it back.
        backend = getattr(self, "backend", None)
        if backend is None:
            return
        for event in (self.out_event, self.back_event):
            if event is not None:
                backend.synchronize(event)
        engine = self.engine
        with engine.lock:
            if self.value is not None:
                engine.in_flight -= self.nbytes
                self.value = None
            engine.pool_of(backend).free(self.block)


def _to_consumer(hc: HostCopy, value: Tensor, event: Any) -> None:
    """O3 [ copies back and their consumers ]: the stream current now (the consumer's) waits for
    ``hc``'s copy back, ``value``, done at ``event``, and marks its memory as used there."""
    backend = hc.backend
    consumer = backend.current_stream(hc.device)
    backend.wait_event(consumer, event)
    backend.record_stream(value, consumer)


class Offloaded:
    """What a saved tensor becomes when it is offloaded: its host copy and its view
    (O1 [ a storage is offloaded whole ])."""

    __slots__ = ("copy", "dtype", "size", "stride", "offset", "version", "sources", "storage", "__weakref__")

    def __init__(self, copy: HostCopy, t: Tensor) -> None:
        self.copy = copy
        copy.users += 1
        self.dtype, self.size, self.stride, self.offset = t.dtype, t.shape, t.stride(), t.storage_offset()
        self.version = t._version
        base = t._base
        self.sources = (weakref.ref(t),) if base is None else (weakref.ref(t), weakref.ref(base))
        # O7 [ unpack checks versions ]: where autograd would keep ``t`` itself (a saved input),
        # its storage then.
        self.storage = t.untyped_storage()._cdata if base is None and not may_be_new_output(t) else None

    def unpack(self) -> Tensor:
        for ref in self.sources:  # O7 [ unpack checks versions ]
            src = ref()
            if src is not None and src._version != self.version:
                raise inplace_error(f"{src.type()} {list(src.shape)}", self.version, src._version)
        src = self.sources[0]()
        if self.storage is not None and src is not None and src.untyped_storage()._cdata != self.storage:
            # O7 [ unpack checks versions ]: autograd's saved input sees the swap (`.data = ...`)
            with without_python_dispatch():
                return src.detach()
        value = self.copy.fetch()
        with _Quiet():
            return torch.empty(0, dtype=self.dtype, device=value.device).set_(
                value.untyped_storage(), self.offset, self.size, self.stride
            )

    def __del__(self) -> None:
        copy = getattr(self, "copy", None)
        if copy is not None:
            with copy.engine.lock:
                copy.users -= 1


class Offloader:
    """One budget's offload engine: its pools, side streams, this step's copies, and
    the order the last step's backward used them in (O4 [ copies back are prefetched ]).

    ``host_limit``: bytes of pinned memory at most (None: as needed). ``window``: bytes
    fetched ahead of need at most (None: twice the largest copy of the step).
    """

    def __init__(self, host_limit: int | None, window: int | None = None) -> None:
        self.host_limit = host_limit
        self.window = window
        self.lock = threading.RLock()
        self.pools: dict[int, HostPool] = {}
        self.streams: dict[tuple[int, torch.device], tuple[Any, Any]] = {}
        self.copies: dict[tuple[int, int], tuple[StorageWeakRef, weakref.ref[HostCopy]]] = {}
        self.evicted: dict[int, HostCopy] = {}  # O5 [ kept inputs are offloaded in place ]: storage id -> its copy
        self.step: list[weakref.ref[HostCopy]] = []  # this step's copies, in forward order
        self.largest = 0
        self.order: dict[Hashable, int] = {}  # the last step's backward order (O4 [ copies back are prefetched ])
        self.used: list[Hashable] = []  # this step's, so far
        self.plan: list[weakref.ref[HostCopy]] = []
        self.started = False
        self.in_flight = 0  # bytes fetched back and not yet served
        self.expected = 0  # host bytes (footprints) the plans offload per step, at most
        # bytes of copies the pool had no room for, since last asked
        # (O6 [ host memory comes from the pool ])
        self.refused = 0

    # -- plumbing

    def pool_of(self, backend: Backend) -> HostPool:
        pool = self.pools.get(id(backend))
        if pool is None:
            pool = self.pools[id(backend)] = HostPool(backend, self.host_limit)
            if self.expected:
                pool.expect(self.expected)
        return pool

    def expect(self, nbytes: int) -> None:
        """A plan will offload ``nbytes`` of host memory (footprints) per step: size the
        pools' slabs for it (``_budget.hostpool`` H4 [ one slab for a bounded pool ])."""
        self.expected = max(self.expected, nbytes) if self.host_limit is not None else nbytes
        for pool in self.pools.values():
            pool.expect(nbytes)

    def capacity(self, device: torch.device) -> float | None:
        """Host bytes (footprints) the pool for ``device`` can hold at once; None where
        tensors on ``device`` have nowhere to go."""
        backend = backend_of(device)
        return None if backend is None else self.pool_of(backend).capacity

    def take_refused(self) -> int:
        """Bytes of the copies the pool had no room for since the last call
        (O6 [ host memory comes from the pool ])."""
        with self.lock:
            n, self.refused = self.refused, 0
        return n

    def streams_of(self, backend: Backend, device: torch.device) -> tuple[Any, Any]:
        key = (id(backend), device)
        pair = self.streams.get(key)
        if pair is None:
            pair = self.streams[key] = (backend.new_stream(device), backend.new_stream(device))
        return pair

    @property
    def live_bytes(self) -> int:
        """Host bytes holding offloaded data now."""
        return sum(p.live for p in self.pools.values())

    @property
    def reserved_bytes(self) -> int:
        """Pinned bytes the pools hold (in use or cached for the next step)."""
        return sum(p.reserved for p in self.pools.values())

    def release_host_memory(self) -> None:
        """Give back the pinned memory no offloaded tensor uses."""
        with self.lock:
            for pool in self.pools.values():
                pool.trim()

    # -- steps

    def new_step(self) -> None:
        """A training step starts: the last one's backward order is the prefetch order."""
        with self.lock:
            if self.used:
                self.order = {key: i for i, key in enumerate(dict.fromkeys(self.used))}
            self.used = []
            self.step = []
            self.plan = []
            self.largest = 0
            self.started = False
            self.copies = {k: v for k, v in self.copies.items() if v[1]() is not None}

    def start_backward(self) -> None:
        """Backward of this step begins: prefetch the first copies
        (O4 [ copies back are prefetched ])."""
        with self.lock:
            if not self.started:
                self.started = True
                big = len(self.order) + len(self.step)
                live = [(r, r()) for r in self.step]
                ranked = sorted(
                    ((self.order.get(hc.key, big), -hc.seq, i) for i, (_, hc) in enumerate(live) if hc is not None)
                )
                self.plan = [live[i][0] for _, _, i in ranked]
                self._prefetch()

    def consume(self, hc: HostCopy) -> None:
        """``hc`` is asked for now (call under ``lock``): note the order, fetch ahead."""
        self.used.append(hc.key)
        if not self.started:
            self.start_backward()
        self._prefetch(hc)

    def _prefetch(self, skip: HostCopy | None = None) -> None:
        window = self.window if self.window is not None else 2 * self.largest
        while self.plan and self.in_flight < window:
            hc = self.plan.pop(0)()
            if hc is not None and hc is not skip and hc.value is None and hc.users + (hc.storage is not None):
                self.copy_back(hc)

    # -- copies

    def copy_out(self, t: Tensor, storage: torch.UntypedStorage, key: Hashable) -> HostCopy | None:
        backend = backend_for(t)
        nbytes = storage.nbytes()
        if backend is None or not nbytes:
            return None
        device = t.device
        out, _ = self.streams_of(backend, device)
        with _Quiet():
            block = self.pool_of(backend).alloc(nbytes)
            if block is None:
                # no host room: the tensor stays on the device
                # (O6 [ host memory comes from the pool ])
                self.refused += nbytes
                return None
            src = _bytes_of(storage, device)
            # O2 [ copies out run on side streams ]: queried now
            ready = backend.record_event(backend.current_stream(device))
            with backend.use_stream(out):
                backend.wait_event(out, ready)
                backend.copy(block.tensor, src)
                done = backend.record_event(out)
            backend.record_stream(src, out)
        hc = HostCopy(self, key, len(self.step), block, device, backend, done)
        self.step.append(weakref.ref(hc))
        self.largest = max(self.largest, nbytes)
        return hc

    def copy_back(self, hc: HostCopy) -> None:
        """Start ``hc``'s copy back on the copy-back stream (call under ``lock``;
        O3 [ copies back and their consumers ])."""
        backend = hc.backend
        _, back = self.streams_of(backend, hc.device)
        with _Quiet(), backend.use_stream(back):
            backend.wait_event(back, hc.out_event)
            value = backend.device_empty(hc.nbytes, hc.device)
            backend.copy(value, hc.block.tensor)
            hc.back_event = backend.record_event(back)
        hc.value = value
        self.in_flight += hc.nbytes

    def pack(self, t: Tensor, key: Hashable) -> Offloaded | None:
        """``t`` (being saved) offloaded, or None where it cannot be: no backend for its
        device, no storage we can copy, no host room."""
        if (type(t) is not Tensor and type(t) is not torch.nn.Parameter) or t.layout != torch.strided:
            return None
        if backend_for(t) is None:
            return None
        storage = t.untyped_storage()
        sid = storage._cdata
        with self.lock:
            seen = self.copies.get((sid, t._version))
            hc = seen[1]() if seen is not None and not seen[0].expired() else None
            if hc is None:
                hc = self.copy_out(t, storage, key)
                if hc is None:
                    return None
                self.copies[(sid, t._version)] = (StorageWeakRef(storage), weakref.ref(hc))
            return Offloaded(hc, t)


# ---------------------------------------------------------------- inputs kept for replay, in
# place (O5 [ kept inputs are offloaded in place ])


def evict(engine: Offloader, aliases: list[Tensor], key: Hashable) -> bool:
    """O5 [ kept inputs are offloaded in place ]: offload the storage of ``aliases`` (tensors of
    one storage, our only holders of it) in place; False where it cannot be (others hold it, no
    room)."""
    t = aliases[0]
    if type(t) is not Tensor or t.layout != torch.strided or backend_for(t) is None:
        return False
    storage = t.untyped_storage()
    count = storage_use_count(storage)
    if count is None or count != len({id(a) for a in aliases}) + 1 or not storage.nbytes():
        return False  # (+1: ``storage`` itself)
    with engine.lock:
        hc = engine.copy_out(t, storage, key)
        if hc is None:
            return False
        out, _ = engine.streams_of(hc.backend, hc.device)
        hc.backend.free_storage(storage, out)
        hc.storage = storage
        sid = storage._cdata
        engine.evicted[sid] = hc
    remaining = [len(aliases)]
    ref = weakref.ref(engine)

    def gone(_: object) -> None:  # the last alias died: nothing will ask for it
        remaining[0] -= 1
        live = ref()
        if remaining[0] == 0 and live is not None:
            with live.lock:
                if live.evicted.get(sid) is hc:
                    del live.evicted[sid]
                    hc.storage = None

    for a in aliases:
        weakref.finalize(a, gone, None)
    return True


def restore(engine: Offloader, t: Tensor) -> bool:
    """O5 [ kept inputs are offloaded in place ], the freed-storage handler: regrow ``t``'s
    storage if this engine emptied it, with its bytes. True if it did."""
    try:
        sid = storage_id(t)
    except (RuntimeError, NotImplementedError):
        return False
    with engine.lock:
        hc = engine.evicted.pop(sid, None)
        if hc is None or hc.storage is None:
            return False
        engine.consume(hc)
        if hc.value is None:
            engine.copy_back(hc)
        value, event, storage = hc.value, hc.back_event, hc.storage
        hc.value = hc.storage = None
        engine.in_flight -= hc.nbytes
    assert value is not None
    _to_consumer(hc, value, event)
    with _Quiet():
        storage.resize_(hc.nbytes)
        _bytes_of(storage, hc.device).copy_(value)
    return True


#: Every live engine (the freed-storage handler asks them all).
engines: weakref.WeakSet[Offloader] = weakref.WeakSet()


def restore_offloaded(t: Tensor) -> bool:
    """The freed-storage handler of every budget's engine
    (O5 [ kept inputs are offloaded in place ]; registered by the package)."""
    return any(restore(e, t) for e in list(engines))


def evicted_bytes(t: Tensor) -> tuple[int, int]:
    """``(storage id, bytes)`` of ``t``'s storage if an engine offloaded it in place, else
    ``(0, 0)`` (for the saved-tensor report)."""
    try:
        sid = storage_id(t)
    except (RuntimeError, NotImplementedError):
        return 0, 0
    for engine in list(engines):
        hc = engine.evicted.get(sid)
        if hc is not None:
            return sid, hc.nbytes
    return 0, 0
