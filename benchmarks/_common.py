"""Pieces shared by the benchmark harnesses (``run.py``, ``models.py``, ``overhead.py``).

Machine description, interleaved timing with per-round ratios, the check that no
saved-tensor hook or dispatch mode is left behind, and number formatting.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import gc
import importlib.metadata
import os
import platform
import statistics
import subprocess
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

import gradient_scope

__all__ = [
    "MiB",
    "KiB",
    "quartiles",
    "fmt_mib",
    "fmt_x",
    "interception_gone",
    "load_average",
    "machine_info",
    "frozen_gc",
    "interleaved_rounds",
    "ratio_summary",
]

MiB = 2**20
KiB = 2**10


def quartiles(v: list[float]) -> tuple[float, float]:
    """First and third quartile of ``v`` (both ``v[0]`` for a single value)."""
    if len(v) < 2:
        return (v[0], v[0])
    q = statistics.quantiles(v, n=4, method="inclusive")
    return (q[0], q[2])


def fmt_mib(b: float | None) -> str:
    """Bytes as MiB with two decimals; empty for None."""
    return "" if b is None else f"{b / MiB:.2f}"


def fmt_x(v: float | None) -> str:
    """A ratio as ``1.234x``; empty for None."""
    return "" if v is None else f"{v:.3f}x"


def interception_gone() -> bool:
    """True when no saved-tensor hook pair and no dispatch mode is active (as before a step)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    return torch._C._autograd._top_saved_tensors_default_hooks(False) is None and _get_current_dispatch_mode() is None


def load_average() -> list[float] | None:
    """The 1/5/15-minute load averages, or None where the OS does not report them."""
    try:
        return list(os.getloadavg())
    except OSError:
        return None


def _package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_info(device: str, packages: Iterable[str] = ()) -> dict[str, Any]:
    """What the numbers were measured on: CPU model, cores, threads, versions, git commit,
    date, load average at start (and GPU where ``device`` is CUDA). ``packages``: further
    distributions whose versions to record (e.g. ``transformers``)."""
    cpu = None
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    info: dict[str, Any] = {
        "cpu_model": cpu or platform.processor() or None,
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "gradient_scope": getattr(gradient_scope, "__version__", None),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    for name in packages:
        info[name] = _package_version(name)
    la = load_average()
    if la is not None:
        info["load_average_at_start"] = la
    try:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        head = subprocess.run(
            ["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", root, "status", "--porcelain", "--", "gradient_scope"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        info["git_commit"] = head + (" (gradient_scope/ modified)" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
    return info


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
    Interleaving spreads slow phases of a shared machine over all strategies alike.
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
    quartiles) of the per-round ratios ``time / base time`` (robust to the machine getting
    slower or faster between rounds)."""
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
