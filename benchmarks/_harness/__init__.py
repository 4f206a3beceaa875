"""The harness every benchmark shares, one module per job:

* :mod:`.memory`: the memory probe (held after forward, peak of fwd+bwd; CPU profiler or
  CUDA allocator statistics);
* :mod:`.timing`: interleaved rounds, per-round ratios, one timed step, the gc freeze,
  the check that no hook or mode outlives a step;
* :mod:`.strategies`: torch's selective checkpointing policy, the benchmark GPT's
  strategies, comparisons with plain;
* :mod:`.machine`: what the numbers were measured on;
* :mod:`.report`: formats, the ``results.md`` header and targets table, ``results.json``
  + ``results.md`` + charts on disk, the command-line plumbing.
"""

from .machine import load_average, machine_info, mark_end
from .memory import cuda_memory, measure, profile_cpu_memory, quiet_stderr
from .report import (
    KiB,
    MiB,
    fmt_mib,
    fmt_x,
    header_lines,
    make_log,
    pyplot,
    resolve_device,
    results_dir,
    save_figure,
    targets_and_strategies,
    targets_markdown,
    write_results,
)
from .strategies import AA, MATMUL_OPS, apply_gpt_strategy, compare_tensors, grad_diff, sac_context, sac_policy
from .timing import (
    frozen_gc,
    interception_gone,
    interleaved_rounds,
    quartiles,
    ratio_summary,
    sync,
    time_step,
    warn_if_interception_left,
)

__all__ = [
    "measure",
    "profile_cpu_memory",
    "cuda_memory",
    "quiet_stderr",
    "quartiles",
    "frozen_gc",
    "interleaved_rounds",
    "ratio_summary",
    "sync",
    "time_step",
    "interception_gone",
    "warn_if_interception_left",
    "AA",
    "MATMUL_OPS",
    "sac_policy",
    "sac_context",
    "apply_gpt_strategy",
    "compare_tensors",
    "grad_diff",
    "load_average",
    "machine_info",
    "mark_end",
    "MiB",
    "KiB",
    "fmt_mib",
    "fmt_x",
    "header_lines",
    "targets_markdown",
    "targets_and_strategies",
    "write_results",
    "pyplot",
    "save_figure",
    "results_dir",
    "resolve_device",
    "make_log",
]
