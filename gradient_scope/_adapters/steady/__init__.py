"""A function-form scope's steady state: its block runs without the recorder.

- ``run`` -- the runner the public scope calls for helpers, decorators and
  ``checkpoint``: dynamo captures the function (its guards prove the same graph runs),
  our backend runs the graph eagerly, recorded the first time, bound from the
  template after (RULES D1..D6: when a block runs in its steady state).
- ``template`` -- what one recorded run tells every later run of the same graph
  (RULES T1..T6: what makes a recorded run a template).
- ``capture`` -- the outside tensors a block makes itself (outputs of ops ``save=``
  keeps), found once among the graph's node values and taken from them (T6).
"""
