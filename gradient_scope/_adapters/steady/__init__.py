"""A function-form scope's steady state: when its block runs without the recorder.

This package only decides *when* a call binds its record instead of recording it:
dynamo captures the function (its guards prove the same graph runs), our backend runs
the graph eagerly, and every fallback to a recorded run is decided here. The record's
second source lives with the first: the template and the binding in ``_record``
(``_record.template``, ``_record.bind``), the steady run's saves in ``_save``
(``_save.sequencer``).

- ``run`` -- the runner the public scope calls for helpers, decorators and
  ``checkpoint``, with the scope's options (``_base.options.ScopeOptions``): recorded
  the first time, bound from the template after (RULES D1..D8: when a block runs in
  its steady state).
- ``capture`` -- the outside tensors a block makes itself (outputs of ops ``save=``
  keeps), found once among the graph's node values and taken from them
  (T6 [ kept ops' outputs taken from the graph ]).
- ``reuse`` -- whether a call may start a capture: a function's graphs must be run
  again (D8 [ captures must be reused ]).

How the steady state mirrors each record-time rule (``_record.entry``): a steady run's
record must be what recording the run would have made, so each rule is either held by
a steady rule or cannot arise in a steady run (checked: ``tests/package/test_rule_citations.py``).

- R1 [ a written input is copied ] -- T1 [ one plain block ]: no outside tensor of a
  template is written; a run that writes one has no template and is always recorded.
- R2 [ kept ops are not recorded ] -- T6 [ kept ops' outputs taken from the graph ]: their
  outputs are outside tensors, taken from the graph's values; D1 [ which calls run steady ]:
  no context policy.
- R3 [ backward's ops are not the block's ] -- D1 [ which calls run steady ]: a steady call
  is entered outside backward; D2 [ what dynamo cannot capture is recorded ]: a function
  that runs a backward pass (``torch.autograd.grad``) is not captured whole, so recorded.
- R4 [ dtype=None as resolved ] -- does not apply: no factory runs under the recorder in a
  steady run; its ops are the template's, recorded with the dtype forward resolved, and
  dynamo's guards hold the global state (the default dtype) they were resolved under.
- R5 [ another block's live tensor is noted ] -- D4 [ a steady run's record is bound ]: each
  run's Inputs note another block's live tensor (``_record.bind.input_of``).
- R6 [ versions are read after the op ] -- D3 [ saves checked against the template ]: a
  steady run's handles carry the template's versions, read after each op of its recorded
  run (its sequencer settles the recorder before each save).
- R7 [ compiled code is not recorded ] -- D6 [ the graph must run the eager ops ]: the
  captured graph runs every op eagerly (dynamo traces into a function the user compiled),
  and is admitted only where an eager run, recorded as usual, had its structure.
- R8 [ jagged nested tensors are not recorded ] -- T1 [ one plain block ]: a record with one
  has no template.
- R9 [ each op's numeric context ] -- T5 [ one numeric context ]: a template is used only
  under the numeric context it was recorded in (T1 [ one plain block ]: one context).
- R10 [ an unseen write makes an Input ] -- T1 [ one plain block ]: a record with such a
  write has no template.
- R11 [ a functional collective replays whole ] -- does not apply in tested use: tensor
  parallel blocks read DTensor parameters, outside wrapper tensors, and T1 [ one plain block ]
  gives such a record no template; a steady block with a collective on plain tensors is untested.
- R12 [ wrappers of block tensors are block tensors ] -- T1 [ one plain block ]: a block that
  reads a wrapper subclass from outside has no template.
"""
