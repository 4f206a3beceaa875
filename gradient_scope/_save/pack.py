"""Save: what a save becomes -- a handle, the tensor as stored, or whatever the pair below ours makes.

RULES S1..S6: what a save becomes.

S1. A block tensor, or a view of one, saved while our pair applies to its
    block, becomes a :class:`~gradient_scope._restore.handles.Handle` -- unless it must
    be stored: its block's record is released (P7), another member of its
    storage group may be written unseen (P8), or it changed in a way the block
    did not record (its data swapped, or a write after the block).
S2. Anything else goes to the pair below ours, exactly as without the scope.
    With no pair below it is stored as autograd stores it: the tensor itself
    (``saved is t`` when it does not require grad, as without hooks; a later
    ``.data = ...`` is seen), but an output of the node that saves it, or what
    may be one, as a detached alias (holding it would make a reference cycle
    through the graph that the garbage collector cannot free). Its version is
    checked at unpack: hooks switch PyTorch's own in-place check off.
S3. Packing never reads the data of the tensor it packs: some kernels save an
    argument before they write it.
S4. A block tensor its frame's ``store`` decision (a memory budget's plan) picks
    is kept as in S2 -- handed to the pair below ours if there is one, else stored
    -- and its replay state is told, so that replays of other values read it instead
    of recomputing it (``_restore.handles`` P9). A decision to offload is a callable
    that makes the packed object (the budget's offload engine); it applies when no
    pair is below ours, or only a transparent one (a report, which counts and hands
    on), and is kept as above when the callable declines. Listeners hear of what
    is offloaded as of handles.
S5. While a thread runs a block in its steady state (``_adapters.steady``: the
    block's ops run without the recorder), the saves of that run go to the run's
    sequencer, which knows from the block's template what the n-th save is; it
    decides S1..S4 for the block's own tensors (S4 by :func:`kept_by_budget`) and
    hands every other save back to :func:`pack_as_usual`.
S6. A tensor that is not a block's, saved while a model region of this thread is
    open (a model-level budget's forward), is shown to the region's innermost
    observer, which counts it and may offload it under the same condition as S4;
    otherwise S2.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch.autograd.function import BackwardCFunction

from .._base.errors import inplace_error, internal_error
from .._base.torch_compat import HookPair, node_sequence_nr, sequence_nr, without_python_dispatch
from .._record import recorder as _recorder
from .._record.registry import Entry, lookup
from .._record.types import Input, Var, ViewSpec, moved

__all__ = [
    "pack",
    "pack_as_usual",
    "kept_by_budget",
    "unpack",
    "add_pack_listener",
    "notify_listeners",
    "may_be_new_output",
    "Stored",
    "Foreign",
    "Sequencer",
    "sequencing",
    "new_handle",
    "store_as_usual",
    "open_region",
    "close_region",
    "regions_open",
]

Tensor = torch.Tensor

_listeners: list[Callable[[Tensor, Any], None]] = []


def add_pack_listener(fn: Callable[[Tensor, Any], None]) -> Callable[[], None]:
    """Call ``fn(tensor, handle)`` each time a save becomes a recompute handle.
    Returns a function that removes the listener."""
    _listeners.append(fn)

    def remove() -> None:
        if fn in _listeners:
            _listeners.remove(fn)

    return remove


def notify_listeners(t: Tensor, h: Any) -> None:
    """Tell the pack listeners that ``t`` became handle ``h``."""
    for fn in _listeners:
        fn(t, h)


class Sequencer(Protocol):
    """The saves of a steady-state run (S5)."""

    def pack(self, below: HookPair | None, serial: int, t: Tensor) -> Any:
        """What ``t``, the next save of the run, becomes."""


_tls = threading.local()


class sequencing:
    """While active, this thread's saves go to ``seq`` (S5); restores what was there."""

    __slots__ = ("seq", "prior")

    def __init__(self, seq: Sequencer) -> None:
        self.seq = seq

    def __enter__(self) -> None:
        self.prior = getattr(_tls, "seq", None)
        _tls.seq = self.seq

    def __exit__(self, *exc: object) -> None:
        _tls.seq = self.prior


