"""The thread's recorder: while a block is open in a thread, a TorchDispatchMode records its ops.

The recorder exists only while a block is open in a thread. It hands each op
to the innermost open block's :class:`~gradient_scope._entry.OpenBlock`,
which appends an ``OpRecord`` ``(func, args, kwargs, rng, outs)`` to the
block's ``BlockRecord`` (see ``_record.types``); the op list never changes once the
block is closed. The rules a recording keeps (R1..R12) are in ``_record.entry``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from .._base.errors import internal_error
from .._base.ops import _FACTS, facts
from .._base.torch_compat import (
    OpOverload,
    TorchDispatchMode,
    current_dispatch_mode,
    current_graph_task,
    default_dtype,
    in_compiled_code,
    pop_dispatch_mode,
    push_dispatch_mode,
    remove_mode_from_under,
    skip_dynamo,
)
from . import registry as _registry
from .entry import (
    OpenBlock,
    Unrecordable,
    has_tensor,
    note_context,
    note_inner,
    outside,
    rewrapped,
    run_unrecorded,
    unseen,
)
from .registry import _LIVE, register
from .types import NO_KWARGS, BlockOwner, BlockRecord, Frame, Input, OpRecord, Var, new_var

__all__ = [
    "Recorder",
    "add_close_listener",
    "open_block",
    "innermost",
    "close_block",
    "settle",
    "has_open_block",
    "paused",
    "suspended",
    "reinstated",
    "adopt",
]

Tensor = torch.Tensor
_FACTS_GET = _FACTS.get
_LIVE_GET = _LIVE.get
_grad_enabled = torch.is_grad_enabled
# OpRecord(...) runs the NamedTuple's Python __new__; the hot path builds the tuple in C.
_new_tuple = tuple.__new__


def _record_op(self: Recorder, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
    """``Recorder.__torch_dispatch__``: record ``func`` into the innermost open block."""
    blocks = self.blocks
    if self.paused or not blocks or type(func) is not OpOverload:
        return func(*args, **(kwargs or {}))
    block = blocks[-1]
    if block.task != current_graph_task():  # R3 [ backward's ops are not the block's ]
        return func(*args, **(kwargs or {}))
    if not _grad_enabled() and in_compiled_code():
        # a compiled graph stores what it decides (R7 [ compiled code is not recorded ])
        return func(*args, **(kwargs or {}))
    if block.unsettled:
        block.settle()
    f = _FACTS_GET(id(func))
    if f is None:
        f = facts(func)
    frame = block.frame
    if kwargs or not f.fast or not frame.plain:
        return block.run_and_record(func, f, args, kwargs or NO_KWARGS)
    # The hot path (most ops): positional arguments, one Tensor output, fresh or a view
    # (``OpenBlock.refs`` and ``_record.entry._new_var``, inlined: same records).
    if f.context:
        note_context(block)  # R9 [ each op's numeric context ]
    owner = block.owner
    rargs: list[Any] = []
    for a in args:
        if isinstance(a, Tensor):
            e = _LIVE_GET(id(a))
            if e is not None and e.frame.owner is owner and e() is a:
                var: Var = e  # type: ignore[assignment]  # this block's entries are Vars
                t: Tensor = a  # type: ignore[assignment]  # (narrowed by `e() is a`)
                try:
                    same = t._version == var.version
                except RuntimeError:  # an inference tensor: no version counter, never written
                    same = True
                rargs.append(var if same else (unseen(block, var, t) or var))  # R10 [ an unseen write makes an Input ]
            else:
                try:
                    rargs.append(outside(block, a, e))
                except Unrecordable:
                    return run_unrecorded(block, func, f, args, NO_KWARGS)
        elif type(a) is list or type(a) is tuple:
            if has_tensor(a):
                return block.run_and_record(func, f, args, NO_KWARGS)
            rargs.append(a)
        else:
            if (type(a) is float or type(a) is complex) and default_dtype() is not block.context[0]:
                note_context(block)  # R9 [ each op's numeric context ]: type promotion reads the default dtype
            rargs.append(a)
    out = f.kernel(*args)
    ops = block.record.ops
    outs: tuple[Var | None, ...] = ()
    # R8 [ jagged nested tensors are not recorded ]
    if type(out) is Tensor or (isinstance(out, Tensor) and not out.is_nested):
        for a in args:
            if a is out:
                break
        else:
            outs = _hot_var(block, f, frame, out, rargs, len(ops))
    ops.append(_new_tuple(OpRecord, (func, rargs, NO_KWARGS, None, outs)))
    if outs and type(out) is not Tensor and outs[0] is not None:
        note_inner(block, outs[0], out)  # R12 [ wrappers of block tensors are block tensors ]
    return out


def _hot_var(block: OpenBlock, f: Any, frame: Frame, t: Tensor, rargs: list[Any], index: int) -> tuple[Var | None, ...]:
    """``(var,)``: the registered Var of ``t``, the output of the hot path's op ``index``;
    ``(None,)`` if ``t`` is a block tensor already."""
    where = f.view_of
    if where < 0:  # a fresh tensor: its own root, version 0
        root = None
        version = 0
    else:
        e = _LIVE_GET(id(t))
        if e is not None and e() is t:
            return (None,)  # not a new tensor (as _entry._new_var says)
        src = rargs[where] if where < len(rargs) else None
        root = src.root if isinstance(src, (Var, Input)) else None
        try:
            version = t._version
        except RuntimeError:  # inference tensors have no version counter
            version = 0
    v = new_var(t, index, frame, root, version)
    if f.loose and type(root) is Var:
        block.record.loose.setdefault(root, []).append(v)
    register(v)
    return (v,)


class Recorder(TorchDispatchMode):
    """One per thread while a block is open there; records into the innermost block."""

    # Higher-order operators (flex_attention, ...) reach __torch_dispatch__ and
    # run as they are (R2 [ kept ops are not recorded ]).
    supports_higher_order_operators = True

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # Dynamo compiles functions called inside a block (it skips frames under
        # modes that say False); the compiled artifacts' ops pass through
        # (R7 [ compiled code is not recorded ]).
        return True

    def __init__(self) -> None:
        super().__init__()
        self.blocks: list[OpenBlock] = []  # open blocks of this thread, innermost last
        self.paused = 0  # > 0: ops pass through (replay, the library's own ops)


def _install_dispatch() -> None:
    """Give Recorder its ``__torch_dispatch__`` (when the first block opens: telling
    dynamo imports it, which takes seconds). Assigned after the class statement so
    that TorchDispatchMode.__init_subclass__ does not wrap it in
    torch._disable_dynamo (two Python frames per op): dynamo is told to skip the
    function, and everything it calls, by its code object instead."""
    skip_dynamo(_record_op.__code__)
    Recorder.__torch_dispatch__ = _record_op  # type: ignore[method-assign,assignment]


# ---------------------------------------------------------------- per thread

_tls = threading.local()


_close_listeners: list[Callable[[BlockRecord], None]] = []


def add_close_listener(fn: Callable[[BlockRecord], None]) -> Callable[[], None]:
    """Call ``fn(record)`` when a block closes normally (an adapter's clean-up).
    Returns a function that removes it."""
    _close_listeners.append(fn)

    def remove() -> None:
        if fn in _close_listeners:
            _close_listeners.remove(fn)

    return remove


def open_block(record: BlockRecord, owner: BlockOwner, frame: Frame) -> OpenBlock:
    """Start recording ``record`` in this thread (entering the recorder if needed)."""
    r: Recorder | None = getattr(_tls, "recorder", None)
    if r is None:
        if "__torch_dispatch__" not in Recorder.__dict__:
            _install_dispatch()
        r = Recorder()
        r.__enter__()
        _tls.recorder = r
    block = OpenBlock(record, owner, frame, _registry.ledger())
    r.blocks.append(block)
    return block


def innermost() -> OpenBlock | None:
    """The innermost open block of this thread, if it was opened in the current
    backward pass (or outside backward, like now)."""
    r: Recorder | None = getattr(_tls, "recorder", None)
    if r is None or not r.blocks:
        return None
    block = r.blocks[-1]
    return block if block.task == current_graph_task() else None


def close_block(block: OpenBlock, aborted: bool) -> bool:
    """Stop recording ``block`` (the innermost). When it was the thread's last
    open block, exit the recorder; returns False if another TorchDispatchMode
    had been entered above it (the recorder is taken out from under it)."""
    r: Recorder = _tls.recorder
    if not r.blocks or r.blocks[-1] is not block:
        internal_error("close_block was called for a block that is not the innermost")
    r.blocks.pop()
    try:
        block.close(aborted)
        if not aborted:
            for fn in _close_listeners:
                fn(block.record)
    finally:
        if not r.blocks:
            _tls.recorder = None
            if current_dispatch_mode() is r:
                r.__exit__(None, None, None)
            else:
                remove_mode_from_under(r)
                return False
    return True


def adopt(t: Tensor) -> Var | None:
    """R12 [ wrappers of block tensors are block tensors ] for a wrapper autograd saves before
    any op reads it (autograd saves an op's inputs before the op reaches the recorder): its
    Var in this thread's innermost open block, if it wraps that block's tensors; else None."""
    r: Recorder | None = getattr(_tls, "recorder", None)
    if r is None or r.paused or not r.blocks:
        return None
    block = r.blocks[-1]
    if block.task != current_graph_task():  # R3 [ backward's ops are not the block's ]
        return None
    return rewrapped(block, t)


def settle() -> None:
    """R6 [ versions are read after the op ] for every open block of this thread (before a pack
    decides)."""
    r: Recorder | None = getattr(_tls, "recorder", None)
    if r is not None:
        for block in r.blocks:
            if block.unsettled:
                block.settle()


def has_open_block() -> bool:
    r: Recorder | None = getattr(_tls, "recorder", None)
    return r is not None and bool(r.blocks)


class paused:
    """A guard under which this thread's recorder records nothing (replay, internals)."""

    __slots__ = ("_r",)

    def __enter__(self) -> None:
        self._r: Recorder | None = getattr(_tls, "recorder", None)
        if self._r is not None:
            self._r.paused += 1

    def __exit__(self, *exc: Any) -> None:
        if self._r is not None:
            self._r.paused -= 1


class suspended:
    """A guard under which this thread's recorder is off the dispatch-mode stack
    (when it is the innermost mode): ops then run with no Python call per op. A
    block run in its steady state binds its record from a template instead of
    recording (``_adapters.steady``); ``paused`` would still cost a mode call per op."""

    __slots__ = ("_r",)

    def __enter__(self) -> None:
        r: Recorder | None = getattr(_tls, "recorder", None)
        self._r = r if r is not None and current_dispatch_mode() is r else None
        if self._r is not None:
            pop_dispatch_mode()

    def __exit__(self, *exc: Any) -> None:
        if self._r is not None:
            push_dispatch_mode(self._r)


class reinstated:
    """Inside :class:`suspended`: the recorder back on the stack (a block's first
    steady-state run is recorded as usual: its record becomes the template)."""

    __slots__ = ("_r",)

    def __enter__(self) -> None:
        r: Recorder | None = getattr(_tls, "recorder", None)
        self._r = r if r is not None and current_dispatch_mode() is not r else None
        if self._r is not None:
            push_dispatch_mode(self._r)

    def __exit__(self, *exc: Any) -> None:
        if self._r is not None:
            pop_dispatch_mode()
