"""Forward and backward timed apart, per strategy, on the real models of ``benchmarks.models``.

A scope's step differs from checkpoint's in two places: its forward records every op of
its blocks (a dispatch mode), and its backward replays recorded ops where checkpoint
reruns the Python forward. This splits the step there, for ``plain``, ``checkpoint``,
``scope_layer`` and ``mode_layer`` (each layer's forward under a do-nothing
``TorchDispatchMode``: what the dispatch mode alone costs, with nothing recorded). Rounds
are interleaved; per strategy the median forward and backward over rounds, in ms.

Run: ``python -m benchmarks.fwd_bwd [--models mixtral llama] [--size full] [--rounds 7]``
(one torch thread).
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

from ._harness.timing import interleaved_rounds
from .hf_zoo import build
from .models import apply_strategy

__all__ = ["time_fwd_bwd", "STRATEGIES"]

STRATEGIES = ["plain", "checkpoint", "scope_layer", "mode_layer"]


def time_fwd_bwd(model: str, size: str = "full", rounds: int = 7, seed: int = 0) -> dict[str, dict[str, float]]:
    """``{strategy: {"fwd_ms": ..., "bwd_ms": ...}}``: medians of ``rounds`` interleaved rounds
    (after two warm-up rounds)."""
    runs: dict[str, tuple[torch.nn.Module, dict[str, torch.Tensor]]] = {}
    for name in STRATEGIES:
        b = build(model, size, seed=seed)
        runs[name] = (apply_strategy(b.model, name, b.is_layer, b.parts_of(b.model)), b.batch)

    times: dict[str, list[tuple[float, float]]] = {name: [] for name in STRATEGIES}

    def stepper(name: str) -> Callable[[], float]:
        def step() -> float:  # notes (forward, backward) in ``times``; returns the whole step
            m, batch = runs[name]
            t0 = time.perf_counter()
            loss = m(**batch).loss
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            m.zero_grad(set_to_none=True)
            times[name].append((t1 - t0, t2 - t1))
            return t2 - t0

        return step

    steps = {name: stepper(name) for name in STRATEGIES}
    interleaved_rounds(steps, 2)  # warm-up
    for v in times.values():
        v.clear()
    interleaved_rounds(steps, rounds)
    return {
        name: {
            "fwd_ms": statistics.median(f for f, _ in v) * 1e3,
            "bwd_ms": statistics.median(b for _, b in v) * 1e3,
        }
        for name, v in times.items()
    }


def _main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["mixtral", "llama"])
    p.add_argument("--size", default="full")
    p.add_argument("--rounds", type=int, default=7)
    a = p.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    print("| model | strategy | forward (ms) | backward (ms) |")
    print("| --- | --- | ---: | ---: |")
    for model in a.models:
        res: dict[str, Any] = time_fwd_bwd(model, a.size, a.rounds)
        for name, v in res.items():
            print(f"| {model} | {name} | {v['fwd_ms']:.1f} | {v['bwd_ms']:.1f} |")


if __name__ == "__main__":
    _main()
