"""A function-form scope's steady state: when its block runs without the recorder.

This package only decides *when* a call binds its record instead of recording it:
dynamo captures the function (its guards prove the same graph runs), our backend runs
the graph eagerly, and every fallback to a recorded run is decided here. The record's
second source lives with the first: the template and the binding in ``_record``
(``_record.template``, ``_record.bind``), the steady run's saves in ``_save``
(``_save.sequencer``).

- ``run`` -- the runner the public scope calls for helpers, decorators and
  ``checkpoint``, with the scope's options (``_base.options.ScopeOptions``): recorded
  the first time, bound from the template after (RULES D1..D6: when a block runs in
  its steady state).
- ``capture`` -- the outside tensors a block makes itself (outputs of ops ``save=``
  keeps), found once among the graph's node values and taken from them (T6).
"""
