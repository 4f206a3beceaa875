"""Memory figures behind the docs' caveats (debug=True, apply_recompute's default check_fn),
on the quickstart's GPT (one step each).

    python -m benchmarks.caveats

* what ``debug=True`` costs: the scope keeps a copy of every tensor the block creates,
  for as long as the block's tensors live (until backward), to compare replays with;
* what ``apply_recompute(model)`` with the default ``check_fn`` (every module: one scope
  around the whole model) does to the peak, next to a scope per block.

Memory comes from the validated CPU probe (``benchmarks/_harness/memory.py``): "held" is what stays
allocated after forward (what autograd and the scopes keep), "peak" the highest level
during forward + backward. Same seed, same data for every variant.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))

from benchmarks._harness.memory import profile_cpu_memory
from benchmarks._harness.report import MiB
from gradient_scope import apply_recompute, recompute_scope

import quickstart as qs


def measure(recompute: bool, setup: Callable[[Any], Any] | None = None, debug: bool = False) -> tuple[int, int]:
    """(held, peak) of one forward + backward of a fresh quickstart GPT."""
    original = qs.scope
    if debug:
        qs.scope = lambda on: recompute_scope(debug=True) if on else contextlib.nullcontext()
    try:
        torch.manual_seed(qs.SEED)
        model = qs.GPT(recompute=recompute)
        if setup is not None:
            setup(model)
        tokens = torch.randint(qs.VOCAB, (qs.BATCH, qs.CONTEXT + 1))
        x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        _, held, peak = profile_cpu_memory(lambda: model(x, y), lambda loss: loss.backward())
    finally:
        qs.scope = original
    return held, peak


def main() -> None:
    variants: list[tuple[str, bool, Callable[[Any], Any] | None, bool]] = [
        ("plain", False, None, False),
        ("quickstart scopes", True, None, False),
        ("quickstart scopes, debug=True", True, None, True),
        ("apply_recompute(model, check_fn=Block)", False, lambda m: apply_recompute(m, check_fn=qs.Block), False),
        (
            "apply_recompute(model, check_fn=Block, debug=True)",
            False,
            lambda m: apply_recompute(m, check_fn=qs.Block, debug=True),
            False,
        ),
        ("apply_recompute(model)  (default check_fn)", False, lambda m: apply_recompute(m), False),
    ]
    print(f"quickstart GPT: {qs.N_LAYER} layers, d={qs.D_MODEL}, batch {qs.BATCH} x {qs.CONTEXT}, dropout {qs.DROPOUT}")
    print(f"{'variant':<52} {'held after fwd':>15} {'vs plain':>9} {'peak fwd+bwd':>14} {'vs plain':>9}")
    plain_held = plain_peak = 0
    for name, recompute, setup, debug in variants:
        held, peak = measure(recompute, setup, debug)
        if name == "plain":
            plain_held, plain_peak = held, peak
        print(
            f"{name:<52} {held / MiB:>11.2f} MiB {held / plain_held:>8.2f}x "
            f"{peak / MiB:>10.2f} MiB {peak / plain_peak:>8.2f}x"
        )


if __name__ == "__main__":
    main()
