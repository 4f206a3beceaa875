"""``torch.compile``: scopes in traced code, recomputed by the compiled backward.

- ``graph`` -- the traced scope (an FX annotation), the joint-graph pass that tags the
  block's nodes ``MUST_RECOMPUTE`` (``save=`` as ``MUST_SAVE``), and the cache keys.
- ``budget`` -- a memory budget in compiled code: the block nodes its planner keeps
  (``MUST_SAVE``) within the budget's bytes.
- ``inputs`` -- graph inputs the graph writes, and the forward ops that read them
  (saved, never recomputed).
- ``versions`` -- a forward op that reads the versions of the parameters and buffers the
  backward reads, and a backward op that checks them (``RecomputeError`` naming the
  parameter).
"""
