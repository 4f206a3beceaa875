"""Where one step's time goes: ``python -m benchmarks.models --cprofile STRATEGY``.

cProfile of one fwd+bwd step of a real model under one strategy, after two warm-up steps;
writes ``cprofile-<model>-<strategy>.md`` and ``.prof``.
"""

from __future__ import annotations

import cProfile
import gc
import os
import pstats
import time
from collections.abc import Callable

import torch

from ._harness.machine import load_average
from .models import Runner, _loss, prepare

__all__ = ["profile_step"]
PROFILE_FILTERS = ("gradient_scope", os.path.join("torch", "utils", "_python_dispatch"))


def _profile_rows(stats: pstats.Stats, key: int, n: int, keep: Callable[[str], bool]) -> list[str]:
    # stats.stats: (file, line, function) -> (primitive calls, calls, tottime, cumtime, callers)
    rows = [(k, v) for k, v in stats.stats.items() if keep(k[0])]  # type: ignore[attr-defined]
    rows.sort(key=lambda kv: kv[1][key], reverse=True)
    out = ["| tottime (ms) | cumtime (ms) | calls | function |", "| ---: | ---: | ---: | --- |"]
    for (file, line, fn), (_, nc, tt, ct, _) in rows[:n]:
        short = file
        for marker in ("gradient_scope" + os.sep, "site-packages" + os.sep):
            if marker in file:
                short = file[file.index(marker) + (0 if marker.startswith("gradient") else len(marker)) :]
                break
        out.append(f"| {tt * 1e3:.1f} | {ct * 1e3:.1f} | {nc} | `{short}:{line}({fn})` |")
    return out


def profile_step(
    name: str, strategy: str, size: str, device: str, dtype: torch.dtype, seed: int, out_dir: str, top: int = 25
) -> str:
    """cProfile one fwd+bwd step of ``name`` under ``strategy`` (after two warm-up steps);
    writes ``cprofile-<name>-<strategy>.md`` (top functions by tottime and cumtime: those of
    gradient_scope and torch/utils/_python_dispatch, then all) and ``.prof``; returns the text.

    The profiler's clock is the process's CPU time, not wall time: on a busy machine wall
    time charges the time the process waits for a core to whatever function was running.
    """
    built, base, batch = prepare(name, size, device, dtype, seed)
    runner = Runner(strategy, base, batch, built, device)
    for _ in range(2):
        runner.timed_step()
    prof = cProfile.Profile(time.process_time)
    runner.model.zero_grad(set_to_none=True)
    gc.collect()
    t0, c0 = time.perf_counter(), time.process_time()
    prof.enable()
    loss = _loss(runner.model, batch)
    loss.backward()
    prof.disable()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    stats = pstats.Stats(prof)
    total = stats.total_tt  # type: ignore[attr-defined]
    base_name = os.path.join(out_dir, f"cprofile-{name}-{strategy}")
    stats.dump_stats(base_name + ".prof")

    def ours(f: str) -> bool:
        return any(p in f for p in PROFILE_FILTERS)

    own = sum(v[2] for k, v in stats.stats.items() if ours(k[0]))  # type: ignore[attr-defined]
    text = [
        f"# cProfile: {name} ({size}), strategy {strategy}, one fwd+bwd step",
        "",
        f"Under cProfile (clock: process CPU time): wall {wall * 1e3:.0f} ms, CPU {cpu * 1e3:.0f} ms; "
        f"total profiled time {total * 1e3:.0f} ms; tottime in gradient_scope + torch/utils/_python_dispatch: "
        f"{own * 1e3:.0f} ms ({own / total:.0%}). torch threads {torch.get_num_threads()}; "
        f"load average {load_average()}. `~:0(...)` rows are C functions; `run_backward`'s tottime is the "
        "C++ autograd engine with the backward kernels it runs.",
        "",
        f"## gradient_scope and torch/utils/_python_dispatch, top {top} by tottime",
        "",
        *_profile_rows(stats, 2, top, ours),
        "",
        f"## gradient_scope and torch/utils/_python_dispatch, top {top} by cumtime",
        "",
        *_profile_rows(stats, 3, top, ours),
        "",
        f"## all functions, top {top} by tottime",
        "",
        *_profile_rows(stats, 2, top, lambda f: True),
        "",
    ]
    s = "\n".join(text)
    with open(base_name + ".md", "w") as f:
        f.write(s)
    return s


