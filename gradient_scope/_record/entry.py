"""How one op of an open block becomes an entry (an ``OpRecord``) of its record.

RULES R1..R12: what a recording keeps.

R1. [ a written input is copied ] A block never holds a tensor whose storage it wrote
    to: an Input written by the block is replaced by a private copy of its value before
    the first write, and replay writes into copies of that copy. (BatchNorm running
    statistics then change once per forward; a view read later from the same storage is
    copied too.)
R2. [ kept ops are not recorded ] Outputs of ops a ``save=`` policy keeps, of
    ``c10d`` collectives (R11 [ a functional collective replays whole ]: functional ones
    are recorded) and of higher-order ops are not recorded: they are ordinary tensors,
    stored by autograd. A ``save=`` policy never keeps an op that writes to an argument.
    Ops whose outputs decide shapes or routing (top-k and sort indices, nonzero,
    bincount, unique, values read to the host: ``_base.ops.kept_always``) are not
    recorded either, whatever ``save=`` says: a replay could choose differently from
    forward (a tie broken another way, an input written unseen), and the ops they feed
    would replay another routing than the one the gradients flow through. Ops that read
    their outputs (a MoE's dispatch and combine) are recorded and read them as outside
    tensors, which the record keeps (a budget counts them as kept bytes). The writes of
    an unrecorded op (a collective's, an ``out=`` variant's) cannot be replayed
    (R10 [ an unseen write makes an Input ]).
R3. [ backward's ops are not the block's ] Ops of a backward pass that runs inside an
    open block belong to that pass, not to the block; ops under ``no_grad`` in the block
    (an ``autograd.Function`` forward) belong to the block.
R4. [ dtype=None as resolved ] ``dtype=None`` of a factory is recorded as the dtype
    forward resolved.
R5. [ another block's live tensor is noted ] An Input that is another block's live
    tensor is noted in that tensor's registry entry: its value is in memory anyway, and
    is used instead of replaying the other block for as long as a handle of it is
    pending.
R6. [ versions are read after the op ] A write's version is read after the op has
    returned to autograd, where ADInplaceOrView bumps it (some kernels write without a
    bump): when the next op is recorded, when a tensor is packed, or when the block
    closes.
R7. [ compiled code is not recorded ] Ops that a compiled artifact (``torch.compile``)
    runs inside a block are not recorded: its graph stores what it decides
    (``_base.torch_compat.in_compiled_code``).
R8. [ jagged nested tensors are not recorded ] Jagged nested tensors are not block
    tensors (autograd stores them): each construction gets a fresh symbolic ragged size,
    so a replayed one could not meet the gradients forward's size flows into. Ops that
    read one are not recorded either (the record never holds one: it holds its block's
    tensors). The tensors they are built from stay recomputable.
R9. [ each op's numeric context ] Each op is recorded with the numeric context it ran
    under (the global flags its result may depend on:
    ``_base.torch_compat.numeric_context``). It is read when the block opens and when a
    nested scope enters, and re-read before ops that read such flags
    (``OpFacts.context``) and before ops with a Python float or complex argument if the
    default dtype changed (type promotion reads it; the only flag such an op reads); a
    change starts a new entry of the record's ``contexts``.
R10. [ an unseen write makes an Input ] A block tensor read at another version than the
    record can rebuild (a write the recorder did not see: a compiled function called in
    the block (R7 [ compiled code is not recorded ]), another thread) is read as an
    Input from then on: its value is kept, as for a tensor from outside. Its storage
    group gets a write that cannot be replayed, so that values saved before it raise
    instead of being rebuilt without it, and later saves of it are stored. Checked at
    every recorded read and, for the block's live tensors, when the block closes.
R11. [ a functional collective replays whole ] A functional collective
    (``_c10d_functional``: all_reduce, all_gather_into_tensor, reduce_scatter_tensor) is
    recorded and its output is a block tensor; its record op runs the collective and waits
    for it (``_record.wrappers.Collective``), so a replay holds no pending work, and its
    ``wait_tensor`` is not recorded (it returns its argument). A replayed collective is a
    collective in backward: every rank of its group must replay the same collectives in the
    same order, which holds when every rank runs the same program and the same plan.
    Collectives that write their argument (``c10d``) stay kept (R2 [ kept ops are not recorded ]).
R12. [ wrappers of block tensors are block tensors ] A wrapper subclass (DTensor,
    ``AsyncCollectiveTensor``) no op returned, read by a recorded op, whose inner tensors are
    this block's tensors (``DTensor.from_local``, ``redistribute``, a collective's async
    result) is a block tensor made by a ``REWRAP`` of them; each inner tensor of a wrapper
    block tensor (a DTensor's local tensor, which ``to_local`` views) is a block tensor made
    by an ``INNER`` of it (``_record.wrappers``). Both share their source's storage group
    with a version counter of their own (the group's loose members).
"""

