"""A block's template: what one recorded run of a captured graph tells every later run.

A graph that dynamo captured (``_adapters.steady``) computes the same ops every time its guards
pass: only the tensors differ. Its first run in a scope is recorded as usual; the
record, the saves made during it, and the random states its random ops drew, make
a :class:`Template` -- plain metadata: fresh copies of the record's Vars (no tensor,
no frame of that run), a marker per outside tensor (which graph argument it is), and
per save what it was. A later run binds a record of its own from the template
(``_record.bind``): its own Inputs, its own Vars for the tensors that outlive it, its own
random states (``_record.bind``). Replay of that record is replay of a recorded block.

RULES T1..T6: what makes a recorded run a template.

T1. [ one plain block ] The record is one block, one frame, one numeric context, and
    every outside tensor it read is a graph argument, read, never written (no
    R1 [ a written input is copied ] copy), or one of
    T6 [ kept ops' outputs taken from the graph ], and not a wrapper subclass; every write to
    a block tensor is replayable (no R10 [ an unseen write makes an Input ] write), no
    storage group with members of separate version counters has two among the graph's
    outputs (so none can escape a run: P8 [ groups of separate counters ]) and no tensor
    is a jagged nested one.
T2. [ saves are classified as they happen ] Each save of the run is classified as it
    happens: a block tensor or a view of one that becomes a handle or a budget's choice
    (S1 [ block tensors become handles ], S4 [ a budget's choice is stored ]), one
    stored whatever the plan (the exceptions of S1 [ block tensors become handles ]), or
    not the block's (S2 [ anything else as without the scope ], or another block's:
    decided again at every run). A save is checked at every run against its shape and
    dtype.
T3. [ random states observed at saves ] Every random op draws from its device's default
    generator, and its state in the record is the state observed after the last save
    before it (or at the block's start): no other random draw, recorded or not (a
    ``save=``-kept dropout), lies between. A later run observes the states there.
T4. [ no nested scope or higher-order op ] The graph has no node of a nested scope
    (``_adapters.compile.graph``'s annotation: nested scopes' options apply only when
    recorded) and no higher-order op (a checkpointed region, ``flex_attention``).
T5. [ one numeric context ] A template is used only under the numeric context it was
    recorded in; another context records the run as usual.
T6. [ kept ops' outputs taken from the graph ] An outside tensor the block reads that is
    no graph argument is an output of an op a ``save=`` policy keeps (not recorded:
    R2 [ kept ops are not recorded ]). A recorded run of the graph node by node finds the
    graph node whose value holds its storage: the run after the first, or, where a template
    of the function had such tensors before (a KV cache: a graph per layer, and per
    length), the first itself. Later runs return those values too and take the tensor from them (same
    storage, dtype, shape, strides and offset). Where no node holds it, there is no
    template. Where the block writes to it (a router that normalises its kept top-k weights in
    place), the record holds a copy taken before the first write
    (R1 [ a written input is copied ]): later runs' graphs copy the node's value as soon as the
    node has run, which is that value where the recorded run saw the tensor at one version
    from the node to the copy; else there is no template.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, NamedTuple

import torch

from .._base.rng import default_generators
from .._base.stats import ScopeStats
from .._base.torch_compat import NumericContext
from .registry import lookup
from .signature import Slots, signature
from .types import BlockRecord, Frame, Input, OpRecord, Var, ViewSpec, template_var

__all__ = [
    "Save",
    "Template",
    "Marker",
    "Log",
    "build",
    "OTHER",
    "BLOCK",
    "KEEP",
]

Tensor = torch.Tensor

# T2 [ saves are classified as they happen ]: not the block's; handle or budget's choice; stored
OTHER, BLOCK, KEEP = 0, 1, 2


class Save(NamedTuple):
    """One save of the run (T2 [ saves are classified as they happen ])."""

    kind: int
    var: Var | None  # the template's Var of the tensor (or of the view's base)
    view: ViewSpec | None
    itself: bool  # autograd keeps the tensor itself (``_restore.handles.Handle.itself``)
    version: int  # at the save, in the template's count (-1: an outside tensor's counter)
    shape: torch.Size
    dtype: torch.dtype


class Marker(Input):
    """Where a template's op reads its ``k``-th outside tensor. An Input without a
    tensor: the root of a template Var that views an outside tensor is one (never
    written: T1 [ one plain block ]), and every op that reads one is bound to the run's Input."""

    __slots__ = ("k",)

    def __init__(self, k: int) -> None:  # no Input.__init__: no tensor
        self.k = k
        self.tensor = None  # type: ignore[assignment]
        self.source = _nothing  # type: ignore[assignment]
        self.version = 0
        self.snapshot = False
        self.writes = ()
        self.storage = None


