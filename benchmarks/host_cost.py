"""Host cost per layer: what each strategy adds to plain's forward and fwd+bwd, per layer, on CPU.

    python -m benchmarks.host_cost [--rounds N] [--inner N] [--dtype bfloat16] [--quick] [--device cuda]
    python -m benchmarks.host_cost --lengths 30 [--steps 60] [--layers 16] [--cache] [--rounds N] [--device cuda]

``--device cuda`` runs the same tiny models on a GPU, where the same host work is what the GPU
waits for (each step ends with a synchronisation; results under ``cuda-host*/``).

On a GPU a scoped forward is host-bound (docs NOTES, fourth round): the Python work per
op takes longer than the kernels. That work is measured here, on a CPU, with tensors so
small that the kernels cost almost nothing: Hugging Face Llama and Mixtral
(``benchmarks/hf_zoo.py`` size ``host``: 8 layers, hidden 64, 32 tokens, tiny MLPs), one
torch thread. Each strategy runs on its own copy of the model (``benchmarks/_harness/suite.py``:
same weights, batch and seed; a few warm-up steps first, from which a ``Budget`` plans);
each round runs every strategy (order rotated), taking the least of ``--inner`` steps.
Per round, a strategy's extra time over plain, divided by the number of layers, is its
host cost per layer, for the forward alone and for forward + backward; the medians over
rounds are reported with their interquartile range, next to plain_again's (the A/A row:
the noise). Aten ops per layer are counted once with a counting ``TorchDispatchMode``
(untimed; the difference between the model at its depth and at half of it, so that
embeddings, head and loss drop out), which turns the per-layer costs into microseconds
per op. Results: ``benchmarks/results/cpu-host/`` (``--quick``: ``cpu-host-quick/``;
``--dtype bfloat16``: ``cpu-host-bf16/``).

Two floors: ``mode_layer`` (a do-nothing dispatch mode, the floor of a recorder) and
``dynamo_layer`` (each layer called through the steady state's own dynamo entry,
outside any scope: dynamo's guards, and the function as dynamo traces it -- code that
branches on ``torch.compiler.is_compiling()`` takes its compiled branch; Hugging Face's
MoE experts do, in float32, a per-expert loop of matmuls behind a custom op, where eager
calls one grouped matmul). ``--dtype bfloat16`` is the dtype the GPU runs use, where both
branches of those experts are the same grouped matmul.

Whole runs (``--lengths N``, ``--cache``): where users train, a model is not called at one
length: batches padded to their longest row come at a new length every few steps, and a
config as shipped (``use_cache=True``) makes a KV cache in a training forward that each layer
writes to. Each strategy trains a fresh Llama (``--layers``, size ``host``) for ``--steps``
steps, all of a round in one fresh process (so the steady state's captures are counted, as a
user's run pays them), interleaved step by step, at lengths taken from N (each length of a
seeded permutation in turn; one length when N is 1), with the cache on under ``--cache``.
Reported per strategy, the median over rounds of: the whole run's seconds, the median step of
a length seen before (for the steady state: a step that binds every layer from its template),
that step against checkpoint's same step (paired: the machine's drift cancels), and its extra
time per layer over plain's. Results: ``benchmarks/results/cpu-host-lengths<N>[-cache]/``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from typing import Any

import torch

from ._harness.machine import machine_info, mark_end
from ._harness.report import Targets, header_lines, make_log, md_table, results_dir, sections, write_results
from ._harness.strategies import AA, DESCRIPTIONS, OpCounter, apply_strategy
from ._harness.suite import Case, run_strategies
from ._harness.timing import quartiles, sync
from .hf_zoo import build, preload

__all__ = ["MODELS", "STRATEGIES", "RUN_STRATEGIES", "count_ops", "per_layer", "run_lengths", "one_run", "main"]

MODELS = ["llama", "mixtral"]
STRATEGIES = [
    "plain",
    "mode_layer",
    "dynamo_layer",
    "checkpoint",
    "scope_layer",
    "scope_layer+fast",
    "scope_layer_savemm",
    "scope_layer_savemm+fast",
    "budget50",
    "budget50+fast",
    AA,
]
#: whole runs (``--lengths``): the recorded path is the CPU default (``scope_layer``)
RUN_STRATEGIES = ["plain", "checkpoint", "scope_layer", "scope_layer+fast", AA]
#: the strategies whose path is the device's default: the recorded path on CPU, the steady state on CUDA
_DEFAULT_PATH = ("scope_layer", "scope_layer_savemm", "budget50")


def explicit(name: str, device: str) -> str:
    """``name`` as it runs the recorded path on ``device``: on a GPU, where the steady state is the
    default, ``scope_layer`` is ``scope_layer+recorded`` (the ``+fast`` rows are the steady state)."""
    return f"{name}+recorded" if name in _DEFAULT_PATH and not device.startswith("cpu") else name


FULL: dict[str, Any] = dict(size="host", rounds=25, inner=5, warmup=3)
QUICK: dict[str, Any] = dict(size="tiny", rounds=2, inner=1, warmup=1)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def count_ops(model: str, size: str, seed: int, dtype: torch.dtype = torch.float32,
              device: str = "cpu") -> dict[str, float]:
    """Aten ops per layer in forward and in backward of plain (untimed)."""

    def count(layers: int | None) -> tuple[int, int, int]:
        built = build(model, size, seed, device=device, dtype=dtype, **({} if layers is None else {"layers": layers}))
        c = built.case(model, device)
        n = sum(1 for m in c.model.modules() if c.layers(m))
        fwd, bwd = OpCounter(), OpCounter()
        torch.manual_seed(seed)
        with fwd:
            loss = c.loss(c.model)
        with bwd:
            loss.backward()
        return n, fwd.count, bwd.count

    n, fwd, bwd = count(None)
    half, fwd_h, bwd_h = count(max(1, n // 2))
    if half == n:
        raise ValueError(f"count_ops: {model} at size {size} has one layer; two depths are needed")
    return {"layers": n, "fwd_ops": fwd, "bwd_ops": bwd,
            "fwd_ops_per_layer": (fwd - fwd_h) / (n - half), "bwd_ops_per_layer": (bwd - bwd_h) / (n - half)}


def per_layer(res: dict[str, Any], name: str, phase: str, layers: int) -> dict[str, Any]:
    """``name``'s extra seconds over plain per layer in ``phase`` (``fwd`` or ``step``), per
    round: median and quartiles, in microseconds."""
    mine = res[name] if phase == "step" else res[name][phase]
    base = res["plain"] if phase == "step" else res["plain"][phase]
    extra = [1e6 * (a - b) / layers for a, b in zip(mine["times_s"], base["times_s"])]
    return {"us_per_layer": statistics.median(extra), "quartiles": quartiles(extra), "per_round": extra}


def run_model(
    model: str, size: str, rounds: int, inner: int, warmup: int, seed: int, log: Any,
    dtype: torch.dtype = torch.float32, device: str = "cpu",
) -> dict[str, Any]:
    """The strategies on one model: timings, per-layer extras, op counts, agreement with plain."""
    built = build(model, size, seed, device=device, dtype=dtype)
    c: Case = built.case(model, device)
    c.warm_up(seed)
    layers = sum(1 for m in c.model.modules() if c.layers(m))
    names = [explicit(s, device) for s in STRATEGIES]
    out = run_strategies(c, names, rounds, seed=seed, warmup=warmup, inner=inner, memory=False, log=log)
    res = out["strategies"]
    ops = count_ops(model, size, seed, dtype, device)
    ops_step = ops["fwd_ops_per_layer"] + ops["bwd_ops_per_layer"]
    host: dict[str, Any] = {}
    for name, v in res.items():
        if name == "plain" or "times_s" not in v:
            continue
        f, s = per_layer(res, name, "fwd", layers), per_layer(res, name, "step", layers)
        host[name] = {"fwd": f, "step": s, "fwd_us_per_op": f["us_per_layer"] / ops["fwd_ops_per_layer"],
                      "step_us_per_op": s["us_per_layer"] / ops_step}
    plain = res["plain"]
    ops["plain_fwd_us_per_op"] = 1e6 * plain["fwd"]["time_median_s"] / ops["fwd_ops"]
    ops["plain_bwd_us_per_op"] = 1e6 * plain["bwd"]["time_median_s"] / ops["bwd_ops"]
    config = {**built.config, "dtype": str(dtype).replace("torch.", ""), "device": device}
    return {"config": config, "layers": layers, "ops": ops, "host": host, **out}


def compute_targets(models: dict[str, Any], device: str = "cpu") -> Targets:
    """Issue 26's host-cost targets, each on every model, with the A/A spread beside them."""
    T = Targets(("target", "model", "measured"))
    # The recorded path (the CPU default) and the steady state (GRADIENT_SCOPE_FAST=1, the
    # CUDA default), each against the target.
    pairs = (
        ("scope_layer", "checkpoint"),
        ("scope_layer+fast", "checkpoint"),
        ("budget50", "scope_layer"),
        ("budget50+fast", "scope_layer+fast"),
    )
    pairs = tuple((explicit(a, device), explicit(b, device)) for a, b in pairs)
    for m, r in models.items():
        h = r["host"]
        aa = h.get(AA, {}).get("step")
        note = "" if aa is None else (f"A/A {aa['us_per_layer']:+.1f} us/layer (IQR {aa['quartiles'][0]:+.1f} to "
                                      f"{aa['quartiles'][1]:+.1f})")
        for mine, theirs in pairs:
            if mine in h and theirs in h:
                a, b = h[mine]["step"]["us_per_layer"], h[theirs]["step"]["us_per_layer"]
                T.add(f"{mine} fwd+bwd host cost per layer <= {theirs}'s", m, f"{a:+.1f} vs {b:+.1f} us/layer",
                      met=a <= b, note=note)
            else:
                missing = [k for k in (mine, theirs) if k not in h]
                T.add(f"{mine} fwd+bwd host cost per layer <= {theirs}'s", m, f"not measured: {', '.join(missing)}",
                      met=None, note=note)
    return T


