"""Per-op overhead microbenchmark: recording (forward) and replay (backward).

**Recording.** A chain of ``n`` tiny ops (``h = h * 1.0001`` on an 8-element tensor that
requires grad) is timed with

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

**Replay.** The program ``out = chain(x) * w`` (``w`` an 8-element leaf that requires
grad, so the final ``mul`` saves the chain's last tensor) runs with no region
(``none/bwd``), inside ``with recompute_scope():`` (``scope/bwd``: backward needs the
chain's last tensor, so the scope replays all ``n`` ops) and inside
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` (``checkpoint/bwd``: the
saved tensor belongs to the checkpointed region, so backward reruns the whole function,
with autograd on). Only ``out.sum().backward()`` is timed. The recomputation costs
``(x/bwd - none/bwd)`` per op; the **replay overhead** per op is that minus the cost of
running the same op eagerly under ``torch.no_grad()`` (``none/no_grad``), and its ratio to
the cost a do-nothing ``TorchDispatchMode`` adds per op under no_grad
(``nop_mode/no_grad - none/no_grad``) puts it on the same scale as the recording ratio.

**Floors and the step.** ``kernel/replay_floor`` times the recorded kernel alone
(``aten.mul.Tensor``'s C++ callable, below autograd with grad mode on: what a replay
must call per op, with no bookkeeping); ``nop_mode/bwd`` the backward of the replay
program run under a do-nothing mode (a graph recorded under any dispatch mode backs
up more slowly: part of ``scope/bwd`` is that). ``scope/step`` and
``checkpoint/step`` time the whole replay program, forward + backward: the tiny-op
chain step.

Rounds are interleaved (every configuration once per round, in rotated order); per
configuration the median over rounds of the time per op is reported in microseconds,
and the overhead ratios as the median over rounds of the per-round ratio.

Run alone: ``python -m benchmarks.overhead [--ops 1000] [--rounds 15]``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from gradient_scope import recompute_scope

from ._harness.strategies import NopMode, sac_context
from ._harness.timing import frozen_gc, interleaved_rounds

__all__ = ["run_overhead", "format_overhead"]


def _chain(h: torch.Tensor, n: int) -> torch.Tensor:
    for _ in range(n):
        h = h * 1.0001
    return h


def _chain_times(h: torch.Tensor, w: torch.Tensor, n: int) -> torch.Tensor:
    """The replay program: ``mul`` by ``w`` saves the chain's last tensor for w's grad."""
    return _chain(h, n) * w


Config = Callable[[torch.Tensor], float]


def _whole(fn: Callable[[torch.Tensor], Any]) -> Config:
    """A configuration timed as a whole call."""

    def run(x: torch.Tensor) -> float:
        t0 = time.perf_counter()
        fn(x)
        return time.perf_counter() - t0

    return run


def _backward_only(forward: Callable[[torch.Tensor], torch.Tensor]) -> Config:
    """A configuration of which only ``forward(x).sum().backward()``'s backward is timed."""

    def run(x: torch.Tensor) -> float:
        loss = forward(x).sum()
        t0 = time.perf_counter()
        loss.backward()
        return time.perf_counter() - t0

    return run


def _configs(n: int, w: torch.Tensor, scopes: list[recompute_scope]) -> dict[str, Config]:
    """The configurations, each ``x -> seconds measured``. ``scopes`` is set to the latest
    replay scope (its stats show whether backward replayed the chain)."""

    def chain_in(*regions: Callable[[], Any]) -> Callable[[torch.Tensor], torch.Tensor]:
        """The chain inside the context managers ``regions()`` (outermost first)."""

        def run(x: torch.Tensor) -> torch.Tensor:
            with contextlib.ExitStack() as stack:
                for region in regions:
                    stack.enter_context(region())
                return _chain(x, n)

        return run

    def sac(x: torch.Tensor) -> torch.Tensor:
        return checkpoint(_chain, x, n, use_reentrant=False, context_fn=sac_context)

    fwd = {"none": chain_in(), "nop_mode": chain_in(NopMode), "sac": sac, "scope": chain_in(recompute_scope)}

    def scope_replay_fwd(x: torch.Tensor) -> torch.Tensor:
        scope = recompute_scope()
        scopes[:] = [scope]  # only the latest: an old scope must not keep its record alive
        with scope:
            return _chain_times(x, w, n)

    def checkpoint_replay_fwd(x: torch.Tensor) -> torch.Tensor:
        return checkpoint(_chain_times, x, w, n, use_reentrant=False)

    def nop_replay_fwd(x: torch.Tensor) -> torch.Tensor:
        with NopMode():
            return _chain_times(x, w, n)

    kernel = torch.ops.aten.mul.Tensor._op  # what a replay calls per op

    def kernel_floor(x: torch.Tensor) -> None:
        h = x.detach()
        with torch._C._AutoDispatchBelowAutograd():
            for _ in range(n):
                h = kernel(h, 1.0001)

    def then_backward(f: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], None]:
        return lambda x: f(x).sum().backward()

    return {
        **{f"{k}/fwd": _whole(f) for k, f in fwd.items()},
        **{f"{k}/fwd+bwd": _whole(then_backward(f)) for k, f in fwd.items()},
        "none/no_grad": _whole(chain_in(torch.no_grad)),
        "nop_mode/no_grad": _whole(chain_in(torch.no_grad, NopMode)),
        "scope/no_grad": _whole(chain_in(torch.no_grad, recompute_scope)),
        "scope_around/no_grad": _whole(chain_in(recompute_scope, torch.no_grad)),
        "none/bwd": _backward_only(lambda x: _chain_times(x, w, n)),
        "scope/bwd": _backward_only(scope_replay_fwd),
        "checkpoint/bwd": _backward_only(checkpoint_replay_fwd),
        "nop_mode/bwd": _backward_only(nop_replay_fwd),
        "kernel/replay_floor": _whole(kernel_floor),
        "scope/step": _whole(then_backward(scope_replay_fwd)),
        "checkpoint/step": _whole(then_backward(checkpoint_replay_fwd)),
    }


