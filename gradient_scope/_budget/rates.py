"""How fast a device runs what a budget trades: matmul FLOPs, bytes moved, one op's
launch, copies to and from host memory, and what autograd and the library itself cost
per op (an op's forward and backward beyond its kernels, recording it, packing a saved
tensor, replaying an op). Measured once per device and process, then cached; the
budget's cost model turns FLOPs, bytes and op counts into seconds with them.

The device measurement runs a few small kernels (tenths of a second on a CPU) under
``torch.no_grad`` with torch function and dispatch modes out of the way, draws no
random numbers and leaves no tensor behind: the program it runs inside sees nothing.
The per-op costs come from a calibration the public layer registers
(:func:`set_calibration`: chains of tiny ops run plain, in a scope and under budgets,
``_api.calibrate``); it runs in a thread of its own, so the caller's open blocks,
modes and hooks (thread-local) neither see it nor change it. Without a registered
calibration those costs are 0.

A process group's collectives (:class:`CommRates`) are measured once per group and
process too, but only where every rank of the group is at the same point of the
program (``_budget.agree`` A2 [ agreed where every rank is ]): a measurement is a
collective itself.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import torch

from .._base.torch_compat import profiler_range, without_python_dispatch, without_torch_function

__all__ = [
    "Rates",
    "rates_for",
    "pinned_rates",
    "seconds",
    "set_calibration",
    "LIBRARY_COSTS",
    "timed",
    "CommRates",
    "comm_rates",
    "comm_seconds",
    "measure_comm",
    "pinned_comm_rates",
]


@dataclass(frozen=True)
class Rates:
    """Throughputs of one device.

    Attributes:
        flops: FLOP/s of a matmul-like op.
        memory: bytes/s an elementwise op reads plus writes.
        overhead: seconds per op beyond its kernel (launch, dispatch).
        to_host: bytes/s of a copy from the device to pinned host memory.
        to_device: bytes/s of a copy from pinned host memory to the device.
        train: seconds per op that autograd adds to a training step beyond the op's
            forward and backward kernels (its node, the backward call, gradient
            accumulation): plain PyTorch's own per-op cost.
        record: seconds per op a scope adds to the forward: recording the op.
        save: seconds per tensor a block saves: the pack hook, the budget's decision,
            and the handle or the stored tensor.
        replay: seconds per replayed op beyond its kernel: replay's bookkeeping.

    The last four default to 0 (a plan then counts the kernels only).

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
    train: float = 0.0
    record: float = 0.0
    save: float = 0.0
    replay: float = 0.0


def seconds(flops: float, nbytes: float, rates: Rates) -> float:
    """One op's predicted time: the slower of its FLOPs and its bytes moved, plus the
    per-op overhead (a roofline)."""
    return max(flops / rates.flops, nbytes / rates.memory) + rates.overhead


#: The per-op cost fields of :class:`Rates` the calibration measures, in its order.
LIBRARY_COSTS = ("train", "record", "save", "replay")

_CACHE: dict[tuple[str, int | None], Rates] = {}
_calibration: list[Callable[[torch.device], dict[str, float]]] = []


def set_calibration(fn: Callable[[torch.device], dict[str, float]]) -> Callable[[], None]:
    """Register ``fn(device) -> {field: seconds}``, the per-op costs of
    :data:`LIBRARY_COSTS` measured on ``device`` (the public layer's, which runs scopes).
    Returns a function that removes it."""
    _calibration[:] = [fn]

    def remove() -> None:
        if _calibration == [fn]:
            _calibration.clear()

    return remove


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
        # Cached before the calibration, whose budgets plan at these rates (no recursion).
        rates = _CACHE[key] = _measure(device)
        if _calibration:
            try:
                costs = _in_own_thread(lambda: _calibration[0](device))
            except BaseException:
                _CACHE.pop(key, None)  # the next call measures again
                raise
            rates = _CACHE[key] = replace(rates, **{k: max(float(costs[k]), 0.0) for k in LIBRARY_COSTS})
    return rates


def _in_own_thread(fn: Callable[[], dict[str, float]]) -> dict[str, float]:
    """``fn()`` run in a new thread, its result or its exception: the library's state,
    grad mode, dispatch modes and saved-tensor hooks are per thread, so a calibration
    started inside a block (a plan is made when a block closes) runs outside it."""
    box: list[object] = []

    def run() -> None:
        try:
            box.append(fn())
        except BaseException as e:  # noqa: BLE001  (re-raised in the caller's thread)
            box.append(e)

    worker = threading.Thread(target=run, name="gradient_scope: calibrate", daemon=True)
    worker.start()
    worker.join()
    out = box[0]
    if isinstance(out, BaseException):
        raise out
    return out  # type: ignore[return-value]


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


