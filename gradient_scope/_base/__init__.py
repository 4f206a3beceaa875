"""Leaves: what every stage below the public layer uses, importing nothing else of the package.

- ``torch_compat`` -- every private PyTorch API the library uses, each behind a named shim;
  ``torch_floor`` -- the oldest supported torch, checked on import; ``version``.
- ``ops`` -- facts about an op overload (what it writes, which outputs are views, whether
  it draws random numbers); ``rng`` -- random-generator state, captured and restored;
  ``subclass`` -- where a wrapper subclass's data is.
- ``stats`` -- ``ScopeStats``, and where compiled scopes of a model helper count;
  ``errors`` -- ``RecomputeError``, where a block was entered,
  the causes messages name, the internal-error check; ``options`` -- option values and the
  process-wide off switch (``disabled()``, ``GRADIENT_SCOPE_DISABLE``); ``feedback`` -- the
  ``gradient_scope`` logger, warnings that name the user's line, misspelled-option errors;
  ``main_thread`` -- a function run in the main thread at its next bytecode boundary, from
  any thread; ``lines`` -- the user's source line of the op running now (the report and
  a budget's plan name it).

No rule family lives here.
"""
