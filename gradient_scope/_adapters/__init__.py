"""Adapters: the core under other PyTorch machinery, registered by the package's ``__init__``.

- ``compile`` -- ``torch.compile``: a scope in traced code becomes an annotation of the
  graph that a joint-graph pass turns into recompute tags, with the checks of graph
  inputs and parameters written between forward and backward.
- ``fsdp`` -- FSDP2: gathers the parameters a replay reads when FSDP2 has freed them.
- ``steady`` -- a function-form scope's steady state: dynamo proves the same graph
  runs, and its block is bound from the record of its first run instead of recorded.
- ``dynamo`` -- dynamo as the steady state calls it: one entry for every function (nothing
  kept per function), quiet captures, guards on module hooks (RULES Q1..Q3).

Private torch APIs beyond ``_base.torch_compat`` are allowed only here.
"""