def run_overhead(n_ops: int = 1000, rounds: int = 15, warmup: int = 2) -> dict[str, Any]:
    """Time every configuration ``rounds`` times (interleaved); see the module docstring.

    Returns ``us_per_op`` (median per configuration), ``overhead_us_per_op`` (median of
    per-round differences to the matching ``none``), ``ratio_vs_nop_mode`` (recording),
    ``replay`` (recomputation and replay overhead per op, scope and checkpoint) and every
    per-round value.
    """
    x = torch.ones(8, requires_grad=True)
    w = torch.ones(8, requires_grad=True)
    scopes: list[recompute_scope] = []
    configs = _configs(n_ops, w, scopes)
    for _ in range(warmup):
        for fn in configs.values():
            fn(x)
    # The measurement is only one of replay if backward did replay the whole chain.
    replayed = scopes[-1].stats.ops_replayed if scopes else 0
    if replayed < n_ops:
        raise RuntimeError(
            f"overhead benchmark: the scope replayed {replayed} ops in backward, expected at "
            f"least {n_ops}: the replay measurement would not measure replay"
        )
    scopes.clear()

    def collected(fn: Config) -> Callable[[], float]:
        def run() -> float:
            gc.collect()
            return fn(x)

        return run

    with frozen_gc():  # keep the per-run gc.collect() cheap
        per_round_s = interleaved_rounds({k: collected(fn) for k, fn in configs.items()}, rounds)
    scopes.clear()
    per_round = {k: [dt / n_ops * 1e6 for dt in v] for k, v in per_round_s.items()}  # us per op
    us = {k: statistics.median(v) for k, v in per_round.items()}

    def ratio(num: str, base: str, floor: str) -> float | None:
        vals = []
        for a, b, c in zip(per_round[num], per_round[base], per_round[floor]):
            if c - b > 0:
                vals.append((a - b) / (c - b))
        return statistics.median(vals) if vals else None

    def delta(num: str, base: str) -> float:
        return statistics.median(a - b for a, b in zip(per_round[num], per_round[base]))

    def replay_stats(region: str) -> dict[str, float | None]:
        # Per round: recomputation per op, its excess over the eager no_grad op, and that
        # excess over the do-nothing mode's per-op cost.
        rec, over, rat = [], [], []
        for i in range(len(per_round["none/bwd"])):
            r = per_round[f"{region}/bwd"][i] - per_round["none/bwd"][i]
            o = r - per_round["none/no_grad"][i]
            floor = per_round["nop_mode/no_grad"][i] - per_round["none/no_grad"][i]
            rec.append(r)
            over.append(o)
            if floor > 0:
                rat.append(o / floor)
        return {
            "recompute_us_per_op": statistics.median(rec),
            "overhead_us_per_op": statistics.median(over),
            "ratio_vs_nop_mode": statistics.median(rat) if rat else None,
        }

    def per_round_ratio(num: str, den: str) -> float:
        return statistics.median(a / b for a, b in zip(per_round[num], per_round[den]))

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
        "nop_mode/no_grad": delta("nop_mode/no_grad", "none/no_grad"),
        "scope/no_grad": delta("scope/no_grad", "none/no_grad"),
        "scope_around/no_grad": delta("scope_around/no_grad", "none/no_grad"),
        "scope/bwd": delta("scope/bwd", "none/bwd"),
        "checkpoint/bwd": delta("checkpoint/bwd", "none/bwd"),
    }
    return {
        "n_ops": n_ops,
        "rounds": rounds,
        "us_per_op": us,
        "overhead_us_per_op": overhead_us,
        "ratio_vs_nop_mode": ratios,
        "replay": {
            "scope": replay_stats("scope"),
            "checkpoint": replay_stats("checkpoint"),
            "eager_no_grad_us_per_op": us["none/no_grad"],
            "nop_mode_no_grad_overhead_us_per_op": overhead_us["nop_mode/no_grad"],
            "scope_ops_replayed_per_backward": replayed,
            # replay vs checkpoint's rerun, per op (median of per-round ratios), and the
            # floor: the kernel alone vs checkpoint's rerun
            "ratio_vs_checkpoint": statistics.median(
                (a - b) / (c - b)
                for a, b, c in zip(per_round["scope/bwd"], per_round["none/bwd"], per_round["checkpoint/bwd"])
            ),
            "floor_ratio_vs_checkpoint": statistics.median(
                k / (c - b)
                for k, b, c in zip(per_round["kernel/replay_floor"], per_round["none/bwd"], per_round["checkpoint/bwd"])
            ),
            "kernel_us_per_op": us["kernel/replay_floor"],
            "mode_graph_bwd_us_per_op": delta("nop_mode/bwd", "none/bwd"),
        },
        "step_ratio_vs_checkpoint": per_round_ratio("scope/step", "checkpoint/step"),
        # The least a recorder that is a dispatch mode can cost for this step: forward under
        # a do-nothing mode, the backward of its graph, and the kernels replayed bare.
        "step_floor_ratio_vs_checkpoint": statistics.median(
            (f + b + k) / c
            for f, b, k, c in zip(
                per_round["nop_mode/fwd"],
                per_round["nop_mode/bwd"],
                per_round["kernel/replay_floor"],
                per_round["checkpoint/step"],
            )
        ),
        "per_round_us_per_op": per_round,
    }


