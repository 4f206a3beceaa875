"""Memory budgets (``gradient_scope.Budget``) against hand policies: bytes vs recompute.

For each model (the benchmark GPT of ``benchmarks.gpt`` and the Hugging Face models of
``benchmarks.hf_zoo``), every strategy runs on its own deep copy from the same weights:

* ``plain`` and ``plain_again`` (the A/A row: two identical runs, their time ratio is the
  noise of the timing), hand policies -- ``scope_layer`` (a scope per layer),
  ``scope_layer_savemm`` (the same with ``save=save_matmuls``), ``checkpoint`` (torch
  checkpoint per layer, non-reentrant), ``sac_mm`` (torch selective checkpointing per
  layer, saving matmuls) -- and ``budget@N``: a scope per layer with ``Budget(N)``, for a
  sweep of budgets from below the floor to plain's held bytes, plus the budgets at which
  each hand policy's held bytes would be met;
* per strategy: bytes held after forward and peak of forward+backward (the validated
  probe, ``benchmarks._harness.memory``), backward FLOPs (``torch.profiler`` ``with_flops=True``:
  it counts matmul-like ops run inside the unpack hook, replays included; recompute
  FLOPs = backward FLOPs - plain's), gradients vs plain (bitwise), step time as medians of
  per-round ratios to plain (interleaved rounds), and for budgets the time spent in the
  budget's own code per step (decisions, structure checks, planning).

Budgets are measured from their third step (step 1 is unplanned, step 2 planned).

    python -m benchmarks.budget --quick        # small sizes, CPU, a few minutes
"""

from __future__ import annotations

import argparse
import copy
import functools
import gc
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.profiler import ProfilerActivity, profile

import gradient_scope
from gradient_scope import Budget

from ._harness.machine import machine_info
from ._harness.memory import measure, quiet_stderr
from ._harness.report import fmt_mib
from ._harness.timing import frozen_gc, interleaved_rounds, ratio_summary

HAND = ["scope_layer", "scope_layer_savemm", "scope_attn_mlp", "checkpoint", "sac_mm"]
MATMULS = ("mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention_for_cpu")


@dataclass
class Case:
    """A model with its loss and how to pick its layers."""

    name: str
    model: nn.Module
    loss: Callable[[nn.Module], torch.Tensor]
    is_layer: Callable[[nn.Module], bool]
    describe: str
    parts: Callable[[nn.Module], list[nn.Module]]  # a copy's attention and MLP modules


def gpt_case(quick: bool) -> Case:
    from .gpt import GPT, Block, GPTConfig, make_batch

    cfg = (
        GPTConfig(vocab=512, seq=64, d_model=128, n_head=4, n_layer=4, batch=2)
        if quick
        else GPTConfig(vocab=2048, seq=128, d_model=256, n_head=4, n_layer=6, batch=4)
    )
    torch.manual_seed(0)
    model = GPT(cfg)
    idx, tgt = make_batch(cfg)
    return Case(
        "gpt",
        model,
        lambda m: m(idx, tgt),
        lambda m: isinstance(m, Block),
        cfg.describe(),
        lambda m: [p for b in m.blocks for p in (b.attn, b.mlp)],
    )


def hf_case(name: str, quick: bool) -> Case:
    from .hf_zoo import build

    built = build(name, "quick" if quick else "full", 0)
    batch = built.batch
    return Case(name, built.model, lambda m: m(**batch).loss, built.is_layer, json.dumps(built.config), built.parts_of)


