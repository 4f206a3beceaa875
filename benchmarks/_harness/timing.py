"""Timing: interleaved rounds, per-round ratios, one timed step, the gc freeze.

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
from typing import Any

import torch

__all__ = [
    "quartiles",
    "frozen_gc",
    "interleaved_rounds",
    "ratio_summary",
    "sync",
    "time_step",
    "interception_gone",
    "warn_if_interception_left",
]


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


def interleaved_rounds(steps: dict[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """Run every step once per round, the order rotated by one each round.

    Each callable runs one step and returns its own duration in seconds (so that it can
    leave set-up and synchronisation out). Returns the durations per name, in round order.
    """
    names = list(steps)
    times: dict[str, list[float]] = {k: [] for k in names}
    for rd in range(rounds):
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
