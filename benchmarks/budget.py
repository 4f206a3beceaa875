"""Memory budgets (``gradient_scope.Budget``) against hand policies: bytes vs recompute.

    python -m benchmarks.budget --quick        # small sizes, CPU, a few minutes
    python -m benchmarks.budget --device cuda --offload   # on a GPU, with the offload strategies

For each model (the benchmark GPT of ``benchmarks.gpt`` and the Hugging Face models of
``benchmarks.hf_zoo``), every strategy runs on its own copy from the same weights
(``benchmarks/_harness/suite.py``):

* ``plain`` and ``plain_again`` (the A/A row: two identical runs, their time ratio is the
  noise of the timing), the hand policies ``scope_layer``, ``scope_layer_savemm``,
  ``scope_attn_mlp``, ``checkpoint`` and ``sac_matmul`` (``benchmarks/_harness/strategies.py``),
  and ``budget@N``: a scope per layer with ``Budget(N)``, for a sweep of budgets from
  below the floor to plain's held bytes, plus the budgets at which each hand policy's held
  bytes would be met;
* per strategy: bytes held after forward and peak of forward+backward (the validated
  probe), backward FLOPs (``torch.profiler`` ``with_flops=True``: it counts matmul-like ops
  run inside the unpack hook, replays included; recompute FLOPs = backward FLOPs -
  plain's), gradients vs plain (bitwise), step time as medians of per-round ratios to
  plain (interleaved rounds), and for budgets the CPU time spent in the budget's own code
  per step (the calls scopes make to it: decisions, structure checks, planning);
* per budget, the predicted step of the blocks (``Budget.predicted_step_time``: their
  forward and backward as timed in the budget's measuring step, plus the plan's recompute
  scaled to that step's replays) against the measured one, taken right after the
  measuring step: the median over 9 rounds of the budget's step less the code outside
  the layers (plain, each layer passing its input through), each step's CPU time (the
  budget's timing takes the lesser of wall and CPU time too: on a shared machine wall
  time counts other programs); and that ratio with each side in units of plain's step
  timed next to it (the machine's speed drifts between the measuring step and the rounds).

With ``--offload``: ``save_on_cpu`` (torch's offloader), ``offload_all`` (every saved
tensor through the library's offload engine, nothing recomputed), and ``budget@N+offload``
(``Budget(N, offload=True)``) at the bytes the checkpoint strategy holds and at budgets
below the floor of recompute alone. Offload moves tensors only from a GPU: on a CPU these
strategies keep what they would offload.

Budgets are measured from their third step (step 1 is unplanned, step 2 planned).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

import gradient_scope
from gradient_scope import Budget

from ._harness.machine import machine_info, mark_end
from ._harness.memory import quiet_stderr
from ._harness.report import fmt_mib, md_table, pyplot, results_dir, save_figure, write_results
from ._harness.suite import Case, Runner
from ._harness.timing import frozen_gc, interleaved_rounds, quartiles, ratio_summary
from .gpt import GPTConfig
from .gpt import case as gpt_case
from .hf_zoo import build

HAND = ["scope_layer", "scope_layer_savemm", "scope_attn_mlp", "checkpoint", "sac_matmul"]
SEED = 1


def make_case(name: str, quick: bool, device: str = "cpu") -> Case:
    """``gpt`` (the benchmark GPT) or a model of ``benchmarks.hf_zoo``, at the quick or full size."""
    if name == "gpt":
        cfg = (GPTConfig(vocab=512, seq=64, d_model=128, n_head=4, n_layer=4, batch=2) if quick
               else GPTConfig(vocab=2048, seq=128, d_model=256, n_head=4, n_layer=6, batch=4))
        c = gpt_case(cfg, device)
        c.config["describe"] = cfg.describe()
        return c
    return build(name, "quick" if quick else "full", 0, device=device).case(name, device)


class _TimedPlan:
    """A budget's plan for one block, handed to the scope in its place: every call the
    scope makes to it adds its CPU time to the budget's ``spent``."""

    def __init__(self, plan: Any, budget: _TimedBudget) -> None:
        self._plan, self._budget = plan, budget

    def __call__(self, *args: Any) -> Any:
        t0 = time.process_time()
        try:
            return self._plan(*args)
        finally:
            self._budget.spent += time.process_time() - t0

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._plan, name)
        if not callable(attr):
            return attr

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.process_time()
            try:
                return attr(*args, **kwargs)
            finally:
                self._budget.spent += time.process_time() - t0

        return timed


