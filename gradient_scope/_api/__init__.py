"""The public layer: what the package's ``__init__`` re-exports, built on the stages below.

- ``scope`` -- ``recompute_scope`` and ``recompute``: options, opening and closing blocks
  (a budget's decision handed to the block's frame), decorator forms.
- ``helpers`` -- ``apply_recompute``, ``remove_recompute``, ``recompute_sequential``.
- ``selection`` -- which modules ``apply_recompute`` scopes (``check_fn``, ``every_n_layers``).
- ``checkpoint`` -- a drop-in for ``torch.utils.checkpoint.checkpoint``.
- ``model_stats`` -- the counters of the scopes a model's helpers ran.
- ``calibrate`` -- what autograd and the library cost per op, for a budget's predicted
  times (registered with ``_budget.rates``).
"""
