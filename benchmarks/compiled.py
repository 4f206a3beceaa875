"""Compiled strategies: every recompute strategy under ``torch.compile`` (inductor).

    python -m benchmarks.compiled [--quick] [--threads N] [--rounds N] [--out DIR]

Runs, on the benchmark GPT (``benchmarks/gpt.py``), from the same seed, in one process,
each strategy of ``benchmarks/_harness/strategies.py`` on its own copy of the model,
compiled with ``torch.compile(model, backend="inductor", fullgraph=True)``: ``plain``,
``checkpoint`` and ``sac_matmul`` per layer, ``scope_layer``, ``scope_mlp`` (the MLP
activation only), ``scope_act`` (the MLP activation and the attention probabilities),
and ``plain_again`` (compiled ``plain`` timed twice per round: the A/A control).

Measured per strategy: **saved for backward**, the bytes of the distinct storages that
autograd keeps for backward (a saved-tensor hook around the compiled call; parameters and
the batch are not counted), **held after forward** and **peak** of forward + backward
(``benchmarks/_harness/memory.py``), and the **step time** of one forward + backward
(median over interleaved rounds, order rotated each round, ratios are medians of
per-round ratios). Gradients are compared with compiled ``plain``'s.

A second, small measurement shows the per-op cost of a scope under compile: a chain of
1000 ``h = h * 1.0001`` ops on an 8-element tensor, forward only, compiled with
``aot_eager`` (each op stays a separate call) with and without a scope around the chain,
next to the eager recording cost of the same chain.

Results go to ``benchmarks/results/cpu-compiled/`` (``--quick``: ``cpu-compiled-quick/``):
``results.json`` and ``results.md``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from gradient_scope import recompute_scope

from ._harness.machine import machine_info, mark_end
from ._harness.report import (
    MiB,
    Targets,
    aa_note,
    fmt_ratio,
    header_lines,
    make_log,
    md_table,
    results_dir,
    sections,
    write_results,
)
from ._harness.strategies import AA, DESCRIPTIONS, compare_tensors
from ._harness.suite import Case, Runner
from ._harness.timing import frozen_gc, interleaved_rounds, quartiles, ratio_summary, time_step
from .gpt import GPTConfig, case

STRATEGIES = ["plain", "checkpoint", "sac_matmul", "scope_layer", "scope_mlp", "scope_act"]
FULL: dict[str, Any] = dict(model=GPTConfig(), rounds=10, chain_rounds=15)
QUICK: dict[str, Any] = dict(model=GPTConfig(vocab=1024, seq=128, d_model=128, n_head=4, n_layer=2, batch=4),
                             rounds=3, chain_rounds=5, threads=1)
CHAIN_OPS = 1000
SEED = 0


def saved_bytes(runner: Runner, c: Case) -> tuple[int, int]:
    """Bytes of the distinct storages autograd saves in one compiled forward (parameters,
    buffers and the batch left out), and how many tensors it saves."""
    exclude = {t.untyped_storage().data_ptr() for t in (*runner.model.parameters(), *runner.model.buffers(), *c.batch)}
    storages: dict[int, int] = {}
    count = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        count[0] += 1
        if s.data_ptr() not in exclude:
            storages[s.data_ptr()] = s.nbytes()
        return t

    runner.model.zero_grad(set_to_none=True)
    torch.manual_seed(SEED)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = runner.forward()
    loss.backward()
    return sum(storages.values()), count[0]


def run_compiled_suite(cfg: GPTConfig, rounds: int, log: Callable[[str], None]) -> dict[str, Any]:
    t0 = time.perf_counter()
    c = case(cfg, seed=SEED)
    runners: dict[str, Runner] = {}
    res: dict[str, dict[str, Any]] = {}
    ref = None
    for name in STRATEGIES:  # compile (forward and backward), then warm up
        t = time.perf_counter()
        r = runners[name] = Runner(c, name, compile_kw={"backend": "inductor", "fullgraph": True})
        r.step(SEED)
        v = res[name] = {"compile_s": time.perf_counter() - t}
        r.step(SEED)
        v["saved_bytes"], v["saved_tensors"] = saved_bytes(r, c)
        p = r.profiled_step(SEED)
        v.update(held=p["held"], peak=p["peak"], loss=float(p["loss"]))
        ref = p["grads"] if ref is None else ref
        v["grads_vs_plain"] = compare_tensors(p["grads"], ref)
        log(f"  {name}: compiled in {v['compile_s']:.1f} s")
    del ref
    runners[AA], res[AA] = runners["plain"], {}
    with frozen_gc():
        times = interleaved_rounds({n: r.timed_step for n, r in runners.items()}, rounds)
    for name, summary in ratio_summary({n: [t["step"] for t in v] for n, v in times.items()}).items():
        res[name].update(summary)
    log(f"  suite: {time.perf_counter() - t0:.1f} s")
    return {"config": cfg.asdict(), "strategies": res}


# ---------------------------------------------------------------------- per-op cost


def _chain(h: torch.Tensor, n: int) -> torch.Tensor:
    for _ in range(n):
        h = h * 1.0001
    return h


def _scoped_chain(h: torch.Tensor, n: int) -> torch.Tensor:
    with recompute_scope():
        return _chain(h, n)


def run_chain(rounds: int, n: int = CHAIN_OPS) -> dict[str, Any]:
    """Forward time per op of an n-op chain: compiled (aot_eager) with and without a
    scope, and eager with and without a scope."""
    x = torch.randn(8, requires_grad=True)
    plain_c = torch.compile(_chain, backend="aot_eager", fullgraph=True)
    scoped_c = torch.compile(_scoped_chain, backend="aot_eager", fullgraph=True)
    configs: dict[str, Callable[[], Any]] = {
        "compiled": lambda: plain_c(x, n),
        "compiled_scope": lambda: scoped_c(x, n),
        "eager": lambda: _chain(x, n),
        "eager_scope": lambda: _scoped_chain(x, n),
    }
    for f in configs.values():  # compile, warm up
        f().sum().backward()
        f()
    times = interleaved_rounds({name: (lambda f=f: time_step(f)) for name, f in configs.items()}, rounds)
    per_round = {f"{k}-{base}": [1e6 * (a - b) / n for a, b in zip(times[k], times[base])]
                 for k, base in (("compiled_scope", "compiled"), ("eager_scope", "eager"))}
    return {
        "n_ops": n,
        "rounds": rounds,
        "us_per_op": {k: 1e6 * statistics.median(v) / n for k, v in times.items()},
        "scope_cost_us_per_op": {k: statistics.median(v) for k, v in per_round.items()},
        "scope_cost_us_per_op_quartiles": {k: quartiles(v) for k, v in per_round.items()},
        "times_s": times,
    }


# ---------------------------------------------------------------------- report


def compute_targets(main: dict[str, Any]) -> Targets:
    s = main["strategies"]
    sl, ck, sm, pl = s["scope_layer"], s["checkpoint"], s["scope_mlp"], s["plain"]
    T, noise = Targets(), aa_note(s)

    def saved(a: dict[str, Any], b: dict[str, Any]) -> str:
        x, y = a["saved_bytes"], b["saved_bytes"]
        return f"{x / MiB:.2f} MiB vs {y / MiB:.2f} MiB ({x / y:.3f}x)"

    T.add("compiled scope_layer saved-for-backward bytes <= compiled checkpoint's", saved(sl, ck),
          met=sl["saved_bytes"] <= ck["saved_bytes"],
          note=f"held after forward: {sl['held'] / MiB:.2f} vs {ck['held'] / MiB:.2f} MiB")
    T.add("compiled scope_layer step time <= 1.00x compiled checkpoint's", fmt_ratio(sl, "checkpoint"),
          met=sl["ratio_vs_checkpoint"] <= 1.00, note=noise)
    T.add("compiled scope_mlp saved-for-backward bytes <= 0.80x compiled plain's", saved(sm, pl),
          met=sm["saved_bytes"] <= 0.80 * pl["saved_bytes"],
          note=f"held after forward: {sm['held'] / pl['held']:.3f}x plain's")
    T.add("compiled scope_mlp step time <= 1.10x compiled plain's", fmt_ratio(sm, "plain"),
          met=sm["ratio_vs_plain"] <= 1.10, note=noise)
    return T


def to_markdown(results: dict[str, Any]) -> str:
    main, chain = results["main"], results["chain"]
    s = main["strategies"]
    pl = s["plain"]
    rows = [[name, *([f"{v['saved_bytes'] / MiB:.2f}", f"{v['saved_bytes'] / pl['saved_bytes']:.3f}x",
                      f"{v['held'] / MiB:.2f}", f"{v['peak'] / MiB:.2f}"] if "saved_bytes" in v else [""] * 4),
             f"{1e3 * v['time_median_s']:.1f}", f"{v['ratio_vs_plain']:.3f}x", f"{v['ratio_vs_checkpoint']:.3f}x",
             f"{v['grads_vs_plain']['max_rel_diff']:.1e}" if "grads_vs_plain" in v else "",
             f"{v['compile_s']:.0f}" if "compile_s" in v else ""] for name, v in s.items()]
    lines = [
        *header_lines("# gradient_scope benchmarks: compiled strategies (inductor)", "benchmarks.compiled", results),
        f"- model: {GPTConfig(**main['config']).describe()}",
        '- every strategy: `torch.compile(model, backend="inductor", fullgraph=True)`, one fwd+bwd step '
        "(no optimizer), same weights, batch and seed",
        "- saved for backward: distinct storages autograd keeps (saved-tensor hook around the compiled call; "
        "parameters and batch excluded); held / peak: CPU profiler (benchmarks/_harness/memory.py)",
        f"- step time: median of {results['rounds']} interleaved rounds; ratios are medians of per-round ratios",
        "",
        *sections(Targets.from_rows(results["targets"]), {k: DESCRIPTIONS[k] for k in [*STRATEGIES, AA]}),
        md_table(["strategy", "saved for bwd (MiB)", "vs plain", "held after fwd (MiB)", "peak fwd+bwd (MiB)",
                  "median step (ms)", "time vs plain", "time vs checkpoint", "max rel grad diff vs plain",
                  "compile (s)"], rows),
    ]
    if chain is not None:
        c, q = chain["scope_cost_us_per_op"], chain["scope_cost_us_per_op_quartiles"]
        lines += [
            "", "## Per-op cost of a scope under compile", "",
            f"A chain of {chain['n_ops']} `h = h * 1.0001` ops on an 8-element tensor that requires grad, forward "
            f"only, median of {chain['rounds']} interleaved rounds; compiled with `aot_eager` (each op stays one call, "
            "so a per-op cost would show).", "",
            md_table(["configuration", "us per op"], ([k, f"{v:.3f}"] for k, v in chain["us_per_op"].items())), "",
            *(f"- scope cost {label}: {c[k]:+.3f} us/op (IQR {q[k][0]:+.3f} to {q[k][1]:+.3f})"
              for label, k in (("under compile", "compiled_scope-compiled"), ("in eager (recording)",
                                                                             "eager_scope-eager"))),
        ]
    return "\n".join([*lines, ""])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Command line entry point; returns the results dict."""
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m benchmarks.compiled", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small model, few rounds")
    p.add_argument("--rounds", type=int)
    p.add_argument("--threads", type=int, help="torch.set_num_threads (quick: 1)")
    p.add_argument("--out")
    p.add_argument("--no-chain", action="store_true", help="skip the per-op cost measurement")
    a = p.parse_args(argv)
    preset = QUICK if a.quick else FULL
    if a.threads or preset.get("threads"):
        torch.set_num_threads(a.threads or preset["threads"])
    rounds = a.rounds or preset["rounds"]
    out_dir = results_dir(a.out, "cpu-compiled-quick" if a.quick else "cpu-compiled")
    # One compiled copy of the model per strategy: more than dynamo's default number of
    # cached variants of GPT.forward.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    t0 = time.perf_counter()
    log = make_log(t0)
    machine = machine_info("cpu")
    log(f"compiled strategies on {preset['model'].describe()}")
    main_res = run_compiled_suite(preset["model"], rounds, log)
    chain = None if a.no_chain else run_chain(preset["chain_rounds"])
    mark_end(machine)
    results: dict[str, Any] = {"argv": argv, "machine": machine, "quick": a.quick, "rounds": rounds,
                               "main": main_res, "chain": chain, "targets": compute_targets(main_res)}
    results["duration_s"] = time.perf_counter() - t0
    md = to_markdown(results)
    write_results(out_dir, results, md)
    print("\n" + md)
    log(f"written to {out_dir}")
    return results


if __name__ == "__main__":
    main()
