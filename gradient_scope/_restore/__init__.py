"""Restore: a handle's value, from memory or by replaying the recorded ops it needs.

- ``handles`` -- handles, each block's replay state and per-pass cache (RULES P1..P11:
  what a replay keeps).
- ``replay`` -- the replay itself: which recorded ops rebuild a value, which values the
  pass keeps, running them (interpreted).
- ``structure`` -- what replay derives once per record signature and shares among every
  record of it: closures, programs, when each value is freed, which replays run a
  collective (``handles`` P11 [ a replay that communicates reads no liveness ]).
- ``codegen`` -- a program that runs again, compiled into straight-line Python (RULES
  C1..C3: when a replay program is compiled, and what its code depends on).
"""
