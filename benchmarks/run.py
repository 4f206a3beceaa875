"""gradient_scope benchmark suite: one command, all strategies on the same model.

    python -m benchmarks.run [--quick] [--device cpu|cuda] [--dtype float32|bfloat16] [--out DIR]

See benchmarks/README.md for what is measured and how to read the results.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from gradient_scope import recompute_scope
from gradient_scope.policies import as_save_policy, save_matmuls

from ._common import (
    KiB,
    MiB,
    frozen_gc,
    interleaved_rounds,
    load_average,
    machine_info,
    ratio_summary,
)
from ._common import (
    fmt_mib as _mib,
)
from ._common import (
    fmt_x as _x,
)
from ._common import (
    interception_gone as _interception_gone,
)
from .ideal import BlockAccounting
from .memory import measure
from .model import GPT, GPTConfig, make_batch
from .overhead import format_overhead, run_overhead, sac_context

SAVE_MM: Any = save_matmuls
SAVE_MM_NAME = "gradient_scope.policies.save_matmuls"

STRATEGIES = ["plain", "checkpoint", "sac_matmul", "scope_layer", "scope_mlp", "scope_act", "scope_layer_savemm"]
SCOPE_STRATEGIES = ["scope_layer", "scope_mlp", "scope_act", "scope_layer_savemm"]
SCALING_STRATEGIES = ["plain", "checkpoint", "scope_layer", "scope_act"]
AA = "plain_again"  # A/A control: the plain strategy timed twice per round

DESCRIPTIONS = {
    "plain": "no recomputation",
    "checkpoint": "torch.utils.checkpoint per layer (use_reentrant=False)",
    "sac_matmul": "torch selective checkpointing per layer: MUST_SAVE matmuls, PREFER_RECOMPUTE the rest",
    "scope_layer": "recompute_scope() around each layer",
    "scope_mlp": "recompute_scope() around the MLP activation gelu(fc1(x)) only (3-D input)",
    "scope_act": "recompute_scope() around gelu(fc1(x)) and around the attention probabilities",
    "scope_layer_savemm": f"recompute_scope(save={SAVE_MM_NAME}) around each layer",
    AA: "plain again (A/A control: the noise floor of the time ratios)",
}

# Sizes. The default model takes ~0.2-1 s per fwd+bwd step on a quiet 2-core CPU.
FULL = dict(
    model=GPTConfig(),
    rounds=10,
    overhead_rounds=25,
    layers=[1, 2, 4, 8],
    seqs=[64, 128, 256, 512],
    scaling_rounds=3,
)
QUICK = dict(
    model=GPTConfig(vocab=1024, seq=128, d_model=128, n_head=4, n_layer=2, batch=4),
    rounds=3,
    overhead_rounds=7,
    layers=[1, 4],
    seqs=[64, 256],
    scaling_rounds=2,
    # One thread: on a busy 2-core machine OpenMP threads spin-wait for each other and a
    # step takes 4x longer and varies wildly; --threads overrides.
    threads=1,
)


# ---------------------------------------------------------------------- strategies


def apply_strategy(
    model: GPT, name: str, scopes: list, make_block: Callable[[], Any] | None = None
) -> None:
    """Point the model's hooks at a strategy. Scopes created are appended to ``scopes``.

    ``make_block`` replaces the scope factory (same placement, other context manager):
    used by the ideal-memory analysis.
    """
    model.reset_strategy()
    if name in ("plain", AA):
        return
    if name == "checkpoint":
        model.layer_call = lambda block, x: checkpoint(block, x, use_reentrant=False)
        return
    if name == "sac_matmul":
        model.layer_call = lambda block, x: checkpoint(
            block, x, use_reentrant=False, context_fn=sac_context
        )
        return
    save = SAVE_MM if name == "scope_layer_savemm" else None

    def new_scope():
        if make_block is not None:
            return make_block()
        s = recompute_scope(save=save)
        scopes.append(s)
        return s

    if name in ("scope_layer", "scope_layer_savemm"):

        def layer_call(block, x):
            with new_scope():
                return block(x)

        model.layer_call = layer_call
    elif name == "scope_act":
        model.act_ctx = lambda kind: new_scope()
    elif name == "scope_mlp":
        model.act_ctx = lambda kind: new_scope() if kind == "mlp_act" else contextlib.nullcontext()
    else:
        raise ValueError(f"unknown strategy {name!r}")


class Bench:
    """One model, one batch; runs strategies on it."""

    def __init__(self, cfg: GPTConfig, device: str, dtype: torch.dtype, seed: int) -> None:
        self.cfg, self.device, self.dtype, self.seed = cfg, device, dtype, seed
        torch.manual_seed(seed)
        self.model = GPT(cfg).to(device=device, dtype=dtype)
        self.model.train()
        self.x, self.y = make_batch(cfg, device, seed)
        self.scopes: list = []
        self.warnings: list[str] = []

    def _sync(self) -> None:
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()

    def _prepare(self, name: str) -> None:
        self.scopes.clear()
        apply_strategy(self.model, name, self.scopes)
        self.model.zero_grad(set_to_none=True)
        torch.manual_seed(self.seed)  # same dropout masks for every strategy

    def _check_clean(self, name: str) -> None:
        if not _interception_gone():
            gc.collect()
            msg = f"{name}: saved-tensor hooks / dispatch mode still active after the step"
            if not _interception_gone():
                msg += " (even after gc.collect())"
            if msg not in self.warnings:
                self.warnings.append(msg)

    def timed_step(self, name: str) -> float:
        self._prepare(name)
        gc.collect()
        self._sync()
        t0 = time.perf_counter()
        loss = self.model(self.x, self.y)
        loss.backward()
        self._sync()
        dt = time.perf_counter() - t0
        del loss
        self._check_clean(name)
        return dt

    def profiled_step(self, name: str) -> dict[str, Any]:
        """Memory (held after forward, peak of fwd+bwd), loss, gradients, scope stats."""
        self._prepare(name)
        gc.collect()
        loss, held, peak = measure(
            lambda: self.model(self.x, self.y), lambda loss: loss.backward(), self.device
        )
        out = {
            "held": held,
            "peak": peak,
            "loss": loss.item(),
            "grads": [p.grad.detach().clone() for p in self.model.parameters()],
        }
        if self.scopes:
            out["scopes"] = len(self.scopes)
            out["bytes_packed"] = sum(s.stats.bytes_packed for s in self.scopes)
            out["tensors_packed"] = sum(s.stats.tensors_packed for s in self.scopes)
            out["ops_recorded"] = sum(s.stats.ops_recorded for s in self.scopes)
            out["ops_replayed"] = sum(s.stats.ops_replayed for s in self.scopes)
            out["replays"] = sum(s.stats.replays for s in self.scopes)
        del loss
        self.scopes.clear()
        self._check_clean(name)
        return out

    def block_accounting(self, name: str) -> dict[str, int]:
        """Storages created / read by the strategy's blocks and saved by plain autograd."""
        policy = as_save_policy(SAVE_MM) if name == "scope_layer_savemm" else None
        acct = BlockAccounting(policy=policy)
        scopes: list = []
        apply_strategy(self.model, name, scopes, make_block=acct.block)
        self.model.zero_grad(set_to_none=True)
        acct.mark_preexisting([*self.model.parameters(), *self.model.buffers(), self.x, self.y])
        torch.manual_seed(self.seed)
        with acct.saving():
            loss = self.model(self.x, self.y)
        res = acct.result()
        res["saved_bytes"] = sum(k[1] for k in acct.saved if k not in acct.preexisting)
        del loss, acct
        gc.collect()
        self.model.reset_strategy()
        return res