def timed(fn: Callable[[], object], sync: Callable[[], None], reps: int, cpu: bool = False) -> float:
    """Seconds per call of ``fn``: the fastest of three rounds of ``reps`` calls. ``cpu``
    (a CPU device): a round takes the lesser of its wall time and the process's CPU time,
    so a busy machine that preempts the process does not count (and threads that run
    in parallel count once)."""
    fn()
    sync()
    best = float("inf")
    for _ in range(3):
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(reps):
            fn()
        sync()
        wall, used = time.perf_counter() - t0, time.process_time() - c0
        best = min(best, (min(wall, used) if cpu else wall) / reps)
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
        flops = 2 * n**3 / timed(lambda: torch.mm(a, a), sync, reps, not cuda)
        src = torch.ones(size // 4, device=device)
        dst = torch.empty_like(src)
        memory = 2 * size / timed(lambda: dst.copy_(src), sync, reps, not cuda)
        tiny = torch.ones(8, device=device)
        overhead = timed(lambda: tiny.add(1), sync, 200, not cuda)
        if cuda:
            host = torch.empty(size // 4, pin_memory=True)
            to_host = size / timed(lambda: host.copy_(src, non_blocking=True), sync, reps, not cuda)
            to_device = size / timed(lambda: src.copy_(host, non_blocking=True), sync, reps, not cuda)
        else:  # the host-copy stand-in copies within host memory
            to_host = to_device = memory / 2
    return Rates(flops=flops, memory=memory, overhead=overhead, to_host=to_host, to_device=to_device)


@dataclass(frozen=True)
class CommRates:
    """How fast one process group's collectives run, as measured on this rank.

    Attributes:
        latency: seconds of a collective of next to no bytes.
        bandwidth: bytes/s of a collective, counted in the local bytes of its larger
            side (an all-gather's output on this rank, a reduce-scatter's input).

    Example::

        >>> comm_seconds(2**20, CommRates(latency=1e-4, bandwidth=2**30))
        0.0010765625
    """

    latency: float
    bandwidth: float


def comm_seconds(nbytes: float, rates: CommRates) -> float:
    """A collective's predicted time for ``nbytes`` local bytes."""
    return rates.latency + nbytes / rates.bandwidth


_COMM: dict[str, CommRates] = {}


def comm_rates(group_name: str) -> CommRates | None:
    """The rates of the process group named ``group_name`` (the name functional
    collectives carry), None until :func:`measure_comm` measured it."""
    return _COMM.get(group_name)


def measure_comm(group_names: list[str]) -> None:
    """Measure the groups of ``group_names`` not measured yet, once per process: an
    all-gather of a few bytes (latency) and of 1 MiB per rank (16 MiB on CUDA). A
    collective: every rank of each group calls it with the same names, in the same order
    (``_budget.agree`` A2 [ agreed where every rank is ])."""
    for name in group_names:
        if name not in _COMM:
            _COMM[name] = _measure_group(name)


def _measure_group(name: str) -> CommRates:
    from torch.distributed import distributed_c10d as c10d

    dist = torch.distributed
    group = c10d._resolve_process_group(name)  # type: ignore[attr-defined, arg-type, unused-ignore]
    size = dist.get_world_size(group)
    cuda = "nccl" in str(dist.get_backend(group)) and torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    n = (16 if cuda else 1) * 2**20 // 4
    with torch.no_grad(), without_torch_function(), without_python_dispatch(), profiler_range("gradient_scope.rates"):
        small, big = torch.zeros(8, device=device), torch.zeros(n, device=device)
        small_out, big_out = torch.empty(8 * size, device=device), torch.empty(n * size, device=device)
        # every rank runs the same number of rounds (``timed``'s are fixed): none waits alone
        latency = timed(lambda: dist.all_gather_into_tensor(small_out, small, group=group), sync, 5)
        each = timed(lambda: dist.all_gather_into_tensor(big_out, big, group=group), sync, 3)
    return CommRates(latency=latency, bandwidth=big_out.numel() * 4 / max(each - latency, 1e-9))


@contextlib.contextmanager
def pinned_comm_rates(group_name: str, rates: CommRates) -> Iterator[CommRates]:
    """Use ``rates`` for the group ``group_name`` inside the ``with`` block (tests, and
    plans made for another machine)."""
    before = _COMM.get(group_name)
    _COMM[group_name] = rates
    try:
        yield rates
    finally:
        if before is None:
            _COMM.pop(group_name, None)
        else:
            _COMM[group_name] = before