def _nothing() -> None:
    return None


_TEMPLATE_FRAME = Frame(False, None, False, ScopeStats(), 0)  # the frame of template Vars: never used


class Template:
    """Plain data a run is bound from (see the module docstring)."""

    __slots__ = (
        "key",
        "refs",
        "of",
        "ops",
        "args",
        "input_slots",
        "input_ops",
        "outputs",
        "output_ids",
        "saves",
        "rng_ops",
        "observe",
        "at_start",
        "context",
        "ops_saved",
        "captured",
        "capture",
        "late_ops",
        "gm",
    )

    def __init__(self) -> None:
        self.key: Hashable = None  # the record signature: the Structure every run shares
        self.refs: list[Any] = []  # slot -> template Var or Marker
        self.of: dict[int, int] = {}  # id(template ref) -> slot
        self.ops: list[OpRecord] = []
        self.args: list[int] = []  # per outside tensor: its position among the graph's arguments
        self.input_slots: list[int] = []  # per outside tensor: its slot
        self.input_ops: list[int] = []  # ops that read an outside tensor (bound per run)
        self.outputs: list[Var | None] = []  # per graph output: its template Var (a block tensor) or None
        self.output_ids: set[int] = set()  # ids of those Vars
        self.saves: list[Save] = []
        self.rng_ops: list[tuple[int, torch.Generator, int]] = []  # (op, generator, observation)
        # saves seen -> generators to read (T3 [ random states observed at saves ])
        self.observe: dict[int, list[torch.Generator]] = {}
        self.at_start: list[torch.Generator] = []  # generators read when the run starts
        self.context: NumericContext = ()
        self.ops_saved = 0  # ops a save= policy kept (R2 [ kept ops are not recorded ]), counted per run
        # T6 [ kept ops' outputs taken from the graph ]: outside tensors made in the run
        # (outputs of ops a save= policy keeps): their input indices; how each is taken from the
        # graph's extra outputs, once found (``(extra output, element or -1, (dtype, size,
        # stride, storage offset))``, element -2 where the output is a copy of one the block
        # writes to: ``_adapters.steady.capture.COPIED``); the ops that read one (bound when the
        # graph has returned); the graph that returns them.
        self.captured: list[int] = []
        self.capture: list[tuple[int, int, tuple[Any, ...]]] | None = None
        self.late_ops: list[int] = []
        self.gm: Any = None


class Log:
    """What a template's first run saw (filled by ``_save.sequencer.Logger``)."""

    __slots__ = ("saves", "seen", "states", "start")

    def __init__(self) -> None:
        self.saves: list[tuple[Save, Var | None]] = []  # with the run's own Var
        self.seen: list[int] = []  # per save: ops recorded before it
        self.states: list[dict[torch.Generator, Tensor]] = []  # per save: states after it
        self.start: dict[torch.Generator, Tensor] = {}


def build(record: BlockRecord, log: Log, args: list[Any], outs: Any, frames: int, has_nested: bool) -> Template | None:
    """The template of a recorded run, or None where T1..T4 and
    T6 [ kept ops' outputs taken from the graph ] do not hold."""
    if frames != 1 or has_nested or len(record.contexts) != 1 or record.escaped:
        return None
    key, slots = signature(record)
    t = Template()
    t.key, t.context = key, record.contexts[0][1]
    copies = _copy_refs(slots, args, t)
    if copies is None:
        return None
    for rec in record.ops:
        t.ops.append(_template_op(rec, copies))
    late = {id(slots.refs[t.input_slots[k]]) for k in t.captured}
    for i, rec in enumerate(record.ops):
        refs = [r for r in _refs(rec) if type(r) is Input]
        if any(id(r) in late for r in refs):
            t.late_ops.append(i)
        elif refs:
            t.input_ops.append(i)
    t.outputs = [_output_var(o, copies) for o in (outs if isinstance(outs, (tuple, list)) else (outs,))]
    t.output_ids = {id(v) for v in t.outputs if v is not None}
    # T1 [ one plain block ]: no group of separate counters can outlive a run
    for root, members in record.loose.items():
        if sum(id(copies[id(v)]) in t.output_ids for v in (root, *members)) > 1:
            return None
    for save, own in log.saves:
        var = copies.get(id(own)) if own is not None else None
        if save.kind != OTHER and var is None:
            return None
        t.saves.append(save._replace(var=var))
    if not _observations(record, log, t):
        return None
    return t


