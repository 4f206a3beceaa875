"""Real-model benchmark: recompute strategies on Hugging Face transformers models.

    python -m benchmarks.models [--quick] [--device cpu|cuda] [--dtype float32|bfloat16]
                                [--models gpt2 llama ...] [--rounds N] [--out DIR]

Every model (small config, random weights) is trained a few steps (forward, backward,
AdamW step) from the same seed and weights under each strategy:

* ``plain``: no recomputation;
* ``checkpoint``: torch's ``apply_activation_checkpointing`` with a non-reentrant
  ``checkpoint_wrapper`` on each layer;
* ``scope_layer``: ``gradient_scope.apply_recompute`` on each layer;
* ``scope_attn_mlp``: ``apply_recompute`` on each attention and MLP submodule;
* ``scope_layer_savemm``: ``apply_recompute(..., save=gradient_scope.save_matmuls)`` per layer;
* ``plain_again``: plain once more (A/A control).

Reported per model and strategy: memory held after forward and peak of fwd+bwd (the
validated probe of ``benchmarks/memory.py`` on CPU, allocator statistics on CUDA), the
fwd+bwd time (median of interleaved rounds, and per-round ratios vs plain and vs
checkpoint), agreement with plain (gradients after the first step, losses of every step,
buffers such as BatchNorm's running statistics after the last step). A depth sweep
compares the peak of a scope per layer with checkpoint's at 4-32 layers. See
``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import functools
import gc
import importlib.util
import json
import os
import pstats
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

import gradient_scope

from ._common import (
    KiB,
    MiB,
    fmt_mib,
    frozen_gc,
    interception_gone,
    interleaved_rounds,
    load_average,
    machine_info,
    ratio_summary,
)
from .memory import measure

__all__ = [
    "STRATEGIES",
    "DESCRIPTIONS",
    "SWEEP_STRATEGIES",
    "apply_strategy",
    "run_model",
    "run_depth_sweep",
    "compute_targets",
    "profile_step",
    "main",
]

STRATEGIES = ["plain", "checkpoint", "scope_layer", "scope_attn_mlp", "scope_layer_savemm", "plain_again"]
SCOPE_STRATEGIES = ["scope_layer", "scope_attn_mlp", "scope_layer_savemm"]
SWEEP_STRATEGIES = ["plain", "checkpoint", "scope_layer", "scope_attn_mlp"]
# The depth-sweep target: the excess of a scope per layer over checkpoint per layer may
# grow by at most this many layer inputs per added layer (memory figures are exact; the
# defect this guards against grows by one layer input per layer).
SWEEP_TOLERANCE = 0.05

DESCRIPTIONS = {
    "plain": "no recomputation",
    "checkpoint": "apply_activation_checkpointing(checkpoint_wrapper, CheckpointImpl.NO_REENTRANT) per layer",
    "scope_layer": "gradient_scope.apply_recompute(model, check_fn=<layer>)",
    "scope_attn_mlp": "apply_recompute on each attention and MLP submodule (ResNet: each residual branch)",
    "scope_layer_savemm": "apply_recompute(model, check_fn=<layer>, save=gradient_scope.save_matmuls)",
    "plain_again": "plain on a second copy (A/A control: the noise floor of the ratios)",
}

# Depths of the sweep and timing/training rounds per mode.
FULL = dict(size="full", rounds=7, train_steps=3, depths=[4, 8, 16, 32])
QUICK = dict(size="quick", rounds=2, train_steps=2, depths=[2, 4, 8], models=["gpt2", "llama", "bert", "resnet"])
TINY = dict(size="tiny", rounds=1, train_steps=2, depths=[1, 2])

Batch = dict[str, torch.Tensor]


# ---------------------------------------------------------------------- strategies


def apply_strategy(
    model: nn.Module, name: str, is_layer: Callable[[nn.Module], bool], parts: list[nn.Module]
) -> nn.Module:
    """Make ``model`` (in place) run strategy ``name``; returns the model.

    ``is_layer`` picks the layers; ``parts`` are the model's own attention/MLP modules.
    """
    if name in ("plain", "plain_again"):
        return model
    if name == "checkpoint":
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            CheckpointImpl,
            apply_activation_checkpointing,
            checkpoint_wrapper,
        )

        apply_activation_checkpointing(
            model,
            checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
            check_fn=is_layer,
        )
        return model
    if name == "scope_layer":
        return gradient_scope.apply_recompute(model, check_fn=is_layer)
    if name == "scope_layer_savemm":
        return gradient_scope.apply_recompute(model, check_fn=is_layer, save=gradient_scope.save_matmuls)
    if name == "scope_attn_mlp":
        ids = {id(m) for m in parts}
        return gradient_scope.apply_recompute(model, check_fn=lambda m: id(m) in ids)
    raise ValueError(f"unknown strategy {name!r}; the strategies are {', '.join(STRATEGIES)}")


def _plain_name(name: str) -> str:
    """Parameter/buffer name without checkpoint_wrapper's extra module level."""
    return name.replace("_checkpoint_wrapped_module.", "")


def _loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    return model(**batch).loss