from __future__ import annotations

from typing import Any

import torch

from .._base import rng as _rng
from .._base.errors import internal_error
from .._base.ops import INPLACE, NEW, VIEW, OpFacts, kept_always
from .._base.subclass import data_address, data_tensors, is_wrapper
from .._base.torch_compat import current_graph_task, default_dtype, numeric_context
from ..policies import OpContext, region_name
from . import registry as _registry
from .context import running_module_path
from .registry import _LIVE, Ledger, register
from .types import NO_KWARGS, BlockOwner, BlockRecord, Frame, Group, Input, MetaArg, OpRecord, Ref, Var, new_var
from .wrappers import collective, note_inner, rewrapped, wrapper

__all__ = [
    "OpenBlock",
    "Unrecordable",
    "run_unrecorded",
    "note_context",
    "unseen",
    "has_tensor",
    "outside",
    "note_inner",
    "rewrapped",
]

Tensor = torch.Tensor
_new_tuple = tuple.__new__


class Unrecordable(Exception):
    """An argument the record must not hold (R8 [ jagged nested tensors are not recorded ]): the
    op runs unrecorded."""


class _Inputs:
    """The tensors from outside an open block that it reads (R1 [ a written input is copied ],
    R5 [ another block's live tensor is noted ])."""

    __slots__ = ("cache", "written", "originals")

    def __init__(self) -> None:
        self.cache: dict[int, Input] = {}  # by id(tensor), while it is unchanged
        self.written: set[int] = set()  # storages the block wrote to (R1 [ a written input is copied ])
        # Where asked for (``keep_originals``: a steady state's template run, which finds in its
        # graph the tensors the block made itself): per Input copied at a write, by id, the
        # tensor it was read from and its version then.
        self.originals: dict[int, tuple[Tensor, int | None]] | None = None

    def keep_originals(self) -> dict[int, tuple[Tensor, int | None]]:
        """From now on, note what each Input copied at a write was read from (kept until the
        block closes); the notes."""
        self.originals = {}
        return self.originals

    def of(self, t: Tensor, entry: _registry.Entry | None) -> Input:
        """The Input standing for ``t`` (``entry``: t's registry entry if another block made it)."""
        if type(t) is not Tensor and t.is_nested:
            raise Unrecordable  # R8 [ jagged nested tensors are not recorded ]
        key = id(t)
        inp = self.cache.get(key)
        if inp is not None and inp.source() is t and inp.version == t._version:
            return inp
        inp = Input(t)
        if not inp.snapshot:
            if self.written and data_address(t) in self.written:
                self._copy(inp)  # R1 [ a written input is copied ]
            else:
                self.cache[key] = inp
                if entry is not None and entry() is t:
                    _registry.note_alias(entry, inp.tensor)  # R5 [ another block's live tensor is noted ]
        return inp

    def before_write(self, root: Input) -> None:
        """R1 [ a written input is copied ]: the block is about to write to ``root``'s storage:
        copy every Input of it."""
        key = data_address(root.tensor)
        if key is not None:
            self.written.add(key)
            for k, inp in list(self.cache.items()):
                if data_address(inp.tensor) == key:
                    self._copy(inp)
                    del self.cache[k]
        if not root.snapshot:
            self._copy(root)

    def _copy(self, inp: Input) -> None:
        if self.originals is not None:
            self.originals[id(inp)] = (inp.tensor, inp.tensor._version)
        inp.take_snapshot()


