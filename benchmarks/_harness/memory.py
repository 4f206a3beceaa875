"""Memory probes: bytes held after forward and peak bytes of forward + backward.

``measure(forward, backward, device)`` runs ``out = forward(); backward(out)`` and returns
``(out, held, peak)`` in bytes, both relative to the moment ``forward`` starts:

* ``held``: bytes allocated during ``forward`` and still allocated when it returns, i.e.
  what autograd (and anything else) keeps for backward; tensors that existed before
  (parameters, inputs) are not counted;
* ``peak``: the highest level reached during forward + backward (gradients included when
  they are allocated by this backward).

CUDA: ``torch.cuda.memory_allocated`` / ``max_memory_allocated`` (after a peak reset).

CPU: PyTorch's profiler with ``profile_memory=True`` logs every CPU tensor allocation
(+nbytes) and free (-nbytes) while it runs, with a timestamp. Summing the deltas in time
order gives the exact number of bytes allocated since the profiler started, at every
moment; ``held`` is the level at the end of the (``record_function``-marked) forward,
``peak`` the maximum. Forward and backward are profiled in ONE session: the profiler
cannot report the free of a block allocated before it started. (This is the method of
``examples/quickstart.py``, which keeps its own copy so that it runs alone; saved-tensor
hooks are no option as a probe, gradient_scope itself is built on them.) The profiler
slows every op down, so steps are timed in separate, unprofiled runs.

``tests/bench/test_bench_memory.py`` validates the CPU probe on known allocation patterns.

**Why the profiler's private ``prof.profiler.kineto_results``.** The peak needs every
allocation and free with its own timestamp, and no public route keeps them:

* ``prof.events()`` (public ``FunctionEvent`` objects) folds every ``[memory]`` record
  that falls inside an op's time range into that op's ``cpu_memory_usage`` (a net sum)
  and emits a ``[memory]`` event of its own only for records outside every op: one of
  the 1,255 events of a step of the ``--quick`` benchmark GPT. ``held`` survives (the forward
  range's ``cpu_memory_usage`` is exactly the probe's held: 18,633,752 bytes both ways on
  the ``--quick`` GPT, plain), the peak does not: an op that allocates a temporary and
  frees it nets zero, and an op that frees its input and allocates its output nets its
  difference. Placing each op's net sum at its start (allocations) or end (frees) gives
  31,806,472 bytes where the true peak is 22,828,056.
* ``prof.export_memory_timeline`` is deprecated (its docstring points to the CUDA-only
  ``torch.cuda.memory._record_memory_history``), needs ``record_shapes`` and
  ``with_stack``, and is built on the same private ``kineto_results``
  (``torch.profiler._memory_profiler``).

So the probe reads the raw records (``name``, ``start_ns``, ``nbytes``, ``device_type``)
in :func:`profile_cpu_memory`, the one place that touches them;
``tests/bench/test_bench_memory.py::test_public_profiler_events_lose_the_peak`` fails the day
``prof.events()`` keeps what the peak needs.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

__all__ = ["measure", "profile_cpu_memory", "cuda_memory", "quiet_stderr"]

_FORWARD_LABEL = "benchmarks.memory.forward"


@contextlib.contextmanager
def quiet_stderr():
    """Silence file descriptor 2 (kineto prints a 'USDT ... profiler_start/stop' line
    at each start and stop of the profiler, from C++, past Python's sys.stderr)."""
    try:
        sys.stderr.flush()
        fd = os.dup(2)
    except (OSError, ValueError):  # no real stderr (e.g. captured): nothing to silence
        yield
        return
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, 2)
        finally:
            os.close(devnull)
        yield
    finally:
        os.dup2(fd, 2)
        os.close(fd)


def profile_cpu_memory(forward: Callable[[], Any], backward: Callable[[Any], Any]) -> tuple[Any, int, int]:
    """CPU: run ``out = forward(); backward(out)`` under the profiler; ``(out, held, peak)``."""
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with quiet_stderr():
        prof.__enter__()
    try:
        with record_function(_FORWARD_LABEL):
            out = forward()
        backward(out)
    finally:
        with quiet_stderr():
            prof.__exit__(None, None, None)
    events = prof.profiler.kineto_results.events()
    fwd_end = max(
        (e.start_ns() + e.duration_ns() for e in events if e.name() == _FORWARD_LABEL),
        default=None,
    )
    if fwd_end is None:
        raise RuntimeError("memory probe: the profiler recorded no forward range")
    deltas = sorted(
        (e.start_ns(), e.nbytes())
        for e in events
        if e.name() == "[memory]" and e.device_type().name == "CPU"
    )
    level = held = peak = 0
    for t, nbytes in deltas:
        level += nbytes
        peak = max(peak, level)
        if t <= fwd_end:
            held = level
    return out, held, peak


def cuda_memory(
    forward: Callable[[], Any], backward: Callable[[Any], Any], device: torch.device | str
) -> tuple[Any, int, int]:
    """CUDA: ``(out, held, peak)`` from the caching allocator's counters."""
    device = torch.device(device)
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    out = forward()
    torch.cuda.synchronize(device)
    held = torch.cuda.memory_allocated(device) - base
    backward(out)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    return out, held, peak


def measure(
    forward: Callable[[], Any], backward: Callable[[Any], Any], device: torch.device | str = "cpu"
) -> tuple[Any, int, int]:
    """``(out, held, peak)`` in bytes on ``device`` (CPU: profiler; CUDA: allocator stats)."""
    if torch.device(device).type == "cuda":
        return cuda_memory(forward, backward, device)
    return profile_cpu_memory(forward, backward)