def _compare(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Max |a - b| and bitwise equality over same-named tensors; names that differ."""
    if a.keys() != b.keys():
        missing = sorted(set(a) ^ set(b))
        return {"max_abs_diff": None, "bitwise_equal": False, "differing": missing[:5], "note": "names differ"}
    worst = 0.0
    differing = []
    for k in a:
        x, y = a[k], b[k]
        if not torch.equal(x, y):
            differing.append(k)
            worst = max(worst, (x.double() - y.double()).abs().max().item())
    return {
        "max_abs_diff": worst,
        "bitwise_equal": not differing,
        "differing": differing[:5],
        "n_differing": len(differing),
    }


class Runner:
    """One strategy on its own copy of the model: profiled, trained and timed steps."""

    def __init__(self, name: str, base: nn.Module, batch: Batch, built: Any, device: str, lr: float = 1e-3) -> None:
        self.name, self.batch, self.device = name, batch, device
        self.model = copy.deepcopy(base)
        apply_strategy(self.model, name, built.is_layer, built.parts_of(self.model))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr)
        self.warnings: list[str] = []

    def _sync(self) -> None:
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()

    def check_clean(self) -> None:
        """Record a warning if a saved-tensor hook or dispatch mode outlived the step."""
        if not interception_gone():
            gc.collect()
            msg = f"{self.name}: saved-tensor hooks / dispatch mode still active after the step"
            if not interception_gone():
                msg += " (even after gc.collect())"
            if msg not in self.warnings:
                self.warnings.append(msg)

    def grads(self) -> dict[str, torch.Tensor]:
        """Copies of the gradients, by parameter name without checkpoint_wrapper's level."""
        return {_plain_name(n): p.grad.detach().clone() for n, p in self.model.named_parameters() if p.grad is not None}

    def buffers(self) -> dict[str, torch.Tensor]:
        """Copies of all buffers (BatchNorm statistics, ...), by plain name."""
        return {_plain_name(n): b.detach().clone() for n, b in self.model.named_buffers()}

    def profiled_step(self, seed: int) -> dict[str, Any]:
        """Step 1 under the memory probe: held, peak, loss, gradients; then the optimizer step."""
        self.model.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        gc.collect()
        loss, held, peak = measure(lambda: _loss(self.model, self.batch), lambda loss: loss.backward(), self.device)
        out = {"held": held, "peak": peak, "loss": loss.detach().clone(), "grads": self.grads()}
        del loss
        self.opt.step()
        self.check_clean()
        return out

    def train_step(self, seed: int) -> torch.Tensor:
        """One fwd+bwd+AdamW step from ``torch.manual_seed(seed)``; returns the loss."""
        self.model.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        loss = _loss(self.model, self.batch)
        loss.backward()
        self.opt.step()
        self.check_clean()
        return loss.detach().clone()

    def timed_step(self) -> float:
        """One fwd+bwd (no optimizer step; gradients set to None before); seconds."""
        self.model.zero_grad(set_to_none=True)
        gc.collect()
        self._sync()
        t0 = time.perf_counter()
        loss = _loss(self.model, self.batch)
        loss.backward()
        self._sync()
        dt = time.perf_counter() - t0
        del loss
        self.check_clean()
        return dt


def _layer_input_bytes(model: nn.Module, batch: Batch, is_layer: Callable[[nn.Module], bool]) -> int | None:
    """Bytes of the first layer's hidden-state input (the unit of a per-layer excess)."""
    layer = next((m for m in model.modules() if is_layer(m)), None)
    if layer is None:
        return None
    seen: list[int] = []

    def hook(mod: nn.Module, args: tuple, kwargs: dict) -> None:
        if not seen:
            x = args[0] if args and isinstance(args[0], torch.Tensor) else kwargs.get("hidden_states")
            if isinstance(x, torch.Tensor):
                seen.append(x.numel() * x.element_size())

    h = layer.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            _loss(model, batch)
    finally:
        h.remove()
    return seen[0] if seen else None


def _prepare(name: str, size: str, device: str, dtype: torch.dtype, seed: int, **overrides: Any):
    """Build the base model, move it, warm it up (one fwd+bwd: lazy initialisation happens
    before any copy is made, so no strategy pays for it in memory)."""
    from .hf_models import build

    built = build(name, size, seed, **overrides)
    base = built.model.to(device=device, dtype=dtype)
    batch = {
        k: (v.to(device=device, dtype=dtype) if v.is_floating_point() else v.to(device)) for k, v in built.batch.items()
    }
    torch.manual_seed(seed)
    _loss(base, batch).backward()
    base.zero_grad(set_to_none=True)
    return built, base, batch


def run_model(
    name: str,
    size: str,
    device: str,
    dtype: torch.dtype,
    strategies: list[str],
    rounds: int,
    train_steps: int,
    seed: int,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """All strategies on one model: memory, agreement with plain, interleaved timing."""
    with frozen_gc():  # the gc.collect() before each step then only sees this model's objects
        return _run_model(name, size, device, dtype, strategies, rounds, train_steps, seed, log)


def _run_model(
    name: str,
    size: str,
    device: str,
    dtype: torch.dtype,
    strategies: list[str],
    rounds: int,
    train_steps: int,
    seed: int,
    log: Callable[[str], None],
) -> dict[str, Any]:
    built, base, batch = _prepare(name, size, device, dtype, seed)
    res: dict[str, Any] = {
        "config": built.config,
        "layer_class": built.layer_class,
        "n_layers": sum(1 for m in base.modules() if built.is_layer(m)),
        "attn_mlp_modules": built.parts_desc,
        "n_attn_mlp_modules": len(built.part_names),
        "layer_input_bytes": _layer_input_bytes(base, batch, built.is_layer),
        "strategies": {},
        "warnings": [],
    }
    runners: dict[str, Runner] = {}
    ref: dict[str, Any] | None = None
    for s in strategies:
        t0 = time.perf_counter()
        r: dict[str, Any] = {}
        try:
            runner = Runner(s, base, batch, built, device)
            p = runner.profiled_step(seed)
            losses = [p["loss"]] + [runner.train_step(seed + i) for i in range(1, train_steps)]
            outcome = {"grads": p["grads"], "losses": losses, "buffers": runner.buffers()}
            r.update(held=p["held"], peak=p["peak"], losses=[float(x) for x in losses])
            if s == "plain":
                ref = outcome
            if ref is not None:
                r["grads_vs_plain"] = _compare(outcome["grads"], ref["grads"])
                r["losses_vs_plain"] = _compare(
                    {str(i): x for i, x in enumerate(outcome["losses"])},
                    {str(i): x for i, x in enumerate(ref["losses"])},
                )
                r["buffers_vs_plain"] = _compare(outcome["buffers"], ref["buffers"])
            runners[s] = runner
            del outcome, p
        except Exception as e:  # noqa: BLE001 - a failing strategy is a result, reported as such
            r["error"] = f"{type(e).__name__}: {e}"
            r["traceback"] = traceback.format_exc(limit=8)
            log(f"  {name}/{s}: FAILED: {r['error']}")
            if not interception_gone():
                res["warnings"].append(f"{s}: hooks/modes left active after the error")
        res["strategies"][s] = r
        log(f"  {name}/{s}: memory + {train_steps} training steps in {time.perf_counter() - t0:.1f} s")
    del ref
    for runner in runners.values():  # one unmeasured step each: optimizer state, caches
        runner.timed_step()
    times = interleaved_rounds({s: rn.timed_step for s, rn in runners.items()}, rounds)
    for s, summary in ratio_summary(times).items():
        res["strategies"][s].update(summary)
    for runner in runners.values():
        res["warnings"].extend(runner.warnings)
    return res


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
    with frozen_gc():
        return _run_depth_sweep(depths, size, device, dtype, seed, strategies, model, log)


def _run_depth_sweep(
    depths: list[int],
    size: str,
    device: str,
    dtype: torch.dtype,
    seed: int,
    strategies: list[str],
    model: str,
    log: Callable[[str], None],
) -> dict[str, Any]:
    out: dict[str, Any] = {"model": model, "size": size, "depths": depths, "strategies": strategies, "results": {}}
    for d in depths:
        t0 = time.perf_counter()
        built, base, batch = _prepare(model, size, device, dtype, seed, layers=d)
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
                    row[s]["grads_bitwise_equal"] = _compare(p["grads"], ref)["bitwise_equal"]
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


# ---------------------------------------------------------------------- targets


def compute_targets(models: dict[str, Any], sweep: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The issue's targets, each measured in the same run: one row per (target, model)."""
    T: list[dict[str, Any]] = []

    def add(target: str, model: str, measured: str, met: bool | None, note: str = "") -> None:
        T.append({"target": target, "model": model, "measured": measured, "met": met, "note": note})

    def ok(v: dict[str, Any] | None, *keys: str) -> bool:
        return bool(v) and "error" not in v and all(k in v for k in keys)

    for m, res in models.items():
        s = res["strategies"]
        sl, ck, sa, aa = s.get("scope_layer"), s.get("checkpoint"), s.get("scope_attn_mlp"), s.get("plain_again")
        noise = ""
        if ok(aa, "ratio_vs_plain_quartiles"):
            q = aa["ratio_vs_plain_quartiles"]
            noise = f"A/A {aa['ratio_vs_plain']:.3f}x (IQR {q[0]:.3f}-{q[1]:.3f})"
        if ok(sl, "peak") and ok(ck, "peak"):
            add(
                "scope_layer peak <= checkpoint's",
                m,
                f"{fmt_mib(sl['peak'])} vs {fmt_mib(ck['peak'])} MiB ({sl['peak'] / ck['peak']:.3f}x)",
                sl["peak"] <= ck["peak"],
            )
            add(
                "scope_layer held after forward <= checkpoint's",
                m,
                f"{fmt_mib(sl['held'])} vs {fmt_mib(ck['held'])} MiB ({sl['held'] / ck['held']:.3f}x)",
                sl["held"] <= ck["held"],
            )
        if ok(sl, "ratio_vs_checkpoint"):
            q = sl["ratio_vs_checkpoint_quartiles"]
            add(
                "scope_layer step time <= 1.00x checkpoint's",
                m,
                f"{sl['ratio_vs_checkpoint']:.3f}x (IQR {q[0]:.3f}-{q[1]:.3f})",
                sl["ratio_vs_checkpoint"] <= 1.00,
                noise,
            )
        if ok(sa, "peak") and ok(ck, "peak"):
            add(
                "scope_attn_mlp peak < checkpoint's",
                m,
                f"{fmt_mib(sa['peak'])} vs {fmt_mib(ck['peak'])} MiB ({sa['peak'] / ck['peak']:.3f}x)",
                sa["peak"] < ck["peak"],
                "residual branches (no attention/MLP)" if m == "resnet" else "",
            )
        scoped = [k for k in SCOPE_STRATEGIES if ok(s.get(k), "grads_vs_plain")]
        if scoped:
            bad = [
                k
                for k in scoped
                if not (s[k]["grads_vs_plain"]["bitwise_equal"] and s[k]["losses_vs_plain"]["bitwise_equal"])
            ]
            worst = max(s[k]["grads_vs_plain"]["max_abs_diff"] or 0.0 for k in scoped)
            add(
                "scope strategies: gradients and losses bitwise equal to plain",
                m,
                f"max abs grad diff {worst:g}" + (f"; differ: {', '.join(bad)}" if bad else ""),
                not bad,
            )
            bad_b = [k for k in scoped if not s[k]["buffers_vs_plain"]["bitwise_equal"]]
            add(
                "scope strategies: buffers bitwise equal to plain after training",
                m,
                "equal" if not bad_b else f"differ: {', '.join(bad_b)}",
                not bad_b,
            )
        failed = [k for k, v in s.items() if "error" in v]
        if failed:
            add("every strategy runs", m, f"failed: {', '.join(failed)}", False)
    if sweep:
        for strat, e in sweep.get("excess", {}).items():
            if strat != "scope_layer":
                continue
            unit = sweep["results"][str(sweep["depths"][-1])].get("layer_input_bytes")
            for metric in ("peak", "held"):
                v = e[metric]
                if len(v["excess_bytes"]) < 2:
                    continue
                span = v["depths"][-1] - v["depths"][0]
                grow = v["excess_bytes"][-1] - v["excess_bytes"][0]
                tol = SWEEP_TOLERANCE * unit * span if unit else 64 * KiB
                li = v["slope_layer_inputs_per_layer"]
                add(
                    f"depth sweep: scope_layer {metric} excess over checkpoint does not grow with depth",
                    f"{sweep['model']} x{v['depths'][0]}-{v['depths'][-1]}",
                    f"excess {v['excess_bytes'][0] / KiB:+.0f} KiB at {v['depths'][0]} layers, "
                    f"{v['excess_bytes'][-1] / KiB:+.0f} KiB at {v['depths'][-1]}"
                    + ("" if li is None else f"; slope {li:+.2f} layer inputs per layer"),
                    grow <= tol,
                    f"met when it grows by <= {SWEEP_TOLERANCE:g} layer input per added layer "
                    f"({tol / KiB:.0f} KiB here)",
                )
    return T


# ---------------------------------------------------------------------- report


def targets_markdown(T: list[dict[str, Any]]) -> str:
    """The targets as a Markdown table (target, model, measured, met?, note)."""
    lines = ["| target | model | measured | met? | note |", "| --- | --- | --- | --- | --- |"]
    for t in T:
        met = "n/a" if t["met"] is None else ("met" if t["met"] else "**missed**")
        lines.append(f"| {t['target']} | {t['model']} | {t['measured']} | {met} | {t['note']} |")
    return "\n".join(lines)


def _eq(v: dict[str, Any], key: str) -> str:
    c = v.get(key)
    if c is None:
        return ""
    if c["bitwise_equal"]:
        return "equal"
    d = c.get("max_abs_diff")
    return f"**{c.get('n_differing', '?')} differ** (max {d:.3g})" if d is not None else "**differ**"


def model_markdown(res: dict[str, Any]) -> str:
    """One model's strategies as a Markdown table (memory, time, agreement with plain)."""
    s = res["strategies"]
    ck = s.get("checkpoint", {})
    lines = [
        "| strategy | held after fwd (MiB) | peak fwd+bwd (MiB) | held vs ckpt | peak vs ckpt | median step (ms) "
        "| time vs plain (IQR) | time vs ckpt (IQR) | grads vs plain | losses | buffers |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- | --- |",
    ]

    def rel(v: dict[str, Any], k: str) -> str:
        return f"{v[k] / ck[k]:.3f}x" if k in v and ck.get(k) else ""

    def ratio(v: dict[str, Any], base: str) -> str:
        r = v.get(f"ratio_vs_{base}")
        if r is None:
            return ""
        q = v[f"ratio_vs_{base}_quartiles"]
        return f"{r:.3f}x ({q[0]:.2f}-{q[1]:.2f})"

    for name, v in s.items():
        if "error" in v:
            lines.append(f"| {name} | failed: {v['error'][:120]} | | | | | | | | | |")
            continue
        lines.append(
            f"| {name} | {fmt_mib(v.get('held'))} | {fmt_mib(v.get('peak'))} | {rel(v, 'held')} | {rel(v, 'peak')} "
            f"| {1e3 * v['time_median_s']:.1f} | {ratio(v, 'plain')} | {ratio(v, 'checkpoint')} "
            f"| {_eq(v, 'grads_vs_plain')} | {_eq(v, 'losses_vs_plain')} | {_eq(v, 'buffers_vs_plain')} |"
            if "time_median_s" in v
            else f"| {name} | {fmt_mib(v.get('held'))} | {fmt_mib(v.get('peak'))} | {rel(v, 'held')} "
            f"| {rel(v, 'peak')} "
            f"| | | | {_eq(v, 'grads_vs_plain')} | {_eq(v, 'losses_vs_plain')} | {_eq(v, 'buffers_vs_plain')} |"
        )
    return "\n".join(lines)


def sweep_markdown(sw: dict[str, Any]) -> str:
    """The depth sweep as a Markdown table, then the growth of each scope's excess."""
    strats = sw["strategies"]
    lines = [
        "| layers | layer input (KiB) | "
        + " | ".join(f"{s} held / peak (MiB)" for s in strats)
        + " | scope_layer - checkpoint: held / peak (KiB) |",
        "| ---: | ---: | " + " | ".join("---:" for _ in strats) + " | ---: |",
    ]
    for d in sw["depths"]:
        row = sw["results"][str(d)]
        cells = []
        for s in strats:
            v = row.get(s, {})
            if "error" in v:
                cells.append("failed")
            else:
                eq = "" if v.get("grads_bitwise_equal", True) else " (grads differ)"
                cells.append(f"{fmt_mib(v['held'])} / {fmt_mib(v['peak'])}{eq}")
        sl, ck = row.get("scope_layer", {}), row.get("checkpoint", {})
        diff = (
            f"{(sl['held'] - ck['held']) / KiB:+.0f} / {(sl['peak'] - ck['peak']) / KiB:+.0f}"
            if "peak" in sl and "peak" in ck
            else ""
        )
        li = row.get("layer_input_bytes")
        lines.append(f"| {d} | {'' if li is None else f'{li / KiB:.0f}'} | " + " | ".join(cells) + f" | {diff} |")
    slopes = []
    for s, e in sw.get("excess", {}).items():
        for metric in ("held", "peak"):
            v = e[metric]
            if v["slope_bytes_per_layer"] is not None:
                li = v["slope_layer_inputs_per_layer"]
                slopes.append(
                    f"- `{s}` - `checkpoint` {metric}: {v['slope_bytes_per_layer'] / KiB:+.1f} KiB per added layer"
                    + ("" if li is None else f" ({li:+.2f} layer inputs)")
                )
    return "\n".join(lines + (["", *slopes] if slopes else []))


def write_markdown(results: dict[str, Any], path: str, charts: list[str]) -> None:
    """Write ``results.md``: run and machine, targets, one section per model, sweep, charts."""
    m = results["machine"]
    la0 = ", ".join(f"{x:.2f}" for x in m.get("load_average_at_start", []))
    la1 = ", ".join(f"{x:.2f}" for x in m.get("load_average_at_end", []))
    out = [
        "# gradient_scope on real models",
        "",
        f"Generated by `python -m benchmarks.models {' '.join(results['argv'])}` on {m['date']}"
        f" in {results['duration_s']:.0f} s.",
        "",
        f"- machine: {m['cpu_model']}, {m['cpu_cores']} cores (torch threads: {m['torch_threads']})"
        + (f", GPU {m['gpu']}" if m.get("gpu") else ""),
        f"- torch {m['torch']}, transformers {m.get('transformers')}, Python {m['python']}, "
        f"gradient_scope {m['gradient_scope']}" + (f" (git {m['git_commit']})" if m.get("git_commit") else ""),
        f"- load average at start: {la0}; at end: {la1}"
        + (
            " -- **the machine was busy: timings are noisy** (memory figures are exact)"
            if max(m.get("load_average_at_start", [0])[:1] + m.get("load_average_at_end", [0])[:1])
            > 0.5 * (m["cpu_cores"] or 1)
            else ""
        ),
        f"- device {results['device']}, dtype {results['dtype']}, size {results['size']}, seed {results['seed']}",
        "- memory: "
        + (
            "torch.cuda memory stats"
            if results["device"].startswith("cuda")
            else "CPU profiler (profile_memory=True), benchmarks/memory.py"
        )
        +
        "; held = allocated during forward and still allocated after it; peak = highest level during fwd+bwd "
        "(first training step, gradients included)",
        f"- step time: fwd+bwd (no optimizer step), median of {results['rounds']} interleaved rounds (order rotated "
        "each round); ratios are medians of per-round ratios, with their interquartile range",
        f"- agreement: gradients after step 1 (identical weights, batch and RNG seed), losses of "
        f"{results['train_steps']} AdamW steps, all buffers (BatchNorm running stats, num_batches_tracked) after them",
        "",
        "## Targets",
        "",
        targets_markdown(results["targets"]),
        "",
        "## Strategies",
        "",
        "\n".join(f"- `{k}`: {v}" for k, v in DESCRIPTIONS.items()),
        "",
    ]
    for name, res in results["models"].items():
        cfg = ", ".join(f"{k}={v}" for k, v in res["config"].items() if k != "model")
        li = res.get("layer_input_bytes")
        out += [
            f"## {name}",
            "",
            f"{res['config']['model']}; {cfg}. Layers: {res['n_layers']} x `{res['layer_class']}`"
            + ("" if li is None else f" (first layer input {li / KiB:.0f} KiB)")
            + f"; attention/MLP scopes: {res['n_attn_mlp_modules']} x {res['attn_mlp_modules']}.",
            "",
            model_markdown(res),
            "",
        ]
        for k, v in res["strategies"].items():
            for key in ("grads_vs_plain", "buffers_vs_plain"):
                c = v.get(key)
                if c and not c["bitwise_equal"] and c.get("differing"):
                    out.append(
                        f"- {k}: {key.replace('_vs_plain', '')} differing from plain: "
                        + ", ".join(f"`{n}`" for n in c["differing"])
                        + ("" if c.get("n_differing", 0) <= 5 else ", ...")
                    )
        out.append("")
    sw = results.get("sweep")
    if sw:
        cfg = ", ".join(f"{k}={v}" for k, v in sw.get("config", {}).items() if k not in ("model", "parameters"))
        out += [f"## Depth sweep ({sw['model']}: {cfg})", "", sweep_markdown(sw), ""]
    if charts:
        out += ["## Charts", ""] + [f"![{c}]({c})" for c in charts] + [""]
    warnings = [f"{n}: {w}" for n, r in results["models"].items() for w in r.get("warnings", [])]
    if warnings:
        out += ["## Warnings", ""] + [f"- {w}" for w in warnings] + [""]
    with open(path, "w") as f:
        f.write("\n".join(out))


def make_charts(results: dict[str, Any], out_dir: str) -> list[str]:
    """memory_per_model.png, time_per_model.png, depth_sweep.png (matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files: list[str] = []
    models = results["models"]
    names = list(models)
    if names:
        cols = min(4, len(names))
        rows = (len(names) + cols - 1) // cols
        fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.6 * rows), squeeze=False)
        for ax, n in zip(axes.flat, names):
            s = {k: v for k, v in models[n]["strategies"].items() if "peak" in v}
            ks = list(s)
            xs = range(len(ks))
            ax.bar([i - 0.2 for i in xs], [s[k]["held"] / MiB for k in ks], 0.4, label="held after fwd")
            ax.bar([i + 0.2 for i in xs], [s[k]["peak"] / MiB for k in ks], 0.4, label="peak fwd+bwd")
            if "checkpoint" in s:
                ax.axhline(s["checkpoint"]["peak"] / MiB, color="gray", ls="--", lw=0.8)
            ax.set_xticks(list(xs), ks, rotation=35, ha="right", fontsize=7)
            ax.set_title(n)
            ax.set_ylabel("MiB")
        for ax in list(axes.flat)[len(names) :]:
            ax.axis("off")
        axes.flat[0].legend(fontsize=7)
        fig.suptitle("Memory per model and strategy (dashed: checkpoint's peak)")
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, "memory_per_model.png"), dpi=100)
        plt.close(fig)
        files.append("memory_per_model.png")

        strats = [s for s in STRATEGIES if s != "plain" and any(s in models[n]["strategies"] for n in names)]
        fig, ax = plt.subplots(figsize=(max(8, 1.3 * len(names) + 3), 4.5))
        w = 0.8 / max(1, len(strats))
        for j, st in enumerate(strats):
            xs, ys, lo, hi = [], [], [], []
            for i, n in enumerate(names):
                v = models[n]["strategies"].get(st, {})
                if "ratio_vs_plain" in v:
                    xs.append(i - 0.4 + w * (j + 0.5))
                    ys.append(v["ratio_vs_plain"])
                    q = v["ratio_vs_plain_quartiles"]
                    lo.append(v["ratio_vs_plain"] - q[0])
                    hi.append(q[1] - v["ratio_vs_plain"])
            ax.bar(xs, ys, w, yerr=[lo, hi], capsize=2, label=st, color=f"C{j}")
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_xticks(range(len(names)), names)
        ax.set_ylabel("fwd+bwd time / plain (median per-round ratio, IQR)")
        ax.set_title("Step time relative to plain")
        ax.legend(fontsize=8, ncol=3)
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, "time_per_model.png"), dpi=100)
        plt.close(fig)
        files.append("time_per_model.png")

    sw = results.get("sweep")
    if sw:
        ds = sw["depths"]
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
        for i, st in enumerate(sw["strategies"]):
            pts = [(d, sw["results"][str(d)].get(st, {})) for d in ds]
            pts = [(d, v) for d, v in pts if "peak" in v]
            a1.plot([d for d, _ in pts], [v["peak"] / MiB for _, v in pts], "o-", color=f"C{i}", label=f"{st} peak")
            a1.plot(
                [d for d, _ in pts],
                [v["held"] / MiB for _, v in pts],
                "s--",
                color=f"C{i}",
                alpha=0.6,
                label=f"{st} held",
            )
        for i, (st, e) in enumerate(sw.get("excess", {}).items()):
            for metric, style in (("peak", "o-"), ("held", "s--")):
                v = e[metric]
                a2.plot(
                    v["depths"], [b / MiB for b in v["excess_bytes"]], style, color=f"C{i + 2}", label=f"{st} {metric}"
                )
        a2.axhline(0, color="black", lw=0.8)
        for a in (a1, a2):
            a.set_xscale("log", base=2)
            a.set_xticks(ds, [str(d) for d in ds])
            a.set_xlabel("layers")
            a.grid(alpha=0.3)
        a1.set_ylabel("MiB")
        a1.set_title(f"Depth sweep ({sw['model']}): solid peak, dashed held")
        a1.legend(fontsize=7, ncol=2)
        a2.set_ylabel("MiB over checkpoint")
        a2.set_title("Scope minus checkpoint (solid peak, dashed held)")
        a2.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, "depth_sweep.png"), dpi=100)
        plt.close(fig)
        files.append("depth_sweep.png")
    return files


# ---------------------------------------------------------------------- cProfile

PROFILE_FILTERS = ("gradient_scope", os.path.join("torch", "utils", "_python_dispatch"))


def _profile_rows(stats: pstats.Stats, key: int, n: int, keep: Callable[[str], bool]) -> list[str]:
    # stats.stats: (file, line, function) -> (primitive calls, calls, tottime, cumtime, callers)
    rows = [(k, v) for k, v in stats.stats.items() if keep(k[0])]  # type: ignore[attr-defined]
    rows.sort(key=lambda kv: kv[1][key], reverse=True)
    out = ["| tottime (ms) | cumtime (ms) | calls | function |", "| ---: | ---: | ---: | --- |"]
    for (file, line, fn), (_, nc, tt, ct, _) in rows[:n]:
        short = file
        for marker in ("gradient_scope" + os.sep, "site-packages" + os.sep):
            if marker in file:
                short = file[file.index(marker) + (0 if marker.startswith("gradient") else len(marker)) :]
                break
        out.append(f"| {tt * 1e3:.1f} | {ct * 1e3:.1f} | {nc} | `{short}:{line}({fn})` |")
    return out


def profile_step(
    name: str, strategy: str, size: str, device: str, dtype: torch.dtype, seed: int, out_dir: str, top: int = 25
) -> str:
    """cProfile one fwd+bwd step of ``name`` under ``strategy`` (after two warm-up steps);
    writes ``cprofile-<name>-<strategy>.md`` (top functions by tottime and cumtime: those of
    gradient_scope and torch/utils/_python_dispatch, then all) and ``.prof``; returns the text.

    The profiler's clock is the process's CPU time, not wall time: on a busy machine wall
    time charges the time the process waits for a core to whatever function was running.
    """
    built, base, batch = _prepare(name, size, device, dtype, seed)
    runner = Runner(strategy, base, batch, built, device)
    for _ in range(2):
        runner.timed_step()
    prof = cProfile.Profile(time.process_time)
    runner.model.zero_grad(set_to_none=True)
    gc.collect()
    t0, c0 = time.perf_counter(), time.process_time()
    prof.enable()
    loss = _loss(runner.model, batch)
    loss.backward()
    prof.disable()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    stats = pstats.Stats(prof)
    total = stats.total_tt  # type: ignore[attr-defined]
    base_name = os.path.join(out_dir, f"cprofile-{name}-{strategy}")
    stats.dump_stats(base_name + ".prof")

    def ours(f: str) -> bool:
        return any(p in f for p in PROFILE_FILTERS)

    own = sum(v[2] for k, v in stats.stats.items() if ours(k[0]))  # type: ignore[attr-defined]
    text = [
        f"# cProfile: {name} ({size}), strategy {strategy}, one fwd+bwd step",
        "",
        f"Under cProfile (clock: process CPU time): wall {wall * 1e3:.0f} ms, CPU {cpu * 1e3:.0f} ms; "
        f"total profiled time {total * 1e3:.0f} ms; tottime in gradient_scope + torch/utils/_python_dispatch: "
        f"{own * 1e3:.0f} ms ({own / total:.0%}). torch threads {torch.get_num_threads()}; "
        f"load average {load_average()}. `~:0(...)` rows are C functions; `run_backward`'s tottime is the "
        "C++ autograd engine with the backward kernels it runs.",
        "",
        f"## gradient_scope and torch/utils/_python_dispatch, top {top} by tottime",
        "",
        *_profile_rows(stats, 2, top, ours),
        "",
        f"## gradient_scope and torch/utils/_python_dispatch, top {top} by cumtime",
        "",
        *_profile_rows(stats, 3, top, ours),
        "",
        f"## all functions, top {top} by tottime",
        "",
        *_profile_rows(stats, 2, top, lambda f: True),
        "",
    ]
    s = "\n".join(text)
    with open(base_name + ".md", "w") as f:
        f.write(s)
    return s


# ---------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    """Command line entry point; returns the results dict (None with ``--cprofile``)."""
    from .hf_models import DEFAULT_MODELS, MODELS, preload

    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m benchmarks.models", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--quick", action="store_true", help="smaller models, GPT-2/Llama/BERT/ResNet, 2 rounds (~1-2 min on CPU)"
    )
    p.add_argument(
        "--size",
        choices=["full", "quick", "tiny"],
        default=None,
        help="model size (default: full, or quick with --quick); tiny is for tests",
    )
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument(
        "--models",
        nargs="+",
        choices=list(MODELS),
        default=None,
        help=f"models to run (default: {' '.join(DEFAULT_MODELS)}; --quick: gpt2 llama bert resnet)",
    )
    p.add_argument("--rounds", type=int, default=None, help="interleaved timing rounds (default 7, --quick 2)")
    p.add_argument("--train-steps", type=int, default=None, help="training steps compared with plain (default 3)")
    p.add_argument("--depths", type=int, nargs="+", default=None, help="depth sweep layers (default 4 8 16 32)")
    p.add_argument("--no-sweep", action="store_true", help="skip the depth sweep")
    p.add_argument(
        "--out",
        default=None,
        help="output directory (default benchmarks/results/<device>-models/, with --quick "
        "benchmarks/results/<device>-models-quick/)",
    )
    p.add_argument("--no-charts", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch.set_num_threads (default 1: on a shared machine OpenMP threads spin-wait for "
        "each other and a step can take 10x longer; 0 keeps torch's default, one per core)",
    )
    p.add_argument(
        "--cprofile",
        metavar="STRATEGY",
        choices=STRATEGIES,
        default=None,
        help="only cProfile one fwd+bwd step of each --models model under STRATEGY and write "
        "cprofile-<model>-<strategy>.md/.prof to the output directory",
    )
    a = p.parse_args(argv)

    if importlib.util.find_spec("transformers") is None:
        p.error("transformers is not installed: pip install -e '.[bench]'")
    t_start = time.perf_counter()
    mode = QUICK if a.quick else FULL
    size = a.size or mode["size"]
    if size == "tiny":
        mode = {**TINY, "models": mode.get("models")}
    if a.threads:
        torch.set_num_threads(a.threads)
    device = "cuda:0" if a.device == "cuda" else a.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda: CUDA is not available")
    dtype = getattr(torch, a.dtype)
    models = a.models or mode.get("models") or DEFAULT_MODELS
    rounds = a.rounds or mode["rounds"]
    train_steps = a.train_steps or mode["train_steps"]
    depths = a.depths or mode["depths"]
    dev_name = torch.device(device).type
    suffix = "-models" + ("-profile" if a.cprofile else "-quick" if a.quick or size == "tiny" else "")
    out_dir = a.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", dev_name + suffix)
    os.makedirs(out_dir, exist_ok=True)

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:6.1f}s] {msg}", flush=True)

    if a.cprofile:
        preload(models)
        for name in models:
            print(profile_step(name, a.cprofile, size, device, dtype, a.seed, out_dir))
        log(f"wrote {out_dir}/cprofile-*.md")
        return None

    machine = machine_info(device, packages=("transformers",))
    log(
        f"{machine['cpu_model']}, {machine['cpu_cores']} cores, {torch.get_num_threads()} torch threads, "
        f"torch {machine['torch']}, transformers {machine['transformers']}; {device} {a.dtype}, size {size}; "
        f"load average {machine.get('load_average_at_start')}"
    )
    preload(list(dict.fromkeys([*models, "gpt2"])))
    results_models: dict[str, Any] = {}
    sweep = None
    with frozen_gc():  # one full collection for the whole run (see frozen_gc)
        for name in models:
            log(f"{name}: {len(STRATEGIES)} strategies, {train_steps} training steps, {rounds} timing rounds")
            results_models[name] = run_model(name, size, device, dtype, STRATEGIES, rounds, train_steps, a.seed, log)
            print(f"\n{name}\n{model_markdown(results_models[name])}\n", flush=True)
        if not a.no_sweep:
            sweep_size = "tiny" if size == "tiny" else "sweep"
            log(f"depth sweep: gpt2 ({sweep_size}) at {depths} layers")
            sweep = run_depth_sweep(depths, sweep_size, device, dtype, a.seed, log=log)
            print(f"\ndepth sweep\n{sweep_markdown(sweep)}\n", flush=True)
    targets = compute_targets(results_models, sweep)
    la = load_average()
    if la is not None:
        machine["load_average_at_end"] = la
    results: dict[str, Any] = {
        "argv": argv,
        "device": device,
        "dtype": a.dtype,
        "size": size,
        "seed": a.seed,
        "rounds": rounds,
        "train_steps": train_steps,
        "machine": machine,
        "strategies": DESCRIPTIONS,
        "models": results_models,
        "sweep": sweep,
        "targets": targets,
    }
    charts = [] if a.no_charts else make_charts(results, out_dir)
    results["charts"] = charts
    results["duration_s"] = time.perf_counter() - t_start
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    write_markdown(results, os.path.join(out_dir, "results.md"), charts)
    print("targets\n" + targets_markdown(targets))
    log(f"wrote {out_dir}/results.json, results.md and {len(charts)} charts")
    return results


if __name__ == "__main__":
    main()