_regions = threading.local()  # .stack: this thread's open regions' observers (S6)


def open_region(observer: Callable[[Tensor, bool], Any]) -> None:
    """A model region opens in this thread: ``observer(t, may_take)`` sees each tensor
    that is not a block's saved from now on until :func:`close_region`, and returns
    what it packs it into (it offloads it; only when ``may_take``) or None (S6)."""
    stack = getattr(_regions, "stack", None)
    if stack is None:
        stack = _regions.stack = []
    stack.append(observer)


def close_region(observer: Callable[[Tensor, bool], Any]) -> None:
    """The region of ``observer`` closes (regions may close out of order)."""
    stack = getattr(_regions, "stack", None) or []
    for i in range(len(stack) - 1, -1, -1):
        if stack[i] is observer:
            del stack[i]
            return


def regions_open() -> bool:
    """Whether this thread has an open model region (our pair stays on its stack, I1)."""
    return bool(getattr(_regions, "stack", None))


def _may_take(below: HookPair | None) -> bool:
    """S4, S6: a budget may offload only with no pair below ours, or a transparent one."""
    return below is None or bool(getattr(below[0], "transparent", False))


def may_be_new_output(t: Tensor) -> bool:
    """Whether ``t``, being saved, may be an output of the autograd node saving it.
    Autograd keeps a saved input itself (so it sees a later ``.data = ...``) and a
    saved output as a shallow copy (holding it would be a reference cycle through
    its own node); whoever keeps a saved tensor for autograd does the same, and
    takes a shallow copy whenever this says "may be". Exact for leaves (never an
    output) and for built-in ops (each node's saves are packed after the node is
    made and before the next one is); a custom Function's saves are packed after
    its forward, which may have made other nodes, so any custom Function output
    may be one."""
    g = t.grad_fn
    if g is None:
        return False
    return node_sequence_nr(g) == sequence_nr() - 1 or isinstance(g, BackwardCFunction)


def _handle(entry: Entry, t: Tensor, view: ViewSpec | None) -> Any:
    """A handle for ``t`` (a block tensor, or ``view`` of one), or None to store it (S1)."""
    var: Var = entry  # type: ignore[assignment]  # only Vars are registered
    root = var.root
    if isinstance(root, Input):
        return None  # a view of an outside tensor: storing it costs nothing extra
    owner = var.frame.owner
    if owner is None:
        internal_error("a registered block tensor has no replay state")
    record = owner.record
    if record is None:
        return None  # released (P7): the block cannot be replayed any more
    if root in record.escaped:
        return None  # another member may be written after the block unseen (P8)
    base = t if view is None else t._base
    if base is not None and moved(var, base):
        return None  # its data was swapped after the block (`.data = ...`)
    v = t._version
    writes = root.writes
    if v != (writes[-1][1] if writes else var.version):
        return None  # changed by something the block did not record (e.g. after it)
    new_output = may_be_new_output(t)
    # debug=True compares the value at unpack with what autograd itself would hand back.
    check = None
    if var.frame.debug and var not in record.scratch:
        check = t.detach() if new_output else t
    return new_handle(owner, var.frame.stats, var, t, v, view, check, view is None and not new_output)


def new_handle(
    owner: Any, stats: Any, var: Var, t: Tensor, version: int, view: ViewSpec | None, check: Any, itself: bool
) -> Any:
    """S1: the handle ``owner`` (the block's replay state) makes for ``t`` (``var``'s tensor
    or ``view`` of it), counted in ``stats`` and told to the pack listeners."""
    h = owner.new_handle(var, version, view, check, itself)
    stats.tensors_packed += 1
    stats.bytes_packed += t.numel() * t.element_size()
    if _listeners:
        notify_listeners(t, h)
    return h


