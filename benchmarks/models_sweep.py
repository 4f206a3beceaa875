"""The depth sweep of ``benchmarks.models``: held and peak memory of ``plain``,
``checkpoint`` and the scope strategies on GPT-2 at growing depth, and the growth per
added layer of each scope strategy's excess over ``checkpoint``."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from ._harness.strategies import compare_tensors
from ._harness.timing import frozen_gc
from .models import SWEEP_STRATEGIES, Runner, _layer_input_bytes, prepare

__all__ = ["run_depth_sweep"]


@frozen_gc()
def run_depth_sweep(
    depths: list[int],
    size: str,
    device: str,
    dtype: torch.dtype,
    seed: int,
    strategies: list[str] = SWEEP_STRATEGIES,
    model: str = "gpt2",
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Held and peak memory per strategy at each depth (one profiled step each; gradients
    compared with plain's)."""
    out: dict[str, Any] = {"model": model, "size": size, "depths": depths, "strategies": strategies, "results": {}}
    for d in depths:
        t0 = time.perf_counter()
        built, base, batch = prepare(model, size, device, dtype, seed, layers=d)
        out["config"] = {k: v for k, v in built.config.items() if k != "layers"}
        row: dict[str, Any] = {"layer_input_bytes": _layer_input_bytes(base, batch, built.is_layer)}
        ref = None
        for s in strategies:
            try:
                runner = Runner(s, base, batch, built, device)
                p = runner.profiled_step(seed)
                row[s] = {"held": p["held"], "peak": p["peak"]}
                if s == "plain":
                    ref = p["grads"]
                if ref is not None:
                    row[s]["grads_bitwise_equal"] = compare_tensors(p["grads"], ref)["bitwise_equal"]
                del runner, p
            except Exception as e:  # noqa: BLE001
                row[s] = {"error": f"{type(e).__name__}: {e}"}
        out["results"][str(d)] = row
        log(f"  depth {d}: {time.perf_counter() - t0:.1f} s")
    out["excess"] = _sweep_excess(out)
    return out


def _slope(xs: list[float], ys: list[float]) -> float | None:
    if len(xs) < 2:
        return None
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else None


def _sweep_excess(sweep: dict[str, Any]) -> dict[str, Any]:
    """Per scope strategy: (scope - checkpoint) held and peak at each depth, and the
    least-squares growth per added layer (bytes and layer inputs)."""
    out: dict[str, Any] = {}
    depths = sweep["depths"]
    for s in sweep["strategies"]:
        if not s.startswith("scope"):
            continue
        e: dict[str, Any] = {}
        for metric in ("held", "peak"):
            vals, xs = [], []
            for d in depths:
                row = sweep["results"][str(d)]
                if metric in row.get(s, {}) and metric in row.get("checkpoint", {}):
                    xs.append(d)
                    vals.append(row[s][metric] - row["checkpoint"][metric])
            slope = _slope(xs, vals)
            unit = sweep["results"][str(depths[-1])].get("layer_input_bytes")
            e[metric] = {
                "depths": xs,
                "excess_bytes": vals,
                "slope_bytes_per_layer": slope,
                "slope_layer_inputs_per_layer": None if slope is None or not unit else slope / unit,
            }
        out[s] = e
    return out