def model_markdown(r: dict[str, Any]) -> str:
    """One model: per-layer extras and per-op costs, then the strategies' own times."""
    s, ops = r["strategies"], r["ops"]

    def cell(v: dict[str, Any]) -> str:
        q = v["quartiles"]
        return f"{v['us_per_layer']:+.1f} ({q[0]:+.1f} to {q[1]:+.1f})"

    rows = []
    for name, v in s.items():
        if "error" in v:
            rows.append([name, f"failed: {v['error'][:100]}", "", "", "", "", "", ""])
            continue
        h = r["host"].get(name)
        rows.append([name, f"{1e3 * v['fwd']['time_median_s']:.2f}", f"{1e3 * v['time_median_s']:.2f}",
                     cell(h["fwd"]) if h else "", cell(h["step"]) if h else "",
                     f"{h['fwd_us_per_op']:+.2f}" if h else "", f"{h['step_us_per_op']:+.2f}" if h else "",
                     "equal" if v.get("grads_vs_plain", {}).get("bitwise_equal") else
                     f"max {v.get('grads_vs_plain', {}).get('max_abs_diff')}"])
    return "\n".join([
        f"{r['config']['model']}; " + ", ".join(f"{k}={v}" for k, v in r["config"].items() if k != "model")
        + f". Aten ops per layer (plain, counted once): {ops['fwd_ops_per_layer']:.1f} forward, "
        f"{ops['bwd_ops_per_layer']:.1f} backward; plain's own time per op: {ops['plain_fwd_us_per_op']:.2f} us "
        f"forward, {ops['plain_bwd_us_per_op']:.2f} us backward ({ops['fwd_ops']} / {ops['bwd_ops']} ops per step). "
        f"{r['rounds']} rounds.", "",
        md_table(["strategy", "fwd (ms)", "fwd+bwd (ms)", "fwd: extra us per layer (IQR)",
                  "fwd+bwd: extra us per layer (IQR)", "fwd: extra us per op", "fwd+bwd: extra us per op",
                  "grads vs plain"], rows),
    ])


