"""What autograd and the library cost per op on a device, for a budget's predicted times
(``_budget.rates``: registered with :func:`~gradient_scope._budget.rates.set_calibration`).

Chains of ``N`` tiny ops (8 elements: their kernels cost a launch each) run forward and
backward, in interleaved rounds, each timed by its fastest run (on a CPU in the
calibrating thread's CPU time: a busy machine that preempts it does not count), and the
differences give the per-op costs:

- plain ``sin`` chain: each op is three kernels (``sin``; ``cos`` and ``mul`` in backward)
  and what autograd adds (``train``);
- an ``add`` chain in a scope against plain: ``add`` saves nothing, so the difference is
  the recording of each op (``record``);
- a ``sin`` chain in a scope under a budget that keeps everything, against plain:
  recording and one saved tensor per op, kept (``record + save``);
- the same under a budget of 0 bytes: each saved tensor is a handle and backward replays
  the ``N - 1`` ops the block made (``record + save`` and per replayed op its kernel and
  ``replay``).

The chains read one 8-element leaf, draw no random numbers and leave nothing behind.
They run where the library's machinery runs for the caller's blocks: recorded (a
function-form scope's steady state, on CUDA, binds instead and costs less per op).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from .._budget.budget import MAX_BYTES, Budget
from .._budget.rates import rates_for, seconds
from .scope import recompute_scope

__all__ = ["library_costs", "fastest"]

N = 32  # ops per chain
ROUNDS = 9


def library_costs(device: torch.device) -> dict[str, float]:
    """Seconds per op on ``device``: ``train`` (autograd's own), ``record``, ``save`` and
    ``replay`` (the library's); see the module docstring.

    Example::

        >>> import torch
        >>> costs = library_costs(torch.device("cpu"))
        >>> sorted(costs)
        ['record', 'replay', 'save', 'train']
    """
    cuda = device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    rates = rates_for(device)  # the device's rates: measured before this runs
    x = torch.ones(8, device=device, requires_grad=True)

    def chain(op: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        y = x
        for _ in range(N):
            y = op(y)
        return y

    def plain(op: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[], None]:
        return lambda: chain(op).sum().backward()

    def scoped(op: Callable[[torch.Tensor], torch.Tensor], budget: Budget | None) -> Callable[[], None]:
        def step() -> None:
            with recompute_scope(budget=budget):
                y = chain(op)
            y.sum().backward()

        step()  # a budget's first step measures; the next ones follow its plan
        return step

    def add(t: torch.Tensor) -> torch.Tensor:
        return t + 1

    steps = [plain(torch.sin), plain(add), scoped(add, None), scoped(torch.sin, Budget(MAX_BYTES)),
             scoped(torch.sin, Budget(0))]  # fmt: skip
    clock = time.perf_counter if cuda else time.thread_time  # tiny ops run on this thread alone
    plain_sin, plain_add, scope_add, keep_sin, replay_sin = fastest(steps, sync, clock, ROUNDS)
    record = scope_add - plain_add
    save = keep_sin - plain_sin - record
    recompute = replay_sin - plain_sin - record - save
    kernel = seconds(0, 2 * x.nbytes, rates)
    x.grad = None
    return {
        "train": plain_sin - 3 * kernel,
        "record": record,
        "save": save,
        "replay": recompute * N / (N - 1) - kernel,
    }


def fastest(steps: list[Callable[[], None]], sync: Callable[[], None], clock: Callable[[], float],
            rounds: int) -> list[float]:  # fmt: skip
    """Seconds per op of each of ``steps`` (one chain each): its fastest run by ``clock``
    in ``rounds`` interleaved rounds."""
    best = [float("inf")] * len(steps)
    for _ in range(rounds):
        for i, step in enumerate(steps):
            sync()
            t0 = clock()
            step()
            sync()
            best[i] = min(best[i], clock() - t0)
    return [b / N for b in best]
