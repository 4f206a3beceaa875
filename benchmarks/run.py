"""gradient_scope benchmark suite: one command, all strategies on the same model.

    python -m benchmarks.run [--quick] [--device cpu|cuda] [--dtype float32|bfloat16] [--out DIR]

See benchmarks/README.md for what is measured and how to read the results.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from gradient_scope import recompute_scope
from gradient_scope.policies import as_save_policy, save_matmuls

from ._harness.machine import machine_info, mark_end
from ._harness.memory import measure
from ._harness.report import finish, make_log, no_charts, resolve_device, results_dir
from ._harness.strategies import AA, apply_gpt_strategy, profile_against_plain
from ._harness.timing import frozen_gc, interleaved_rounds, ratio_summary, time_step, warn_if_interception_left
from .gpt import GPT, GPTConfig, make_batch
from .ideal import BlockAccounting
from .overhead import format_overhead, run_overhead
from .run_report import (
    compute_targets,
    make_charts,
    scaling_markdown,
    strategies_markdown,
    targets_markdown,
    to_markdown,
)

SAVE_MM: Any = save_matmuls
SAVE_MM_NAME = "gradient_scope.policies.save_matmuls"

STRATEGIES = ["plain", "checkpoint", "sac_matmul", "scope_layer", "scope_mlp", "scope_act", "scope_layer_savemm"]
SCOPE_STRATEGIES = ["scope_layer", "scope_mlp", "scope_act", "scope_layer_savemm"]
SCALING_STRATEGIES = ["plain", "checkpoint", "scope_layer", "scope_act"]

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


def apply_strategy(model: GPT, name: str, scopes: list, make_block: Callable[[], Any] | None = None) -> None:
    """Point the model's hooks at a strategy. Scopes created are appended to ``scopes``.

    ``make_block`` replaces the scope factory (same placement, other context manager):
    used by the ideal-memory analysis.
    """
    save = SAVE_MM if name == "scope_layer_savemm" else None

    def new_scope() -> Any:
        if make_block is not None:
            return make_block()
        s = recompute_scope(save=save)
        scopes.append(s)
        return s

    apply_gpt_strategy(model, name, new_scope)


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

    def _prepare(self, name: str) -> None:
        self.scopes.clear()
        apply_strategy(self.model, name, self.scopes)
        self.model.zero_grad(set_to_none=True)
        torch.manual_seed(self.seed)  # same dropout masks for every strategy

    def _step(self) -> torch.Tensor:
        loss = self.model(self.x, self.y)
        loss.backward()
        return loss

    def timed_step(self, name: str) -> float:
        self._prepare(name)
        dt = time_step(self._step, self.device)
        warn_if_interception_left(name, self.warnings)
        return dt

    def profiled_step(self, name: str) -> dict[str, Any]:
        """Memory (held after forward, peak of fwd+bwd), loss, gradients, scope stats."""
        self._prepare(name)
        gc.collect()
        loss, held, peak = measure(lambda: self.model(self.x, self.y), lambda loss: loss.backward(), self.device)
        out = {
            "held": held,
            "peak": peak,
            "loss": loss.item(),
            "grads": [p.grad.detach().clone() for p in self.model.parameters()],
        }
        if self.scopes:
            out["scopes"] = len(self.scopes)
            for key in ("bytes_packed", "tensors_packed", "ops_recorded", "ops_replayed", "replays"):
                out[key] = sum(getattr(s.stats, key) for s in self.scopes)
        del loss
        self.scopes.clear()
        warn_if_interception_left(name, self.warnings)
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
    """Every strategy on one model: memory and gradients (profiled step), interleaved
    timing (with the A/A row when ``aa``), the ideal held memory when ``ideal``."""
    bench = Bench(cfg, device, dtype, seed)
    timed = strategies + ([AA] if aa else [])
    for name in timed:  # warm-up (allocator, lazy init, lazy imports, op caches)
        bench.timed_step(name)
    with frozen_gc():  # keeps the gc.collect() before each measured step cheap
        res = profile_against_plain(strategies, bench.profiled_step)
        times = interleaved_rounds({name: (lambda n=name: bench.timed_step(n)) for name in timed}, rounds)
        for name, summary in ratio_summary(times).items():
            res.setdefault(name, {}).update(summary)
        if ideal and "plain" in res:
            _add_ideal(bench, strategies, res)
    return {"config": bench.cfg.asdict(), "strategies": res, "warnings": bench.warnings}


def _add_ideal(bench: Bench, strategies: list[str], res: dict[str, dict[str, Any]]) -> None:
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


def run_scaling(
    base: GPTConfig, axis: str, points: list[int], device: str, dtype: torch.dtype, rounds: int, log
) -> dict[str, Any]:
    """The scaling strategies at each depth (``axis="layers"``) or sequence length."""
    out: dict[str, Any] = {"axis": axis, "points": points, "results": {}}
    for p in points:
        cfg = GPTConfig(**{**base.asdict(), ("n_layer" if axis == "layers" else "seq"): p})
        t0 = time.perf_counter()
        r = run_suite(cfg, device, dtype, SCALING_STRATEGIES, rounds, aa=False)
        out["results"][str(p)] = r["strategies"]
        out.setdefault("warnings", []).extend(f"{axis}={p}: {w}" for w in r["warnings"])
        log(f"  scaling {axis}={p}: {time.perf_counter() - t0:.1f} s")
    return out


def _parser() -> argparse.ArgumentParser:
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
    for flag, kind in (("--layers", int), ("--d-model", int), ("--heads", int), ("--seq", int),
                       ("--batch", int), ("--vocab", int), ("--dropout", float)):
        g.add_argument(flag, type=kind)
    g.add_argument("--attn", choices=["explicit", "sdpa"])
    return p


def _config(mode: dict[str, Any], a: argparse.Namespace) -> GPTConfig:
    over = {
        "n_layer": a.layers, "d_model": a.d_model, "n_head": a.heads, "seq": a.seq,
        "batch": a.batch, "vocab": a.vocab, "dropout": a.dropout, "attn": a.attn,
    }
    return GPTConfig(**{**mode["model"].asdict(), **{k: v for k, v in over.items() if v is not None}})


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Command line entry point; returns the results dict."""
    argv = sys.argv[1:] if argv is None else argv
    p = _parser()
    a = p.parse_args(argv)
    t_start = time.perf_counter()
    log = make_log(t_start)
    mode = QUICK if a.quick else FULL
    threads = a.threads or mode.get("threads")
    if threads:
        torch.set_num_threads(threads)
    device = resolve_device(a.device, p.error)
    dtype = getattr(torch, a.dtype)
    cfg = _config(mode, a)
    rounds = a.rounds or mode["rounds"]
    dev_name = torch.device(device).type
    out_dir = results_dir(a.out, dev_name + ("-quick" if a.quick else ""))  # a quick run never overwrites a full one

    machine = machine_info(device)
    log(f"{machine['cpu_model']}, {machine['cpu_cores']} cores, torch {machine['torch']}, "
        f"python {machine['python']}; {cfg.describe()}; {device} {a.dtype}")
    if a.quick:
        log("quick mode: a small model and few rounds; numbers are indicative only")

    log(f"main comparison: {len(STRATEGIES)} strategies + A/A, {rounds} rounds")
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
        log(f"scaling with depth {mode['layers']} (seq {cfg.seq})")
        scaling["layers"] = run_scaling(cfg, "layers", mode["layers"], device, dtype, srounds, log)
        log(f"scaling with sequence length {mode['seqs']} ({cfg.n_layer} layers)")
        scaling["seq"] = run_scaling(cfg, "seq", mode["seqs"], device, dtype, srounds, log)
        for sc in scaling.values():
            print(f"\nscaling: {sc['axis']}\n{scaling_markdown(sc)}")

    targets = compute_targets(main_res, overhead, dev_name)
    mark_end(machine)
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
    finish(results, out_dir, t_start, to_markdown, no_charts if a.no_charts else make_charts)
    charts = results["charts"]
    print(f"\ntargets\n{targets_markdown(targets)}")
    for w in main_res["warnings"]:
        print(f"WARNING: {w}")
    log(f"wrote {out_dir}/results.json, results.md and {len(charts)} charts")
    return results


if __name__ == "__main__":
    main()