def run_suite(
    cfg: GPTConfig,
    device: str,
    dtype: torch.dtype,
    strategies: list[str],
    rounds: int,
    seed: int = 0,
    aa: bool = True,
    ideal: bool = False,
) -> dict[str, Any]:
    bench = Bench(cfg, device, dtype, seed)
    timed = strategies + ([AA] if aa else [])
    for name in timed:  # warm-up (allocator, lazy init, lazy imports, op caches)
        bench.timed_step(name)
    with frozen_gc():  # keeps the gc.collect() before each measured step cheap
        return _run_suite(bench, strategies, timed, rounds, ideal)


def _run_suite(bench: Bench, strategies: list[str], timed: list[str], rounds: int, ideal: bool) -> dict:
    res: dict[str, dict[str, Any]] = {}
    plain_grads = None
    for name in strategies:
        r = bench.profiled_step(name)
        grads = r.pop("grads")
        if name == "plain":
            plain_grads = grads
        if plain_grads is not None:
            r["grad_max_abs_diff"] = max(
                (g.float() - p.float()).abs().max().item() for g, p in zip(grads, plain_grads)
            )
            r["grads_bitwise_equal"] = all(torch.equal(g, p) for g, p in zip(grads, plain_grads))
        res[name] = r
        del grads
    del plain_grads
    # Timing: interleaved rounds, order rotated each round.
    times = interleaved_rounds({name: (lambda n=name: bench.timed_step(n)) for name in timed}, rounds)
    for name, summary in ratio_summary(times).items():
        res.setdefault(name, {}).update(summary)
    if ideal and "plain" in res:
        plain_acct = bench.block_accounting("plain")
        res["plain"]["saved_bytes_distinct"] = plain_acct["saved_bytes"]
        for name in strategies:
            if name not in SCOPE_STRATEGIES:
                continue
            a = bench.block_accounting(name)
            r = res[name]
            r["ideal"] = {
                "held": res["plain"]["held"] - a["removed"] + a["retained"],
                "removed": a["removed"],
                "retained": a["retained"],
                "blocks_per_step": a["blocks"],
                "held_by_bytes_packed": res["plain"]["held"] - r.get("bytes_packed", 0),
            }
    return {"config": bench.cfg.asdict(), "strategies": res, "warnings": bench.warnings}


