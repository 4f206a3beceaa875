"""Recompute strategies on Hugging Face models, on CPU or GPU.

    python -m benchmarks.models [--quick] [--models gpt2 llama ...] [--rounds N] [--out DIR]
    python -m benchmarks.models --device cuda --gpu-suite [--phase-timeout S] [--profile-cuda]

Every model (``benchmarks/hf_zoo.py``: small configs, random weights) runs each strategy
on its own copy from the same seed and weights (``benchmarks/_harness/suite.py``): memory
held after forward and peak of fwd+bwd, forward / backward / step time in interleaved
rounds (per-round ratios vs plain and vs checkpoint), and agreement with plain
(gradients, losses of a few AdamW steps, buffers such as BatchNorm's running statistics).
A depth sweep compares the memory of a scope per layer with checkpoint's at 4-32 layers.
``--gpu-suite`` runs the models, sizes and strategies of the GPU benchmark (issue 26).
``--cprofile STRATEGY`` and ``--profile-cuda`` only profile one step per model and
strategy. See ``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import importlib.util
import os
import pstats
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from ._harness.machine import load_average, machine_info, mark_end
from ._harness.report import (
    KiB,
    MiB,
    Targets,
    aa_note,
    fmt_mib,
    fmt_ratio,
    grouped_bars,
    header_lines,
    make_log,
    md_table,
    pyplot,
    resolve_device,
    results_dir,
    save_figure,
    sections,
    write_results,
)
from ._harness.strategies import DESCRIPTIONS
from ._harness.suite import Case, Runner, free_device_memory, layer_input_bytes, run_strategies
from ._harness.timing import quartiles, sync
from .hf_zoo import DEFAULT_MODELS, GPU_SUITE, MODELS, build, preload

__all__ = ["STRATEGIES", "GPU_STRATEGIES", "SWEEP_STRATEGIES", "run_model", "run_depth_sweep", "main"]

STRATEGIES = ["plain", "checkpoint", "scope_layer", "scope_attn_mlp", "scope_layer_savemm", "mode_layer", "plain_again"]
# On CUDA the function-form scopes run in their steady state by default (docs/concepts.md);
# scope_layer+recorded shows the recorded path beside it.
GPU_STRATEGIES = ["plain", "checkpoint", "sac_matmul", "scope_layer", "scope_layer+recorded", "scope_layer_savemm",
                  "budget50", "budget25", "mode_layer", "plain_again"]
SWEEP_STRATEGIES = ["plain", "checkpoint", "scope_layer", "scope_attn_mlp"]

# Timing rounds, training steps, depth sweep and models per preset.
FULL: dict[str, Any] = dict(size="full", rounds=7, train_steps=3, depths=[4, 8, 16, 32])
QUICK: dict[str, Any] = dict(size="quick", rounds=2, train_steps=2, depths=[2, 4, 8],
                             models=["gpt2", "llama", "bert", "resnet"])
TINY: dict[str, Any] = dict(size="tiny", rounds=1, train_steps=2, depths=[1, 2])
# One warm-up step more than a Budget needs to plan; one step compared (no optimizer:
# the copies share one set of weights, which is what lets the 8B-layer stack fit).
GPU: dict[str, Any] = dict(rounds=5, train_steps=1, phase_timeout=100.0)

# The depth-sweep target: the excess of a scope per layer over checkpoint per layer may
# grow by at most this many layer inputs per added layer (memory figures are exact; the
# defect this guards against grows by one layer input per layer).
SWEEP_TOLERANCE = 0.05


def _case(label: str, model: str, size: str, device: str, dtype: torch.dtype, seed: int,
          **overrides: Any) -> tuple[Case, dict[str, Any]]:
    built = build(model, size, seed, device, dtype, **overrides)
    c = built.case(label, device)
    c.warm_up(seed)
    info = {"config": built.config, "layer_class": built.layer_class,
            "n_layers": sum(1 for m in c.model.modules() if c.layers(m)), "attn_mlp_modules": built.parts_desc,
            "n_attn_mlp_modules": built.n_parts, "layer_input_bytes": layer_input_bytes(c)}
    return c, info


def run_model(label: str, model: str, size: str, device: str, dtype: torch.dtype, strategies: list[str],
              rounds: int, train_steps: int, seed: int, deadline: float | None = None,
              log: Callable[[str], None] = print, **overrides: Any) -> dict[str, Any]:
    """All strategies on one model: memory, agreement with plain, interleaved timing."""
    try:
        c, info = _case(label, model, size, device, dtype, seed, **overrides)
    except Exception as e:  # noqa: BLE001 - e.g. a model that does not fit: reported, the next one runs
        free_device_memory(device)
        log(f"  {label}: could not be built: {type(e).__name__}: {e}")
        return {"error": f"{type(e).__name__}: {e}"[:2000], "strategies": {}, "warnings": []}
    res = run_strategies(c, strategies, rounds, seed=seed, train_steps=train_steps, deadline=deadline, log=log)
    del c
    free_device_memory(device)
    return {**info, "dtype": str(dtype).removeprefix("torch."), **res}


def run_depth_sweep(depths: list[int], size: str, device: str, dtype: torch.dtype, seed: int,
                    log: Callable[[str], None] = print) -> dict[str, Any]:
    """Held and peak memory of :data:`SWEEP_STRATEGIES` on GPT-2 at each depth, and the
    least-squares growth per added layer of each scope strategy's excess over checkpoint's."""
    out: dict[str, Any] = {"model": "gpt2", "size": size, "depths": depths, "strategies": SWEEP_STRATEGIES,
                           "results": {}}
    for d in depths:
        t0 = time.perf_counter()
        c, info = _case("gpt2", "gpt2", size, device, dtype, seed, layers=d)
        out["config"] = {k: v for k, v in info["config"].items() if k != "layers"}
        r = run_strategies(c, SWEEP_STRATEGIES, 0, seed=seed, warmup=0, log=lambda m: None)["strategies"]
        out["results"][str(d)] = {"layer_input_bytes": info["layer_input_bytes"], **r}
        log(f"  depth {d}: {time.perf_counter() - t0:.1f} s")
    out["excess"] = {}
    unit = out["results"][str(depths[-1])]["layer_input_bytes"]
    for s in SWEEP_STRATEGIES:
        if s.startswith("scope"):
            out["excess"][s] = {}
            for metric in ("held", "peak"):
                pts = [(d, row[s][metric] - row["checkpoint"][metric]) for d in depths
                       for row in [out["results"][str(d)]] if metric in row[s] and metric in row["checkpoint"]]
                slope = statistics.linear_regression(*zip(*pts)).slope if len(pts) > 1 else None
                out["excess"][s][metric] = {
                    "depths": [d for d, _ in pts], "excess_bytes": [e for _, e in pts], "slope_bytes_per_layer": slope,
                    "slope_layer_inputs_per_layer": None if slope is None or not unit else slope / unit,
                }
    return out


# ---------------------------------------------------------------------- profiles


def _loaded(c: Case, strategy: str, seed: int) -> Runner:
    """A warm runner of ``strategy`` (plain's held bytes measured first for a budget)."""
    plain_held = None
    if strategy.startswith("budget"):
        plain_held = run_strategies(c, ["plain"], 0, seed=seed, warmup=0, log=lambda m: None)["strategies"]["plain"]
        plain_held = plain_held["held"]
    runner = Runner(c, strategy, plain_held, share_params=True)
    for _ in range(2):
        runner.step(seed)
    return runner


def _profile_rows(stats: pstats.Stats, key: int, n: int, keep: Callable[[str], bool]) -> list[list[Any]]:
    # stats.stats: (file, line, function) -> (primitive calls, calls, tottime, cumtime, callers)
    rows = sorted(((k, v) for k, v in stats.stats.items() if keep(k[0])),  # type: ignore[attr-defined]
                  key=lambda kv: kv[1][key], reverse=True)
    return [[f"{tt * 1e3:.1f}", f"{ct * 1e3:.1f}", nc,
             f"`{file.split('site-packages' + os.sep)[-1].split(os.sep + 'gradient_scope' + os.sep)[-1]}:{line}({fn})`"]
            for (file, line, fn), (_, nc, tt, ct, _) in rows[:n]]


def cprofile_step(c: Case, strategy: str, seed: int, out_dir: str, top: int = 25) -> str:
    """cProfile one fwd+bwd step under ``strategy`` (after two warm-up steps); writes
    ``cprofile-<model>-<strategy>.md`` (top functions by tottime and cumtime: those of
    gradient_scope and torch/utils/_python_dispatch, then all) and ``.prof``; returns the text.

    The profiler's clock is the process's CPU time, not wall time: on a busy machine wall
    time charges the time the process waits for a core to whatever function was running.
    """
    runner = _loaded(c, strategy, seed)
    prof = cProfile.Profile(time.process_time)
    runner.model.zero_grad(set_to_none=True)
    t0, c0 = time.perf_counter(), time.process_time()
    prof.enable()
    runner.forward().backward()
    prof.disable()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    stats = pstats.Stats(prof)
    base = os.path.join(out_dir, f"cprofile-{c.name}-{strategy}")
    stats.dump_stats(base + ".prof")

    def ours(f: str) -> bool:
        return "gradient_scope" in f or os.path.join("torch", "utils", "_python_dispatch") in f

    total = stats.total_tt  # type: ignore[attr-defined]
    own = sum(v[2] for k, v in stats.stats.items() if ours(k[0]))  # type: ignore[attr-defined]
    head = ["tottime (ms)", "cumtime (ms)", "calls", "function"]
    text = "\n".join([
        f"# cProfile: {c.name}, strategy {strategy}, one fwd+bwd step", "",
        f"Under cProfile (clock: process CPU time): wall {wall * 1e3:.0f} ms, CPU {cpu * 1e3:.0f} ms; total profiled "
        f"time {total * 1e3:.0f} ms; tottime in gradient_scope + torch/utils/_python_dispatch: {own * 1e3:.0f} ms "
        f"({own / total:.0%}). torch threads {torch.get_num_threads()}; load average {load_average()}. `~:0(...)` rows "
        "are C functions; `run_backward`'s tottime is the C++ autograd engine with the backward kernels it runs.", "",
        f"## gradient_scope and torch/utils/_python_dispatch, top {top} by tottime", "",
        md_table(head, _profile_rows(stats, 2, top, ours)), "",
        f"## gradient_scope and torch/utils/_python_dispatch, top {top} by cumtime", "",
        md_table(head, _profile_rows(stats, 3, top, ours)), "",
        f"## all functions, top {top} by tottime", "",
        md_table(head, _profile_rows(stats, 2, top, lambda f: True)), "",
    ])
    with open(base + ".md", "w") as f:
        f.write(text)
    return text


def profile_device_step(c: Case, strategy: str, seed: int, out_dir: str) -> dict[str, Any]:
    """One step of ``strategy`` under ``torch.profiler``: the host's time in forward and in
    backward against the device's kernel time (a forward whose kernels take less time
    than the host needs to launch them is host-bound); on CUDA also the chrome trace
    (``trace-<model>-<strategy>.json``) and one more step under
    ``torch.cuda.set_sync_debug_mode("warn")``, counting the synchronizing calls by where
    they were made."""
    on_cuda = c.device.startswith("cuda")
    runner = _loaded(c, strategy, seed)
    runner.model.zero_grad(set_to_none=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    sync(c.device)
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        with record_function("benchmarks.forward"):
            loss = runner.forward()
        with record_function("benchmarks.backward"):
            loss.backward()
        sync(c.device)
    wall = time.perf_counter() - t0
    events = prof.events()
    ranges = {e.name: e for e in events if e.name in ("benchmarks.forward", "benchmarks.backward")}
    kernels_us = sum(e.self_device_time_total for e in events)
    out: dict[str, Any] = {
        "step_wall_ms": wall * 1e3,
        "host_fwd_ms": ranges["benchmarks.forward"].cpu_time_total / 1e3,
        "host_bwd_call_ms": ranges["benchmarks.backward"].cpu_time_total / 1e3,
        "device_fwd_ms": ranges["benchmarks.forward"].device_time_total / 1e3,
        "device_total_ms": kernels_us / 1e3,
        "device_busy": kernels_us / 1e3 / (wall * 1e3) if on_cuda else None,
    }
    if on_cuda:
        prof.export_chrome_trace(os.path.join(out_dir, f"trace-{c.name}-{strategy}.json"))
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                runner.step(seed)
                sync(c.device)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        where = collections.Counter(f"{w.filename}:{w.lineno}: {str(w.message).splitlines()[0][:120]}"
                                    for w in caught if "synchroniz" in str(w.message))
        out["sync_calls"] = dict(where.most_common())
    del loss, runner
    free_device_memory(c.device)
    return out


# ---------------------------------------------------------------------- report


def _round_ratio(a: dict[str, Any], b: dict[str, Any]) -> tuple[float, tuple[float, float]] | None:
    """Median (and quartiles) of the per-round ratios of two strategies' step times."""
    if "times_s" not in a or "times_s" not in b:
        return None
    r = [x / y for x, y in zip(a["times_s"], b["times_s"])]
    return (statistics.median(r), quartiles(r)) if r else None


def compute_targets(models: dict[str, Any], sweep: dict[str, Any] | None, device: str) -> Targets:
    """The issues' targets, each measured in the same run: one row per (target, model)."""
    T = Targets(("target", "model", "measured"))
    for m, res in models.items():
        s = res["strategies"]
        sl, ck, sa, ml = (s.get(k, {}) for k in ("scope_layer", "checkpoint", "scope_attn_mlp", "mode_layer"))
        noise = aa_note(s, base="plain")
        if "peak" in sl and "peak" in ck:
            for metric in ("peak", "held"):
                T.add(f"scope_layer {'held after forward' if metric == 'held' else 'peak'} <= checkpoint's", m,
                      f"{fmt_mib(sl[metric])} vs {fmt_mib(ck[metric])} MiB ({sl[metric] / ck[metric]:.3f}x)",
                      met=sl[metric] <= ck[metric])
        if "ratio_vs_checkpoint" in sl:
            floor = ""
            if "ratio_vs_plain" in ml and "ratio_vs_plain" in ck:
                # What a do-nothing dispatch mode around each layer adds to plain's step, as a
                # share of checkpoint's step: the least any dispatch-mode recorder adds.
                mode = (ml["ratio_vs_plain"] - 1) / ck["ratio_vs_plain"]
                floor = f"; a do-nothing mode per layer alone adds {mode:.3f}x of checkpoint's step"
            T.add("scope_layer step time <= 1.00x checkpoint's", m, fmt_ratio(sl, "checkpoint"),
                  met=sl["ratio_vs_checkpoint"] <= 1.00, note=noise + floor)
        b50 = s.get("budget50", {})
        if "ratio_vs_checkpoint" in b50:
            T.add("budget50 step time <= 0.90x checkpoint's", m, fmt_ratio(b50, "checkpoint"),
                  met=b50["ratio_vs_checkpoint"] <= 0.90, note=noise)
        sac, mm = s.get("sac_matmul", {}), s.get("scope_layer_savemm", {})
        if "sac_matmul" in s and "scope_layer_savemm" in s:
            rr = _round_ratio(mm, sac)
            T.add("scope_layer_savemm step time <= sac_matmul's", m,
                  "n/a" if rr is None else f"{rr[0]:.3f}x ({rr[1][0]:.2f}-{rr[1][1]:.2f})",
                  met=None if rr is None else rr[0] <= 1.0,
                  note=f"sac_matmul failed: {sac['error'][:160]}" if "error" in sac else noise)
        if "peak" in sa and "peak" in ck:
            T.add("scope_attn_mlp peak < checkpoint's", m,
                  f"{fmt_mib(sa['peak'])} vs {fmt_mib(ck['peak'])} MiB ({sa['peak'] / ck['peak']:.3f}x)",
                  met=sa["peak"] < ck["peak"], note="residual branches (no attention/MLP)" if m == "resnet" else "")
        scoped = [k for k in s if (k.startswith("scope") or k.startswith("budget")) and "grads_vs_plain" in s[k]]
        if scoped and device == "cpu" and res.get("dtype") == "float32":
            bad = [k for k in scoped if not (s[k]["grads_vs_plain"]["bitwise_equal"]
                                             and s[k]["losses_vs_plain"]["bitwise_equal"])]
            worst = max(s[k]["grads_vs_plain"]["max_abs_diff"] or 0.0 for k in scoped)
            T.add("scope strategies: gradients and losses bitwise equal to plain", m,
                  f"max abs grad diff {worst:g}" + (f"; differ: {', '.join(bad)}" if bad else ""), met=not bad)
            bad = [k for k in scoped if not s[k]["buffers_vs_plain"]["bitwise_equal"]]
            T.add("scope strategies: buffers bitwise equal to plain after training", m,
                  "equal" if not bad else f"differ: {', '.join(bad)}", met=not bad)
        failed = [k for k, v in s.items() if "error" in v]
        if failed or "error" in res:
            T.add("every strategy runs", m, res.get("error", f"failed: {', '.join(failed)}")[:300], met=False)
    for metric, v in ((mt, e) for mt, e in (sweep or {}).get("excess", {}).get("scope_layer", {}).items()):
        if len(v["excess_bytes"]) > 1:
            unit = sweep["results"][str(sweep["depths"][-1])]["layer_input_bytes"]  # type: ignore[index]
            span, grow = v["depths"][-1] - v["depths"][0], v["excess_bytes"][-1] - v["excess_bytes"][0]
            tol = SWEEP_TOLERANCE * unit * span if unit else 64 * KiB
            li = v["slope_layer_inputs_per_layer"]
            T.add(f"depth sweep: scope_layer {metric} excess over checkpoint does not grow with depth",
                  f"gpt2 x{v['depths'][0]}-{v['depths'][-1]}",
                  f"excess {v['excess_bytes'][0] / KiB:+.0f} KiB at {v['depths'][0]} layers, "
                  f"{v['excess_bytes'][-1] / KiB:+.0f} KiB at {v['depths'][-1]}"
                  + ("" if li is None else f"; slope {li:+.2f} layer inputs per layer"), met=grow <= tol,
                  note=f"met when it grows by <= {SWEEP_TOLERANCE:g} layer input per added layer ({tol / KiB:.0f} KiB)")
    return T


def _eq(v: dict[str, Any], key: str) -> str:
    c = v.get(key)
    if c is None:
        return ""
    if c["bitwise_equal"]:
        return "equal"
    d = c.get("max_abs_diff")
    return f"**{c.get('n_differing', '?')} differ** (max {d:.3g})" if d is not None else "**differ**"


def model_markdown(res: dict[str, Any]) -> str:
    """One model's strategies: memory, forward / backward / step time, agreement with plain."""
    s = res["strategies"]
    ck = s.get("checkpoint", {})

    def rel(v: dict[str, Any], k: str) -> str:
        return f"{v[k] / ck[k]:.3f}x" if k in v and ck.get(k) else ""

    def ms(v: dict[str, Any] | None) -> str:
        return f"{1e3 * v['time_median_s']:.1f}" if v and "time_median_s" in v else ""

    rows = []
    for name, v in s.items():
        if "error" in v:
            rows.append([name, f"failed: {v['error'][:120]}", *[""] * 13])
            continue
        rows.append([name, fmt_mib(v.get("held")), fmt_mib(v.get("peak")), rel(v, "held"), rel(v, "peak"),
                     ms(v.get("fwd")), ms(v.get("bwd")), ms(v), ms(v.get("host_fwd")), fmt_ratio(v, "plain"),
                     fmt_ratio(v, "checkpoint"), _eq(v, "grads_vs_plain"), _eq(v, "losses_vs_plain"),
                     _eq(v, "buffers_vs_plain"), v.get("grads_vs_plain", {}).get("max_rel_diff", "")])
    return md_table(["strategy", "held after fwd (MiB)", "peak fwd+bwd (MiB)", "held vs ckpt", "peak vs ckpt",
                     "fwd (ms)", "bwd (ms)", "step (ms)", "host in fwd (ms)", "step vs plain (IQR)",
                     "step vs ckpt (IQR)", "grads vs plain", "losses", "buffers", "max rel grad diff"], rows)


def sweep_markdown(sw: dict[str, Any]) -> str:
    """The depth sweep as a Markdown table, then the growth of each scope's excess."""
    rows = []
    for d in sw["depths"]:
        row = sw["results"][str(d)]
        sl, ck = row["scope_layer"], row["checkpoint"]
        rows.append([d, f"{row['layer_input_bytes'] / KiB:.0f}" if row["layer_input_bytes"] else "",
                     *(f"{fmt_mib(row[s].get('held'))} / {fmt_mib(row[s].get('peak'))}"
                       + ("" if row[s].get("grads_vs_plain", {}).get("bitwise_equal", True) else " (grads differ)")
                       for s in sw["strategies"]),
                     f"{(sl['held'] - ck['held']) / KiB:+.0f} / {(sl['peak'] - ck['peak']) / KiB:+.0f}"
                     if "peak" in sl and "peak" in ck else ""])
    slopes = [f"- `{s}` - `checkpoint` {metric}: {v['slope_bytes_per_layer'] / KiB:+.1f} KiB per added layer"
              + ("" if v["slope_layer_inputs_per_layer"] is None else f" ({v['slope_layer_inputs_per_layer']:+.2f} "
                 "layer inputs)")
              for s, e in sw["excess"].items() for metric, v in e.items() if v["slope_bytes_per_layer"] is not None]
    return "\n".join([md_table(["layers", "layer input (KiB)", *(f"{s} held / peak (MiB)" for s in sw["strategies"]),
                                "scope_layer - checkpoint: held / peak (KiB)"], rows), "", *slopes])


def to_markdown(results: dict[str, Any]) -> str:
    """``results.md``: run and machine, targets, one section per model, sweep, charts."""
    on_cuda = results["device"].startswith("cuda")
    out = [
        *header_lines("# gradient_scope on real models", "benchmarks.models", results, ("transformers",)),
        f"- device {results['device']}, size {results['size']}, seed {results['seed']}",
        "- memory: " + ("torch.cuda allocator statistics" if on_cuda else
                        "CPU profiler (profile_memory=True), benchmarks/_harness/memory.py")
        + "; held = allocated during forward and still allocated after it; peak = highest level during fwd+bwd "
        "(gradients included)",
        f"- time: forward, backward and the step (no optimizer), medians of {results['rounds']} interleaved rounds "
        "(order rotated each round)" + (" from CUDA events; host in fwd: the host's time in the forward call" if on_cuda
                                         else "") + "; ratios are medians of per-round ratios, with their IQR",
        f"- agreement: gradients after the first measured step (identical weights, batch and RNG seed), losses of "
        f"{results['train_steps']} step(s), all buffers after them; the plain_again row is plain against itself",
        "",
        *sections(Targets.from_rows(results["targets"]), results["strategies"]),
    ]
    for name, res in results["models"].items():
        if "error" in res:
            out += [f"## {name}", "", f"Not run: {res['error']}", ""]
            continue
        cfg = ", ".join(f"{k}={v}" for k, v in res["config"].items() if k != "model")
        li = res.get("layer_input_bytes")
        out += [f"## {name}", "",
                f"{res['config']['model']}; {cfg}; {res['dtype']}. Layers: {res['n_layers']} x `{res['layer_class']}`"
                + ("" if li is None else f" (first layer input {li / KiB:.0f} KiB)")
                + f"; attention/MLP scopes: {res['n_attn_mlp_modules']} x {res['attn_mlp_modules']}; "
                f"{res['rounds']} timing rounds.", "", model_markdown(res), ""]
        for k, v in res["strategies"].items():
            for key in ("grads_vs_plain", "buffers_vs_plain"):
                c = v.get(key)
                if c and not c["bitwise_equal"] and c.get("differing") and not on_cuda:
                    out.append(f"- {k}: {key.replace('_vs_plain', '')} differing from plain: "
                               + ", ".join(f"`{n}`" for n in c["differing"])
                               + (", ..." if c["n_differing"] > 5 else ""))
        out.append("")
    if results.get("sweep"):
        sw = results["sweep"]
        cfg = ", ".join(f"{k}={v}" for k, v in sw["config"].items() if k not in ("model", "parameters"))
        out += [f"## Depth sweep ({sw['model']}: {cfg})", "", sweep_markdown(sw), ""]
    warn = [f"{n}: {w}" for n, r in results["models"].items() for w in r.get("warnings", [])]
    return "\n".join(out + sections(charts=results.get("charts", []), warnings=warn))


def make_charts(results: dict[str, Any], out_dir: str) -> list[str]:
    """memory_per_model.png, time_per_model.png, depth_sweep.png."""
    plt = pyplot()
    files: list[str] = []
    models = {n: r for n, r in results["models"].items() if r["strategies"]}
    if models:
        cols = min(4, len(models))
        rows = (len(models) + cols - 1) // cols
        fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.6 * rows), squeeze=False)
        for ax, (n, res) in zip(axes.flat, models.items()):
            s = {k: v for k, v in res["strategies"].items() if "peak" in v}
            grouped_bars(ax, list(s), {"held after fwd": [v["held"] / MiB for v in s.values()],
                                       "peak fwd+bwd": [v["peak"] / MiB for v in s.values()]})
            if "checkpoint" in s:
                ax.axhline(s["checkpoint"]["peak"] / MiB, color="gray", ls="--", lw=0.8)
            ax.set_title(n)
            ax.set_ylabel("MiB")
        for ax in list(axes.flat)[len(models):]:
            ax.axis("off")
        axes.flat[0].legend(fontsize=7)
        fig.suptitle("Memory per model and strategy (dashed: checkpoint's peak)")
        save_figure(fig, out_dir, "memory_per_model.png", files, dpi=100)

        strats = [k for k in results["strategies"] if k != "plain"]
        series, errors = {}, {}
        for st in strats:
            vs = [m["strategies"].get(st, {}) for m in models.values()]
            series[st] = [v.get("ratio_vs_plain") for v in vs]
            errors[st] = ([v["ratio_vs_plain"] - v["ratio_vs_plain_quartiles"][0] if "ratio_vs_plain" in v else 0
                           for v in vs],
                          [v["ratio_vs_plain_quartiles"][1] - v["ratio_vs_plain"] if "ratio_vs_plain" in v else 0
                           for v in vs])
        fig, ax = plt.subplots(figsize=(max(8, 1.3 * len(models) + 3), 4.5))
        grouped_bars(ax, list(models), series, errors)
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_ylabel("fwd+bwd time / plain (median per-round ratio, IQR)")
        ax.set_title("Step time relative to plain")
        ax.legend(fontsize=8, ncol=3)
        save_figure(fig, out_dir, "time_per_model.png", files, dpi=100)
    sw = results.get("sweep")
    if sw:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
        for i, st in enumerate(sw["strategies"]):
            pts = [(d, sw["results"][str(d)][st]) for d in sw["depths"] if "peak" in sw["results"][str(d)][st]]
            a1.plot([d for d, _ in pts], [v["peak"] / MiB for _, v in pts], "o-", color=f"C{i}", label=f"{st} peak")
            a1.plot([d for d, _ in pts], [v["held"] / MiB for _, v in pts], "s--", color=f"C{i}", alpha=0.6,
                    label=f"{st} held")
        for i, (st, e) in enumerate(sw["excess"].items()):
            for metric, style in (("peak", "o-"), ("held", "s--")):
                v = e[metric]
                a2.plot(v["depths"], [b / MiB for b in v["excess_bytes"]], style, color=f"C{i + 2}",
                        label=f"{st} {metric}")
        a2.axhline(0, color="black", lw=0.8)
        for a, title in ((a1, f"Depth sweep ({sw['model']}): solid peak, dashed held"),
                         (a2, "Scope minus checkpoint (solid peak, dashed held)")):
            a.set_xscale("log", base=2)
            a.set_xticks(sw["depths"], [str(d) for d in sw["depths"]])
            a.set_xlabel("layers")
            a.set_ylabel("MiB")
            a.set_title(title)
            a.grid(alpha=0.3)
            a.legend(fontsize=7)
        save_figure(fig, out_dir, "depth_sweep.png", files, dpi=100)
    return files


