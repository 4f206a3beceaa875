"""A record's signature: its structure as one hashable key, the only structural key there is.

Two records have the same signature when they recorded the same ops, wired the same
way (which earlier output or outside tensor each argument is), with outputs of the same
shapes, dtypes and devices, in the same storage groups, written by the same ops.
Replay shares what it derives from a record among all records of one signature
(``_restore.structure``); a budget caches its plans by it and checks a block that is
still being recorded against a plan's signature one decision at a time
(:func:`output_matches`, ``_budget.budget`` M3 [ a plan follows its structure ]).

The key is a tuple: one entry per op, then one entry per written storage group. An op's
entry is a flat tuple -- ``id(op)``, whether it has no RNG state, its arity and its
number of keyword arguments; ``(position or name, how)`` for each argument that is a
recorded value (see ``Fill``); ``...``; then one item per output: None, or ``(slot,
shape, dtype, device, root slot)``. Values are numbered by *slot*: each outside tensor
(``Input``) and each op output (``Var``) gets the next number the first time the record
mentions it, so the entries of a record's first ``n`` ops depend on those ops alone.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

from .types import BlockRecord, Input, MetaArg, Ref, Var

__all__ = ["Fill", "Slots", "fill", "signature", "constants", "output_matches"]

#: How an argument of a recorded op is filled in at replay: ``(position or name, how)``
#: where ``how`` is a slot number, None (a MetaArg: a fresh empty tensor like it), or a
#: tuple with a slot number or -1 (a plain value) per element of a ``Tensor[]`` list.
Fill = tuple[Any, Any]


class Slots:
    """One record's side of its signature: the Var or Input behind each slot."""

    __slots__ = ("refs", "of")

    def __init__(self, refs: list[Ref], of: dict[int, int]) -> None:
        self.refs = refs  # slot -> Var or Input
        self.of = of  # id(ref) -> slot


def fill(a: Any, slot: Callable[[Ref], int]) -> Any:
    """How argument ``a`` is filled in (see ``Fill``), or ``...`` for a plain value."""
    t = type(a)
    if t is Var or t is Input:
        return slot(a)
    if t is MetaArg:
        return None
    if t is list:
        for x in a:
            if type(x) is Var or type(x) is Input:
                return tuple(slot(x) if type(x) is Var or type(x) is Input else -1 for x in a)
    return ...


def signature(record: BlockRecord) -> tuple[Hashable, Slots]:
    """The signature of ``record`` and its slots; computed once for a closed record."""
    known = record.signature
    if known is not None:
        return known  # type: ignore[no-any-return]
    found = _signature(record)
    if not record.open:  # its op list no longer changes
        record.signature = found
    return found


def _signature(record: BlockRecord) -> tuple[Hashable, Slots]:
    refs: list[Ref] = []
    of: dict[int, int] = {}
    get = of.get

    def slot(r: Ref) -> int:
        s = get(id(r))
        if s is None:
            s = of[id(r)] = len(refs)
            refs.append(r)
        return s

    # Hot loop (every replayed or budgeted block, every step): per op, one flat tuple
    # built by appends (see the module docstring); the rare argument kinds go through
    # ``fill``. A compiled replay passes plain arguments one by one and keywords only
    # to ops that have some (``_restore.codegen``): hence the arity and keyword count.
    key: list[Hashable] = []
    add = key.append
    for func, args, kwargs, rng, outs in record.ops:
        k: list[Any] = [id(func), rng is None, len(args), len(kwargs)]  # an OpOverload hashes in Python
        put = k.append
        for pos, a in enumerate(args):
            t = type(a)
            if t is Var or t is Input:
                s = get(id(a))
                if s is None:
                    s = of[id(a)] = len(refs)
                    refs.append(a)
                put(pos)
                put(s)
            elif t is MetaArg or t is list:
                how = fill(a, slot)
                if how is not ...:
                    put(pos)
                    put(how)
        if kwargs:
            for name, a in kwargs.items():
                how = fill(a, slot)
                if how is not ...:
                    put(name)
                    put(how)
        put(...)
        for v in outs:
            if v is None:
                put(None)
                continue
            s = get(id(v))
            if s is None:
                s = of[id(v)] = len(refs)
                refs.append(v)
            b = v.base
            put((s, v.size, v.dtype, v.device, -1 if b is None else slot(b)))
        add(tuple(k))
    for s, r in enumerate(refs):  # the writes of each storage group, by root
        if r.writes and (type(r) is Input or r.base is None):  # type: ignore[union-attr]
            key.append((s, tuple(j for j, _ in r.writes)))
    return tuple(key), Slots(refs, of)


def constants(record: BlockRecord) -> tuple[Hashable, ...]:
    """The Python numbers among the arguments of ``record``'s ops (also inside list
    arguments), op by op: what the signature leaves out, since a replay reads each record's
    own. Floats by their exact bits (``float.hex``: -0.0 and NaN are told apart and compare
    equal to themselves)."""
    out: list[Hashable] = []
    add = out.append
    for _, args, kwargs, _, _ in record.ops:
        for a in (*args, *kwargs.values()):
            t = type(a)
            if t is list or t is tuple:
                for x in a:
                    tx = type(x)
                    if tx is float:
                        add(x.hex())
                    elif tx is int or tx is bool or tx is complex:
                        add(x)
            elif t is float:
                add(a.hex())
            elif t is int or t is bool or t is complex:
                add(a)
        add(...)
    return tuple(out)


def output_matches(entry: Any, func: Any, n_outs: int, k: int, size: Any, dtype: Any) -> bool:
    """Whether a signature's op entry ``entry`` is of op ``func`` with ``n_outs``
    outputs, output ``k`` of ``size`` and ``dtype``: what can be checked of one op
    while its block is still being recorded (its wiring is checked when it closes)."""
    if type(entry) is not tuple or len(entry) < n_outs + 5 or entry[0] != id(func):
        return False
    if entry[len(entry) - n_outs - 1] is not ...:  # another number of outputs
        return False
    out = entry[len(entry) - n_outs + k]
    return type(out) is tuple and out[1] == size and out[2] == dtype
