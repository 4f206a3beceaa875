"""Where offloaded bytes go and how they travel: a device backend for the offload engine
(``_budget.offload``).

* :class:`CudaBackend` -- CUDA streams, events, pinned host memory, through public
  ``torch.cuda`` APIs.
* :class:`HostCopyStandIn` -- the same interface on CPU tensors, for tests: "device"
  tensors are CPU tensors, "host" memory is other CPU buffers, and streams are fake. The
  current stream runs each operation at once; a side stream made by :meth:`new_stream`
  queues its operations and runs them only when something waits for them (an event
  waited on, queried or synchronised), the latest a real copy could finish. A missing
  wait therefore reads what a fresh device buffer holds, all bits set (NaN for floats),
  and a copy whose source died before it ran (no ``record_stream``) raises. Its
  "pinned" allocations are sized as CUDA's caching host allocator reserves them (a
  power of two): :meth:`HostCopyStandIn.pinned_bytes` is what the host really holds.

:func:`backend_for` picks the backend of a tensor: CUDA for CUDA tensors, the stand-in
for CPU tensors while :func:`host_copy_stand_in` is active, else None (nowhere to go).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch

from .._base.torch_compat import without_python_dispatch, without_torch_function

__all__ = [
    "Backend",
    "CudaBackend",
    "HostCopyStandIn",
    "backend_for",
    "backend_of",
    "host_copy_stand_in",
    "offloadable",
]

Tensor = torch.Tensor


class Backend(Protocol):
    """What the offload engine needs of a device."""

    def current_stream(self, device: torch.device) -> Any: ...
    def new_stream(self, device: torch.device) -> Any: ...
    def use_stream(self, stream: Any) -> Any: ...
    def record_event(self, stream: Any) -> Any: ...
    def wait_event(self, stream: Any, event: Any) -> None: ...
    def done(self, event: Any) -> bool: ...
    def synchronize(self, event: Any) -> None: ...
    def record_stream(self, t: Tensor, stream: Any) -> None: ...
    def pinned_size(self, nbytes: int) -> int:
        """The bytes a pinned host allocation of ``nbytes`` really reserves."""

    def host_empty(self, nbytes: int) -> Tensor: ...
    def device_empty(self, nbytes: int, device: torch.device) -> Tensor: ...
    def copy(self, dst: Tensor, src: Tensor) -> None: ...
    def free_storage(self, storage: torch.UntypedStorage, stream: Any) -> None: ...


class CudaBackend:
    """CUDA, through public APIs only."""

    def current_stream(self, device: torch.device) -> Any:
        return torch.cuda.current_stream(device)

    def new_stream(self, device: torch.device) -> Any:
        return torch.cuda.Stream(device)

    def use_stream(self, stream: Any) -> Any:
        return torch.cuda.stream(stream)

    def record_event(self, stream: Any) -> Any:
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def wait_event(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def done(self, event: Any) -> bool:
        return bool(event.query())

    def synchronize(self, event: Any) -> None:
        event.synchronize()

    def record_stream(self, t: Tensor, stream: Any) -> None:
        t.record_stream(stream)

    def pinned_size(self, nbytes: int) -> int:
        # The caching host allocator rounds every pinned allocation up to a power of two
        # (its default: no ``pinned_max_round_threshold``; above one set, sizes are not
        # rounded and this overcounts, never under).
        return _power_of_two(nbytes)

    def host_empty(self, nbytes: int) -> Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def device_empty(self, nbytes: int, device: torch.device) -> Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def copy(self, dst: Tensor, src: Tensor) -> None:
        dst.copy_(src, non_blocking=True)

    def free_storage(self, storage: torch.UntypedStorage, stream: Any) -> None:
        # The caching allocator keeps the block from reuse until the work recorded on
        # ``stream`` (record_stream, done by the caller) has finished.
        storage.resize_(0)


class _FakeStream:
    """A stand-in stream: ``deferred`` ones queue operations until something waits."""

    __slots__ = ("deferred", "queue", "ran", "kept", "log", "__weakref__")

    def __init__(self, deferred: bool) -> None:
        self.deferred = deferred
        self.queue: list[tuple[int, Callable[[], None]]] = []  # (index, operation)
        self.ran = 0  # operations run so far (indices 1..ran)
        self.kept: list[tuple[int, Tensor]] = []  # record_stream: held until index has run
        self.log: list[str] = []

    def enqueue(self, op: Callable[[], None], what: str) -> int:
        self.log.append(what)
        index = self.ran + len(self.queue) + 1
        if not self.deferred:
            op()
            self.ran = index
            return index
        self.queue.append((index, op))
        return index

    def run_to(self, index: int) -> None:
        while self.queue and self.queue[0][0] <= index:
            i, op = self.queue.pop(0)
            op()
            self.ran = i
        self.kept = [(i, t) for i, t in self.kept if i > self.ran]


class _FakeEvent:
    __slots__ = ("stream", "index")

    def __init__(self, stream: _FakeStream, index: int) -> None:
        self.stream, self.index = stream, index


class HostCopyStandIn:
    """The offload backend on CPU tensors, for tests (see the module docstring).

    ``log`` lists what each stream was asked to do, in order (``"copy"``, ``"wait"``,
    ``"event"``); ``copies`` counts the copies run.

    Example::

        >>> import torch
        >>> from gradient_scope._budget.streams import HostCopyStandIn
        >>> b = HostCopyStandIn()
        >>> side = b.new_stream(torch.device("cpu"))
        >>> src, dst = torch.ones(4, dtype=torch.uint8), b.device_empty(4, torch.device("cpu"))
        >>> with b.use_stream(side):
        ...     b.copy(dst, src)
        ...     ev = b.record_event(side)
        >>> b.record_stream(src, side)
        >>> dst.tolist(), b.done(ev)          # queued: not run yet
        ([255, 255, 255, 255], False)
        >>> b.wait_event(b.current_stream(torch.device("cpu")), ev)
        >>> dst.tolist()
        [1, 1, 1, 1]
    """

    def __init__(self) -> None:
        self._tls = threading.local()
        self.compute = _FakeStream(deferred=False)
        self.copies = 0
        self.streams: list[weakref.ref[_FakeStream]] = []
        self.host: list[weakref.ref[Tensor]] = []  # host_empty's allocations

    def _current(self) -> _FakeStream:
        return getattr(self._tls, "stream", None) or self.compute

    def current_stream(self, device: torch.device) -> Any:
        return self._current()

    def new_stream(self, device: torch.device) -> Any:
        s = _FakeStream(deferred=True)
        self.streams.append(weakref.ref(s))
        return s

    @contextlib.contextmanager
    def use_stream(self, stream: Any) -> Iterator[None]:
        before = getattr(self._tls, "stream", None)
        self._tls.stream = stream
        try:
            yield
        finally:
            self._tls.stream = before

    def record_event(self, stream: Any) -> Any:
        return _FakeEvent(stream, stream.enqueue(lambda: None, "event"))

    def wait_event(self, stream: Any, event: Any) -> None:
        target: _FakeStream = event.stream
        if target is stream:
            return
        stream.enqueue(lambda: target.run_to(event.index), "wait")

    def done(self, event: Any) -> bool:
        return bool(event.stream.ran >= event.index)

    def synchronize(self, event: Any) -> None:
        event.stream.run_to(event.index)

    def record_stream(self, t: Tensor, stream: Any) -> None:
        if stream.deferred:
            stream.kept.append((stream.ran + len(stream.queue), t))

    def pinned_size(self, nbytes: int) -> int:
        return _power_of_two(nbytes)  # as CUDA's pinned allocations

    def host_empty(self, nbytes: int) -> Tensor:
        t = torch.empty(nbytes, dtype=torch.uint8)
        self.host.append(weakref.ref(t))
        return t

    def pinned_bytes(self) -> int:
        """The bytes its "pinned" allocations alive now reserve, rounded as CUDA's are:
        what the host really holds for the pool."""
        self.host = [r for r in self.host if r() is not None]
        return sum(self.pinned_size(t.numel()) for t in (r() for r in self.host) if t is not None)

    def device_empty(self, nbytes: int, device: torch.device) -> Tensor:
        return torch.full((nbytes,), 255, dtype=torch.uint8)  # what a fresh buffer may hold

    def copy(self, dst: Tensor, src: Tensor) -> None:
        src_ref = weakref.ref(src)

        def run() -> None:
            s = src_ref()
            if s is None:
                raise RuntimeError(
                    "host-copy stand-in: the source of a copy was freed before the copy ran "
                    "(the engine did not keep it for the side stream: record_stream)"
                )
            with torch.no_grad(), without_torch_function(), without_python_dispatch():
                dst.copy_(s)  # (whenever it runs, no mode around sees it)
            self.copies += 1

        self._current().enqueue(run, "copy")

    def free_storage(self, storage: torch.UntypedStorage, stream: Any) -> None:
        # As CUDA's allocator: the memory goes back only after the stream's work on it.
        stream.run_to(stream.ran + len(stream.queue))
        storage.resize_(0)

    def drain(self) -> None:
        """Run every queued operation (as a device synchronisation would)."""
        for ref in self.streams:
            s = ref()
            if s is not None:
                s.run_to(s.ran + len(s.queue))

    def pending(self) -> int:
        """Operations queued and not run, over all side streams."""
        return sum(len(s.queue) for s in (r() for r in self.streams) if s is not None)


def _power_of_two(nbytes: int) -> int:
    return 1 << max(nbytes - 1, 0).bit_length() if nbytes > 0 else 0


_stand_in: list[HostCopyStandIn] = []
_cuda = CudaBackend()


def backend_for(t: Tensor) -> Backend | None:
    """The backend that can offload ``t``, or None (a CPU tensor has nowhere to go)."""
    if t.is_cuda:
        return _cuda
    if _stand_in and t.device.type == "cpu":
        return _stand_in[-1]
    return None


def offloadable(device: torch.device) -> bool:
    """Whether tensors on ``device`` have somewhere to go."""
    return backend_of(device) is not None


def backend_of(device: torch.device) -> Backend | None:
    """The backend that can offload tensors on ``device``, or None."""
    if device.type == "cuda":
        return _cuda
    if _stand_in and device.type == "cpu":
        return _stand_in[-1]
    return None


@contextlib.contextmanager
def host_copy_stand_in(backend: HostCopyStandIn | None = None) -> Iterator[HostCopyStandIn]:
    """Offload CPU tensors with the stand-in inside the ``with`` block (tests)."""
    b = backend if backend is not None else HostCopyStandIn()
    _stand_in.append(b)
    try:
        yield b
    finally:
        _stand_in.remove(b)
