"""Per-op overhead microbenchmark.

A chain of ``n`` tiny ops (``h = h * 1.0001`` on an 8-element tensor that requires grad)
is timed with

* ``none``        no mode at all;
* ``nop_mode``    under a do-nothing ``TorchDispatchMode`` (the floor for any
                  dispatch-level recorder);
* ``sac``         inside ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False,
                  context_fn=create_selective_checkpoint_contexts(policy))`` (matmul
                  policy; no matmul here, every op PREFER_RECOMPUTE);
* ``scope``       inside ``with recompute_scope():``;

forward only and forward + backward (``h.sum().backward()``); and under
``torch.no_grad()`` (``none`` vs a ``recompute_scope`` entered under no_grad, and, for
information, a scope entered with grad enabled around a ``no_grad`` chain).

Rounds are interleaved (every configuration once per round, in rotated order); per
configuration the median over rounds of the time per op is reported in microseconds,
and the overhead ratios ``(x - none) / (nop_mode - none)`` as the median over rounds of
the per-round ratio.

Run alone: ``python -m benchmarks.overhead [--ops 1000] [--rounds 15]``.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from gradient_scope import recompute_scope

__all__ = ["run_overhead", "NopMode", "MATMUL_OPS", "sac_policy"]


class NopMode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


_aten = torch.ops.aten
MATMUL_OPS = frozenset(
    {
        _aten.mm.default,
        _aten.bmm.default,
        _aten.addmm.default,
        _aten.baddbmm.default,
        _aten.addbmm.default,
        _aten.mv.default,
        _aten.addmv.default,
        _aten.dot.default,
        _aten._scaled_dot_product_flash_attention_for_cpu.default,
        _aten._scaled_dot_product_flash_attention.default,
        _aten._scaled_dot_product_efficient_attention.default,
        _aten._scaled_dot_product_cudnn_attention.default,
    }
)


def sac_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Selective checkpointing: save matmul-like outputs, recompute everything else."""
    return CheckpointPolicy.MUST_SAVE if op in MATMUL_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def sac_context():
    return create_selective_checkpoint_contexts(sac_policy)


def _chain(h: torch.Tensor, n: int) -> torch.Tensor:
    for _ in range(n):
        h = h * 1.0001
    return h


def _configs(n: int) -> dict[str, Callable[[torch.Tensor], None]]:
    def none_fwd(x):
        _chain(x, n)

    def nop_fwd(x):
        with NopMode():
            _chain(x, n)

    def sac_fwd(x):
        checkpoint(_chain, x, n, use_reentrant=False, context_fn=sac_context)

    def scope_fwd(x):
        with recompute_scope():
            _chain(x, n)

    def none_fb(x):
        _chain(x, n).sum().backward()

    def nop_fb(x):
        with NopMode():
            h = _chain(x, n)
        h.sum().backward()

    def sac_fb(x):
        checkpoint(_chain, x, n, use_reentrant=False, context_fn=sac_context).sum().backward()

    def scope_fb(x):
        with recompute_scope():
            h = _chain(x, n)
        h.sum().backward()

    def none_nograd(x):
        with torch.no_grad():
            _chain(x, n)

    def scope_nograd(x):
        with torch.no_grad():
            with recompute_scope():
                _chain(x, n)

    def scope_around_nograd(x):
        with recompute_scope():
            with torch.no_grad():
                _chain(x, n)

    return {
        "none/fwd": none_fwd,
        "nop_mode/fwd": nop_fwd,
        "sac/fwd": sac_fwd,
        "scope/fwd": scope_fwd,
        "none/fwd+bwd": none_fb,
        "nop_mode/fwd+bwd": nop_fb,
        "sac/fwd+bwd": sac_fb,
        "scope/fwd+bwd": scope_fb,
        "none/no_grad": none_nograd,
        "scope/no_grad": scope_nograd,
        "scope_around/no_grad": scope_around_nograd,
    }


def run_overhead(n_ops: int = 1000, rounds: int = 15, warmup: int = 2) -> dict[str, Any]:
    configs = _configs(n_ops)
    names = list(configs)
    x = torch.ones(8, requires_grad=True)
    for _ in range(warmup):
        for fn in configs.values():
            fn(x)
    per_round: dict[str, list[float]] = {k: [] for k in names}
    gc.collect()
    gc.freeze()  # keep the per-run gc.collect() cheap (see run.py)
    try:
        for r in range(rounds):
            order = names[r % len(names):] + names[: r % len(names)]
            for name in order:
                gc.collect()
                t0 = time.perf_counter()
                configs[name](x)
                dt = time.perf_counter() - t0
                per_round[name].append(dt / n_ops * 1e6)  # us per op
    finally:
        gc.unfreeze()
    us = {k: statistics.median(v) for k, v in per_round.items()}

    def ratio(num: str, base: str, floor: str) -> float | None:
        vals = []
        for a, b, c in zip(per_round[num], per_round[base], per_round[floor]):
            if c - b > 0:
                vals.append((a - b) / (c - b))
        return statistics.median(vals) if vals else None

    def delta(num: str, base: str) -> float:
        return statistics.median(a - b for a, b in zip(per_round[num], per_round[base]))

    ratios = {
        "scope/fwd": ratio("scope/fwd", "none/fwd", "nop_mode/fwd"),
        "sac/fwd": ratio("sac/fwd", "none/fwd", "nop_mode/fwd"),
        "scope/fwd+bwd": ratio("scope/fwd+bwd", "none/fwd+bwd", "nop_mode/fwd+bwd"),
        "sac/fwd+bwd": ratio("sac/fwd+bwd", "none/fwd+bwd", "nop_mode/fwd+bwd"),
    }
    overhead_us = {
        "nop_mode/fwd": delta("nop_mode/fwd", "none/fwd"),
        "sac/fwd": delta("sac/fwd", "none/fwd"),
        "scope/fwd": delta("scope/fwd", "none/fwd"),
        "nop_mode/fwd+bwd": delta("nop_mode/fwd+bwd", "none/fwd+bwd"),
        "sac/fwd+bwd": delta("sac/fwd+bwd", "none/fwd+bwd"),
        "scope/fwd+bwd": delta("scope/fwd+bwd", "none/fwd+bwd"),
        "scope/no_grad": delta("scope/no_grad", "none/no_grad"),
        "scope_around/no_grad": delta("scope_around/no_grad", "none/no_grad"),
    }
    return {
        "n_ops": n_ops,
        "rounds": rounds,
        "us_per_op": us,
        "overhead_us_per_op": overhead_us,
        "ratio_vs_nop_mode": ratios,
        "per_round_us_per_op": per_round,
    }


def format_overhead(res: dict[str, Any]) -> str:
    lines = [
        f"per-op overhead: {res['n_ops']} x `h = h * 1.0001` (8 elements, requires grad), "
        f"median of {res['rounds']} interleaved rounds",
        "",
        "| configuration | us/op | overhead us/op (vs none) | (x - none)/(nop_mode - none) |",
        "| --- | ---: | ---: | ---: |",
    ]
    for k, v in res["us_per_op"].items():
        ov = res["overhead_us_per_op"].get(k)
        r = res["ratio_vs_nop_mode"].get(k)
        lines.append(
            f"| {k} | {v:.2f} | {'' if ov is None else f'{ov:+.2f}'} | {'' if r is None else f'{r:.2f}x'} |"
        )
    return "\n".join(lines)


def _main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=15)
    a = p.parse_args()
    print(format_overhead(run_overhead(a.ops, a.rounds)))


if __name__ == "__main__":
    _main()