def run_scaling(
    base: GPTConfig, axis: str, points: list[int], device: str, dtype: torch.dtype, rounds: int, log
) -> dict[str, Any]:
    out: dict[str, Any] = {"axis": axis, "points": points, "results": {}}
    for p in points:
        cfg = GPTConfig(**{**base.asdict(), ("n_layer" if axis == "layers" else "seq"): p})
        t0 = time.perf_counter()
        r = run_suite(cfg, device, dtype, SCALING_STRATEGIES, rounds, aa=False)
        out["results"][str(p)] = r["strategies"]
        out.setdefault("warnings", []).extend(f"{axis}={p}: {w}" for w in r["warnings"])
        log(f"  scaling {axis}={p}: {time.perf_counter() - t0:.1f} s")
    return out


# ---------------------------------------------------------------------- report


def compute_targets(main: dict[str, Any], overhead: dict[str, Any] | None, device: str) -> list[dict]:
    s = main["strategies"]
    aa = s.get(AA, {})
    noise = aa.get("ratio_vs_plain_quartiles")
    noise_txt = (
        f"A/A ratio {aa['ratio_vs_plain']:.3f}x (IQR {noise[0]:.3f}-{noise[1]:.3f})" if noise else ""
    )
    T: list[dict] = []

    def add(target: str, measured: str, met: bool | None, note: str = "") -> None:
        T.append({"target": target, "measured": measured, "met": met, "note": note})

    sl, ck, sa, pl = s.get("scope_layer"), s.get("checkpoint"), s.get("scope_mlp"), s.get("plain")
    if sl and ck:
        add(
            "scope_layer held after forward <= checkpoint's",
            f"{_mib(sl['held'])} MiB vs {_mib(ck['held'])} MiB ({sl['held'] / ck['held']:.3f}x)",
            sl["held"] <= ck["held"],
        )
        add(
            "scope_layer step time <= 1.00x checkpoint's",
            _x(sl["ratio_vs_checkpoint"]),
            sl["ratio_vs_checkpoint"] <= 1.00,
            noise_txt,
        )
    if sa and pl:
        add(
            "scope_mlp (MLP activation only) held after forward <= 0.80x plain's",
            f"{_mib(sa['held'])} MiB vs {_mib(pl['held'])} MiB ({sa['held'] / pl['held']:.3f}x)",
            sa["held"] <= 0.80 * pl["held"],
        )
        add(
            "scope_mlp (MLP activation only) step time <= 1.10x plain's",
            _x(sa["ratio_vs_plain"]),
            sa["ratio_vs_plain"] <= 1.10,
            noise_txt,
        )
    if overhead:
        r = overhead["ratio_vs_nop_mode"]["scope/fwd"]
        ov = overhead["overhead_us_per_op"]
        add(
            "recording overhead per op <= 1.5x a do-nothing TorchDispatchMode's",
            "n/a" if r is None else f"{r:.2f}x ({ov['scope/fwd']:.2f} us vs {ov['nop_mode/fwd']:.2f} us per op)",
            None if r is None else r <= 1.5,
        )
        add(
            "overhead per op under torch.no_grad() <= 1 us",
            f"{ov['scope/no_grad']:.3f} us",
            ov["scope/no_grad"] <= 1.0,
            f"scope entered with grad on around a no_grad chain: {ov['scope_around/no_grad']:.2f} us/op",
        )
        rp = overhead.get("replay")
        if rp:
            sc, ck = rp["scope"], rp["checkpoint"]
            r = sc["ratio_vs_nop_mode"]
            add(
                "replay overhead per op measured (no target set)",
                f"{sc['overhead_us_per_op']:+.2f} us over the eager no_grad op"
                + ("" if r is None else f" ({r:.2f}x a do-nothing mode's per-op cost)"),
                None,
                f"recomputation per op: scope {sc['recompute_us_per_op']:.2f} us, "
                f"torch checkpoint's rerun {ck['recompute_us_per_op']:.2f} us; "
                f"eager op under no_grad {rp['eager_no_grad_us_per_op']:.2f} us",
            )
    diffs = {k: v.get("grad_max_abs_diff") for k, v in s.items() if v.get("grad_max_abs_diff") is not None}
    if diffs:
        worst = max(diffs.values())
        nonzero = ", ".join(f"{k}: {v:g}" for k, v in diffs.items() if v)
        add(
            "gradients bitwise equal to plain (all strategies)",
            f"max |grad diff| {worst:g}" + ("" if worst == 0 else f" ({nonzero})"),
            all(v.get("grads_bitwise_equal", True) for v in s.values()),
            "" if device == "cpu" else "bitwise equality is only expected on CPU",
        )
    for name in SCOPE_STRATEGIES:
        v = s.get(name)
        if not v or "ideal" not in v:
            continue
        ideal = v["ideal"]["held"]
        tol = 0.01 * ideal + 64 * KiB
        d = v["held"] - ideal
        add(
            f"{name} held within 1% + 64 KiB of ideal",
            f"{_mib(v['held'])} MiB vs ideal {_mib(ideal)} MiB ({d / KiB:+.0f} KiB; tolerance {tol / KiB:.0f} KiB)",
            abs(d) <= tol,
            f"ideal from plain_held - sum(bytes_packed): {_mib(v['ideal']['held_by_bytes_packed'])} MiB",
        )
    return T


