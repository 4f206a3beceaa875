"""The harness every benchmark job shares (jobs and the model zoo import it, never the reverse):

* :mod:`.suite`: a :class:`~.suite.Case` (a model, its loss, its layers and regions) and
  :func:`~.suite.run_strategies`, the strategies side by side on it;
* :mod:`.strategies`: the strategies, applied by module selection; comparisons with plain;
* :mod:`.timing`: interleaved rounds, per-round ratios, forward and backward timed apart;
* :mod:`.memory`: the memory probe (held after forward, peak of fwd+bwd; CPU profiler or
  CUDA allocator statistics);
* :mod:`.ideal`: the ideal held memory for a placement of scopes;
* :mod:`.machine`: what the numbers were measured on;
* :mod:`.report`: formats, Markdown tables, targets, ``results.json`` + ``results.md``,
  charts, the command-line plumbing.
"""
