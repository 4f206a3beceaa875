"""Save: what a tensor autograd saves becomes.

- ``interception`` -- the thread's saved-tensor hook pair, on the stack exactly while a
  block tensor lives; the only module that edits PyTorch's hook stack or patches PyTorch
  (RULES I1..I9: the hook pair's invariants).
- ``pack`` -- the pack hook: a handle that stands for a block tensor, the tensor stored as
  autograd stores it, or what the pair below ours makes (RULES S1..S6: what a save
  becomes).
- ``sequencer`` -- the saves of a block run in its steady state: logged and classified in
  its template's first run, taken in order from the template after (``pack``'s
  S5 [ a steady run's saves go to its sequencer ]).
"""
