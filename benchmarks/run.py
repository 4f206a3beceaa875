"""Every strategy on the benchmark GPT, the per-op overhead, the scaling sweeps.

    python -m benchmarks.run [--quick] [--device cpu|cuda] [--dtype float32|bfloat16] [--out DIR]

See benchmarks/README.md for what is measured and how to read the results.
"""

from __future__ import annotations

import argparse
import copy
import gc
import sys
import time
from typing import Any

import torch

from gradient_scope.policies import as_save_policy

from ._harness.ideal import BlockAccounting
from ._harness.machine import machine_info, mark_end
from ._harness.report import (
    KiB,
    MiB,
    Targets,
    aa_note,
    fmt_mib,
    fmt_x,
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
from ._harness.strategies import AA, DESCRIPTIONS, selection, wrap_forward
from ._harness.suite import Case, run_strategies
from ._harness.timing import frozen_gc
from .gpt import GPTConfig, add_size_args, case, config_from
from .overhead import format_overhead, run_overhead

STRATEGIES = ["plain", "checkpoint", "sac_matmul", "scope_layer", "scope_mlp", "scope_act", "scope_layer_savemm"]
SCOPE_STRATEGIES = ["scope_layer", "scope_mlp", "scope_act", "scope_layer_savemm"]
SCALING_STRATEGIES = ["plain", "checkpoint", "scope_layer", "scope_act"]

# Sizes. The default model takes ~0.2-1 s per fwd+bwd step on a quiet 2-core CPU.
FULL: dict[str, Any] = dict(model=GPTConfig(), rounds=10, overhead_rounds=25, layers=[1, 2, 4, 8],
                            seqs=[64, 128, 256, 512], scaling_rounds=3)
QUICK: dict[str, Any] = dict(
    model=GPTConfig(vocab=1024, seq=128, d_model=128, n_head=4, n_layer=2, batch=4),
    rounds=3, overhead_rounds=7, layers=[1, 4], seqs=[64, 256], scaling_rounds=2,
    # One thread: on a busy 2-core machine OpenMP threads spin-wait for each other and a
    # step takes 4x longer and varies wildly; --threads overrides.
    threads=1,
)


def run_suite(
    cfg: GPTConfig, device: str, dtype: torch.dtype, strategies: list[str], rounds: int,
    seed: int = 0, aa: bool = True, ideal: bool = False,
) -> dict[str, Any]:
    """Every strategy on one GPT: memory, gradients, interleaved timing (with the A/A row
    when ``aa``), the ideal held memory of the scope strategies when ``ideal``."""
    c = case(cfg, device, dtype, seed)
    with frozen_gc():  # keeps the gc.collect() before each measured step cheap
        out = run_strategies(c, [*strategies, *([AA] if aa else [])], rounds, seed=seed, warmup=1, log=lambda m: None)
        res = out["strategies"]
        if ideal and "held" in res.get("plain", {}):
            res["plain"]["saved_bytes_distinct"] = block_accounting(c, "plain", seed)["saved_bytes"]
            for name in strategies:
                if name in SCOPE_STRATEGIES and "held" in res[name]:
                    a = block_accounting(c, name, seed)
                    res[name]["ideal"] = {
                        "held": res["plain"]["held"] - a["removed"] + a["retained"],
                        "removed": a["removed"],
                        "retained": a["retained"],
                        "blocks_per_step": a["blocks"],
                        "held_by_bytes_packed": res["plain"]["held"]
                        - res[name].get("scopes", {}).get("bytes_packed", 0),
                    }
    return {"config": cfg.asdict(), **out}


def block_accounting(c: Case, name: str, seed: int) -> dict[str, int]:
    """Storages created / read by the strategy's blocks and saved by plain autograd, from
    one plain forward with a marker where the strategy puts its scopes
    (``benchmarks/_harness/ideal.py``)."""
    chosen = selection(name, c.layers, c.parts)
    acct = BlockAccounting(policy=None if chosen is None else as_save_policy(chosen[1]))
    model = copy.deepcopy(c.model, {id(p): p for p in c.model.parameters()})
    if chosen is not None:
        wrap_forward(model, chosen[0], acct.block)
    acct.mark_preexisting([*model.parameters(), *model.buffers(), *c.batch])
    torch.manual_seed(seed)
    with acct.saving():
        loss = c.loss(model)
    res = acct.result()
    res["saved_bytes"] = sum(k[1] for k in acct.saved if k not in acct.preexisting)
    del loss, acct, model
    gc.collect()
    return res


def run_scaling(base: GPTConfig, axis: str, points: list[int], device: str, dtype: torch.dtype, rounds: int,
                log: Any) -> dict[str, Any]:
    """The scaling strategies at each depth (``axis="layers"``) or sequence length."""
    out: dict[str, Any] = {"axis": axis, "points": points, "results": {}, "warnings": []}
    for p in points:
        cfg = GPTConfig(**{**base.asdict(), ("n_layer" if axis == "layers" else "seq"): p})
        t0 = time.perf_counter()
        r = run_suite(cfg, device, dtype, SCALING_STRATEGIES, rounds, aa=False)
        out["results"][str(p)] = r["strategies"]
        out["warnings"] += [f"{axis}={p}: {w}" for w in r["warnings"]]
        log(f"  scaling {axis}={p}: {time.perf_counter() - t0:.1f} s")
    return out


# ---------------------------------------------------------------------- report


def compute_targets(main: dict[str, Any], overhead: dict[str, Any] | None, device: str) -> Targets:
    """The targets, each measured in this run (see benchmarks/README.md)."""
    s = main["strategies"]
    T = Targets()
    noise = aa_note(s)
    sl, ck, sm, pl = (s.get(k, {}) for k in ("scope_layer", "checkpoint", "scope_mlp", "plain"))
    if "held" in sl and "held" in ck:
        T.add("scope_layer held after forward <= checkpoint's",
              f"{fmt_mib(sl['held'])} MiB vs {fmt_mib(ck['held'])} MiB ({sl['held'] / ck['held']:.3f}x)",
              met=sl["held"] <= ck["held"])
    if "ratio_vs_checkpoint" in sl:
        T.add("scope_layer step time <= 1.00x checkpoint's", fmt_x(sl["ratio_vs_checkpoint"]),
              met=sl["ratio_vs_checkpoint"] <= 1.00, note=noise)
    if "held" in sm and "held" in pl:
        T.add("scope_mlp (MLP activation only) held after forward <= 0.80x plain's",
              f"{fmt_mib(sm['held'])} MiB vs {fmt_mib(pl['held'])} MiB ({sm['held'] / pl['held']:.3f}x)",
              met=sm["held"] <= 0.80 * pl["held"])
    if "ratio_vs_plain" in sm:
        T.add("scope_mlp (MLP activation only) step time <= 1.10x plain's", fmt_x(sm["ratio_vs_plain"]),
              met=sm["ratio_vs_plain"] <= 1.10, note=noise)
    if overhead:
        r, ov = overhead["ratio_vs_nop_mode"]["scope/fwd"], overhead["overhead_us_per_op"]
        T.add("recording overhead per op <= 1.5x a do-nothing TorchDispatchMode's",
              "n/a" if r is None else f"{r:.2f}x ({ov['scope/fwd']:.2f} us vs {ov['nop_mode/fwd']:.2f} us per op)",
              met=None if r is None else r <= 1.5)
        T.add("overhead per op under torch.no_grad() <= 1 us", f"{ov['scope/no_grad']:.3f} us",
              met=ov["scope/no_grad"] <= 1.0,
              note=f"scope entered with grad on around a no_grad chain: {ov['scope_around/no_grad']:.2f} us/op")
        rp = overhead["replay"]
        T.add("replay per op <= 0.8x torch checkpoint's rerun",
              f"{rp['ratio_vs_checkpoint']:.2f}x ({rp['scope']['recompute_us_per_op']:.2f} us vs "
              f"{rp['checkpoint']['recompute_us_per_op']:.2f} us per op)",
              met=rp["ratio_vs_checkpoint"] <= 0.8,
              note=f"floor: the kernel alone, below autograd, is {rp['floor_ratio_vs_checkpoint']:.2f}x; a graph "
              f"recorded under any dispatch mode backs up {rp['mode_graph_bwd_us_per_op']:+.2f} us/op slower")
        T.add("tiny-op chain step (fwd+bwd) <= 1.15x torch checkpoint's", fmt_x(overhead["step_ratio_vs_checkpoint"]),
              met=overhead["step_ratio_vs_checkpoint"] <= 1.15,
              note=f"floor for a dispatch-mode recorder: {overhead['step_floor_ratio_vs_checkpoint']:.2f}x")
    cmp = {k: v["grads_vs_plain"] for k, v in s.items() if "grads_vs_plain" in v}
    if cmp:
        worst = max(c["max_abs_diff"] or 0.0 for c in cmp.values())
        nonzero = ", ".join(f"{k}: {c['max_abs_diff']:g}" for k, c in cmp.items() if c["max_abs_diff"])
        T.add("gradients bitwise equal to plain (all strategies)",
              f"max |grad diff| {worst:g}" + (f" ({nonzero})" if nonzero else ""),
              met=all(c["bitwise_equal"] for c in cmp.values()),
              note="" if device == "cpu" else "bitwise equality is only expected on CPU")
    for name, v in s.items():
        if "ideal" in v:
            ideal = v["ideal"]["held"]
            tol, d = 0.01 * ideal + 64 * KiB, v["held"] - ideal
            T.add(f"{name} held within 1% + 64 KiB of ideal",
                  f"{fmt_mib(v['held'])} MiB vs ideal {fmt_mib(ideal)} MiB ({d / KiB:+.0f} KiB; "
                  f"tolerance {tol / KiB:.0f} KiB)", met=abs(d) <= tol,
                  note=f"ideal from plain_held - sum(bytes_packed): {fmt_mib(v['ideal']['held_by_bytes_packed'])} MiB")
    return T


def strategies_markdown(main: dict[str, Any]) -> str:
    """The main comparison as a Markdown table."""
    s = main["strategies"]
    ph = s.get("plain", {}).get("held")

    def row(name: str, v: dict[str, Any]) -> list[Any]:
        if "error" in v:
            return [name, f"failed: {v['error'][:100]}", *[""] * 8]
        g = v.get("grads_vs_plain", {}).get("max_abs_diff")
        return [name, fmt_mib(v.get("held")), fmt_mib(v.get("peak")),
                f"{v['held'] / ph:.3f}x" if ph and "held" in v else "",
                f"{1e3 * v['time_median_s']:.1f}" if "time_median_s" in v else "",
                fmt_x(v.get("ratio_vs_plain")), fmt_x(v.get("ratio_vs_checkpoint")),
                "" if g is None else f"{g:g}", fmt_mib(v["ideal"]["held"]) if "ideal" in v else ""]

    return md_table(["strategy", "held after fwd (MiB)", "peak fwd+bwd (MiB)", "held vs plain", "median step (ms)",
                     "time vs plain", "time vs checkpoint", "max abs grad diff", "ideal held (MiB)"],
                    (row(k, v) for k, v in s.items()))


def scaling_markdown(sc: dict[str, Any]) -> str:
    """One scaling sweep as a Markdown table."""
    return md_table(
        [sc["axis"], "strategy", "held (MiB)", "peak (MiB)", "median step (ms)", "time vs plain"],
        ([p, name, fmt_mib(v.get("held")), fmt_mib(v.get("peak")), f"{1e3 * v.get('time_median_s', 0):.1f}",
          fmt_x(v.get("ratio_vs_plain"))] for p in sc["points"] for name, v in sc["results"][str(p)].items()),
    )


def to_markdown(results: dict[str, Any]) -> str:
    """``results.md``: run and machine, targets, strategies, ideal memory, overhead, scaling."""
    main = results["main"]
    s = main["strategies"]
    out = [
        *header_lines("# gradient_scope benchmarks", "benchmarks.run", results),
        f"- device {results['device']}, dtype {results['dtype']}, mode {'quick' if results['quick'] else 'full'}",
        f"- model: {GPTConfig(**main['config']).describe()}",
        "- memory: " + ("torch.cuda memory stats" if results["device"].startswith("cuda")
                        else "CPU profiler (profile_memory=True), benchmarks/_harness/memory.py")
        + "; held = allocated during forward and still allocated after it; peak = highest level during fwd+bwd",
        f"- step time: fwd+bwd, median of {results['rounds']} interleaved rounds (order rotated each round); "
        "ratios are medians of per-round ratios",
        "",
        *sections(Targets.from_rows(results["targets"]), {k: DESCRIPTIONS[k] for k in s}),
        strategies_markdown(main),
        "",
    ]
    ideal = [(k, v) for k, v in s.items() if "ideal" in v]
    if ideal:
        out += [
            "### Ideal memory (benchmarks/_harness/ideal.py)", "",
            f"Plain autograd saves {fmt_mib(s['plain'].get('saved_bytes_distinct'))} MiB of distinct storages "
            f"created in forward (plain held: {fmt_mib(s['plain']['held'])} MiB).", "",
            md_table(["strategy", "held (MiB)", "ideal (MiB)", "held - ideal (KiB)", "removed by blocks (MiB)",
                      "inputs kept by blocks (MiB)", "sum(bytes_packed) (MiB)", "plain - sum(bytes_packed) (MiB)"],
                     ([k, fmt_mib(v["held"]), fmt_mib(i["held"]), f"{(v['held'] - i['held']) / KiB:+.0f}",
                       fmt_mib(i["removed"]), fmt_mib(i["retained"]), fmt_mib(v.get("scopes", {}).get("bytes_packed")),
                       fmt_mib(i["held_by_bytes_packed"])] for k, v in ideal for i in [v["ideal"]])), "",
            "Scope statistics of the profiled step:", "",
            md_table(["strategy", "scoped modules", "ops recorded", "tensors packed", "bytes packed (MiB)", "replays",
                      "ops replayed"],
                     ([k, st.get("modules"), st.get("ops_recorded"), st.get("tensors_packed"),
                       fmt_mib(st.get("bytes_packed")), st.get("replays"), st.get("ops_replayed")]
                      for k, v in ideal for st in [v.get("scopes", {})])), "",
        ]
    if results.get("overhead"):
        out += ["## Per-op overhead", "", format_overhead(results["overhead"]), ""]
    for key, title in (("layers", "Scaling with depth"), ("seq", "Scaling with sequence length")):
        if key in results["scaling"]:
            out += [f"## {title}", "", scaling_markdown(results["scaling"][key]), ""]
    warnings = main["warnings"] + [w for sc in results["scaling"].values() for w in sc["warnings"]]
    return "\n".join(out + sections(charts=results["charts"], warnings=warnings))


def make_charts(results: dict[str, Any], out_dir: str) -> list[str]:
    """memory_per_strategy.png, time_per_strategy.png, scaling_*.png, overhead.png."""
    plt = pyplot()
    files: list[str] = []
    s = results["main"]["strategies"]
    names = [k for k in s if "held" in s[k]]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    grouped_bars(ax, names, {"held after forward": [s[k]["held"] / MiB for k in names],
                             "peak fwd+bwd": [s[k]["peak"] / MiB for k in names],
                             "ideal held": [s[k]["ideal"]["held"] / MiB if "ideal" in s[k] else None for k in names]})
    ax.set_ylabel("MiB")
    ax.set_title("Memory per strategy")
    ax.legend()
    save_figure(fig, out_dir, "memory_per_strategy.png", files)

    t = [k for k in s if "time_median_s" in s[k]]
    med = [1e3 * s[k]["time_median_s"] for k in t]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    iqr = ([m - 1e3 * s[k]["time_quartiles_s"][0] for m, k in zip(med, t)],
           [1e3 * s[k]["time_quartiles_s"][1] - m for m, k in zip(med, t)])
    grouped_bars(ax, t, {"fwd+bwd": med}, {"fwd+bwd": iqr})
    for i, k in enumerate(t):
        ax.annotate(fmt_x(s[k].get("ratio_vs_plain")), (i, med[i]), ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("ms per fwd+bwd step (median, IQR)")
    ax.set_title("Step time per strategy (labels: median per-round ratio vs plain)")
    save_figure(fig, out_dir, "time_per_strategy.png", files)

    for key, sc in results["scaling"].items():
        pts = sc["points"]
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
        for i, name in enumerate(sc["results"][str(pts[0])]):
            rows = [sc["results"][str(p)][name] for p in pts]
            a1.plot(pts, [r["held"] / MiB for r in rows], "o-", color=f"C{i}", label=f"{name} held")
            a1.plot(pts, [r["peak"] / MiB for r in rows], "s--", color=f"C{i}", alpha=0.6, label=f"{name} peak")
            a2.plot(pts, [1e3 * r["time_median_s"] for r in rows], "o-", color=f"C{i}", label=name)
        xlabel = "layers" if key == "layers" else "sequence length"
        for a, ylabel in ((a1, "MiB (solid: held, dashed: peak)"), (a2, "ms per fwd+bwd step (median)")):
            a.set_xscale("log", base=2)
            a.set_xticks(pts, [str(p) for p in pts])
            a.set_xlabel(xlabel)
            a.set_ylabel(ylabel)
            a.grid(alpha=0.3)
            a.legend(fontsize=7)
        save_figure(fig, out_dir, f"scaling_{key}.png", files)

    ov = results.get("overhead")
    if ov:
        fig, ax = plt.subplots(figsize=(9, 4))
        grouped_bars(ax, list(ov["us_per_op"]), {"us per op": list(ov["us_per_op"].values())})
        ax.set_ylabel("us per op (median)")
        ax.set_title(f"Per-op cost, {ov['n_ops']} tiny ops")
        save_figure(fig, out_dir, "overhead.png", files)
    return files


# ---------------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Command line entry point; returns the results dict."""
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small model, few rounds and points (< 60 s on CPU)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--out", help="output directory (default benchmarks/results/<device>[-quick]/)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, help="timing rounds of the main comparison")
    p.add_argument("--scaling-rounds", type=int)
    p.add_argument("--overhead-rounds", type=int)
    p.add_argument("--no-scaling", action="store_true", help="skip the layers / sequence sweeps")
    p.add_argument("--no-overhead", action="store_true", help="skip the per-op overhead microbenchmark")
    p.add_argument("--no-charts", action="store_true")
    p.add_argument("--threads", type=int, help="torch.set_num_threads (default: 1 with --quick, else torch's)")
    add_size_args(p)
    a = p.parse_args(argv)
    t_start = time.perf_counter()
    log = make_log(t_start)
    mode = QUICK if a.quick else FULL
    if a.threads or mode.get("threads"):
        torch.set_num_threads(a.threads or mode["threads"])
    device, dtype = resolve_device(a.device, p.error), getattr(torch, a.dtype)
    cfg = config_from(mode["model"], a)
    rounds = a.rounds or mode["rounds"]
    dev_name = torch.device(device).type
    out_dir = results_dir(a.out, dev_name + ("-quick" if a.quick else ""))  # a quick run never overwrites a full one
    machine = machine_info(device)
    log(f"{machine['cpu_model']}, {machine['cpu_cores']} cores, torch {machine['torch']}; {cfg.describe()}; "
        f"{device} {a.dtype}; main comparison: {len(STRATEGIES)} strategies + A/A, {rounds} rounds")
    main_res = run_suite(cfg, device, dtype, STRATEGIES, rounds, seed=a.seed, ideal=True)
    print(f"\nstrategies\n{strategies_markdown(main_res)}")
    overhead = None
    if not a.no_overhead:
        log("per-op overhead microbenchmark")
        overhead = run_overhead(1000, a.overhead_rounds or mode["overhead_rounds"])
        print(f"\nper-op overhead\n{format_overhead(overhead)}")
    scaling: dict[str, Any] = {}
    if not a.no_scaling:
        srounds = a.scaling_rounds or mode["scaling_rounds"]
        for axis, points in (("layers", mode["layers"]), ("seq", mode["seqs"])):
            log(f"scaling with {axis} {points}")
            scaling[axis] = run_scaling(cfg, axis, points, device, dtype, srounds, log)
    mark_end(machine)
    results: dict[str, Any] = {
        "argv": argv, "quick": a.quick, "device": device, "dtype": a.dtype, "seed": a.seed, "rounds": rounds,
        "machine": machine, "strategies": {k: DESCRIPTIONS[k] for k in main_res["strategies"]},
        "main": main_res, "overhead": overhead, "scaling": scaling,
        "targets": compute_targets(main_res, overhead, dev_name),
    }
    results["charts"] = [] if a.no_charts else make_charts(results, out_dir)
    results["duration_s"] = time.perf_counter() - t_start
    write_results(out_dir, results, to_markdown(results))
    print(f"\ntargets\n{Targets.from_rows(results['targets']).markdown()}")
    for w in main_res["warnings"]:
        print(f"WARNING: {w}")
    log(f"wrote {out_dir}/results.json, results.md and {len(results['charts'])} charts")
    return results


if __name__ == "__main__":
    main()