class _TimedBudget(Budget):
    """A Budget that counts the CPU time of the calls scopes make to it (``_open_block``,
    which also ends and plans a step) and to the plans it hands out, in ``spent``."""

    def __init__(self, nbytes: int) -> None:
        super().__init__(nbytes)
        self.spent = 0.0

    def _open_block(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.process_time()
        try:
            plan = super()._open_block(*args, **kwargs)
        finally:
            self.spent += time.process_time() - t0
        return _TimedPlan(plan, self)


def own_time(c: Case, nbytes: int) -> dict[str, float] | None:
    """CPU seconds spent in a budget's own code during a step, and the step's (the middle
    of 3 steps by share); None where scopes no longer call ``Budget._open_block``."""
    if not callable(getattr(Budget, "_open_block", None)):
        return None
    runner = Runner(c, "plain", share_params=True)
    budget = _TimedBudget(nbytes)
    gradient_scope.apply_recompute(runner.model, check_fn=c.layers, budget=budget)
    for _ in range(2):
        runner.step(SEED)
    fractions = []
    for _ in range(3):  # CPU time (a shared machine preempts)
        budget.spent = 0.0
        t0 = time.process_time()
        runner.step(SEED)
        step = time.process_time() - t0
        fractions.append((budget.spent / step, budget.spent, step))
    frac, own, step = sorted(fractions)[1]
    return {"budget_code_s": own, "step_s": step, "fraction": frac}


def outside_layers(c: Case) -> Runner:
    """Plain, with every layer passing its input through: the code outside the layers
    (embedding, final norm, head, loss) alone."""
    runner = Runner(c, "plain", share_params=True)

    def passthrough(*args: Any, **kwargs: Any) -> Any:
        return args[0] if args else kwargs["hidden_states"]

    for m in runner.model.modules():
        if c.layers(m):
            m.forward = passthrough  # type: ignore[method-assign]
    return runner


def cpu_step(runner: Runner, steps: int = 7) -> float:
    """The least CPU time of ``steps`` forward+backward steps of ``runner`` (seconds)."""
    best = float("inf")
    for _ in range(steps):
        t0 = time.process_time()
        runner.step(SEED)
        best = min(best, time.process_time() - t0)
    return best


def blocks_steps(runner: Runner, outside: Runner, rounds: int = 9,
                 reference: Runner | None = None) -> tuple[list[float], list[float]]:
    """The step of ``runner``'s blocks, per round: its step less that of ``outside`` (the
    code outside the layers), CPU seconds; and per round the step of ``reference`` (plain:
    the machine's speed then), if given. Taken right after the budget's measuring step,
    which its prediction comes from: the speed of a shared machine drifts over seconds
    (plain's step by 1.5x, in phases of about half a second), so the two are measured as
    close together as can be. One planned step first (the plan's first use), then
    ``rounds`` rounds of one step each, in alternating order."""
    runner.step(SEED)
    order = [runner, outside] + ([reference] if reference is not None else [])
    blocks, ref = [], []
    for i in range(rounds):
        spent = [0.0] * len(order)
        for k in range(len(order)) if i % 2 == 0 else reversed(range(len(order))):
            spent[k] = cpu_step(order[k], 1)
        blocks.append(spent[0] - spent[1])
        ref += spent[2:]
    return blocks, ref


def bwd_flops(runner: Runner) -> int:
    """FLOPs of one backward as the profiler counts them (replayed matmuls included)."""
    runner.model.zero_grad(set_to_none=True)
    torch.manual_seed(SEED)
    loss = runner.forward()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if runner.device.startswith("cuda") else [])
    with quiet_stderr(), profile(activities=activities, with_flops=True) as prof:
        loss.backward()
    return int(sum(e.flops or 0 for e in prof.events()))


def _measured(runner: Runner, ref: dict[str, torch.Tensor], base_flops: int) -> dict[str, Any]:
    for _ in range(2):
        runner.step(SEED)
    p = runner.profiled_step(SEED)
    grads = p.pop("grads")
    return {"held": p["held"], "peak": p["peak"], "recompute_flops": bwd_flops(runner) - base_flops,
            "bitwise": grads.keys() == ref.keys() and all(torch.equal(g, ref[k]) for k, g in grads.items())}