def store_as_usual(below: HookPair | None, t: Tensor, made_by_block: bool) -> Any:
    """S2: ``t`` to the pair below ours, or stored as autograd stores it."""
    if below is not None:
        return Foreign(below[1], below[0](t))
    return Stored(t, made_by_block)


class Stored:
    """A tensor kept as autograd would keep it, with its version (S2)."""

    __slots__ = ("t", "version")

    def __init__(self, t: Tensor, made_by_block: bool) -> None:
        self.version = t._version
        # A block tensor (or a view of one) is never kept itself: its liveness is what
        # tells the block which of its tensors are still in memory (P3, P8).
        if not t.requires_grad or not (made_by_block or may_be_new_output(t)):
            self.t = t
        elif type(t) is Tensor or type(t) is torch.nn.Parameter:
            with without_python_dispatch():  # no mode needs to see this detach
                self.t = t.detach()
        else:
            with _recorder.paused():  # a subclass must see its detach; no block records it
                self.t = t.detach()

    def unpack(self) -> Tensor:
        t = self.t
        if t._version != self.version:
            raise inplace_error(f"{t.type()} {list(t.shape)}", self.version, t._version)
        return t


class Foreign:
    """What the pair below ours made of a tensor."""

    __slots__ = ("unpack_fn", "packed")

    def __init__(self, unpack_fn: Callable[[Any], Tensor], packed: Any) -> None:
        self.unpack_fn = unpack_fn
        self.packed = packed

    def unpack(self) -> Tensor:
        return self.unpack_fn(self.packed)


def pack(below: HookPair | None, serial: int, t: Tensor) -> Any:
    """Pack ``t`` for our pair: ``below`` is the pair under it; with one, only
    tensors of blocks with serial >= ``serial`` are ours (innermost wins)."""
    seq = getattr(_tls, "seq", None)
    if seq is not None:  # S5
        return seq.pack(below, serial, t)
    return pack_as_usual(below, serial, t)


def pack_as_usual(below: HookPair | None, serial: int, t: Tensor) -> Any:
    """S1..S4 for ``t``, found by the registry."""
    entry = lookup(t)
    view = None
    made_by_block = entry is not None
    if entry is None:
        base = t._base
        if base is not None:
            entry = lookup(base)
            if entry is not None:
                made_by_block = True
                view = ViewSpec.of(t, base)
                if view is None:
                    entry = None
    if entry is not None and (below is None or entry.frame.serial >= serial):
        _recorder.settle()
        frame = entry.frame
        if frame.store is not None:
            decision = frame.store(entry, t)
            if decision:
                return kept_by_budget(decision, entry, t, view is None, below, frame.owner)  # S4
        h = _handle(entry, t, view)  # S1
        if h is not None:
            return h
    stack = getattr(_regions, "stack", None)
    if stack and entry is None:
        packed = stack[-1](t, _may_take(below))  # S6
        if packed is not None:
            if _listeners:
                notify_listeners(t, packed)
            return packed
    return store_as_usual(below, t, made_by_block)


def kept_by_budget(decision: Any, entry: Any, t: Tensor, whole: bool, below: HookPair | None, owner: Any) -> Any:
    """S4: what a block tensor its budget keeps or offloads becomes (``entry``: its Var;
    ``whole``: ``t`` is the Var's tensor, not a view of it; ``owner``: the block's replay
    state)."""
    if decision is not True and _may_take(below):
        packed = decision(entry, t)
        if packed is not None:
            if owner is not None:
                owner.note_stored(entry, packed)  # the block lives while it does (P9)
            for fn in _listeners:
                fn(t, packed)
            return packed
    if below is not None:
        if whole and owner is not None:
            owner.note_stored(entry, t)
        return Foreign(below[1], below[0](t))
    stored = Stored(t, True)
    if whole and owner is not None:
        owner.note_stored(entry, stored.t)
    return stored


def unpack(packed: Any) -> Tensor:
    return packed.unpack()  # type: ignore[no-any-return]
