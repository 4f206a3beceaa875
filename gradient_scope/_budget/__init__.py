"""The budget: measure what blocks save, plan what to store, apply the plan.

- ``measure`` -- what a budget reads from a closed record: each op's replay cost, the
  values it reads, the outside tensors kept for replay.
- ``planner`` -- the store-or-recompute choice, a pure greedy, closure-aware planner on
  plain data (RULES K1..K5: what a budget's plan stores).
- ``budget`` -- ``Budget``: per block the store decision the frame carries, steps, plans
  cached by structure, the curve (RULES M1..M6: how a budget runs).

Above the core: it reads records and hands the pack hook a callback (``Frame.store``);
the core never imports it.
"""