def targets_markdown(T: list[dict]) -> str:
    lines = ["| target | measured | met? | note |", "| --- | --- | --- | --- |"]
    for t in T:
        met = "n/a" if t["met"] is None else ("met" if t["met"] else "**missed**")
        lines.append(f"| {t['target']} | {t['measured']} | {met} | {t['note']} |")
    return "\n".join(lines)


def strategies_markdown(main: dict[str, Any]) -> str:
    s = main["strategies"]
    lines = [
        "| strategy | held after fwd (MiB) | peak fwd+bwd (MiB) | held vs plain | median step (ms) "
        "| time vs plain | time vs checkpoint | max abs grad diff | ideal held (MiB) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    ph = s["plain"]["held"] if "plain" in s and "held" in s["plain"] else None
    for name, v in s.items():
        held = v.get("held")
        lines.append(
            "| {} | {} | {} | {} | {:.1f} | {} | {} | {} | {} |".format(
                name,
                _mib(held),
                _mib(v.get("peak")),
                "" if held is None or not ph else f"{held / ph:.3f}x",
                1e3 * v["time_median_s"],
                _x(v.get("ratio_vs_plain")),
                _x(v.get("ratio_vs_checkpoint")),
                "" if v.get("grad_max_abs_diff") is None else f"{v['grad_max_abs_diff']:g}",
                _mib(v["ideal"]["held"]) if "ideal" in v else "",
            )
        )
    return "\n".join(lines)


def scaling_markdown(sc: dict[str, Any]) -> str:
    axis = sc["axis"]
    lines = [
        f"| {axis} | strategy | held (MiB) | peak (MiB) | median step (ms) | time vs plain |",
        "| ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for p in sc["points"]:
        for name, v in sc["results"][str(p)].items():
            lines.append(
                f"| {p} | {name} | {_mib(v['held'])} | {_mib(v['peak'])} | {1e3 * v['time_median_s']:.1f} "
                f"| {_x(v.get('ratio_vs_plain'))} |"
            )
    return "\n".join(lines)


def write_markdown(results: dict[str, Any], path: str, charts: list[str]) -> None:
    m, main = results["machine"], results["main"]
    cfg = GPTConfig(**main["config"])
    out = [
        "# gradient_scope benchmarks",
        "",
        f"Generated by `python -m benchmarks.run {' '.join(results['argv'])}` on {m['date']}"
        f" in {results['duration_s']:.0f} s.",
        "",
        f"- machine: {m['cpu_model']}, {m['cpu_cores']} cores (torch threads: {m['torch_threads']})"
        + (f", GPU {m['gpu']}" if m.get("gpu") else ""),
        f"- torch {m['torch']}, Python {m['python']}, gradient_scope {m['gradient_scope']}"
        + (f" (git {m['git_commit']})" if m.get("git_commit") else ""),
        f"- load average at start: {', '.join(f'{x:.2f}' for x in m.get('load_average_at_start', []))};"
        f" at end: {', '.join(f'{x:.2f}' for x in m.get('load_average_at_end', []))}",
        f"- device {results['device']}, dtype {results['dtype']}, mode {'quick' if results['quick'] else 'full'}",
        f"- model: {cfg.describe()}",
        "- memory: "
        + (
            "torch.cuda memory stats"
            if results["device"].startswith("cuda")
            else "CPU profiler (profile_memory=True), benchmarks/memory.py"
        )
        + "; held = allocated during forward and still allocated after it; peak = highest level during fwd+bwd",
        f"- step time: fwd+bwd, median of {results['rounds']} interleaved rounds (order rotated each round); "
        "ratios are medians of per-round ratios",
        "",
        "## Targets",
        "",
        targets_markdown(results["targets"]),
        "",
        "## Strategies",
        "",
        "\n".join(f"- `{k}`: {v}" for k, v in DESCRIPTIONS.items()),
        "",
        strategies_markdown(main),
        "",
    ]
    ideal_rows = [
        (k, v) for k, v in main["strategies"].items() if "ideal" in v
    ]
    if ideal_rows:
        out += [
            "### Ideal memory (benchmarks/ideal.py)",
            "",
            f"Plain autograd saves {_mib(main['strategies']['plain'].get('saved_bytes_distinct'))} MiB of "
            f"distinct storages created in forward (plain held: {_mib(main['strategies']['plain']['held'])} MiB).",
            "",
            "| strategy | held (MiB) | ideal (MiB) | held - ideal (KiB) | removed by blocks (MiB) "
            "| inputs kept by blocks (MiB) | sum(bytes_packed) (MiB) | plain - sum(bytes_packed) (MiB) |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for k, v in ideal_rows:
            i = v["ideal"]
            out.append(
                f"| {k} | {_mib(v['held'])} | {_mib(i['held'])} | {(v['held'] - i['held']) / KiB:+.0f} "
                f"| {_mib(i['removed'])} | {_mib(i['retained'])} | {_mib(v.get('bytes_packed'))} "
                f"| {_mib(i['held_by_bytes_packed'])} |"
            )
        out.append("")
        out += [
            "Scope statistics of the profiled step:",
            "",
            "| strategy | scopes | ops recorded | tensors packed | bytes packed (MiB) | replays | ops replayed |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for k, v in ideal_rows:
            out.append(
                f"| {k} | {v.get('scopes')} | {v.get('ops_recorded')} | {v.get('tensors_packed')} "
                f"| {_mib(v.get('bytes_packed'))} | {v.get('replays')} | {v.get('ops_replayed')} |"
            )
        out.append("")
    if results.get("overhead"):
        out += ["## Per-op overhead", "", format_overhead(results["overhead"]), ""]
    for key, title in (("layers", "Scaling with depth"), ("seq", "Scaling with sequence length")):
        sc = results.get("scaling", {}).get(key)
        if sc:
            out += [f"## {title}", "", scaling_markdown(sc), ""]
    if charts:
        out += ["## Charts", ""] + [f"![{c}]({c})" for c in charts] + [""]
    scaling_warnings = [w for sc in results.get("scaling", {}).values() for w in sc.get("warnings", [])]
    warnings = main.get("warnings", []) + scaling_warnings
    if warnings:
        out += ["## Warnings", ""] + [f"- {w}" for w in warnings] + [""]
    with open(path, "w") as f:
        f.write("\n".join(out))


# ---------------------------------------------------------------------- charts


def make_charts(results: dict[str, Any], out_dir: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    s = results["main"]["strategies"]
    names = [k for k in s if "held" in s[k]]

    # memory per strategy
    fig, ax = plt.subplots(figsize=(9, 4.5))
    xs = range(len(names))
    w = 0.38
    ax.bar([i - w / 2 for i in xs], [s[k]["held"] / MiB for k in names], w, label="held after forward")
    ax.bar([i + w / 2 for i in xs], [s[k]["peak"] / MiB for k in names], w, label="peak fwd+bwd")
    ideal_x = [i - w / 2 for i, k in enumerate(names) if "ideal" in s[k]]
    ideal_y = [s[k]["ideal"]["held"] / MiB for k in names if "ideal" in s[k]]
    if ideal_x:
        ax.scatter(ideal_x, ideal_y, marker="_", s=600, color="black", zorder=3, label="ideal held")
    ax.set_xticks(list(xs), names, rotation=20, ha="right")
    ax.set_ylabel("MiB")
    ax.set_title("Memory per strategy")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "memory_per_strategy.png"), dpi=110)
    plt.close(fig)
    files.append("memory_per_strategy.png")

    # time per strategy
    tnames = list(s)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    med = [1e3 * s[k]["time_median_s"] for k in tnames]
    lo = [m - 1e3 * s[k]["time_quartiles_s"][0] for m, k in zip(med, tnames)]
    hi = [1e3 * s[k]["time_quartiles_s"][1] - m for m, k in zip(med, tnames)]
    bars = ax.bar(range(len(tnames)), med, yerr=[lo, hi], capsize=4, color="tab:green")
    for b, k in zip(bars, tnames):
        r = s[k].get("ratio_vs_plain")
        if r is not None:
            ax.annotate(f"{r:.2f}x", (b.get_x() + b.get_width() / 2, b.get_height()), ha="center",
                        va="bottom", fontsize=8, xytext=(0, 2), textcoords="offset points")
    ax.set_xticks(range(len(tnames)), tnames, rotation=20, ha="right")
    ax.set_ylabel("ms per fwd+bwd step (median, IQR)")
    ax.set_title("Step time per strategy (labels: median per-round ratio vs plain)")
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "time_per_strategy.png"), dpi=110)
    plt.close(fig)
    files.append("time_per_strategy.png")

    for key, xlabel in (("layers", "layers"), ("seq", "sequence length")):
        sc = results.get("scaling", {}).get(key)
        if not sc:
            continue
        pts = sc["points"]
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
        for i, name in enumerate(SCALING_STRATEGIES):
            c = f"C{i}"
            held = [sc["results"][str(p)][name]["held"] / MiB for p in pts]
            peak = [sc["results"][str(p)][name]["peak"] / MiB for p in pts]
            tm = [1e3 * sc["results"][str(p)][name]["time_median_s"] for p in pts]
            a1.plot(pts, held, "o-", color=c, label=f"{name} held")
            a1.plot(pts, peak, "s--", color=c, alpha=0.6, label=f"{name} peak")
            a2.plot(pts, tm, "o-", color=c, label=name)
        for a in (a1, a2):
            a.set_xlabel(xlabel)
            a.set_xscale("log", base=2)
            a.set_xticks(pts, [str(p) for p in pts])
            a.grid(alpha=0.3)
        a1.set_ylabel("MiB")
        a1.set_title(f"Memory vs {xlabel} (solid: held, dashed: peak)")
        a1.legend(fontsize=7, ncol=2)
        a2.set_ylabel("ms per fwd+bwd step (median)")
        a2.set_title(f"Step time vs {xlabel}")
        a2.legend(fontsize=8)
        fig.tight_layout()
        fname = f"scaling_{key}.png"
        fig.savefig(os.path.join(out_dir, fname), dpi=110)
        plt.close(fig)
        files.append(fname)

    ov = results.get("overhead")
    if ov:
        fig, ax = plt.subplots(figsize=(9, 4))
        ks = list(ov["us_per_op"])
        ax.bar(range(len(ks)), [ov["us_per_op"][k] for k in ks], color="tab:purple")
        ax.set_xticks(range(len(ks)), ks, rotation=30, ha="right")
        ax.set_ylabel("us per op (median)")
        ax.set_title(f"Per-op cost, {ov['n_ops']} tiny ops")
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, "overhead.png"), dpi=110)
        plt.close(fig)
        files.append("overhead.png")
    return files


