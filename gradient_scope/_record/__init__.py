"""Record: one op of an open block becomes an entry of the block's record.

- ``recorder`` -- the thread's TorchDispatchMode, and which block records now.
- ``entry`` -- how one op becomes an ``OpRecord`` (RULES R1..R12: what a recording keeps).
- ``wrappers`` -- the record ops of wrapper subclasses (a DTensor built around block tensors,
  its local tensor) and of functional collectives (tensor parallelism).
- ``types`` -- the record's types: ``Var``, ``Input``, ``MetaArg``, ``OpRecord``,
  ``ViewSpec``, ``Frame``, ``BlockRecord``, ``BlockOwner``.
- ``signature`` -- a record's structure as one key: what replay shares its plans by and a
  budget caches its plans by.
- ``registry`` -- which live tensors blocks made (tensor id -> ``Var``), per-thread ledgers.
- ``context`` -- where an op runs (the running module's path), for context policies.
- ``template`` -- what one recorded run of a captured graph tells every later run of it: the
  record's second source, for a block run in its steady state (``_adapters.steady``)
  (RULES T1..T6: what makes a recorded run a template).
- ``bind`` -- a steady run's record, bound from its template instead of recorded: its
  Inputs, its Vars of the tensors that outlive it, its random states, its signature.

Only this package writes a record (``types``): the recorder for a recorded block, ``bind``
for a steady one.

Imports only ``_base`` and ``policies``; the stages above reach it downward.
"""