class OpenBlock:
    """The recorder's state for one open block; discarded when the block closes."""

    __slots__ = (
        "record",
        "owner",
        "ledger",
        "task",
        "frames",
        "starts",
        "frame",
        "inputs",
        "counted",
        "unsettled",
        "context",
    )

    def __init__(self, record: BlockRecord, owner: BlockOwner, frame: Frame, lg: Ledger) -> None:
        self.record = record
        self.owner = owner  # the block's replay state: its tensors' registry entries point to it
        self.ledger = lg
        frame.owner, frame.ledger = owner, lg
        # R3 [ backward's ops are not the block's ]: the backward pass it was opened in (-1: none)
        self.task = current_graph_task()
        self.frames = [frame]
        self.starts = [0]  # op index at which each frame began
        self.frame = frame  # the innermost scope's
        self.inputs = _Inputs()
        self.counted = 0  # ops already counted into some frame's stats
        # Writes of the last op, whose versions are not bumped yet
        # (R6 [ versions are read after the op ]).
        self.unsettled: list[tuple[Group, Tensor, int]] = []
        self.context = numeric_context()  # R9 [ each op's numeric context ]: the context of the ops recorded now
        record.contexts.append((len(record.ops), self.context))

    # -- nested scopes

    def _count(self) -> None:
        n = len(self.record.ops)
        self.frame.stats.ops_recorded += n - self.counted
        self.counted = n

    def push(self, frame: Frame) -> None:
        frame.owner, frame.ledger = self.owner, self.ledger
        self._count()
        self.frames.append(frame)
        self.starts.append(len(self.record.ops))
        self.frame = frame
        note_context(self)

    def pop(self, aborted: bool) -> None:
        self._count()
        self.frames.pop()
        start = self.starts.pop()
        self.frame = self.frames[-1]
        if aborted:  # tensors of a scope that raised are ordinary tensors from now on
            _registry.forget([v for rec in self.record.ops[start:] for v in rec.outs if v is not None])

    def settle(self) -> None:
        """R6 [ versions are read after the op ]: note the version each write of the last op
        left its tensor at."""
        for root, t, index in self.unsettled:
            self._add_write(root, index, t._version)
        self.unsettled.clear()

    def close(self, aborted: bool) -> None:
        self.settle()
        self._count()
        record = self.record
        _note_escaped(record)
        registered = record.registered_vars()
        if aborted:
            _note_unseen(self, [(v, t) for v in registered if (t := _registry.tensor_of(v)) is not None])
            _registry.forget(registered)
        else:
            _note_unseen(self, _registry.close_entries(registered))  # type: ignore[arg-type]
        record.open = False
        self.inputs = _Inputs()

    # -- arguments

    def refs(self, args: tuple[Any, ...] | list[Any]) -> list[Any]:
        """The recorded form of positional arguments: Vars, Inputs, plain values."""
        live_get = _LIVE.get
        owner = self.owner
        out: list[Any] = []
        for a in args:
            if isinstance(a, Tensor):
                e = live_get(id(a))
                if e is not None and e.frame.owner is owner and e() is a:
                    var: Var = e  # type: ignore[assignment]  # this block's entries are Vars
                    t: Tensor = a  # type: ignore[assignment]  # (narrowed by `e() is a`)
                    out.append(var if _version(t) == var.version else (unseen(self, var, t) or var))
                else:
                    out.append(outside(self, a, e))
            elif (type(a) is list or type(a) is tuple) and has_tensor(a):
                out.append([self.ref(x) if isinstance(x, Tensor) else x for x in a])
            else:
                out.append(a)
        return out

    def ref(self, t: Tensor) -> Ref:
        e = _LIVE.get(id(t))
        if e is not None and e.frame.owner is self.owner and e() is t:
            var: Var = e  # type: ignore[assignment]
            return var if _version(t) == var.version else (unseen(self, var, t) or var)
        return outside(self, t, e)

    # -- ops

    def run_and_record(self, func: Any, f: OpFacts, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run and record one op (every op the hot path does not take)."""
        frame = self.frame
        if f.context or (_has_float(args) and default_dtype() is not self.context[0]):
            note_context(self)  # R9 [ each op's numeric context ]
        # R2 [ kept ops are not recorded ], R11 [ a functional collective replays whole ]
        always = (f.never_replay and not f.collective) or (f.host_copy and kept_always(f, args, kwargs))
        kept = frame.save is not None and not f.writes and frame.keeps(func)
        if kept:
            frame.stats.ops_saved += 1
            self.frames[0].kept_any = True
        elif kept is None and not always:  # a context policy: asked once the op has run
            return _decide_after(self, func, f, args, kwargs)
        if kept or always:
            pre = _before_writes(self, f, args, kwargs) if f.writes else None
            out = func(*args, **kwargs)  # R2 [ kept ops are not recorded ]: not recorded
            for root, _ in pre or ():
                self._add_write(root, len(self.record.ops), None)
            return out
        try:
            rargs = self.refs(args)
            rkwargs = _ref_kwargs(self, kwargs) if kwargs else NO_KWARGS
        except Unrecordable:
            return run_unrecorded(self, func, f, args, kwargs)
        if (
            f.meta_only
            and args
            and isinstance(args[0], Tensor)
            and args[0].layout == torch.strided
            and not is_wrapper(args[0])
        ):
            rargs[0] = MetaArg(args[0])
        rng = _rng.capture(args, kwargs) if f.seeded and frame.preserve_rng else None
        pre = _before_writes(self, f, args, kwargs) if f.writes else None

        out = f.kernel(*args, **kwargs)  # func(...) without OpOverload.__call__'s Python frame

        index = len(self.record.ops)
        for root, t in pre or ():
            self.unsettled.append((root, t, index))
        # R11 [ a functional collective replays whole ]
        _append(self, collective(func) if f.collective else func, f, args, kwargs, rargs, rkwargs, rng, out)
        return out

    @staticmethod
    def _add_write(root: Group, index: int, version: int | None) -> None:
        if not root.writes:
            root.writes = []
        root.writes.append((index, version))


def _ref_kwargs(block: OpenBlock, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The recorded form of keyword arguments (raises Unrecordable,
    R8 [ jagged nested tensors are not recorded ])."""
    rkwargs = {}
    for k, a in kwargs.items():
        if isinstance(a, Tensor):
            a = block.ref(a)
        elif (type(a) is list or type(a) is tuple) and has_tensor(a):
            a = [block.ref(x) if isinstance(x, Tensor) else x for x in a]
        rkwargs[k] = a
    return rkwargs


def _append(
    block: OpenBlock,
    func: Any,
    f: OpFacts,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    rargs: list[Any],
    rkwargs: dict[str, Any],
    rng: Any,
    out: Any,
) -> None:
    """Append the record of an op that has run (its new tensors become Vars)."""
    ops = block.record.ops
    index = len(ops)
    if isinstance(out, Tensor):
        outs: tuple[Var | None, ...] = (_new_var(block, out, f, 0, args, kwargs, rargs, rkwargs, index),)
    elif isinstance(out, (tuple, list)):
        outs = tuple(
            _new_var(block, o, f, i, args, kwargs, rargs, rkwargs, index) if isinstance(o, Tensor) else None
            for i, o in enumerate(out)
        )
    else:
        outs = ()
    if f.dtype_arg and rkwargs.get("dtype") is None and isinstance(out, Tensor):
        rkwargs = {**rkwargs, "dtype": out.dtype}  # R4 [ dtype=None as resolved ]
    ops.append(_new_tuple(OpRecord, (func, rargs, rkwargs, rng, outs)))  # OpRecord(...), built in C
    outputs = out if isinstance(out, (tuple, list)) else (out,)
    for v, o in zip(outs, outputs):
        if v is not None and type(o) is not Tensor:
            note_inner(block, v, o)  # R12 [ wrappers of block tensors are block tensors ]


def outside(block: OpenBlock, t: Tensor, entry: _registry.Entry | None) -> Ref:
    """The ref of ``t``, read by an op of ``block`` and no tensor of it (``entry``: its registry
    entry if another block made it): a wrapper of this block's tensors becomes one
    (R12 [ wrappers of block tensors are block tensors ]), anything else an Input."""
    # a dead entry at ``t``'s id (a tensor that died in an open block, its id reused) is no
    # entry of ``t``: which ids are reused differs from process to process
    if (entry is None or entry() is not t) and wrapper(t):
        var = rewrapped(block, t)
        if var is not None:
            return var
    return block.inputs.of(t, entry)


def _decide_after(block: OpenBlock, func: Any, f: OpFacts, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run an op of a frame with a context policy, then ask the policy (it sees the
    outputs): kept, it is not recorded (R2 [ kept ops are not recorded ]); else it is recorded as
    run_and_record
    does. Only ops that write to no argument and that are not kept always
    (R2 [ kept ops are not recorded ]) come here."""
    frame = block.frame
    rng = _rng.capture(args, kwargs) if f.seeded and frame.preserve_rng else None
    out = f.kernel(*args, **kwargs)
    ctx = OpContext(func, args, out, region_name(), running_module_path)
    try:
        kept = frame.save(ctx)  # type: ignore[misc]
    finally:
        ctx.release()
    if kept:
        frame.stats.ops_saved += 1
        block.frames[0].kept_any = True
        return out
    try:
        rargs = block.refs(args)
        rkwargs = _ref_kwargs(block, kwargs) if kwargs else NO_KWARGS
    except Unrecordable:
        # R8 [ jagged nested tensors are not recorded ]: its outputs are ordinary tensors (it writes
        # nothing)
        return out
    first = args[0] if args else None
    if f.meta_only and isinstance(first, Tensor) and first.layout == torch.strided and not is_wrapper(first):
        rargs[0] = MetaArg(first)
    _append(block, func, f, args, kwargs, rargs, rkwargs, rng, out)
    return out


def _new_var(
    rec: OpenBlock,
    t: Tensor,
    f: OpFacts,
    i: int,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    rargs: list[Any],
    rkwargs: dict[str, Any],
    index: int,
) -> Var | None:
    """The Var of a new tensor an op returned (its ``i``-th output), registered; None
    for an output that is not a new tensor."""
    kind = f.out_kind(i)
    if kind == INPLACE or _registry.lookup(t) is not None or _is_arg(t, args, kwargs):
        return None  # not a new tensor
    if type(t) is not Tensor and t.is_nested:
        return None  # R8 [ jagged nested tensors are not recorded ]
    root: Group | None = None
    version = 0
    if kind == VIEW:
        where = f.view_arg(i)
        src = rkwargs.get(where) if isinstance(where, str) else (rargs[where] if where < len(rargs) else None)
        if isinstance(src, list):  # Tensor[] arguments (cat-like views are not a thing)
            src = src[0] if src else None
        if isinstance(src, (Var, Input)):
            root = src.root
        version = _version(t)
    elif kind != NEW:  # pragma: no cover
        internal_error(f"unknown output kind {kind} of {f.name}")
    var = new_var(t, index, rec.frame, root, version)
    if f.loose and isinstance(root, Var):
        rec.record.loose.setdefault(root, []).append(var)
    if rec.frame.debug:
        if i in f.scratch:
            rec.record.scratch.add(var)
        elif not f.uninitialized:
            rec.record.debug_values[var] = t.detach().clone()
    register(var)
    return var


def _before_writes(
    block: OpenBlock, f: OpFacts, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> list[tuple[Group, Tensor]]:
    """The groups ``f`` is about to write to; Inputs among them are copied first
    (R1 [ a written input is copied ])."""
    out: list[tuple[Group, Tensor]] = []
    for w in f.writes:
        a = kwargs.get(w) if isinstance(w, str) else (args[w] if w < len(args) else None)
        # A Tensor[] argument (``_foreach_mul_``) writes each of its tensors.
        for t in (a,) if isinstance(a, Tensor) else a if type(a) is list or type(a) is tuple else ():
            if not isinstance(t, Tensor):
                continue
            root = block.ref(t).root
            if isinstance(root, Input) and not root.snapshot:
                block.inputs.before_write(root)
            out.append((root, t))
    return out


def note_context(block: OpenBlock) -> None:
    """R9 [ each op's numeric context ]: re-read the numeric context; a change applies from the
    next op on."""
    ctx = numeric_context()
    if ctx != block.context:
        block.context = ctx
        contexts = block.record.contexts
        index = len(block.record.ops)
        if contexts[-1][0] == index:
            contexts[-1] = (index, ctx)
        else:
            contexts.append((index, ctx))


def unseen(block: OpenBlock, var: Var, t: Tensor) -> Input | None:
    """R10 [ an unseen write makes an Input ]: ``t`` (the tensor of ``var``, at another version
    than ``var`` was made at) as a new Input if a write the record cannot replay changed it,
    else None."""
    root = var.root
    writes = root.writes
    # With no recorded write the group is at its root's version: a view's own Var was
    # made inside dispatch, before its counter was tied to its base's.
    expected = writes[-1][1] if writes else root.version
    if (expected is None and not writes) or t._version == expected or root in block.record.loose:
        return None
    if not writes or writes[-1][1] is not None:
        block._add_write(root, len(block.record.ops), None)
    return block.inputs.of(t, None)


def _note_unseen(block: OpenBlock, alive: list[tuple[Var, Tensor]]) -> None:
    """R10 [ an unseen write makes an Input ] at block exit: the block's live tensors
    (``alive``: Vars with their tensors) written unseen since their last recorded read (values
    saved before such a write must not be rebuilt)."""
    for var, t in alive:
        if not t.is_inference() and t._version != var.version:
            unseen(block, var, t)


def run_unrecorded(rec: OpenBlock, func: Any, f: OpFacts, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run an op that reads a jagged nested tensor
    (R8 [ jagged nested tensors are not recorded ]) without recording it; block tensors inside
    an argument it writes to can no longer be replayed."""
    out = func(*args, **kwargs)
    index = len(rec.record.ops)
    for w in f.writes:
        t = kwargs.get(w) if isinstance(w, str) else (args[w] if w < len(args) else None)
        if isinstance(t, Tensor):
            for d in data_tensors(t):
                e = _registry.lookup(d)
                if e is not None and e.frame.owner is rec.owner:
                    rec._add_write(e.root, index, None)  # type: ignore[attr-defined]
    return out


def _note_escaped(record: BlockRecord) -> None:
    """At block exit (P8 [ groups of separate counters ] in ``_restore.handles``): groups with
    separate-counter members alive now."""
    for root, members in record.loose.items():
        alive = {v: t._version for v in (root, *members) if (t := _registry.tensor_of(v)) is not None}
        if len(alive) > 1:
            record.escaped[root] = alive


def _has_float(args: tuple[Any, ...]) -> bool:
    for a in args:
        if type(a) is float or type(a) is complex:
            return True
    return False


def has_tensor(seq: Any) -> bool:
    """Whether the list or tuple ``seq`` holds a tensor."""
    for x in seq:
        if isinstance(x, Tensor):
            return True
    return False


def _is_arg(t: Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether ``t`` is one of the op's own arguments (an op that returned an input)."""
    for a in (*args, *kwargs.values()):
        if a is t or ((type(a) is list or type(a) is tuple) and any(x is t for x in a)):
            return True
    return False


def _version(t: Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # inference tensors have no version counter
        return 0