def to_markdown(results: dict[str, Any]) -> str:
    names = [explicit(s, results.get("device", "cpu")) for s in STRATEGIES]
    out = [
        *header_lines("# Host cost per layer", "benchmarks.host_cost", results, ("transformers",)),
        f"- {results.get('device', 'cpu')}, one torch thread; per round the least of {results['inner']} steps per "
        f"strategy, {results['warmup']} warm-up steps first; extra = (strategy - plain) / layers, per round, "
        "median (IQR)",
        "- per op: the extra per layer over the aten ops per layer (forward ops for fwd; forward + backward ops "
        "for fwd+bwd)",
        "",
        *sections(Targets.from_rows(results["targets"]), {k: DESCRIPTIONS[k] for k in names}),
    ]
    for m, r in results["models"].items():
        out += [f"## {m}", "", model_markdown(r), ""]
    warnings = [f"{m}: {w}" for m, r in results["models"].items() for w in r["warnings"]]
    return "\n".join(out + sections(warnings=warnings))


def run_lengths(n: int, steps: int, seed: int) -> list[int]:
    """The length of each step: ``n`` lengths from 16 on, each of a seeded permutation in turn."""
    lengths = list(range(16, 16 + n))
    random.Random(seed).shuffle(lengths)
    return [lengths[k % n] for k in range(steps)]