# ---------------------------------------------------------------------- main


def _print_table(title: str, md: str) -> None:
    print(f"\n{title}\n{md}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small model, few rounds and points (< 60 s on CPU)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument(
        "--out",
        default=None,
        help="output directory (default benchmarks/results/<device>/, with --quick "
        "benchmarks/results/<device>-quick/)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=None, help="timing rounds of the main comparison")
    p.add_argument("--scaling-rounds", type=int, default=None)
    p.add_argument("--overhead-rounds", type=int, default=None)
    p.add_argument("--no-scaling", action="store_true", help="skip the layers / sequence sweeps")
    p.add_argument("--no-overhead", action="store_true", help="skip the per-op overhead microbenchmark")
    p.add_argument("--no-charts", action="store_true")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch.set_num_threads (default: 1 with --quick, else torch's default, one per "
        "core). On a busy machine 1 thread is far less noisy: OpenMP threads spin-wait "
        "for each other",
    )
    g = p.add_argument_group("model (defaults: the --quick or full size)")
    g.add_argument("--layers", type=int)
    g.add_argument("--d-model", type=int)
    g.add_argument("--heads", type=int)
    g.add_argument("--seq", type=int)
    g.add_argument("--batch", type=int)
    g.add_argument("--vocab", type=int)
    g.add_argument("--dropout", type=float)
    g.add_argument("--attn", choices=["explicit", "sdpa"])
    a = p.parse_args(argv)

    t_start = time.perf_counter()
    mode = QUICK if a.quick else FULL
    threads = a.threads or mode.get("threads")
    if threads:
        torch.set_num_threads(threads)
    device = a.device
    if device == "cuda":
        device = "cuda:0"
    if device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda: CUDA is not available")
    dtype = getattr(torch, a.dtype)
    cfg = mode["model"]
    over = {
        "n_layer": a.layers, "d_model": a.d_model, "n_head": a.heads, "seq": a.seq,
        "batch": a.batch, "vocab": a.vocab, "dropout": a.dropout, "attn": a.attn,
    }
    cfg = GPTConfig(**{**cfg.asdict(), **{k: v for k, v in over.items() if v is not None}})
    rounds = a.rounds or mode["rounds"]
    dev_name = torch.device(device).type
    # A quick run never overwrites the results of a full run.
    out_dir = a.out or os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "results", dev_name + ("-quick" if a.quick else "")
    )
    os.makedirs(out_dir, exist_ok=True)

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:6.1f}s] {msg}", flush=True)

    machine = machine_info(device)
    log(f"{machine['cpu_model']}, {machine['cpu_cores']} cores, torch {machine['torch']}, "
        f"python {machine['python']}; {cfg.describe()}; {device} {a.dtype}")
    if a.quick:
        log("quick mode: a small model and few rounds; numbers are indicative only")

    log(f"main comparison: {len(STRATEGIES)} strategies + A/A, {rounds} rounds")
    main_res = run_suite(cfg, device, dtype, STRATEGIES, rounds, seed=a.seed, ideal=True)
    _print_table("strategies", strategies_markdown(main_res))

    overhead = None
    if not a.no_overhead:
        log("per-op overhead microbenchmark")
        overhead = run_overhead(1000, a.overhead_rounds or mode["overhead_rounds"])
        _print_table("per-op overhead", format_overhead(overhead))

    scaling: dict[str, Any] = {}
    if not a.no_scaling:
        srounds = a.scaling_rounds or mode["scaling_rounds"]
        log(f"scaling with depth {mode['layers']} (seq {cfg.seq})")
        scaling["layers"] = run_scaling(cfg, "layers", mode["layers"], device, dtype, srounds, log)
        log(f"scaling with sequence length {mode['seqs']} ({cfg.n_layer} layers)")
        scaling["seq"] = run_scaling(cfg, "seq", mode["seqs"], device, dtype, srounds, log)
        for sc in scaling.values():
            _print_table(f"scaling: {sc['axis']}", scaling_markdown(sc))

    targets = compute_targets(main_res, overhead, dev_name)
    la = load_average()
    if la is not None:
        machine["load_average_at_end"] = la
    results = {
        "argv": argv,
        "quick": a.quick,
        "device": device,
        "dtype": a.dtype,
        "seed": a.seed,
        "rounds": rounds,
        "machine": machine,
        "strategies": DESCRIPTIONS,
        "save_matmuls_policy": SAVE_MM_NAME,
        "main": main_res,
        "overhead": overhead,
        "scaling": scaling,
        "targets": targets,
        "duration_s": time.perf_counter() - t_start,
    }
    charts = [] if a.no_charts else make_charts(results, out_dir)
    results["charts"] = charts
    results["duration_s"] = time.perf_counter() - t_start
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    write_markdown(results, os.path.join(out_dir, "results.md"), charts)
    _print_table("targets", targets_markdown(targets))
    for w in main_res["warnings"]:
        print(f"WARNING: {w}")
    log(f"wrote {out_dir}/results.json, results.md and {len(charts)} charts")
    return results


if __name__ == "__main__":
    main()