def format_overhead(res: dict[str, Any]) -> str:
    """Markdown tables of a :func:`run_overhead` result (recording, then replay)."""
    lines = [
        f"per-op overhead: {res['n_ops']} x `h = h * 1.0001` (8 elements, requires grad), "
        f"median of {res['rounds']} interleaved rounds; `*/bwd`: only the backward of "
        "`(chain(x) * w).sum()` is timed",
        "",
        "| configuration | us/op | overhead us/op (vs none) | (x - none)/(nop_mode - none) |",
        "| --- | ---: | ---: | ---: |",
    ]
    for k, v in res["us_per_op"].items():
        ov = res["overhead_us_per_op"].get(k)
        r = res["ratio_vs_nop_mode"].get(k)
        lines.append(f"| {k} | {v:.2f} | {'' if ov is None else f'{ov:+.2f}'} | {'' if r is None else f'{r:.2f}x'} |")
    rp = res.get("replay")
    if rp:
        lines += [
            "",
            f"replay: backward recomputes the chain ({rp['scope_ops_replayed_per_backward']} ops replayed "
            f"by the scope per backward); eager op under no_grad: {rp['eager_no_grad_us_per_op']:.2f} us; "
            f"a do-nothing mode adds {rp['nop_mode_no_grad_overhead_us_per_op']:.2f} us per op under no_grad",
            "",
            "| region | recomputation us/op (x/bwd - none/bwd) | overhead us/op (minus eager no_grad op) "
            "| overhead / do-nothing mode's |",
            "| --- | ---: | ---: | ---: |",
        ]
        for region in ("scope", "checkpoint"):
            v = rp[region]
            r = v["ratio_vs_nop_mode"]
            lines.append(
                f"| {region} | {v['recompute_us_per_op']:.2f} | {v['overhead_us_per_op']:+.2f} "
                f"| {'' if r is None else f'{r:.2f}x'} |"
            )
        if "ratio_vs_checkpoint" in rp:
            lines += [
                "",
                f"replay vs checkpoint's rerun, per op: {rp['ratio_vs_checkpoint']:.2f}x; the kernel alone "
                f"({rp['kernel_us_per_op']:.2f} us/op, below autograd) is {rp['floor_ratio_vs_checkpoint']:.2f}x; "
                f"a graph recorded under a do-nothing mode backs up {rp['mode_graph_bwd_us_per_op']:+.2f} us/op "
                "slower than plain's (counted in the scope's recomputation)",
            ]
    if "step_ratio_vs_checkpoint" in res:
        step, floor = res["step_ratio_vs_checkpoint"], res.get("step_floor_ratio_vs_checkpoint")
        lines += [
            "",
            f"tiny-op chain step (forward + backward) vs checkpoint's: {step:.2f}x"
            + ("" if floor is None else f"; floor (do-nothing mode fwd + its bwd + bare kernels): {floor:.2f}x"),
        ]
    return "\n".join(lines)


def _main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=15)
    a = p.parse_args()
    print(format_overhead(run_overhead(a.ops, a.rounds)))


if __name__ == "__main__":
    _main()
