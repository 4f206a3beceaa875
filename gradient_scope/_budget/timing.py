"""A budget's measuring step, timed: what each block's forward, backward and replay took
(for the predicted step of ``_budget.step``, N5 [ predicted seconds and peak ]).

A block measured by its budget (its step is unplanned, ``_budget.block``) carries a
:class:`Stopwatch`: its forward runs from the block's entry to its close, less the time of
the measuring's own code that ran in it (what a planned step does not run: where each save
ran, the record's measurement, the plan), whichever block's value that code measured (a
block's output saved by the next block's first op is measured there); its backward runs
from the first unpack of one of its saved tensors to the end of the last, less the time
inside those unpacks; and that time inside is its replay, since in a measuring step every
saved tensor of the block is a handle that backward replays. Each interval is read on two
clocks, wall time and the process's CPU time, and counted as the lesser of them: on a busy
machine that preempts the process wall time counts other programs, and with other threads
of the process busy CPU time counts them. Where CUDA is in use (initialized), each mark
synchronizes the current device first (a one-off cost of the measuring step), so that the
marks bracket the kernels, and only wall time counts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

__all__ = ["Stopwatch", "Timing", "syncs"]


def syncs() -> bool:
    """Whether a :class:`Stopwatch` synchronizes at its marks (CUDA in use)."""
    return torch.cuda.is_available() and torch.cuda.is_initialized()


@dataclass(frozen=True)
class Timing:
    """One measured block's seconds: ``forward`` and ``backward`` (without replay), and
    ``replay``, recomputing every value it saved."""

    forward: float
    backward: float
    replay: float


class Stopwatch:
    """The marks of one measuring block (the module docstring). Not thread-safe by
    itself: the forward marks come from the thread that runs the block, the unpack marks
    from the one backward runs in, and those do not overlap."""

    __slots__ = ("cuda", "opened", "closed", "own", "first", "last", "inside", "entered")

    def __init__(self) -> None:
        self.cuda = syncs()
        self.opened = self.now()
        self.closed: tuple[float, float] | None = None
        self.own = (0.0, 0.0)  # the measuring's own code in forward
        self.first: tuple[float, float] | None = None  # the first unpack's start
        self.last = (0.0, 0.0)  # the last unpack's end
        self.inside = (0.0, 0.0)  # inside unpacks
        self.entered = (0.0, 0.0)

    def now(self) -> tuple[float, float]:
        """(wall, process CPU) seconds now; with CUDA after the device's queued work."""
        if self.cuda:
            torch.cuda.synchronize()
            return time.perf_counter(), 0.0
        return time.perf_counter(), time.process_time()

    def add_own(self, since: tuple[float, float], until: tuple[float, float]) -> None:
        """The measuring's own code ran from ``since`` to ``until`` (marks of :meth:`now`),
        inside this block's forward."""
        self.own = (self.own[0] + until[0] - since[0], self.own[1] + until[1] - since[1])

    def close(self) -> None:
        self.closed = self.now()

    def unpacking(self) -> None:
        """Backward starts to unpack one of the block's saved tensors."""
        self.entered = self.now()
        if self.first is None:
            self.first = self.entered

    def unpacked(self) -> None:
        """That unpack ended (also when it raised)."""
        w, c = self.last = self.now()
        self.inside = (self.inside[0] + w - self.entered[0], self.inside[1] + c - self.entered[1])

    def timing(self) -> Timing | None:
        """The block's seconds; None if it closed unmeasured. A block backward never
        unpacked (it saved nothing, or no backward ran) has no backward and no replay."""
        if self.closed is None:
            return None
        if self.first is None:
            self.first = self.last = self.closed
        cuda = self.cuda

        def lesser(wall: float, used: float) -> float:
            return max(wall if cuda else min(wall, used), 0.0)

        (w0, c0), (w1, c1), (w2, c2), (w3, c3) = self.opened, self.closed, self.first, self.last
        forward = lesser(w1 - w0 - self.own[0], c1 - c0 - self.own[1])
        backward = lesser(w3 - w2 - self.inside[0], c3 - c2 - self.inside[1])
        return Timing(forward, backward, lesser(*self.inside))
