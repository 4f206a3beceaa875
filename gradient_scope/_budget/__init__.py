"""The budget: measure what blocks save, plan what to keep, offload or recompute, apply it.

- ``budget`` -- ``Budget``, the public face (RULES M1..M8: how a budget runs).
- ``run`` -- a budget at run time: steps, blocks, model regions, cached plans.
- ``block`` -- one scoped block under a budget: its per-tensor decision, what it saw.
- ``region`` -- one forward of a model under a model-level budget: what the code
  outside the scopes saves.
- ``measure`` -- what a budget reads from a closed record: each op's FLOPs and bytes,
  the values it reads, the outside tensors kept for replay.
- ``agree`` -- plans agreed across the ranks of a distributed run (RULES A1..A5: how the
  ranks agree on a budget's plan).
- ``rates`` -- the device's measured FLOP/s, bytes/s, per-op overhead and copy rates.
- ``timing`` -- a measuring step timed: each block's forward, backward and replay.
- ``step`` -- one step's plan on plain data (RULES N1..N5: what a step's plan covers).
- ``planner`` -- keep, offload or recompute: a pure, closure-aware planner on plain data
  (RULES K1..K8: what a budget's plan keeps, offloads and recomputes).
- ``curve`` -- the plan for people: stored ops, the curve, units.
- ``offload`` -- the offload engine (RULES O1..O7: how offloaded bytes travel);
  ``hostpool`` its pinned memory (RULES H1..H4: what the pool holds and reports),
  ``streams`` its device backends (CUDA, and the host-copy stand-in that tests the
  engine on CPU).

``run`` knows its blocks and regions; ``block`` and ``region`` ask it only through the
protocols they define (``BlockRun``, ``RegionRun``): the rooms import one way.

Above the core: it reads records and hands the pack hook callbacks (``Frame.store``, a
model region's observer); the core never imports it.
"""
