"""A block record's structure, and the replay plans shared by every record of that structure.

Two records have the same structure when they recorded the same ops, wired the same
way (which earlier output or outside tensor each argument is), with outputs of the
same shapes, dtypes and devices, in the same storage groups, written by the same ops:
their signature (``_record.signature``, the one structural key of a record, which a
budget's plans are cached by too) is the same. Replaying either record then runs the same ops in
the same order and frees the same values at the same points; only the values differ.
So what replay derives from a record -- which ops rebuild a value, which values a pass
keeps, when each intermediate can be freed -- is computed once per structure and
shared by every layer of a model and every step (:class:`Structure`, cached in a
bounded table by signature).

In a structure, values are numbered by *slot*, as the signature numbers them: each
outside tensor (``Input``) and each op output (``Var``) gets the next number the first
time the record mentions it. A record's own ``Slots`` maps slot numbers back to its
Vars and Inputs.

A plan depends on more than the structure in one respect: a value still in memory is
not rebuilt (P3 [ values in memory are used ] in ``_restore.handles``). A cached plan therefore
remembers which values it asked about and what the answers were; it is reused only where every
one of those answers is the same (:meth:`Structure.closure`), which means the closure would have
asked the same questions and come to the same plan.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import torch

from .._base.torch_compat import overload_kernel
from .._record.signature import Fill, Slots, fill, signature
from .._record.types import BlockRecord
from .._record.wrappers import is_collective

__all__ = ["Fill", "Slots", "Structure", "Closure", "Program", "structure_of", "cached_structures", "communicates"]

Tensor = torch.Tensor


class Closure:
    """A plan (the ops that rebuild a value, in order) and the questions that chose it:
    ``asked[k]`` is a slot whose value was looked for in memory, ``answers[k]`` the
    answer."""

    __slots__ = ("plan", "asked", "answers", "programs")

    def __init__(self, plan: tuple[int, ...], asked: tuple[int, ...], answers: tuple[bool, ...]) -> None:
        self.plan = plan
        self.asked = asked
        self.answers = answers
        self.programs: dict[Hashable, Program] = {}  # (target, wanted slots) -> program


class Program:
    """How to run a plan for one target and one set of wanted values
    (P4 [ each op at most once per pass ]): the slots loaded before the first op, and per op of
    the plan which outputs to keep in the environment and which slots to free after it."""

    __slots__ = ("plan", "target", "loads", "steps", "targets", "frontier", "keep", "runs", "code")

    def __init__(self, target: int) -> None:
        self.plan: tuple[int, ...] = ()
        self.target = target  # the slot it rebuilds
        self.loads: tuple[tuple[int, int], ...] = ()  # (slot, op index that reads it first)
        # Per op of the plan: (op index, ((output index, slot, store in env), ...), slots to free).
        self.steps: tuple[tuple[int, tuple[tuple[int, int, bool], ...], tuple[int, ...]], ...] = ()
        self.targets: dict[int, list[int]] = {}  # slot -> positions in wanted it serves
        self.frontier: dict[int, list[int]] = {}  # slot -> positions in wanted whose replay reads it
        self.keep: frozenset[int] = frozenset()
        self.runs = 0  # how often it was interpreted (C1 [ compiled at the HOT-th run ] in ``_restore.codegen``)
        # its compiled forms (C2 [ what the code depends on ] in ``_restore.codegen``)
        self.code: dict[Hashable, Any] = {}


class Structure:
    """Everything replay derives from one record structure (plain data, no tensors)."""

    __slots__ = (
        "reads",
        "made_by",
        "group_writes",
        "fills",
        "positional",
        "outputs",
        "meta",
        "funcs",
        "kernels",
        "calls",
        "closures",
        "reads_of_memo",
        "communicating",
    )

    def __init__(self, record: BlockRecord, slots: Slots) -> None:
        of = slots.of
        n = len(slots.refs)
        self.made_by = [-1] * n  # slot -> op that made it (-1: an Input)
        self.meta: list[Any] = [None] * n  # slot -> (size, dtype, device) of a Var
        self.reads: list[tuple[int, ...]] = []  # per op: the slots it reads, in argument order
        self.fills: list[tuple[Fill, ...]] = []
        # Per op: its fills when each is a ref at a position (most ops), else None.
        self.positional: list[tuple[tuple[int, int], ...] | None] = []
        self.outputs: list[tuple[tuple[int, int], ...]] = []  # per op: (output index, slot)
        self.funcs = [rec.func for rec in record.ops]  # alive while their ids are in the key
        self.kernels = [overload_kernel(f) for f in self.funcs]  # the callable each op runs
        # Per op: (positional arguments, has keyword arguments, replayed with an RNG state).
        self.calls = [(len(rec.args), bool(rec.kwargs), rec.rng is not None) for rec in record.ops]
        for i, (_, args, kwargs, _, outs) in enumerate(record.ops):
            fills: list[Fill] = []
            read: list[int] = []
            for where, a in (*enumerate(args), *kwargs.items()):
                how = fill(a, lambda r: of[id(r)])
                if how is ...:
                    continue
                fills.append((where, how))
                if type(how) is int:
                    read.append(how)
                elif type(how) is tuple:
                    read.extend(s for s in how if s >= 0)
            self.fills.append(tuple(fills))
            simple = all(type(where) is int and type(how) is int for where, how in fills)
            self.positional.append(tuple(fills) if simple else None)
            self.reads.append(tuple(read))
            made = []
            for k, v in enumerate(outs):
                if v is not None:
                    s = of[id(v)]
                    self.made_by[s] = i
                    self.meta[s] = (v.size, v.dtype, v.device)
                    made.append((k, s))
            self.outputs.append(tuple(made))
        # slot -> op indices of the writes to its storage group
        self.group_writes: list[tuple[int, ...]] = [tuple(j for j, _ in r.root.writes) for r in slots.refs]
        self.closures: dict[int, tuple[Closure, ...]] = {}  # target slot -> plans known for it
        self.reads_of_memo: dict[int, tuple[tuple[int, int], ...]] = {}
        # None where no op is a collective, else per slot whether the ops that rebuild it from
        # the inputs alone hold one (``_restore.handles``
        # P11 [ a replay that communicates reads no liveness ])
        self.communicating: dict[int, bool] | None = {} if any(map(is_collective, self.funcs)) else None

    def closure(self, target: int, available: Callable[[int], bool] | None) -> Closure:
        """The ops needed to rebuild slot ``target`` at the end of the record, sorted.
        A Var's slot for which ``available`` is true (its value is in a cache or
        alive, and its group was never written to) is not rebuilt."""
        known = self.closures.get(target, ()) if available is not None else ()
        for c in known:
            for s, a in zip(c.asked, c.answers):
                if available(s) is not a:  # type: ignore[misc]
                    break
            else:
                return c
        c = self._closure(target, available)
        if available is not None:
            self.closures[target] = (*known[-3:], c)  # a few liveness patterns per target
        return c

    def _closure(self, target: int, available: Callable[[int], bool] | None) -> Closure:
        made_by, group_writes, reads = self.made_by, self.group_writes, self.reads
        bound = len(reads)
        need = bytearray(bound)
        need[made_by[target]] = 1
        for j in group_writes[target]:
            need[j] = 1
        asked: list[int] = []
        answers: list[bool] = []
        for i in range(bound - 1, -1, -1):
            if not need[i]:
                continue
            for s in reads[i]:
                writes = group_writes[s]
                op = made_by[s]
                if op >= 0 and not writes:
                    if available is None:
                        need[op] = 1
                    else:
                        a = available(s)
                        asked.append(s)
                        answers.append(a)
                        if not a:
                            need[op] = 1
                elif op >= 0:
                    need[op] = 1
                for j in writes:
                    if j >= i:
                        break
                    need[j] = 1
        return Closure(tuple(i for i in range(bound) if need[i]), tuple(asked), tuple(answers))

    def reads_of(self, target: int) -> tuple[tuple[int, int], ...]:
        """``(i, s)`` for each op ``i`` of the closure of ``target`` and each slot ``s``
        of a Var it reads whose group is never written to: the values a replay of
        ``target`` may read."""
        pairs = self.reads_of_memo.get(target)
        if pairs is None:
            found = []
            for i in self.closure(target, None).plan:
                for s in self.reads[i]:
                    if self.made_by[s] >= 0 and not self.group_writes[s]:
                        found.append((i, s))
            pairs = self.reads_of_memo[target] = tuple(found)
        return pairs

    def program(self, c: Closure, target: int, wanted: tuple[int, ...]) -> Program:
        """How to run plan ``c`` for ``target`` while keeping ``wanted``
        (P4 [ each op at most once per pass ])."""
        key = (target, wanted)
        p = c.programs.get(key)
        if p is None:
            if len(c.programs) >= 64:  # handles asking in ever new orders: keep the table bounded
                c.programs.clear()
            p = c.programs[key] = self._program(c.plan, target, wanted)
        return p

    def _program(self, plan: tuple[int, ...], target: int, wanted: tuple[int, ...]) -> Program:
        p = Program(target)
        p.plan = plan
        in_plan = set(plan)
        for w, s in enumerate(wanted):
            if self.made_by[s] in in_plan:
                p.targets.setdefault(s, []).append(w)
                continue
            for i, r in self.reads_of(s):
                if self.made_by[r] in in_plan and i not in in_plan:
                    p.frontier.setdefault(r, []).append(w)
        p.keep = frozenset(p.targets.keys() | p.frontier.keys())
        made: set[int] = set()
        last_use: dict[int, int] = {}
        loads: list[tuple[int, int]] = []
        loaded: set[int] = set()
        for i in plan:
            for s in self.reads[i]:
                last_use[s] = i
                if s not in made and s not in loaded:
                    loaded.add(s)
                    loads.append((s, i))
            made.update(s for _, s in self.outputs[i])
        frees: dict[int, list[int]] = {}
        for s, i in last_use.items():
            if s != target:
                frees.setdefault(i, []).append(s)
        p.loads = tuple(loads)
        p.steps = tuple(
            (i, tuple((k, s, s in last_use) for k, s in self.outputs[i]), tuple(frees.get(i, ()))) for i in plan
        )
        return p


_MAX_STRUCTURES = 256
_structures: dict[Hashable, Structure] = {}
# The same table by the key object's id, holding the key (so that its id is not reused
# while the entry lives): a steady-state run's record carries its template's key object
# (``_adapters.steady``), found here without hashing a key of a few thousand items.
_by_key_id: dict[int, tuple[Hashable, Structure]] = {}


def communicates(st: Structure, target: int) -> bool:
    """Whether rebuilding slot ``target`` of ``st`` from the block's inputs alone runs a
    collective (``_restore.handles`` P11 [ a replay that communicates reads no liveness ])."""
    known = st.communicating
    if known is None:
        return False
    found = known.get(target)
    if found is None:
        funcs = st.funcs
        found = known[target] = any(is_collective(funcs[i]) for i in st.closure(target, None).plan)
    return found


def structure_of(record: BlockRecord) -> tuple[Structure, Slots]:
    """The structure of ``record`` (shared with every record of the same signature,
    once it is closed) and its slots."""
    key, slots = signature(record)
    if record.open:  # its op list still grows: nothing about it is shared
        return Structure(record, slots), slots
    hit = _by_key_id.get(id(key))
    if hit is not None and hit[0] is key:
        return hit[1], slots
    st = _structures.get(key)
    if st is None:
        if len(_structures) >= _MAX_STRUCTURES:
            _structures.clear()  # a model with this many block structures plans anew
            _by_key_id.clear()
        st = _structures[key] = Structure(record, slots)
    if len(_by_key_id) >= _MAX_STRUCTURES:
        _by_key_id.clear()
    _by_key_id[id(key)] = (key, st)
    return st, slots


def cached_structures() -> int:
    """How many record structures have a cached plan table (for tests and benchmarks)."""
    return len(_structures)
