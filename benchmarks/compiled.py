"""Compiled strategies: every recompute strategy under ``torch.compile`` (inductor).

    python -m benchmarks.compiled [--quick] [--threads N] [--rounds N] [--out DIR]

Runs, on the benchmark GPT (``benchmarks/gpt.py``), from the same seed, in one process,
each strategy compiled with ``torch.compile(model, backend="inductor", fullgraph=True)``:

* ``plain``: no recomputation;
* ``checkpoint``: ``torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)`` per layer;
* ``sac_matmul``: selective checkpointing per layer, MUST_SAVE matmuls and attention
  kernels, PREFER_RECOMPUTE the rest (``create_selective_checkpoint_contexts``);
* ``scope_layer``: ``with recompute_scope():`` around each layer;
* ``scope_mlp``: ``recompute_scope()`` around the MLP activation ``gelu(fc1(x))`` only;
* ``scope_act``: ``recompute_scope()`` around the MLP activation and the attention probabilities;
* ``plain_again``: ``plain`` timed twice per round (A/A control: the noise floor).

Measured per strategy: **saved for backward**, the bytes of the distinct storages that
autograd keeps for backward (a saved-tensor hook around the compiled call; parameters and
the batch are not counted), **held after forward** and **peak** of forward + backward
(``benchmarks/_harness/memory.py``: the CPU profiler's allocation log), and the **step time** of
one forward + backward (median over interleaved rounds, order rotated each round, ratios
are medians of per-round ratios). Gradients are compared with compiled ``plain``'s.

A second, small measurement shows the per-op cost of a scope under compile: a chain of
1000 ``h = h * 1.0001`` ops on an 8-element tensor, forward only, compiled with
``aot_eager`` (each op stays a separate call) with and without a scope around the chain,
next to the eager recording cost of the same chain.

Results go to ``benchmarks/results/cpu-compiled/`` (``--quick``: ``cpu-compiled-quick/``):
``results.json`` and ``results.md``.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from gradient_scope import recompute_scope

from ._harness.machine import machine_info, mark_end
from ._harness.memory import measure
from ._harness.report import (
    MiB,
    finish,
    header_lines,
    make_log,
    results_dir,
    targets_and_strategies,
    targets_markdown,
)
from ._harness.strategies import AA, apply_gpt_strategy, profile_against_plain
from ._harness.timing import frozen_gc, interleaved_rounds, quartiles, ratio_summary, time_step
from .gpt import GPT, GPTConfig, make_batch

STRATEGIES = ["plain", "checkpoint", "sac_matmul", "scope_layer", "scope_mlp", "scope_act"]
DESCRIPTIONS = {
    "plain": "no recomputation",
    "checkpoint": "torch.utils.checkpoint per layer (use_reentrant=False)",
    "sac_matmul": "selective checkpointing per layer: MUST_SAVE matmuls/attention, PREFER_RECOMPUTE the rest",
    "scope_layer": "recompute_scope() around each layer",
    "scope_mlp": "recompute_scope() around the MLP activation gelu(fc1(x)) only",
    "scope_act": "recompute_scope() around gelu(fc1(x)) and around the attention probabilities",
    AA: "plain again (A/A control: the noise floor of the time ratios)",
}

FULL = dict(model=GPTConfig(), rounds=10, chain_rounds=15)
QUICK = dict(
    model=GPTConfig(vocab=1024, seq=128, d_model=128, n_head=4, n_layer=2, batch=4),
    rounds=3,
    chain_rounds=5,
    threads=1,
)
CHAIN_OPS = 1000


class SavedBytes:
    """Distinct storages autograd saves for backward while active (bytes), except those
    in ``exclude`` (parameters, the batch)."""

    def __init__(self, exclude: list[torch.Tensor]) -> None:
        self.exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self.storages: dict[int, int] = {}
        self.count = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        self.count += 1
        if s.data_ptr() not in self.exclude:
            self.storages[s.data_ptr()] = s.nbytes()
        return t

    @property
    def nbytes(self) -> int:
        return sum(self.storages.values())


class CompiledBench:
    """One compiled copy of the model per strategy, same weights and batch."""

    def __init__(self, cfg: GPTConfig, seed: int) -> None:
        self.cfg, self.seed = cfg, seed
        self.x, self.y = make_batch(cfg, "cpu", seed)
        self.models: dict[str, GPT] = {}
        self.compiled: dict[str, Callable[..., torch.Tensor]] = {}
        for name in [*STRATEGIES, AA]:
            if name == AA:
                m = self.models["plain"]
            else:
                torch.manual_seed(seed)  # the same weights in every copy
                m = GPT(cfg)
                m.train()
            apply_gpt_strategy(m, name)  # module-level hooks: nothing is recorded per call
            self.models[name] = m
            self.compiled[name] = (
                self.compiled["plain"] if name == AA else torch.compile(m, backend="inductor", fullgraph=True)
            )

    def _prepare(self, name: str) -> None:
        self.models[name].zero_grad(set_to_none=True)
        torch.manual_seed(self.seed)  # same dropout masks for every strategy

    def step(self, name: str) -> torch.Tensor:
        self._prepare(name)
        return self._fwd_bwd(name)

    def timed_step(self, name: str) -> float:
        self._prepare(name)
        return time_step(lambda: self._fwd_bwd(name))

    def _fwd_bwd(self, name: str) -> torch.Tensor:
        loss = self.compiled[name](self.x, self.y)
        loss.backward()
        return loss

    def profiled_step(self, name: str) -> dict[str, Any]:
        model = self.models[name]
        model.zero_grad(set_to_none=True)
        saved = SavedBytes([*model.parameters(), *model.buffers(), self.x, self.y])
        torch.manual_seed(self.seed)
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
            loss = self.compiled[name](self.x, self.y)
        loss.backward()
        out = {
            "saved_bytes": saved.nbytes,
            "saved_tensors": saved.count,
            "loss": loss.item(),
            "grads": [p.grad.detach().clone() for p in model.parameters()],
        }
        del loss
        model.zero_grad(set_to_none=True)
        gc.collect()
        torch.manual_seed(self.seed)
        loss, held, peak = measure(lambda: self.compiled[name](self.x, self.y), lambda loss: loss.backward())
        out["held"], out["peak"] = held, peak
        del loss
        return out


def _grad_diffs(grads: list[torch.Tensor], ref: list[torch.Tensor]) -> dict[str, float]:
    return {
        "grad_max_abs_diff": max((g - p).abs().max().item() for g, p in zip(grads, ref)),
        "grad_max_rel_diff": max(
            ((g - p).abs().max() / p.abs().max().clamp_min(1e-30)).item() for g, p in zip(grads, ref)
        ),
    }


def run_compiled_suite(cfg: GPTConfig, rounds: int, seed: int, log: Callable[[str], None]) -> dict[str, Any]:
    t0 = time.perf_counter()
    bench = CompiledBench(cfg, seed)
    compile_s: dict[str, float] = {}
    for name in [*STRATEGIES, AA]:  # compile (forward and backward), then warm up
        t = time.perf_counter()
        bench.step(name)
        compile_s[name] = time.perf_counter() - t
        bench.step(name)
        log(f"  {name}: compiled in {compile_s[name]:.1f} s")
    res = profile_against_plain(STRATEGIES, bench.profiled_step, _grad_diffs)
    for name, r in res.items():
        r["compile_s"] = compile_s[name]
    timed = [*STRATEGIES, AA]
    with frozen_gc():
        times = interleaved_rounds({name: (lambda n=name: bench.timed_step(n)) for name in timed}, rounds)
    for name, summary in ratio_summary(times).items():
        res.setdefault(name, {}).update(summary)
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
    us = {k: 1e6 * statistics.median(v) / n for k, v in times.items()}
    per_round = {
        "compiled_scope-compiled": [1e6 * (a - b) / n for a, b in zip(times["compiled_scope"], times["compiled"])],
        "eager_scope-eager": [1e6 * (a - b) / n for a, b in zip(times["eager_scope"], times["eager"])],
    }
    return {
        "n_ops": n,
        "rounds": rounds,
        "us_per_op": us,
        "scope_cost_us_per_op": {k: statistics.median(v) for k, v in per_round.items()},
        "scope_cost_us_per_op_quartiles": {k: quartiles(v) for k, v in per_round.items()},
        "times_s": times,
    }


# ---------------------------------------------------------------------- report


def compute_targets(main: dict[str, Any]) -> list[dict[str, Any]]:
    s = main["strategies"]
    aa = s[AA]
    noise = (
        f"A/A {aa['ratio_vs_plain']:.3f}x (IQR {aa['ratio_vs_plain_quartiles'][0]:.3f}-"
        f"{aa['ratio_vs_plain_quartiles'][1]:.3f})"
    )
    sl, ck, sm, pl = s["scope_layer"], s["checkpoint"], s["scope_mlp"], s["plain"]
    T = []

    def add(target: str, measured: str, met: bool, note: str = "") -> None:
        T.append({"target": target, "measured": measured, "met": met, "note": note})

    add(
        "compiled scope_layer saved-for-backward bytes <= compiled checkpoint's",
        f"{sl['saved_bytes'] / MiB:.2f} MiB vs {ck['saved_bytes'] / MiB:.2f} MiB "
        f"({sl['saved_bytes'] / ck['saved_bytes']:.3f}x)",
        sl["saved_bytes"] <= ck["saved_bytes"],
        f"held after forward: {sl['held'] / MiB:.2f} vs {ck['held'] / MiB:.2f} MiB",
    )
    add(
        "compiled scope_layer step time <= 1.00x compiled checkpoint's",
        f"{sl['ratio_vs_checkpoint']:.3f}x (IQR {sl['ratio_vs_checkpoint_quartiles'][0]:.3f}-"
        f"{sl['ratio_vs_checkpoint_quartiles'][1]:.3f})",
        sl["ratio_vs_checkpoint"] <= 1.00,
        noise,
    )
    add(
        "compiled scope_mlp saved-for-backward bytes <= 0.80x compiled plain's",
        f"{sm['saved_bytes'] / MiB:.2f} MiB vs {pl['saved_bytes'] / MiB:.2f} MiB "
        f"({sm['saved_bytes'] / pl['saved_bytes']:.3f}x)",
        sm["saved_bytes"] <= 0.80 * pl["saved_bytes"],
        f"held after forward: {sm['held'] / pl['held']:.3f}x plain's",
    )
    add(
        "compiled scope_mlp step time <= 1.10x compiled plain's",
        f"{sm['ratio_vs_plain']:.3f}x (IQR {sm['ratio_vs_plain_quartiles'][0]:.3f}-"
        f"{sm['ratio_vs_plain_quartiles'][1]:.3f})",
        sm["ratio_vs_plain"] <= 1.10,
        noise,
    )
    return T


def to_markdown(results: dict[str, Any]) -> str:
    main, chain = results["main"], results["chain"]
    cfg = GPTConfig(**main["config"])
    s = main["strategies"]
    pl = s["plain"]
    lines = [
        *header_lines(
            "# gradient_scope benchmarks: compiled strategies (inductor)",
            "benchmarks.compiled",
            results,
            load_note=" (the machine is shared: step times are noisy, see the A/A row)",
        ),
        f"- model: {cfg.describe()}",
        '- every strategy: `torch.compile(model, backend="inductor", fullgraph=True)`, one fwd+bwd step '
        "(no optimizer), same weights, batch and seed",
        "- saved for backward: distinct storages autograd keeps (saved-tensor hook around the compiled call; "
        "parameters and batch excluded); held / peak: CPU profiler (benchmarks/_harness/memory.py)",
        f"- step time: median of {results['rounds']} interleaved rounds; ratios are medians of per-round ratios",
        "",
        *targets_and_strategies(targets_markdown(results["targets"]), DESCRIPTIONS),
        "",
        "| strategy | saved for bwd (MiB) | vs plain | held after fwd (MiB) | peak fwd+bwd (MiB) "
        "| median step (ms) | time vs plain | time vs checkpoint | max rel grad diff vs plain | compile (s) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, v in s.items():
        has_mem = "saved_bytes" in v
        lines.append(
            "| {} | {} | {} | {} | {} | {:.1f} | {:.3f}x | {:.3f}x | {} | {} |".format(
                name,
                f"{v['saved_bytes'] / MiB:.2f}" if has_mem else "",
                f"{v['saved_bytes'] / pl['saved_bytes']:.3f}x" if has_mem else "",
                f"{v['held'] / MiB:.2f}" if has_mem else "",
                f"{v['peak'] / MiB:.2f}" if has_mem else "",
                1e3 * v["time_median_s"],
                v["ratio_vs_plain"],
                v["ratio_vs_checkpoint"],
                f"{v['grad_max_rel_diff']:.1e}" if has_mem else "",
                f"{v['compile_s']:.0f}" if has_mem else "",
            )
        )
    if chain is None:
        return "\n".join([*lines, ""])
    c = chain["scope_cost_us_per_op"]
    q = chain["scope_cost_us_per_op_quartiles"]
    lines += [
        "",
        "## Per-op cost of a scope under compile",
        "",
        f"A chain of {chain['n_ops']} `h = h * 1.0001` ops on an 8-element tensor that requires grad, "
        f"forward only, median of {chain['rounds']} interleaved rounds; compiled with `aot_eager` "
        "(each op stays one call, so a per-op cost would show).",
        "",
        "| configuration | us per op |",
        "| --- | ---: |",
    ]
    for k, v in chain["us_per_op"].items():
        lines.append(f"| {k} | {v:.3f} |")
    lines += [
        "",
        f"- scope cost under compile: {c['compiled_scope-compiled']:+.3f} us/op "
        f"(IQR {q['compiled_scope-compiled'][0]:+.3f} to {q['compiled_scope-compiled'][1]:+.3f})",
        f"- scope cost in eager (recording): {c['eager_scope-eager']:+.3f} us/op "
        f"(IQR {q['eager_scope-eager'][0]:+.3f} to {q['eager_scope-eager'][1]:+.3f})",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Command line entry point; returns the results dict."""
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m benchmarks.compiled", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small model, few rounds")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (quick: 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    p.add_argument("--no-chain", action="store_true", help="skip the per-op cost measurement")
    a = p.parse_args(argv)
    preset = QUICK if a.quick else FULL
    threads = a.threads if a.threads is not None else preset.get("threads")
    if threads:
        torch.set_num_threads(threads)
    rounds = a.rounds or preset["rounds"]
    out_dir = results_dir(a.out, "cpu-compiled-quick" if a.quick else "cpu-compiled")
    # One compiled copy of the model per strategy: more than dynamo's default number of
    # cached variants of GPT.forward.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    t0 = time.perf_counter()
    log = make_log(t0)
    machine = machine_info("cpu")
    log(f"compiled strategies on {GPTConfig(**preset['model'].asdict()).describe()}")
    main_res = run_compiled_suite(preset["model"], rounds, a.seed, log)
    chain = None if a.no_chain else run_chain(preset["chain_rounds"])
    mark_end(machine)
    results: dict[str, Any] = {
        "argv": argv,
        "machine": machine,
        "quick": a.quick,
        "rounds": rounds,
        "main": main_res,
        "chain": chain,
        "duration_s": time.perf_counter() - t0,
    }
    results["targets"] = compute_targets(main_res)
    md = finish(results, out_dir, t0, lambda r, charts: to_markdown(r))
    print("\n" + md)
    log(f"written to {out_dir}")
    return results


if __name__ == "__main__":
    main()