@frozen_gc()  # the gc.collect() before each step then only sees this case's objects
def run_case(c: Case, rounds: int, points: int, log: Callable[[str], None],
             inductor: list[float] | None = None, hand: list[str] = HAND, offload: bool = False) -> dict[str, Any]:
    res: dict[str, Any] = {"describe": c.config.get("describe", str(c.config)), "strategies": {}}
    plain = Runner(c, "plain", share_params=True)
    plain.step(SEED)
    base = plain.profiled_step(SEED)
    ref = base.pop("grads")
    base_flops = bwd_flops(plain)
    probe0 = Runner(c, "budget@0", share_params=True)
    for _ in range(2):
        probe0.step(SEED)
    assert probe0.budget is not None
    floor = probe0.budget.floor_bytes or 0
    unscoped = probe0.profiled_step(SEED)["held"] - floor
    res.update(plain={"held": base["held"], "peak": base["peak"]}, plain_bwd_flops=base_flops, floor=floor,
               unscoped=unscoped)
    log(f"{c.name}: plain held {fmt_mib(base['held'])} MiB peak {fmt_mib(base['peak'])} MiB, floor {fmt_mib(floor)}")
    runners: dict[str, Runner] = {}
    outside = outside_layers(c)
    outside.step(SEED)

    def run(name: str) -> dict[str, Any]:
        r = runners[name] = Runner(c, name, share_params=True)
        steps: list[float] = []
        if r.budget is not None:
            before = cpu_step(plain, 1)  # the machine's speed at the measuring step: plain's step next to it
            r.step(SEED)  # the measuring step, then its plan (outside any timed step)
            r.budget.floor_bytes  # noqa: B018
            at_measuring = (before + cpu_step(plain, 1)) / 2
            steps, plains = blocks_steps(r, outside, reference=plain)
        m = res["strategies"][name] = _measured(r, ref, base_flops)
        if r.budget is not None:
            q1, q3 = quartiles(steps)
            m.update(budget=r.budget.bytes, planned=r.budget.planned_bytes, predicted=r.budget.predicted_recompute,
                     offloaded=r.budget.offloaded_bytes, predicted_step_s=r.budget.predicted_step_time,
                     predicted_library_s=r.budget._run.result.library, timed=r.budget._run.result.timed,
                     measured_blocks_s=r.budget._run.result.measured, replay_scale=r.budget._run.result.scale,
                     blocks_steps_s=steps, blocks_measured_s=statistics.median(steps),
                     blocks_quartiles_s=(q1, q3), plain_at_measuring_s=at_measuring,
                     plain_at_measured_s=statistics.median(plains))
            m.update(own_time(c, r.budget.bytes) or {})
        log(f"  {name:20s} held {fmt_mib(m['held']):>8} peak {fmt_mib(m['peak']):>8} recompute "
            f"{m['recompute_flops'] / 1e9:.3f} GFLOP bitwise {m['bitwise']}"
            + (f" own {100 * m['fraction']:.2f}%" if "fraction" in m else ""))
        return m

    for name in ["plain", "plain_again", *hand]:
        run(name)
    top = base["held"]
    sweep = {floor // 2, floor, top, top - unscoped}
    sweep |= {floor + (top - unscoped - floor) * i // (points + 1) for i in range(1, points + 1)}
    sweep |= {max(res["strategies"][h]["held"] - unscoped, 0) for h in hand}
    for b in sorted(sweep):
        run(f"budget@{b}")
    if offload:  # torch's and our offloaders, and the budget with offload (--offload)
        for name in ("save_on_cpu", "offload_all"):
            run(name)
        at = {res["strategies"]["checkpoint"]["held"]} if "checkpoint" in res["strategies"] else set()
        for b in sorted(at | {floor // 2, floor // 4}):
            run(f"budget@{b}+offload")
    fresh = Runner(c, f"budget@{top}", share_params=True)  # a fresh budget's first planning, timed
    fresh.step(SEED)
    t0 = time.perf_counter()
    assert fresh.budget is not None
    fresh.budget.floor_bytes  # noqa: B018  (ends the step: plans it)
    res["planning_s"] = time.perf_counter() - t0
    times = interleaved_rounds({n: r.timed_step for n, r in runners.items()}, rounds)
    for n, s in ratio_summary({n: [t["step"] for t in v] for n, v in times.items()}, bases=("plain",)).items():
        res["strategies"][n].update(time_ratio_vs_plain=s["ratio_vs_plain"], time_median_s=s["time_median_s"])
    res["outside_s"] = cpu_step(outside)
    for v in res["strategies"].values():
        if v.get("predicted_step_s"):
            v["predicted_vs_measured"] = v["predicted_step_s"] / v["blocks_measured_s"]
            q1, q3 = v["blocks_quartiles_s"]
            v["predicted_vs_quartiles"] = (v["predicted_step_s"] / q3, v["predicted_step_s"] / q1)
            # the same, each side in units of plain's step timed next to it (the machine's drift removed)
            v["predicted_vs_measured_at_speed"] = v["predicted_vs_measured"] * (
                v["plain_at_measured_s"] / v["plain_at_measuring_s"])
    if inductor:
        res["inductor"] = inductor_points(c, inductor, ref, log)
    res["curve"] = probe0.budget.curve().rows
    res["targets"] = targets(res, hand)
    return res


def inductor_points(c: Case, ratios: list[float], ref: dict[str, torch.Tensor], log: Callable[[str], None]) -> list:
    """The same model compiled with inductor under ``activation_memory_budget`` ratios:
    held, peak, backward FLOPs (recompute: vs the ratio 1.0 point) and the largest
    gradient difference from eager plain (inductor fuses: not bitwise)."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    points = []
    for r in sorted(ratios, reverse=True):
        torch._dynamo.reset()
        with (functorch_config.patch(activation_memory_budget=r, enable_autograd_cache=False),
              inductor_config.patch(fx_graph_cache=False)):
            runner = Runner(c, "plain", compile_kw={})
            t0 = time.perf_counter()
            for _ in range(2):
                runner.step(SEED)
            compile_s = time.perf_counter() - t0
            p = runner.profiled_step(SEED)
            flops = bwd_flops(runner)
        diff = max(float((p["grads"][n] - g).abs().max()) for n, g in ref.items() if n in p["grads"])
        points.append({"ratio": r, "held": p["held"], "peak": p["peak"], "bwd_flops": flops,
                       "max_abs_grad_diff": diff, "compile_s": compile_s})
        log(f"  inductor activation_memory_budget={r}: held {fmt_mib(p['held'])} peak {fmt_mib(p['peak'])} "
            f"bwd {flops / 1e9:.3f} GFLOP grad diff {diff:.2e}")
    for pt in points:
        pt["recompute_flops"] = pt["bwd_flops"] - points[0]["bwd_flops"]
    return points


def targets(res: dict[str, Any], hand: list[str] = HAND) -> list[dict[str, Any]]:
    S, floor, unscoped = res["strategies"], res["floor"], res["unscoped"]
    budgets = sorted((v for n, v in S.items() if "budget" in v and not n.endswith("+offload")),
                     key=lambda v: v["budget"])
    out: list[dict[str, Any]] = []

    def add(target: str, met: bool, detail: str) -> None:
        out.append({"target": target, "met": met, "detail": detail})

    worst = max((v["held"] - v["budget"] - unscoped for v in budgets if v["budget"] >= floor), default=0)
    add("held <= budget + unscoped (budget >= floor)", worst <= 0, f"worst excess {worst} bytes")
    flops = [v["recompute_flops"] for v in budgets]
    add("recompute FLOPs non-increasing in budget", flops == sorted(flops, reverse=True), str(flops))
    for h in hand:
        best = min((v["recompute_flops"] for v in budgets if v["held"] <= S[h]["held"]), default=None)
        add(f"at {h}'s held bytes, recompute <= {h}'s", best is not None and best <= S[h]["recompute_flops"],
            f"budget {best} vs {h} {S[h]['recompute_flops']} FLOPs (held {S[h]['held']})")
    top = [v for v in budgets if v["held"] >= res["plain"]["held"]]
    add("at plain's held bytes nothing recomputed", bool(top) and top[0]["recompute_flops"] == 0,
        f"{[(v['budget'], v['recompute_flops']) for v in budgets[-2:]]}")
    peaks = [v["peak"] for v in budgets]
    add("no peak above plain's", max(peaks) <= res["plain"]["peak"],
        f"max {max(peaks)} vs plain {res['plain']['peak']}")
    fracs = [v["fraction"] for v in budgets if "fraction" in v]
    if fracs:
        add("budget code per step < 1% of a step", max(fracs) < 0.01,
            f"max {100 * max(fracs):.2f}%, planning once {res['planning_s']:.3f} s")
    ratios = [v["predicted_vs_measured"] for v in budgets if "predicted_vs_measured" in v]
    if ratios:
        add("predicted step of the blocks within 15% of the measured one", all(0.85 <= r <= 1.15 for r in ratios),
            f"predicted / measured from {min(ratios):.2f} to {max(ratios):.2f}")
    at_speed = [v["predicted_vs_measured_at_speed"] for v in budgets if "predicted_vs_measured_at_speed" in v]
    if at_speed:
        add("the same, each in units of plain's step timed next to it", all(0.85 <= r <= 1.15 for r in at_speed),
            f"from {min(at_speed):.2f} to {max(at_speed):.2f}")
    same = _same_plan(budgets, res["plain"]["held"])
    if same is not None:
        (p0, m0), (p1, m1) = same
        add("A/A: one plan predicted from two measuring steps within 15%", 0.85 <= p1 / p0 <= 1.15,
            f"the two budgets keeping everything: predicted {1e3 * p0:.1f} and {1e3 * p1:.1f} ms "
            f"({p1 / p0:.2f}), measured {1e3 * m0:.1f} and {1e3 * m1:.1f} ms ({m1 / m0:.2f})")
    add("gradients bitwise equal to plain", all(v["bitwise"] for v in S.values()), "")
    return out


def _same_plan(budgets: list[dict[str, Any]], plain_held: int) -> tuple[tuple[float, float], ...] | None:
    """(predicted, measured) seconds of the two largest budgets if both keep everything
    (one plan, planned from two measuring steps: how far one step's figure moves on this
    machine); else None."""
    top = [v for v in budgets[-2:] if v["held"] >= plain_held and v["recompute_flops"] == 0
           and v.get("predicted_step_s") and v.get("blocks_measured_s")]  # fmt: skip
    if len(top) < 2:
        return None
    return tuple((v["predicted_step_s"], v["blocks_measured_s"]) for v in top)


def chart(results: dict[str, Any], out: str) -> list[str]:
    plt = pyplot()
    cases = results["cases"]
    fig, axes = plt.subplots(1, len(cases), figsize=(5 * len(cases), 4), squeeze=False)
    for ax, (name, res) in zip(axes[0], cases.items()):
        S = res["strategies"]
        bud = sorted((v for v in S.values() if "budget" in v), key=lambda v: v["held"])
        ax.plot([v["held"] / 2**20 for v in bud], [v["recompute_flops"] / 1e9 for v in bud], "o-", label="Budget sweep")
        for h, marker in zip([h for h in HAND if h in S], "sDP^v"):
            label = f"{h} (counts its cached matmuls)" if h == "sac_matmul" else h
            ax.plot(S[h]["held"] / 2**20, S[h]["recompute_flops"] / 1e9, marker, ms=9, label=label)
        ind = res.get("inductor") or []
        if ind:
            ax.plot([q["held"] / 2**20 for q in ind], [q["recompute_flops"] / 1e9 for q in ind], "x:", ms=9,
                    label="inductor activation_memory_budget")
        ax.axvline(res["plain"]["held"] / 2**20, color="gray", ls="--", lw=1, label="plain held")
        ax.set_title(name)
        ax.set_xlabel("held after forward (MiB)")
        ax.set_ylabel("recompute (GFLOP, profiler)")
        ax.legend(fontsize=7)
    files: list[str] = []
    save_figure(fig, out, "budget.png", files)
    return files


def markdown(results: dict[str, Any]) -> str:
    lines = ["# Memory budget sweep", "", f"Generated by `python -m benchmarks.budget {' '.join(results['argv'])}`.",
             "", f"Machine: `{results['machine']}`", ""]
    for name, res in results["cases"].items():
        rows = [[n.split("@")[0], fmt_mib(v.get("budget")), fmt_mib(v["held"]), fmt_mib(v["peak"]),
                 f"{v['recompute_flops'] / 1e9:.3f}", f"{v.get('time_ratio_vs_plain', 0):.3f}x",
                 f"{100 * v['fraction']:.2f}%" if "fraction" in v else "",
                 f"{v['predicted_step_s'] * 1e3:.1f} / {v['blocks_measured_s'] * 1e3:.1f} ms = "
                 f"{v['predicted_vs_measured']:.2f} ({v['predicted_vs_quartiles'][0]:.2f}..."
                 f"{v['predicted_vs_quartiles'][1]:.2f})" if "predicted_vs_measured" in v else "",
                 f"{v['predicted_vs_measured_at_speed']:.2f}" if "predicted_vs_measured_at_speed" in v else "",
                 v["bitwise"]]
                for n, v in sorted(res["strategies"].items(), key=lambda kv: ("budget" in kv[1], kv[1]["held"]))]
        lines += [
            f"## {name}", "", res["describe"], "",
            f"plain held {fmt_mib(res['plain']['held'])} MiB, peak {fmt_mib(res['plain']['peak'])} MiB; floor "
            f"{fmt_mib(res['floor'])} MiB; unscoped part {fmt_mib(res['unscoped'])} MiB; planning (once) "
            f"{res['planning_s'] * 1e3:.1f} ms", "",
            md_table(["strategy", "budget MiB", "held MiB", "peak MiB", "recompute GFLOP", "time vs plain",
                      "budget code", "predicted / measured step", "at plain's speed", "bitwise"], rows), "",
            "predicted / measured step: `Budget.predicted_step_time` (the blocks' forward and backward as timed "
            "in the budget's measuring step, plus the plan's recompute scaled to that step's replays) against "
            "the step of the blocks measured right after that measuring step: the median over 9 rounds of the "
            "budget's step less the code outside the layers (plain with every layer passing its input through, "
            f"{res['outside_s'] * 1e3:.1f} ms at least), each the process's CPU time of one step, the two in "
            "alternating order; in brackets the prediction over the third and the first quartile of those rounds "
            "(their spread: the machine's noise). At plain's speed: the same ratio with each side divided by "
            "plain's step timed next to it (before and after the measuring step; in each of the 9 rounds): the "
            "machine's speed drifts between the two moments.",
        ]
        if res.get("inductor"):
            lines += [
                "", "Inductor (`torch.compile`, `activation_memory_budget` ratio; recompute vs ratio 1.0; its dropout "
                "draws other random numbers than eager, hence the gradient difference):", "",
                md_table(["ratio", "held MiB", "peak MiB", "recompute GFLOP", "max abs grad diff vs eager plain"],
                         ([q["ratio"], fmt_mib(q["held"]), fmt_mib(q["peak"]), f"{q['recompute_flops'] / 1e9:.3f}",
                           f"{q['max_abs_grad_diff']:.2e}"] for q in res["inductor"])),
            ]
        lines += [
            "", "`sac_matmul`'s recompute is overstated: the profiler records each op at dispatch, also the matmuls "
            "that selective checkpointing then serves from its cache in the recomputation (checked: "
            "`torch.utils.checkpoint` with `MUST_SAVE` on `mm` counts the cached `mm` calls). The targets against it "
            "are listed but say little.", "",
            md_table(["target", "met", "detail"], ([t["target"], "yes" if t["met"] else "NO", t["detail"]]
                                                   for t in res["targets"])), "",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m benchmarks.budget", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small sizes, GPT + gpt2 + llama, 3 rounds")
    p.add_argument("--models", nargs="+", help="gpt and/or names of benchmarks.hf_zoo")
    p.add_argument("--rounds", type=int)
    p.add_argument("--points", type=int, help="budgets between the floor and plain")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--inductor", type=float, nargs="*",
                   help="also compile the GPT with inductor at these activation_memory_budget ratios "
                   "(e.g. 1.0 0.5 0.1)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--offload", action="store_true",
                   help="also run save_on_cpu, offload_all and budgets with offload=True")
    p.add_argument("--no-charts", action="store_true")
    p.add_argument("--out", help="output directory (default benchmarks/results/cpu-budget/)")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    models = a.models or (["gpt", "gpt2", "llama"] if a.quick else ["gpt", "gpt2", "llama", "bert", "t5"])
    rounds, points = a.rounds or (3 if a.quick else 7), a.points or (5 if a.quick else 8)
    out = results_dir(a.out, "cpu-budget" if a.device == "cpu" else "gpu-budget")
    t_start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:6.1f}s] {msg}", flush=True)

    results: dict[str, Any] = {"argv": argv, "machine": machine_info(a.device, ["transformers"]), "cases": {}}
    for name in models:
        results["cases"][name] = run_case(make_case(name, a.quick, a.device), rounds, points, log,
                                          a.inductor if name == "gpt" else None, offload=a.offload)
    mark_end(results["machine"])
    results["charts"] = [] if a.no_charts else chart(results, out)
    write_results(out, results, markdown(results))
    log(f"wrote {out}")
    return results


if __name__ == "__main__":
    main()
