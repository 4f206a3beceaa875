"""The report of ``benchmarks.run``: targets, Markdown tables, ``results.md`` and charts."""

from __future__ import annotations

from typing import Any

from ._harness.report import (
    KiB,
    MiB,
    charts_and_warnings,
    header_lines,
    pyplot,
    save_figure,
    targets_and_strategies,
    targets_markdown,
)
from ._harness.report import fmt_mib as _mib
from ._harness.report import fmt_x as _x
from ._harness.strategies import AA
from .gpt import GPTConfig
from .overhead import format_overhead

__all__ = ["compute_targets", "strategies_markdown", "scaling_markdown", "to_markdown", "make_charts"]


def compute_targets(main: dict[str, Any], overhead: dict[str, Any] | None, device: str) -> list[dict]:
    """The targets, each measured in this run (see benchmarks/README.md)."""
    s = main["strategies"]
    aa = s.get(AA, {})
    noise = aa.get("ratio_vs_plain_quartiles")
    noise_txt = f"A/A ratio {aa['ratio_vs_plain']:.3f}x (IQR {noise[0]:.3f}-{noise[1]:.3f})" if noise else ""
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
            floor = rp.get("floor_ratio_vs_checkpoint")
            add(
                "replay per op <= 0.8x torch checkpoint's rerun",
                f"{rp['ratio_vs_checkpoint']:.2f}x ({sc['recompute_us_per_op']:.2f} us vs "
                f"{ck['recompute_us_per_op']:.2f} us per op)"
                if "ratio_vs_checkpoint" in rp
                else "n/a",
                rp["ratio_vs_checkpoint"] <= 0.8 if "ratio_vs_checkpoint" in rp else None,
                ""
                if floor is None
                else f"floor: the kernel alone, below autograd, is {floor:.2f}x; a graph "
                f"recorded under any dispatch mode backs up {rp['mode_graph_bwd_us_per_op']:+.2f} us/op slower",
            )
        step = overhead.get("step_ratio_vs_checkpoint")
        if step is not None:
            floor = overhead.get("step_floor_ratio_vs_checkpoint")
            add(
                "tiny-op chain step (fwd+bwd) <= 1.15x torch checkpoint's",
                _x(step),
                step <= 1.15,
                "" if floor is None else f"floor for a dispatch-mode recorder: {floor:.2f}x",
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
    for name, v in s.items():
        if "ideal" not in v:
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


def strategies_markdown(main: dict[str, Any]) -> str:
    """The main comparison as a Markdown table."""
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
    """One scaling sweep as a Markdown table."""
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


def to_markdown(results: dict[str, Any], charts: list[str]) -> str:
    """``results.md``: run and machine, targets, strategies, ideal memory, overhead, scaling."""
    main = results["main"]
    cfg = GPTConfig(**main["config"])
    out = [
        *header_lines("# gradient_scope benchmarks", "benchmarks.run", results),
        f"- device {results['device']}, dtype {results['dtype']}, mode {'quick' if results['quick'] else 'full'}",
        f"- model: {cfg.describe()}",
        "- memory: "
        + (
            "torch.cuda memory stats"
            if results["device"].startswith("cuda")
            else "CPU profiler (profile_memory=True), benchmarks/_harness/memory.py"
        )
        + "; held = allocated during forward and still allocated after it; peak = highest level during fwd+bwd",
        f"- step time: fwd+bwd, median of {results['rounds']} interleaved rounds (order rotated each round); "
        "ratios are medians of per-round ratios",
        "",
        *targets_and_strategies(targets_markdown(results["targets"]), results["strategies"]),
        "",
        strategies_markdown(main),
        "",
    ]
    ideal_rows = [(k, v) for k, v in main["strategies"].items() if "ideal" in v]
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
    scaling_warnings = [w for sc in results.get("scaling", {}).values() for w in sc.get("warnings", [])]
    return "\n".join(out + charts_and_warnings(charts, main.get("warnings", []) + scaling_warnings))


# ---------------------------------------------------------------------- charts


def make_charts(results: dict[str, Any], out_dir: str) -> list[str]:
    """memory_per_strategy.png, time_per_strategy.png, scaling_*.png, overhead.png."""
    plt = pyplot()

    files: list[str] = []
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
    save_figure(fig, out_dir, "memory_per_strategy.png", files)

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
            ax.annotate(
                f"{r:.2f}x",
                (b.get_x() + b.get_width() / 2, b.get_height()),
                ha="center",
                va="bottom",
                fontsize=8,
                xytext=(0, 2),
                textcoords="offset points",
            )
    ax.set_xticks(range(len(tnames)), tnames, rotation=20, ha="right")
    ax.set_ylabel("ms per fwd+bwd step (median, IQR)")
    ax.set_title("Step time per strategy (labels: median per-round ratio vs plain)")
    save_figure(fig, out_dir, "time_per_strategy.png", files)

    for key, xlabel in (("layers", "layers"), ("seq", "sequence length")):
        sc = results.get("scaling", {}).get(key)
        if not sc:
            continue
        pts = sc["points"]
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
        for i, name in enumerate(sc["results"][str(pts[0])]):
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
        save_figure(fig, out_dir, f"scaling_{key}.png", files)

    ov = results.get("overhead")
    if ov:
        fig, ax = plt.subplots(figsize=(9, 4))
        ks = list(ov["us_per_op"])
        ax.bar(range(len(ks)), [ov["us_per_op"][k] for k in ks], color="tab:purple")
        ax.set_xticks(range(len(ks)), ks, rotation=30, ha="right")
        ax.set_ylabel("us per op (median)")
        ax.set_title(f"Per-op cost, {ov['n_ops']} tiny ops")
        save_figure(fig, out_dir, "overhead.png", files)
    return files
