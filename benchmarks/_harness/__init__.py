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