def one_run(order: list[str], layers: int, cache: bool, lengths: list[int], seed: int,
            device: str = "cpu") -> dict[str, Any]:
    """Whole runs of the strategies of ``order``, each on a fresh Llama, interleaved step by step
    in this process (the order rotated at every step): each step's seconds per strategy. Only the
    steady state captures, so each run pays what it pays alone; interleaving gives the strategies
    the same machine at each step (the paired ratios)."""
    torch.set_num_threads(1)
    models = {}
    for name in order:
        built = build("llama", "host", seed, device=device, layers=layers)
        c = built.case("llama", device)
        c.model.config.use_cache = cache
        apply_strategy(c.model, "plain" if name == AA else name, c.layers, c.parts)
        models[name] = c.model
    vocab = built.config.get("vocab", 128)
    gen = torch.Generator().manual_seed(seed)
    times: dict[str, list[float]] = {name: [] for name in order}
    for k, length in enumerate(lengths):
        ids = torch.randint(3, vocab, (1, length), generator=gen).to(device)
        for name in order[k % len(order):] + order[:k % len(order)]:
            model = models[name]
            torch.manual_seed(seed)
            sync(device)
            t = time.perf_counter()
            model(input_ids=ids, labels=ids).loss.backward()
            sync(device)
            times[name].append(time.perf_counter() - t)
            model.zero_grad(set_to_none=True)
    return {name: {"times_s": t} for name, t in times.items()}


