"""The report of ``benchmarks.models``: targets, Markdown tables, ``results.md`` and charts."""

from __future__ import annotations

from typing import Any

from ._harness.report import (
    KiB,
    MiB,
    charts_and_warnings,
    fmt_mib,
    header_lines,
    pyplot,
    save_figure,
    targets_and_strategies,
)
from ._harness.report import targets_markdown as _targets_table

__all__ = ["SWEEP_TOLERANCE", "compute_targets", "targets_markdown", "model_markdown", "sweep_markdown", "to_markdown",
           "make_charts"]

# The depth-sweep target: the excess of a scope per layer over checkpoint per layer may
# grow by at most this many layer inputs per added layer (memory figures are exact; the
# defect this guards against grows by one layer input per layer).
SWEEP_TOLERANCE = 0.05


def targets_markdown(T: list[dict[str, Any]]) -> str:
    """The targets as a Markdown table (target, model, measured, met?, note)."""
    return _targets_table(T, ("target", "model", "measured"))


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
            ml = s.get("mode_layer")
            floor = ""
            if ok(ml, "ratio_vs_plain") and ok(ck, "ratio_vs_plain"):
                # What a do-nothing dispatch mode around each layer adds to plain's step, as a
                # share of checkpoint's step: the least any dispatch-mode recorder adds.
                mode = (ml["ratio_vs_plain"] - 1.0) / ck["ratio_vs_plain"]
                floor = f"; a do-nothing mode per layer alone adds {mode:.3f}x of checkpoint's step"
            add(
                "scope_layer step time <= 1.00x checkpoint's",
                m,
                f"{sl['ratio_vs_checkpoint']:.3f}x (IQR {q[0]:.3f}-{q[1]:.3f})",
                sl["ratio_vs_checkpoint"] <= 1.00,
                noise + floor,
            )
        if ok(sa, "peak") and ok(ck, "peak"):
            add(
                "scope_attn_mlp peak < checkpoint's",
                m,
                f"{fmt_mib(sa['peak'])} vs {fmt_mib(ck['peak'])} MiB ({sa['peak'] / ck['peak']:.3f}x)",
                sa["peak"] < ck["peak"],
                "residual branches (no attention/MLP)" if m == "resnet" else "",
            )
        scoped = [k for k in s if k.startswith("scope") and ok(s[k], "grads_vs_plain")]
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


def to_markdown(results: dict[str, Any], charts: list[str]) -> str:
    """``results.md``: run and machine, targets, one section per model, sweep, charts."""
    m = results["machine"]
    busy = max(m.get("load_average_at_start", [0])[:1] + m.get("load_average_at_end", [0])[:1]) > 0.5 * (
        m["cpu_cores"] or 1
    )
    note = " -- **the machine was busy: timings are noisy** (memory figures are exact)" if busy else ""
    out = [
        *header_lines("# gradient_scope on real models", "benchmarks.models", results, ("transformers",), note),
        f"- device {results['device']}, dtype {results['dtype']}, size {results['size']}, seed {results['seed']}",
        "- memory: "
        + (
            "torch.cuda memory stats"
            if results["device"].startswith("cuda")
            else "CPU profiler (profile_memory=True), benchmarks/_harness/memory.py"
        )
        +
        "; held = allocated during forward and still allocated after it; peak = highest level during fwd+bwd "
        "(first training step, gradients included)",
        f"- step time: fwd+bwd (no optimizer step), median of {results['rounds']} interleaved rounds (order rotated "
        "each round); ratios are medians of per-round ratios, with their interquartile range",
        f"- agreement: gradients after step 1 (identical weights, batch and RNG seed), losses of "
        f"{results['train_steps']} AdamW steps, all buffers (BatchNorm running stats, num_batches_tracked) after them",
        "",
        *targets_and_strategies(targets_markdown(results["targets"]), results["strategies"]),
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
    warnings = [f"{n}: {w}" for n, r in results["models"].items() for w in r.get("warnings", [])]
    return "\n".join(out + charts_and_warnings(charts, warnings))


def make_charts(results: dict[str, Any], out_dir: str) -> list[str]:
    """memory_per_model.png, time_per_model.png, depth_sweep.png (matplotlib)."""
    plt = pyplot()

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
        save_figure(fig, out_dir, "memory_per_model.png", files, dpi=100)

        strats = [s for s in results["strategies"] if s != "plain" and any(s in models[n]["strategies"] for n in names)]
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
        save_figure(fig, out_dir, "time_per_model.png", files, dpi=100)

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
        save_figure(fig, out_dir, "depth_sweep.png", files, dpi=100)
    return files