def _copy_refs(slots: Slots, args: list[Any], t: Template) -> dict[int, Any] | None:
    """Template copies of the record's refs (T1 [ one plain block ]), by id of the original."""
    position = {id(a): k for k, a in enumerate(args) if isinstance(a, Tensor)}
    copies: dict[int, Any] = {}
    anchor = torch.empty(0)  # every copy is a weak reference to this: dead once it goes
    for s, r in enumerate(slots.refs):
        c: Any
        if type(r) is Input:
            src = r.source()
            k = position.get(id(src), -1) if src is not None else -1
            written = r.snapshot or bool(r.writes)
            if r.storage is not None or (
                written and (k >= 0 or r.version is None or any(w is None for _, w in r.writes))
            ):
                return None
            c = Marker(len(t.args))
            if k < 0:
                # T6 [ kept ops' outputs taken from the graph ]: found in the graph by the next run
                t.captured.append(len(t.args))
                if written:  # its value before the block's writes, copied in the graph
                    c.snapshot, c.writes = True, list(r.writes)
            t.args.append(k)
            t.input_slots.append(s)
        else:
            v: Var = r  # type: ignore[assignment]
            if v.size is None or any(w is None for _, w in v.writes):
                return None  # T1 [ one plain block ]: a jagged nested tensor, an unreplayable write
            c = template_var(v, anchor, _TEMPLATE_FRAME)
        copies[id(r)] = c
        t.refs.append(c)
        t.of[id(c)] = s
    for s, r in enumerate(slots.refs):
        if type(r) is Var and r.base is not None:
            t.refs[s].base = copies[id(r.base)]  # a template Var, or a Marker (a view of an outside tensor)
    return copies


def _refs(rec: OpRecord) -> list[Any]:
    out: list[Any] = []
    for a in (*rec.args, *rec.kwargs.values()):
        if type(a) is list:
            out.extend(a)
        else:
            out.append(a)
    return out


def _sub(a: Any, copies: dict[int, Any]) -> Any:
    if type(a) is Var or type(a) is Input:
        return copies[id(a)]
    if type(a) is list:
        return [_sub(x, copies) for x in a]
    return a


def _template_op(rec: OpRecord, copies: dict[int, Any]) -> OpRecord:
    args = [_sub(a, copies) for a in rec.args]
    kwargs = {k: _sub(a, copies) for k, a in rec.kwargs.items()} if rec.kwargs else rec.kwargs
    outs = tuple(None if v is None else copies[id(v)] for v in rec.outs)
    # each run's own state (T3 [ random states observed at saves ])
    rng = None if rec.rng is None else (rec.rng[0], None)
    return OpRecord(rec.func, args, kwargs, rng, outs)


def _output_var(o: Any, copies: dict[int, Any]) -> Var | None:
    e = lookup(o) if isinstance(o, Tensor) else None
    c = copies.get(id(e)) if e is not None else None
    return c if type(c) is Var else None


def _observations(record: BlockRecord, log: Log, t: Template) -> bool:
    """T3 [ random states observed at saves ]: where each random op's state is observed in a run."""
    gens = set(default_generators())
    last_random = -1
    for i, rec in enumerate(record.ops):
        if rec.rng is None:
            continue
        gen, state = rec.rng
        if gen not in gens:
            return False
        n = sum(1 for m in log.seen if m <= i)  # saves made before op i
        if n and log.seen[n - 1] <= last_random:
            return False  # another random op ran after that save
        if not n and last_random >= 0:
            return False
        seen = log.states[n - 1] if n else log.start
        if gen not in seen or not torch.equal(seen[gen], state):
            return False  # an unrecorded draw lies between (T3 [ random states observed at saves ])
        t.rng_ops.append((i, gen, n))
        if n:
            t.observe.setdefault(n, [])
            if gen not in t.observe[n]:
                t.observe[n].append(gen)
        elif gen not in t.at_start:
            t.at_start.append(gen)
        last_random = i
    return True
