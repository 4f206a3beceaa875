"""Timing: interleaved rounds, per-round ratios, forward and backward timed apart, the gc freeze.

Every benchmark times its configurations the same way: after warm-up, each round runs
every configuration once, in an order rotated by one each round (slow phases of a shared
machine then hit all configurations alike), with ``gc.collect()`` before each step (cheap
under :func:`frozen_gc`). Ratios are medians of per-round ratios, robust to the machine
getting slower or faster between rounds.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import torch

__all__ = [
    "quartiles",
    "frozen_gc",
    "interleaved_rounds",
    "ratio_summary",
    "sync",
    "time_step",
    "time_fwd_bwd",
    "PHASES",
    "interception_gone",
    "warn_if_interception_left",
]

T = TypeVar("T")

# What time_fwd_bwd returns: the forward, the backward, the two, and the host's time in
# the forward call (on CUDA the host returns before the GPU is done; on CPU it is "fwd").
PHASES = ("step", "fwd", "bwd", "host_fwd")


def quartiles(v: list[float]) -> tuple[float, float]:
    """First and third quartile of ``v`` (both ``v[0]`` for a single value)."""
    if len(v) < 2:
        return (v[0], v[0])
    q = statistics.quantiles(v, n=4, method="inclusive")
    return (q[0], q[2])


_freeze_depth = 0


@contextlib.contextmanager
def frozen_gc() -> Iterator[None]:
    """Move everything alive now out of the collector's sight while the block runs.

    The ``gc.collect()`` before each timed step then takes microseconds instead of
    ~0.1-0.2 s (torch's and transformers' modules alone are hundreds of thousands of
    objects), so collecting before each step does not distort the timings. Nested uses
    are free: only the outermost one collects, freezes and unfreezes (``gc.unfreeze``
    would thaw everything, the outer block's objects included).
    """
    global _freeze_depth
    if _freeze_depth == 0:
        gc.collect()
        gc.freeze()
    _freeze_depth += 1
    try:
        yield
    finally:
        _freeze_depth -= 1
        if _freeze_depth == 0:
            gc.unfreeze()


def interleaved_rounds(
    steps: dict[str, Callable[[], T]], rounds: int, deadline: float | None = None
) -> dict[str, list[T]]:
    """Run every step once per round, the order rotated by one each round.

    Each callable runs one step and returns its own measurement (so that it can leave
    set-up and synchronisation out). Returns the measurements per name, in round order.
    With ``deadline`` (a ``time.perf_counter()`` value), no round starts after it (at
    least one round always runs).
    """
    names = list(steps)
    times: dict[str, list[T]] = {k: [] for k in names}
    for rd in range(rounds if names else 0):
        if rd and deadline is not None and time.perf_counter() > deadline:
            break
        k = rd % len(names)
        for name in names[k:] + names[:k]:
            times[name].append(steps[name]())
    return times


def ratio_summary(
    times: dict[str, list[float]], bases: Iterable[str] = ("plain", "checkpoint")
) -> dict[str, dict[str, Any]]:
    """Per name: all times, median, quartiles, and for each base present the median (and
    quartiles) of the per-round ratios ``time / base time``."""
    out: dict[str, dict[str, Any]] = {}
    bases = [b for b in bases if b in times]
    for name, t in times.items():
        r: dict[str, Any] = {
            "times_s": t,
            "time_median_s": statistics.median(t),
            "time_quartiles_s": quartiles(t),
        }
        for base in bases:
            ratios = [a / b for a, b in zip(t, times[base])]
            r[f"ratio_vs_{base}"] = statistics.median(ratios)
            r[f"ratio_vs_{base}_quartiles"] = quartiles(ratios)
        out[name] = r
    return out


def sync(device: str) -> None:
    """Wait for the device's queued work (CUDA); nothing on CPU."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_step(step: Callable[[], Any], device: str = "cpu") -> float:
    """Seconds one ``step()`` takes, after ``gc.collect()`` and with the device synchronised
    on both sides; what ``step`` returns (e.g. the loss) is dropped after the clock stops."""
    gc.collect()
    sync(device)
    t0 = time.perf_counter()
    out = step()
    sync(device)
    dt = time.perf_counter() - t0
    del out
    return dt


def time_fwd_bwd(forward: Callable[[], Any], backward: Callable[[Any], Any], device: str = "cpu") -> dict[str, float]:
    """One ``backward(forward())``, after ``gc.collect()``: seconds of each phase (:data:`PHASES`).

    CUDA: the phases come from CUDA events recorded around them on the current stream, so
    the host is not stopped between forward and backward (as in training); a forward the
    host cannot feed fast enough shows as a forward longer than its kernels. ``host_fwd``
    is the host's time in the forward call. CPU: wall clock.
    """
    gc.collect()
    sync(device)
    if device.startswith("cuda"):
        e0, e1, e2 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        e0.record()
        h0 = time.perf_counter()
        out = forward()
        h1 = time.perf_counter()
        e1.record()
        backward(out)
        e2.record()
        e2.synchronize()
        fwd, bwd = e0.elapsed_time(e1) / 1e3, e1.elapsed_time(e2) / 1e3
        del out
        return {"step": fwd + bwd, "fwd": fwd, "bwd": bwd, "host_fwd": h1 - h0}
    t0 = time.perf_counter()
    out = forward()
    t1 = time.perf_counter()
    backward(out)
    t2 = time.perf_counter()
    del out
    return {"step": t2 - t0, "fwd": t1 - t0, "bwd": t2 - t1, "host_fwd": t1 - t0}


def interception_gone() -> bool:
    """True when no saved-tensor hook pair and no dispatch mode is active (as before a step)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    return torch._C._autograd._top_saved_tensors_default_hooks(False) is None and _get_current_dispatch_mode() is None


def warn_if_interception_left(name: str, warnings: list[str]) -> None:
    """Append a warning (once) to ``warnings`` if a saved-tensor hook or dispatch mode
    outlived ``name``'s step, saying whether a ``gc.collect()`` removes it."""
    if not interception_gone():
        gc.collect()
        msg = f"{name}: saved-tensor hooks / dispatch mode still active after the step"
        if not interception_gone():
            msg += " (even after gc.collect())"
        if msg not in warnings:
            warnings.append(msg)