# ---------------------------------------------------------------------- command line


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.models", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smaller models, GPT-2/Llama/BERT/ResNet, 2 rounds")
    p.add_argument("--gpu-suite", action="store_true",
                   help=f"the GPU benchmark: models {' '.join(GPU_SUITE)} at their GPU sizes and dtypes, strategies "
                   f"{' '.join(GPU_STRATEGIES)}, {GPU['rounds']} rounds, no sweep")
    p.add_argument("--size", choices=["full", "quick", "tiny"],
                   help="model size (default: full, quick with --quick, the GPU sizes with --gpu-suite); tiny: tests")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                   help="default float32 (with --gpu-suite: each model's own)")
    p.add_argument("--models", nargs="+", help=f"models to run (default: {' '.join(DEFAULT_MODELS)}; --quick: gpt2 "
                   f"llama bert resnet; --gpu-suite: {' '.join(GPU_SUITE)})")
    p.add_argument("--strategies", nargs="+", help="strategies, plain first (default: the preset's)")
    p.add_argument("--layers", type=int, help="layers of every model (e.g. as many as fit for llama8b_stack)")
    p.add_argument("--rounds", type=int, help="interleaved timing rounds (default 7, --quick 2, --gpu-suite 5)")
    p.add_argument("--train-steps", type=int, help="steps compared with plain (default 3; --gpu-suite 1, no optimizer)")
    p.add_argument("--phase-timeout", type=float, metavar="S",
                   help="seconds per model: strategies not started and timing rounds not begun by then are skipped "
                   f"(default: none; --gpu-suite {GPU['phase_timeout']:.0f})")
    p.add_argument("--depths", type=int, nargs="+", help="depth sweep layers (default 4 8 16 32)")
    p.add_argument("--no-sweep", action="store_true", help="skip the depth sweep")
    p.add_argument("--out", help="output directory (default benchmarks/results/<device>-models[-quick]/)")
    p.add_argument("--no-charts", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1,
                   help="torch.set_num_threads (default 1: on a shared machine OpenMP threads spin-wait for each "
                   "other and a step can take 10x longer; 0 keeps torch's default)")
    p.add_argument("--cprofile", metavar="STRATEGY",
                   help="only cProfile one fwd+bwd step of each model under STRATEGY (cprofile-<model>-<strategy>.md)")
    p.add_argument("--profile-cuda", action="store_true",
                   help="only profile one step of each model and strategy with torch.profiler (host time of forward "
                   "vs GPU time, chrome trace) and, on CUDA, count the synchronizing calls of one more step")
    return p


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    """Command line entry point; returns the results dict (None with ``--cprofile``)."""
    argv = sys.argv[1:] if argv is None else argv
    p = _parser()
    a = p.parse_args(argv)
    if importlib.util.find_spec("transformers") is None:
        p.error("transformers is not installed: pip install -e '.[bench]'")
    t_start = time.perf_counter()
    log = make_log(t_start)
    if a.threads:
        torch.set_num_threads(a.threads)
    device = resolve_device(a.device, p.error)
    mode = GPU if a.gpu_suite else QUICK if a.quick else FULL
    size = a.size or mode.get("size")
    if size == "tiny":  # the GPU suite keeps its one compared step: its copies share weights
        mode = {**mode, **{k: v for k, v in TINY.items() if k != "size" and not (a.gpu_suite and k == "train_steps")}}
    # label -> (model, size, dtype)
    if a.gpu_suite:
        cases = {k: (m, size or s, a.dtype or d) for k, (m, s, d) in GPU_SUITE.items()}
    else:
        cases = {k: (k, size, a.dtype or "float32") for k in mode.get("models") or DEFAULT_MODELS}
    if a.models:
        unknown = [m for m in a.models if m not in cases and m not in MODELS]
        if unknown:
            p.error(f"unknown models {unknown}; the models are {', '.join(cases | dict.fromkeys(MODELS))}")
        cases = {m: cases.get(m, (m, size or "full", a.dtype or "float32")) for m in a.models}
    strategies = a.strategies or (GPU_STRATEGIES if a.gpu_suite else STRATEGIES)
    rounds, train_steps = a.rounds or mode["rounds"], a.train_steps or mode["train_steps"]
    timeout = a.phase_timeout or mode.get("phase_timeout")
    overrides = {} if a.layers is None else {"layers": a.layers}
    dev_name = torch.device(device).type
    profiling = a.cprofile or a.profile_cuda
    suffix = "-models" + ("-profile" if profiling else "-quick" if a.quick or size == "tiny" else "")
    out_dir = results_dir(a.out, dev_name + suffix)
    preload(sorted({m for m, _, _ in cases.values()} | ({"gpt2"} if not a.no_sweep else set())))

    if profiling:
        profiles: dict[str, Any] = {}
        for label, (model, sz, dt) in cases.items():
            deadline = None if timeout is None else time.perf_counter() + timeout
            c, _ = _case(label, model, sz, device, getattr(torch, dt), a.seed, **overrides)
            for st in [a.cprofile] if a.cprofile else strategies:
                if a.cprofile:
                    print(cprofile_step(c, st, a.seed, out_dir))
                    continue
                per = profiles.setdefault(label, {})
                if deadline is not None and time.perf_counter() > deadline:
                    per[st] = {"error": "skipped: the time limit of this model was reached"}
                    continue
                try:
                    per[st] = profile_device_step(c, st, a.seed, out_dir)
                except Exception as e:  # noqa: BLE001 - a failing strategy is a result
                    per[st] = {"error": f"{type(e).__name__}: {e}"[:500]}
                    free_device_memory(device)
                log(f"  {label}/{st}: {per[st]}")
                if a.profile_cuda:  # after each strategy: a run cut short keeps what it measured
                    write_results(out_dir, {"argv": argv, "profiles": profiles}, _profiles_markdown(profiles))
            del c
            free_device_memory(device)
        log(f"wrote {out_dir}")
        return None if a.cprofile else {"profiles": profiles}

    machine = machine_info(device, packages=("transformers",))
    log(f"{machine['cpu_model']}, {machine['cpu_cores']} cores, {torch.get_num_threads()} torch threads, "
        f"torch {machine['torch']}, transformers {machine['transformers']}; {device}, size {size or 'gpu'}")
    results: dict[str, Any] = {
        "argv": argv, "device": device, "size": size or "gpu", "seed": a.seed, "rounds": rounds,
        "train_steps": train_steps, "phase_timeout_s": timeout, "machine": machine,
        "strategies": {k: DESCRIPTIONS[k] for k in strategies}, "models": {}, "sweep": None, "charts": [],
    }

    def write() -> None:  # after each model: a run cut short leaves what it measured
        mark_end(machine)
        results["targets"] = compute_targets(results["models"], results["sweep"], dev_name)
        results["duration_s"] = time.perf_counter() - t_start
        write_results(out_dir, results, to_markdown(results))

    for label, (model, sz, dt) in cases.items():
        log(f"{label}: {model} {sz} {dt}; {len(strategies)} strategies, {train_steps} step(s), {rounds} rounds")
        deadline = None if timeout is None else time.perf_counter() + timeout
        results["models"][label] = run_model(label, model, sz, device, getattr(torch, dt), strategies, rounds,
                                             train_steps, a.seed, deadline, log, **overrides)
        if results["models"][label]["strategies"]:
            print(f"\n{label}\n{model_markdown(results['models'][label])}\n", flush=True)
        write()
    if not (a.no_sweep or a.gpu_suite):
        sweep_size = "tiny" if size == "tiny" else "sweep"
        depths = a.depths or mode["depths"]
        log(f"depth sweep: gpt2 ({sweep_size}) at {depths} layers")
        results["sweep"] = run_depth_sweep(depths, sweep_size, device, torch.float32, a.seed, log)
        print(f"\ndepth sweep\n{sweep_markdown(results['sweep'])}\n", flush=True)
    if not a.no_charts:
        results["charts"] = make_charts(results, out_dir)
    write()
    print("targets\n" + results["targets"].markdown())
    log(f"wrote {out_dir}/results.json, results.md and {len(results['charts'])} charts")
    return results


def _profiles_markdown(profiles: dict[str, Any]) -> str:
    cols = ["step_wall_ms", "host_fwd_ms", "host_bwd_call_ms", "device_fwd_ms", "device_total_ms", "device_busy"]
    rows = [[f"{m}/{st}", *(r.get("error", "")[:100] if "error" in r and c == cols[0] else
                            "" if r.get(c) is None else f"{r[c]:.3g}" for c in cols),
             "; ".join(f"{k} x{n}" for k, n in r.get("sync_calls", {}).items()) or ("" if "sync_calls" in r else "n/a")]
            for m, per in profiles.items() for st, r in per.items()]
    return "\n".join(["# One step per strategy under torch.profiler", "",
                      "Host time of forward against the device's kernel time; synchronizing calls of one step under "
                      "`torch.cuda.set_sync_debug_mode('warn')` (CUDA only).", "",
                      md_table(["model/strategy", *cols, "synchronizing calls"], rows), ""])


if __name__ == "__main__":
    main()