def _run_in_process(order: list[str], layers: int, cache: bool, lengths: list[int], seed: int,
                    device: str = "cpu") -> dict[str, Any]:
    """One round: a fresh process runs each strategy of ``order`` once, interleaved (only the
    steady state captures: its run pays every capture, as a user's first run does)."""
    spec = json.dumps({"order": order, "layers": layers, "cache": cache, "lengths": lengths, "seed": seed,
                       "device": device})
    done = subprocess.run([sys.executable, "-m", "benchmarks.host_cost", "--one", spec],
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _seen_steps(lengths: list[int], times: list[float]) -> list[float]:
    return [t for k, (n, t) in enumerate(zip(lengths, times)) if n in lengths[:k]]


def runs(a: argparse.Namespace, log: Any) -> dict[str, Any]:
    """Whole runs of ``RUN_STRATEGIES`` (order rotated per round), each in its own process."""
    lengths = run_lengths(a.lengths, a.steps, a.seed)
    names = [explicit(s, a.device) for s in RUN_STRATEGIES]
    per: dict[str, list[dict[str, Any]]] = {s: [] for s in names}
    rounds = a.rounds or 3
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        done = _run_in_process(order, a.layers, a.cache, lengths, a.seed, a.device)
        for name in order:
            per[name].append(done[name])
            log(f"round {r}: {name} {sum(done[name]['times_s']):.2f} s")
    out: dict[str, Any] = {}
    for name, done in per.items():
        whole = [sum(d["times_s"]) for d in done]
        seen = [statistics.median(_seen_steps(lengths, d["times_s"])) for d in done]
        plain = [statistics.median(_seen_steps(lengths, d["times_s"])) for d in per["plain"]]
        extra = [1e6 * (a_ - b) / a.layers for a_, b in zip(seen, plain)]
        # paired: per round, the median over seen steps of this strategy's step / checkpoint's same step
        paired = [statistics.median(_seen_steps(lengths, [x / y for x, y in zip(d["times_s"], c["times_s"])]))
                  for d, c in zip(done, per["checkpoint"])]
        out[name] = {"whole_s": statistics.median(whole), "whole_per_round_s": whole,
                     "seen_vs_checkpoint": statistics.median(paired), "seen_vs_checkpoint_per_round": paired,
                     "seen_step_ms": 1e3 * statistics.median(seen), "seen_per_round_ms": [1e3 * x for x in seen],
                     "extra_us_per_layer": statistics.median(extra), "extra_quartiles": quartiles(extra)}
    return {"lengths": lengths, "strategies": out, "rounds": rounds}


def runs_markdown(results: dict[str, Any]) -> str:
    """The whole-run table and the two targets, with the A/A row."""
    s = results["runs"]["strategies"]
    rows = [[n, f"{v['whole_s']:.2f}", f"{v['seen_step_ms']:.1f}", f"{v['seen_vs_checkpoint']:.2f}x",
             f"{v['extra_us_per_layer']:+.0f} ({v['extra_quartiles'][0]:+.0f} to {v['extra_quartiles'][1]:+.0f})"]
            for n, v in s.items()]
    rec = s[explicit("scope_layer", results.get("device", "cpu"))]
    fast, ck = s["scope_layer+fast"], s["checkpoint"]
    def met(a: float, b: float) -> str:
        return f"({a / b:.2f}x): " + ("met" if a <= b else "NOT met")

    targets = [
        f"- steps of seen lengths, steady state vs checkpoint (the same step, paired): "
        f"{fast['seen_vs_checkpoint']:.3f}x: " + ("met" if fast["seen_vs_checkpoint"] <= 1 else "NOT met")
        + f" (medians of the runs' seen steps: {fast['seen_step_ms']:.1f} vs {ck['seen_step_ms']:.1f} ms)",
        f"- whole run, steady state vs the recorded path: {fast['whole_s']:.2f} vs {rec['whole_s']:.2f} s "
        + met(fast["whole_s"], rec["whole_s"]),
        f"- A/A (plain_again vs plain): whole run {s[AA]['whole_s'] / s['plain']['whole_s']:.2f}x, seen step "
        f"{s[AA]['seen_step_ms'] / s['plain']['seen_step_ms']:.2f}x (paired "
        f"{s[AA]['seen_vs_checkpoint'] / s['plain']['seen_vs_checkpoint']:.2f}x)",
    ]
    r = results
    return "\n".join([
        *header_lines("# Host cost of whole runs", "benchmarks.host_cost", r, ("transformers",)),
        f"- {r.get('device', 'cpu')}; Llama (hf_zoo size host) with {r['layers']} layers, batch 1, "
        f"{r['steps']} steps at {r['n_lengths']} "
        f"length(s) ({min(r['runs']['lengths'])}-{max(r['runs']['lengths'])}), use_cache={r['cache']}; "
        f"each round a fresh process, its runs interleaved step by step, one torch thread; medians over "
        f"{r['runs']['rounds']} rounds",
        "- seen step: the median step of a length seen before in the run; vs checkpoint: the median, over "
        "those steps, of the strategy's step / checkpoint's same step (interleaved); extra: (strategy - plain) / "
        "layers, per round, median (IQR)", "", "## Targets", "", *targets, "", "## Runs", "",
        md_table(["strategy", "whole run (s)", "seen step (ms)", "seen step vs checkpoint",
                  "seen step: extra us per layer (IQR)"], rows), "",
    ])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Command line entry point; returns the results dict."""
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m benchmarks.host_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny models (2 layers), 2 rounds: a smoke test in seconds")
    p.add_argument("--models", nargs="+", choices=MODELS, default=MODELS)
    p.add_argument("--rounds", type=int, help=f"interleaved rounds (default {FULL['rounds']})")
    p.add_argument("--inner", type=int, help=f"steps per strategy and round, the least kept (default {FULL['inner']})")
    p.add_argument("--warmup", type=int, help=f"warm-up steps per strategy (default {FULL['warmup']})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                   help="the models' parameter dtype (default float32; bfloat16 writes to cpu-host-bf16/)")
    p.add_argument("--out", help="output directory (default benchmarks/results/cpu-host[-quick]/)")
    p.add_argument("--lengths", type=int, help="whole runs at this many lengths (see the module docstring)")
    p.add_argument("--cache", action="store_true", help="whole runs with the KV cache on (use_cache=True)")
    p.add_argument("--steps", type=int, default=60, help="steps per whole run (default 60)")
    p.add_argument("--layers", type=int, default=16, help="layers of the whole runs' Llama (default 16)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu; results under <device>-host*/)")
    p.add_argument("--one", help=argparse.SUPPRESS)  # one whole run, in this process (JSON spec)
    a = p.parse_args(argv)
    if a.one:
        spec = json.loads(a.one)
        print(json.dumps(one_run(spec["order"], spec["layers"], spec["cache"], spec["lengths"], spec["seed"],
                                 spec.get("device", "cpu"))))
        return {}
    if a.lengths or a.cache:
        return _main_runs(a)
    mode = QUICK if a.quick else FULL
    rounds, inner, warmup = a.rounds or mode["rounds"], a.inner or mode["inner"], a.warmup or mode["warmup"]
    torch.set_num_threads(1)
    t_start = time.perf_counter()
    log = make_log(t_start)
    dtype = DTYPES[a.dtype]
    out_dir = results_dir(a.out, f"{a.device.split(':')[0]}-host" + ("" if a.dtype == "float32" else "-bf16")
                          + ("-quick" if a.quick else ""))
    preload(a.models)
    machine = machine_info(a.device, packages=("transformers",))
    results: dict[str, Any] = {"argv": argv, "device": a.device, "size": mode["size"], "dtype": a.dtype,
                               "rounds": rounds, "inner": inner,
                               "warmup": warmup, "seed": a.seed, "machine": machine, "models": {}}
    for m in a.models:
        log(f"{m} ({mode['size']}): {len(STRATEGIES)} strategies, {rounds} rounds of {inner} step(s)")
        results["models"][m] = run_model(m, mode["size"], rounds, inner, warmup, a.seed, log, dtype, a.device)
        print(f"\n{m}\n{model_markdown(results['models'][m])}\n", flush=True)
    mark_end(machine)
    results["targets"] = compute_targets(results["models"], a.device)
    results["duration_s"] = time.perf_counter() - t_start
    write_results(out_dir, results, to_markdown(results))
    print("targets\n" + results["targets"].markdown())
    log(f"wrote {out_dir}/results.json and results.md")
    return results


def _main_runs(a: argparse.Namespace) -> dict[str, Any]:
    t_start = time.perf_counter()
    log = make_log(t_start)
    n = a.lengths or 1
    a.lengths = n
    out_dir = results_dir(a.out, f"{a.device.split(':')[0]}-host-lengths{n}" + ("-cache" if a.cache else ""))
    preload(["llama"])
    machine = machine_info(a.device, packages=("transformers",))
    results: dict[str, Any] = {"argv": sys.argv[1:], "device": a.device, "layers": a.layers, "steps": a.steps,
                               "n_lengths": n,
                               "cache": a.cache, "seed": a.seed, "machine": machine}
    results["runs"] = runs(a, log)
    mark_end(machine)
    results["duration_s"] = time.perf_counter() - t_start
    md = runs_markdown(results)
    write_results(out_dir, results, md)
    print(md)
    return results


if __name__ == "__main__":
    main()