def _sac_checkpoint(fn: Any, *args: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    ops = {getattr(torch.ops.aten, n) for n in MATMULS if hasattr(torch.ops.aten, n)}

    def policy(ctx: Any, op: Any, *a: Any, **k: Any) -> Any:
        return CheckpointPolicy.MUST_SAVE if op.overloadpacket in ops else CheckpointPolicy.PREFER_RECOMPUTE

    return checkpoint(
        fn,
        *args,
        use_reentrant=False,
        context_fn=functools.partial(create_selective_checkpoint_contexts, policy),
        **kwargs,
    )


def apply(case: Case, model: nn.Module, name: str) -> Budget | None:
    """Make ``model`` (a copy of ``case.model``) run strategy ``name``."""
    if name in ("plain", "plain_again"):
        return None
    if name.startswith("budget@"):
        budget = Budget(int(name.split("@")[1]))
        gradient_scope.apply_recompute(model, check_fn=case.is_layer, budget=budget)
        return budget
    if name == "scope_layer":
        gradient_scope.apply_recompute(model, check_fn=case.is_layer)
    elif name == "scope_attn_mlp":
        ids = {id(m) for m in case.parts(model)}
        gradient_scope.apply_recompute(model, check_fn=lambda m: id(m) in ids)
    elif name == "scope_layer_savemm":
        gradient_scope.apply_recompute(model, check_fn=case.is_layer, save=gradient_scope.save_matmuls)
    elif name in ("checkpoint", "sac_mm"):
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            CheckpointImpl,
            apply_activation_checkpointing,
            checkpoint_wrapper,
        )

        wrapper = (
            functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
            if name == "checkpoint"
            else functools.partial(checkpoint_wrapper, checkpoint_fn=_sac_checkpoint)
        )
        apply_activation_checkpointing(model, checkpoint_wrapper_fn=wrapper, check_fn=case.is_layer)
    else:
        raise ValueError(name)
    return None


class Runner:
    def __init__(self, case: Case, name: str) -> None:
        self.case, self.name = case, name
        self.model = copy.deepcopy(case.model)
        self.budget = apply(case, self.model, name)

    def step(self, seed: int = 1) -> None:
        self.model.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        self.case.loss(self.model).backward()

    def grads(self) -> dict[str, torch.Tensor]:
        return {
            n.replace("_checkpoint_wrapped_module.", ""): p.grad.clone()
            for n, p in self.model.named_parameters()
            if p.grad is not None
        }

    def probe(self) -> dict[str, Any]:
        self.model.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        gc.collect()
        _, held, peak = measure(lambda: self.case.loss(self.model), lambda loss: loss.backward())
        return {"held": held, "peak": peak}

    def bwd_flops(self) -> int:
        self.model.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        loss = self.case.loss(self.model)
        with quiet_stderr():
            with profile(activities=[ProfilerActivity.CPU], with_flops=True) as prof:
                loss.backward()
        return int(sum(e.flops or 0 for e in prof.events()))

    def timed(self) -> float:
        self.model.zero_grad(set_to_none=True)
        gc.collect()
        t0 = time.perf_counter()
        self.step()
        return time.perf_counter() - t0


def own_time(runner: Runner) -> dict[str, float]:
    """CPU seconds spent in the budget's own code during a step, and the step's (median of 3)."""
    from gradient_scope import _budget

    spent = [0.0]
    originals = {}

    def timed(cls: Any, attr: str) -> None:
        fn = getattr(cls, attr)
        originals[(cls, attr)] = fn

        def wrapper(*a: Any, **k: Any) -> Any:
            t0 = time.process_time()
            try:
                return fn(*a, **k)
            finally:
                spent[0] += time.process_time() - t0

        setattr(cls, attr, wrapper)

    for cls, attr in ((_budget._BlockPlan, "__call__"), (_budget._BlockPlan, "close"), (_budget.Budget, "open_block")):
        timed(cls, attr)
    fractions = []
    try:
        for _ in range(3):  # CPU time (a shared machine preempts), median of 3 steps
            spent[0] = 0.0
            runner.model.zero_grad(set_to_none=True)
            gc.collect()
            t0 = time.process_time()
            runner.step()
            step = time.process_time() - t0
            fractions.append((spent[0] / step, spent[0], step))
    finally:
        for (cls, attr), fn in originals.items():
            setattr(cls, attr, fn)
    frac, own, step = sorted(fractions)[1]
    return {"budget_code_s": own, "step_s": step, "fraction": frac}


