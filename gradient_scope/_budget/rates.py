"""How fast a device runs what a budget trades: matmul FLOPs, bytes moved, one op's
launch, copies to and from host memory. Measured once per device and process, then
cached; the budget's cost model turns FLOPs and bytes into seconds with them.

The measurement runs a few small kernels (tenths of a second on a CPU) under
``torch.no_grad`` with torch function and dispatch modes out of the way, draws no
random numbers and leaves no tensor behind: the program it runs inside sees nothing.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from .._base.torch_compat import profiler_range, without_python_dispatch, without_torch_function

__all__ = ["Rates", "rates_for", "pinned_rates", "seconds"]


@dataclass(frozen=True)
class Rates:
    """Throughputs of one device.

    Attributes:
        flops: FLOP/s of a matmul-like op.
        memory: bytes/s an elementwise op reads plus writes.
        overhead: seconds per op beyond its kernel (launch, dispatch).
        to_host: bytes/s of a copy from the device to pinned host memory.
        to_device: bytes/s of a copy from pinned host memory to the device.

    Example::

        >>> r = Rates(flops=1e12, memory=1e11, overhead=1e-5, to_host=2e10, to_device=2e10)
        >>> seconds(2e9, 0, r), seconds(0, 1e9, r)   # 2 GFLOP, 1 GB moved
        (0.00201, 0.01001)
    """

    flops: float
    memory: float
    overhead: float
    to_host: float
    to_device: float


def seconds(flops: float, nbytes: float, rates: Rates) -> float:
    """One op's predicted time: the slower of its FLOPs and its bytes moved, plus the
    per-op overhead (a roofline)."""
    return max(flops / rates.flops, nbytes / rates.memory) + rates.overhead


_CACHE: dict[tuple[str, int | None], Rates] = {}


def _key(device: torch.device) -> tuple[str, int | None]:
    index = device.index
    if device.type == "cuda" and index is None:
        index = torch.cuda.current_device()
    return device.type, index


def rates_for(device: torch.device | str) -> Rates:
    """The rates of ``device``: pinned ones (:func:`pinned_rates`), else measured the
    first time they are asked for in this process."""
    device = torch.device(device)
    key = _key(device)
    rates = _CACHE.get(key)
    if rates is None:
        rates = _CACHE[key] = _measure(device)
    return rates


@contextlib.contextmanager
def pinned_rates(device: torch.device | str, rates: Rates) -> Iterator[Rates]:
    """Use ``rates`` for ``device`` inside the ``with`` block (tests, and plans made for
    another machine); the cached measurement, if any, comes back after it."""
    key = _key(torch.device(device))
    before = _CACHE.get(key)
    _CACHE[key] = rates
    try:
        yield rates
    finally:
        if before is None:
            _CACHE.pop(key, None)
        else:
            _CACHE[key] = before


def _timed(fn: Callable[[], object], sync: Callable[[], None], reps: int) -> float:
    """Seconds per call of ``fn``: the fastest of three rounds of ``reps`` calls."""
    fn()
    sync()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        sync()
        best = min(best, (time.perf_counter() - t0) / reps)
    return max(best, 1e-9)


def _measure(device: torch.device) -> Rates:
    cuda = device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    # Small enough to fit beside a model that fills the device (it runs at the first plan).
    n, size, reps = (2048, 64 * 2**20, 10) if cuda else (256, 8 * 2**20, 5)
    dtype = torch.bfloat16 if cuda else torch.float32
    with torch.no_grad(), without_torch_function(), without_python_dispatch(), profiler_range("gradient_scope.rates"):
        a = torch.ones(n, n, dtype=dtype, device=device)
        flops = 2 * n**3 / _timed(lambda: torch.mm(a, a), sync, reps)
        src = torch.ones(size // 4, device=device)
        dst = torch.empty_like(src)
        memory = 2 * size / _timed(lambda: dst.copy_(src), sync, reps)
        tiny = torch.ones(8, device=device)
        overhead = _timed(lambda: tiny.add(1), sync, 200)
        if cuda:
            host = torch.empty(size // 4, pin_memory=True)
            to_host = size / _timed(lambda: host.copy_(src, non_blocking=True), sync, reps)
            to_device = size / _timed(lambda: src.copy_(host, non_blocking=True), sync, reps)
        else:  # the host-copy stand-in copies within host memory
            to_host = to_device = memory / 2
    return Rates(flops=flops, memory=memory, overhead=overhead, to_host=to_host, to_device=to_device)
