"""The saved-tensor report (``saved_tensors_report``): what autograd saves, by module and op.

- ``where`` -- where a save happens: the running module (global module hooks), the op
  (a ``TorchFunctionMode``), what the block made, the source line; inert while dynamo traces.
- ``tally`` -- the counting: saves per row, bytes per storage (once each), grouping,
  bytes held by scopes.
- ``format`` -- the text tables: one report, or two side by side (``diff``).
- ``report`` -- the context manager and its results.

No rule family lives here.
"""