def run_case(
    case: Case, rounds: int, points: int, log: Callable[[str], None], inductor: list[float] | None = None
) -> dict[str, Any]:
    res: dict[str, Any] = {"describe": case.describe, "strategies": {}}
    plain = Runner(case, "plain")
    plain.step()
    base = plain.probe()
    plain.step()
    ref = plain.grads()
    base_flops = plain.bwd_flops()
    probe0 = Runner(case, "budget@0")
    for _ in range(2):
        probe0.step()
    assert probe0.budget is not None
    floor = probe0.budget.floor_bytes or 0
    unscoped = probe0.probe()["held"] - floor
    res.update(plain=base, plain_bwd_flops=base_flops, floor=floor, unscoped=unscoped)
    log(f"{case.name}: plain held {fmt_mib(base['held'])} MiB peak {fmt_mib(base['peak'])} MiB, floor {fmt_mib(floor)}")
    names = ["plain", "plain_again", *HAND]
    runners: dict[str, Runner] = {}
    for name in names:
        r = runners[name] = Runner(case, name)
        r.step()
        r.step()
        m = r.probe()
        r.step()
        m["bitwise"] = all(torch.equal(a, ref[k]) for k, a in r.grads().items()) and r.grads().keys() == ref.keys()
        m["recompute_flops"] = r.bwd_flops() - base_flops
        res["strategies"][name] = m
        log(
            f"  {name:20s} held {fmt_mib(m['held']):>8} peak {fmt_mib(m['peak']):>8} "
            f"recompute {m['recompute_flops'] / 1e9:.3f} GFLOP bitwise {m['bitwise']}"
        )
    top = base["held"]
    sweep = {floor // 2, floor, top, top - unscoped}
    sweep |= {floor + (top - unscoped - floor) * i // (points + 1) for i in range(1, points + 1)}
    sweep |= {max(res["strategies"][h]["held"] - unscoped, 0) for h in HAND}
    for b in sorted(sweep):
        name = f"budget@{b}"
        r = runners[name] = Runner(case, name)
        for _ in range(2):
            r.step()
        m = r.probe()
        r.step()
        m["bitwise"] = all(torch.equal(a, ref[k]) for k, a in r.grads().items()) and r.grads().keys() == ref.keys()
        m["recompute_flops"] = r.bwd_flops() - base_flops
        m["budget"] = b
        m["planned"] = r.budget.planned_bytes if r.budget else None
        m["predicted"] = r.budget.predicted_recompute if r.budget else None
        m.update(own_time(r))
        res["strategies"][name] = m
        log(
            f"  {name:20s} held {fmt_mib(m['held']):>8} peak {fmt_mib(m['peak']):>8} "
            f"recompute {m['recompute_flops'] / 1e9:.3f} GFLOP bitwise {m['bitwise']} own {100 * m['fraction']:.2f}%"
        )
    # planning time: a fresh budget's first planning, timed
    fresh = Runner(case, f"budget@{top}")
    fresh.step()
    t0 = time.perf_counter()
    assert fresh.budget is not None
    fresh.budget.floor_bytes  # noqa: B018  (ends the step: plans it)
    res["planning_s"] = time.perf_counter() - t0
    timing = {n: r.timed for n, r in runners.items()}
    times = interleaved_rounds(timing, rounds)
    for n, s in ratio_summary(times, bases=("plain",)).items():
        res["strategies"][n]["time_ratio_vs_plain"] = s["ratio_vs_plain"]
        res["strategies"][n]["time_median_s"] = s["time_median_s"]
    if inductor:
        res["inductor"] = inductor_points(case, inductor, ref, log)
    res["curve"] = probe0.budget.curve().rows
    res["targets"] = targets(res)
    return res


def inductor_points(case: Case, ratios: list[float], ref: dict[str, torch.Tensor], log: Callable[[str], None]) -> list:
    """The same model compiled with inductor under ``activation_memory_budget`` ratios:
    held, peak, backward FLOPs (recompute: vs the ratio 1.0 point) and the largest
    gradient difference from eager plain (inductor fuses: not bitwise)."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    points = []
    for r in sorted(ratios, reverse=True):
        torch._dynamo.reset()
        model = copy.deepcopy(case.model)
        compiled = torch.compile(model)
        with (
            functorch_config.patch(activation_memory_budget=r, enable_autograd_cache=False),
            inductor_config.patch(fx_graph_cache=False),
        ):
            t0 = time.perf_counter()
            for _ in range(2):
                model.zero_grad(set_to_none=True)
                torch.manual_seed(1)
                case.loss(compiled).backward()
            compile_s = time.perf_counter() - t0
            runner = Runner.__new__(Runner)
            runner.case, runner.name, runner.budget = case, "", None
            runner.model = compiled
            m = runner.probe()
            flops = runner.bwd_flops()
            grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        diff = max(float((grads[n] - g).abs().max()) for n, g in ref.items() if n in grads)
        points.append({"ratio": r, **m, "bwd_flops": flops, "max_abs_grad_diff": diff, "compile_s": compile_s})
        log(
            f"  inductor activation_memory_budget={r}: held {fmt_mib(m['held'])} peak {fmt_mib(m['peak'])} "
            f"bwd {flops / 1e9:.3f} GFLOP grad diff {diff:.2e}"
        )
    base = points[0]["bwd_flops"]
    for pt in points:
        pt["recompute_flops"] = pt["bwd_flops"] - base
    return points


def targets(res: dict[str, Any]) -> list[dict[str, Any]]:
    S, floor, unscoped = res["strategies"], res["floor"], res["unscoped"]
    budgets = sorted((v for v in S.values() if "budget" in v), key=lambda v: v["budget"])
    out = []

    def add(target: str, met: bool, detail: str) -> None:
        out.append({"target": target, "met": met, "detail": detail})

    over = [(v["budget"], v["held"] - v["budget"] - unscoped) for v in budgets if v["budget"] >= floor]
    worst = max((o for _, o in over), default=0)
    add("held <= budget + unscoped (budget >= floor)", worst <= 0, f"worst excess {worst} bytes")
    flops = [v["recompute_flops"] for v in budgets]
    add("recompute FLOPs non-increasing in budget", flops == sorted(flops, reverse=True), str(flops))
    for h in HAND:
        p = S[h]
        at = [v for v in budgets if v["held"] <= p["held"]]
        best = min((v["recompute_flops"] for v in at), default=None)
        add(
            f"at {h}'s held bytes, recompute <= {h}'s",
            best is not None and best <= p["recompute_flops"],
            f"budget {best} vs {h} {p['recompute_flops']} FLOPs (held {p['held']})",
        )
    top = [v for v in budgets if v["held"] >= res["plain"]["held"] - 0]
    add(
        "at plain's held bytes nothing recomputed",
        bool(top) and top[0]["recompute_flops"] == 0,
        f"{[(v['budget'], v['recompute_flops']) for v in budgets[-2:]]}",
    )
    peaks = [v["peak"] for v in budgets]
    add(
        "no peak above plain's", max(peaks) <= res["plain"]["peak"], f"max {max(peaks)} vs plain {res['plain']['peak']}"
    )
    frac = max(v["fraction"] for v in budgets)
    add(
        "budget code per step < 1% of a step",
        frac < 0.01,
        f"max {100 * frac:.2f}%, planning once {res['planning_s']:.3f} s",
    )
    add("gradients bitwise equal to plain", all(v["bitwise"] for v in S.values()), "")
    return out


def chart(results: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = results["cases"]
    fig, axes = plt.subplots(1, len(cases), figsize=(5 * len(cases), 4), squeeze=False)
    for ax, (name, res) in zip(axes[0], cases.items()):
        S = res["strategies"]
        bud = sorted((v for v in S.values() if "budget" in v), key=lambda v: v["held"])
        ax.plot([v["held"] / 2**20 for v in bud], [v["recompute_flops"] / 1e9 for v in bud], "o-", label="Budget sweep")
        for h, marker in zip(HAND, "sDP^v"):
            label = f"{h} (counts its cached matmuls)" if h == "sac_mm" else h
            ax.plot(S[h]["held"] / 2**20, S[h]["recompute_flops"] / 1e9, marker, ms=9, label=label)
        ind = res.get("inductor") or []
        if ind:
            ax.plot(
                [q["held"] / 2**20 for q in ind],
                [q["recompute_flops"] / 1e9 for q in ind],
                "x:",
                ms=9,
                label="inductor activation_memory_budget",
            )
        ax.axvline(res["plain"]["held"] / 2**20, color="gray", ls="--", lw=1, label="plain held")
        ax.set_title(name)
        ax.set_xlabel("held after forward (MiB)")
        ax.set_ylabel("recompute (GFLOP, profiler)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(results: dict[str, Any]) -> str:
    lines = ["# Memory budget sweep", "", f"Machine: `{json.dumps(results['machine'])}`", ""]
    for name, res in results["cases"].items():
        lines += [
            f"## {name}",
            "",
            res["describe"],
            "",
            f"plain held {fmt_mib(res['plain']['held'])} MiB, peak {fmt_mib(res['plain']['peak'])} MiB; "
            f"floor {fmt_mib(res['floor'])} MiB; unscoped part {fmt_mib(res['unscoped'])} MiB; "
            f"planning (once) {res['planning_s'] * 1e3:.1f} ms",
            "",
            "| strategy | budget MiB | held MiB | peak MiB | recompute GFLOP | time vs plain | budget code | bitwise |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
        ]
        for n, v in sorted(res["strategies"].items(), key=lambda kv: ("budget" in kv[1], kv[1]["held"])):
            own = f"{100 * v['fraction']:.2f}%" if "fraction" in v else ""
            lines.append(
                f"| {n.split('@')[0]} | {fmt_mib(v.get('budget'))} | {fmt_mib(v['held'])} | {fmt_mib(v['peak'])} | "
                f"{v['recompute_flops'] / 1e9:.3f} | {v.get('time_ratio_vs_plain', 0):.3f}x | {own} | {v['bitwise']} |"
            )
        if res.get("inductor"):
            lines += [
                "",
                "Inductor (`torch.compile`, `activation_memory_budget` ratio; recompute vs ratio 1.0; its "
                "dropout draws other random numbers than eager, hence the gradient difference):",
                "",
                "| ratio | held MiB | peak MiB | recompute GFLOP | max abs grad diff vs eager plain |",
                "| ---: | ---: | ---: | ---: | ---: |",
            ]
            lines += [
                f"| {q['ratio']} | {fmt_mib(q['held'])} | {fmt_mib(q['peak'])} | "
                f"{q['recompute_flops'] / 1e9:.3f} | {q['max_abs_grad_diff']:.2e} |"
                for q in res["inductor"]
            ]
        lines += [
            "",
            "`sac_mm`'s recompute is overstated: the profiler records each op at dispatch, also the "
            "matmuls that selective checkpointing then serves from its cache in the recomputation "
            "(checked: `torch.utils.checkpoint` with `MUST_SAVE` on `mm` counts the cached `mm` calls). "
            "The targets against it are listed but say little.",
        ]
        lines += ["", "| target | met | detail |", "| --- | --- | --- |"]
        lines += [f"| {t['target']} | {'yes' if t['met'] else 'NO'} | {t['detail']} |" for t in res["targets"]]
        lines.append("")
    return "\n".join(lines)


def write(results: dict[str, Any], out: str) -> None:
    """results.json, results.md and the chart (when matplotlib is installed) in ``out``."""
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(markdown(results))
    try:
        chart(results, os.path.join(out, "budget.png"))
    except ImportError:
        print("matplotlib not installed: no chart")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m benchmarks.budget", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small sizes, GPT + gpt2 + llama, 3 rounds")
    p.add_argument("--models", nargs="+", default=None, help="gpt and/or names of benchmarks.hf_zoo")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--points", type=int, default=None, help="budgets between the floor and plain")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument(
        "--inductor",
        type=float,
        nargs="*",
        default=None,
        help="also compile the GPT with inductor at these activation_memory_budget ratios (e.g. 1.0 0.5 0.1)",
    )
    p.add_argument("--out", default=None)
    a = p.parse_args(sys.argv[1:] if argv is None else argv)
    torch.set_num_threads(a.threads)
    models = a.models or (["gpt", "gpt2", "llama"] if a.quick else ["gpt", "gpt2", "llama", "bert", "t5"])
    rounds = a.rounds or (3 if a.quick else 7)
    points = a.points or (5 if a.quick else 8)
    out = a.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "cpu-budget")
    os.makedirs(out, exist_ok=True)
    t_start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:6.1f}s] {msg}", flush=True)

    results: dict[str, Any] = {"machine": machine_info("cpu", ["transformers"]), "cases": {}}
    with frozen_gc():
        for name in models:
            case = gpt_case(a.quick) if name == "gpt" else hf_case(name, a.quick)
            ind = a.inductor if name == "gpt" else None
            results["cases"][name] = run_case(case, rounds, points, log, ind)
    write(results, out)
    log(f"wrote {out}")
    return results


if __name__ == "__main__":
    main()
