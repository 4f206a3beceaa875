"""Save: what a save becomes -- a handle, the tensor as stored, or whatever the pair below ours makes.

RULES S1..S6: what a save becomes.

S1. [ block tensors become handles ] A block tensor, or a view of one, saved while our
    pair applies to its block, becomes a
    :class:`~gradient_scope._restore.handles.Handle` -- unless it must be stored: its
    block's record is released (P7 [ the record lives with its handles ]), another
    member of its storage group may be written unseen
    (P8 [ groups of separate counters ]), it changed in a way the block did not
    record (its data swapped, or a write after the block), or it is saved after its
    block closed and its replay would run a collective (tensor parallelism: the next
    block's or the loss's save of a block output is kept, as ``torch.utils.checkpoint``
    keeps its output, and no rank replays a collective for it; ``_restore.handles``
    P11 [ a replay that communicates reads no liveness ]).
S2. [ anything else as without the scope ] Anything else goes to the pair below ours,
    exactly as without the scope (its pack is not recorded: it is not the block's
    computation). With no pair below it is stored as autograd stores it: the tensor
    itself (``saved is t`` when it does not require grad, as without hooks; a later
    ``.data = ...`` is seen), but an output of the node that saves it, or what may be
    one, as a detached alias (holding it would make a reference cycle through the graph
    that the garbage collector cannot free). Its version is checked at unpack: hooks
    switch PyTorch's own in-place check off.
S3. [ packing reads no data ] Packing never reads the data of the tensor it packs: some
    kernels save an argument before they write it.
S4. [ a budget's choice is stored ] A block tensor that could be a handle
    (S1 [ block tensors become handles ]) and that its frame's ``store`` decision (a
    memory budget's plan) picks is stored exactly as in
    S2 [ anything else as without the scope ] (the pair below ours gets it, where there
    is one), and served as its handle would be: the tensor itself where autograd would
    keep it and its data was swapped (``.data = ...``), PyTorch's in-place error where
    the tensor itself was written, a replay of the value as saved where the stored copy
    was written after the save and the tensor is gone (``_restore.handles``
    P9 [ stored values serve replays ]). A plan changes what is kept, never what a
    program computes or raises. Its replay state is told, so that replays of other
    values read it instead of recomputing it (P9 [ stored values serve replays ]). A
    decision to offload is a callable that makes the packed object (the budget's offload
    engine, which checks versions as a handle does); it applies when no pair is below
    ours, or only a transparent one (a report, which counts and hands on), and the value
    is stored as above when the callable declines. Listeners hear of what is offloaded
    as of handles. With ``debug=True`` the plan is not followed: every value is a
    checked handle (``check`` keeps the saved tensor, so memory is what storing it would
    hold).
S5. [ a steady run's saves go to its sequencer ] While a thread runs a block in its
    steady state (``_adapters.steady``: the block's ops run without the recorder), the
    saves of that run go to the run's sequencer, which knows from the block's template
    what the n-th save is; it decides S1..S4 for the block's own tensors
    (S4 [ a budget's choice is stored ] by :func:`store_chosen`) and hands every other
    save back to :func:`pack_as_usual`.
S6. [ a region's saves go to its observer ] A tensor that is not a block's, saved while
    a model region of this thread is open (a model-level budget's forward), is shown to
    the region's innermost observer, which counts it and may offload it under the same
    condition as S4 [ a budget's choice is stored ]; otherwise
    S2 [ anything else as without the scope ].
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch.autograd.function import BackwardCFunction

from .._base.errors import inplace_error, internal_error
from .._base.subclass import is_wrapper
from .._base.torch_compat import HookPair, node_sequence_nr, sequence_nr, without_python_dispatch
from .._record import recorder as _recorder
from .._record.registry import Entry, lookup
from .._record.types import Input, Var, ViewSpec, moved

__all__ = [
    "pack",
    "pack_as_usual",
    "find",
    "replayable",
    "store_chosen",
    "unpack",
    "add_pack_listener",
    "add_store_listener",
    "notify_listeners",
    "may_be_new_output",
    "Stored",
    "Kept",
    "Foreign",
    "Sequencer",
    "sequencing",
    "new_handle",
    "store_as_usual",
    "open_region",
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


_store_listeners: list[Callable[[Tensor, Any], None]] = []


def add_store_listener(fn: Callable[[Tensor, Any], None]) -> Callable[[], None]:
    """Call ``fn(tensor, owner)`` each time a budget's plan stores a block tensor
    (S4 [ a budget's choice is stored ]): ``owner`` is its block's replay state. Returns a
    function that removes it."""
    _store_listeners.append(fn)

    def remove() -> None:
        if fn in _store_listeners:
            _store_listeners.remove(fn)

    return remove


def notify_listeners(t: Tensor, h: Any) -> None:
    """Tell the pack listeners that ``t`` became handle ``h``."""
    for fn in _listeners:
        fn(t, h)


class Sequencer(Protocol):
    """The saves of a steady-state run (S5 [ a steady run's saves go to its sequencer ])."""

    def pack(self, below: HookPair | None, serial: int, t: Tensor) -> Any:
        """What ``t``, the next save of the run, becomes."""


_tls = threading.local()


class sequencing:
    """While active, this thread's saves go to ``seq``
    (S5 [ a steady run's saves go to its sequencer ]); restores what was there."""

    __slots__ = ("seq", "prior")

    def __init__(self, seq: Sequencer) -> None:
        self.seq = seq

    def __enter__(self) -> None:
        self.prior = getattr(_tls, "seq", None)
        _tls.seq = self.seq

    def __exit__(self, *exc: object) -> None:
        _tls.seq = self.prior


# .stack: this thread's open regions' observers (S6 [ a region's saves go to its observer ])
_regions = threading.local()


def open_region(observer: Callable[[Tensor, bool], Any]) -> Callable[[], None]:
    """A model region opens in this thread: ``observer(t, may_take)`` sees each tensor
    that is not a block's saved from now on until the returned function closes the
    region, and returns what it packs it into (it offloads it; only when ``may_take``)
    or None (S6 [ a region's saves go to its observer ]). Regions may close out of order."""
    stack = getattr(_regions, "stack", None)
    if stack is None:
        stack = _regions.stack = []
    stack.append(observer)

    def close() -> None:
        for i in range(len(stack) - 1, -1, -1):
            if stack[i] is observer:
                del stack[i]
                return

    return close


def regions_open() -> bool:
    """Whether this thread has an open model region (our pair stays on its stack,
    I1 [ one pair of ours while needed ])."""
    return bool(getattr(_regions, "stack", None))


def _may_take(below: HookPair | None) -> bool:
    """S4 [ a budget's choice is stored ], S6 [ a region's saves go to its observer ]: a budget
    may offload only with no pair below ours, or a transparent one."""
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


def find(t: Tensor) -> tuple[Entry | None, ViewSpec | None, bool]:
    """What the registry says of ``t``, being saved: its entry (a block's Var), or that of
    its base with ``t``'s view of it; and whether a block made ``t`` or its base (a view
    that cannot be rebuilt has no entry, but was made by a block). The first question of
    every save, in both of a block's ways to run (S1 [ block tensors become handles ],
    S5 [ a steady run's saves go to its sequencer ])."""
    entry = lookup(t)
    if entry is not None:
        return entry, None, True
    if type(t) is not Tensor and not t.is_nested and is_wrapper(t):
        var = _recorder.adopt(t)  # R12 [ wrappers of block tensors are block tensors ]
        if var is not None:
            return var, None, True
    base = t._base
    if base is None:
        return None, None, False
    entry = lookup(base)
    if entry is None:
        return None, None, False
    view = ViewSpec.of(t, base)
    if view is None:
        return None, None, True
    return entry, view, True


def replayable(entry: Entry, t: Tensor, view: ViewSpec | None) -> Var | None:
    """``t``'s Var if a replay rebuilds ``t`` (a block tensor, or ``view`` of one) as
    autograd saves it now, else None: it must be stored (S1 [ block tensors become handles ]).
    The one classifier of a block tensor's save: a recorded run's pack asks it per save, a
    template's first run per save of the template (``_save.sequencer``)."""
    var: Var = entry  # type: ignore[assignment]  # only Vars are registered
    root = var.root
    if isinstance(root, Input):
        return None  # a view of an outside tensor: storing it costs nothing extra
    owner = var.frame.owner
    if owner is None:
        internal_error("a registered block tensor has no replay state")
    record = owner.record
    if record is None:
        return None  # released (P7 [ the record lives with its handles ]): the block cannot be replayed any more
    if root in record.escaped:
        return None  # another member may be written after the block unseen (P8 [ groups of separate counters ])
    base = t if view is None else t._base
    if base is not None and moved(var, base):
        return None  # its data was swapped after the block (`.data = ...`)
    writes = root.writes
    if t._version != (writes[-1][1] if writes else var.version):
        return None  # changed by something the block did not record (e.g. after it)
    if owner.replay_communicates(var):
        return None  # saved after its block, and its replay would run a collective: kept, as checkpoint keeps it
    return var


def _handle(var: Var, t: Tensor, view: ViewSpec | None) -> Any:
    """S1 [ block tensors become handles ]: a handle for ``t``, ``var``'s tensor or ``view`` of
    it."""
    owner = var.frame.owner
    new_output = may_be_new_output(t)
    # debug=True compares the value at unpack with what autograd itself would hand back.
    check = None
    if var.frame.debug and var not in owner.record.scratch:
        check = t.detach() if new_output else t
    return new_handle(owner, var.frame.stats, var, t, t._version, view, check, view is None and not new_output)


def new_handle(
    owner: Any, stats: Any, var: Var, t: Tensor, version: int, view: ViewSpec | None, check: Any, itself: bool
) -> Any:
    """S1 [ block tensors become handles ]: the handle ``owner`` (the block's replay state)
    makes for ``t`` (``var``'s tensor or ``view`` of it), counted in ``stats`` and told to the
    pack listeners."""
    h = owner.new_handle(var, version, view, check, itself)
    stats.tensors_packed += 1
    stats.bytes_packed += t.numel() * t.element_size()
    if _listeners:
        notify_listeners(t, h)
    return h


def store_chosen(
    decision: Any,
    owner: Any,
    var: Var,
    t: Tensor,
    view: ViewSpec | None,
    below: HookPair | None,
    version: int | None = None,
) -> Any:
    """S4 [ a budget's choice is stored ]: ``t`` (``var``'s tensor or ``view`` of it) as its
    frame's ``store`` ``decision`` chose: offloaded, or stored as
    S2 [ anything else as without the scope ] stores it. ``owner``, its block's replay state,
    lives while it does and reads a stored value instead of recomputing it
    (P9 [ stored values serve replays ]). ``version``: what a replay of it is checked against
    (P2 [ a handle is its tensor as saved ]; default ``t``'s)."""
    if decision is not True and _may_take(below):
        packed = decision(var, t)
        if packed is not None:
            owner.note_kept(packed)  # replays do not read it: it has no ``alias``
            for fn in _listeners:
                fn(t, packed)
            return packed
    inner = _below(below, t) if below is not None else Stored(t, True, alias=True)
    kept = Kept(inner, owner, var, t, view, t._version if version is None else version)
    owner.note_kept(kept)
    for fn in _store_listeners:
        fn(t, owner)
    return kept


def store_as_usual(below: HookPair | None, t: Tensor, made_by_block: bool) -> Any:
    """S2 [ anything else as without the scope ]: ``t`` to the pair below ours, or stored as
    autograd stores it."""
    if below is not None:
        return _below(below, t)
    return Stored(t, made_by_block)


def _below(below: HookPair, t: Tensor) -> Foreign:
    """What the pair below ours makes of ``t`` (S2 [ anything else as without the scope ]). Its
    pack runs unrecorded: what it computes (a copy to the host, a detach) is not the block's
    computation, and a tensor it made would count as a live block tensor."""
    with _recorder.paused():
        packed = below[0](t)
    return Foreign(below[1], packed)


class Stored:
    """A tensor kept as autograd would keep it, with its version
    (S2 [ anything else as without the scope ])."""

    __slots__ = ("t", "version")

    def __init__(self, t: Tensor, made_by_block: bool, alias: bool = False) -> None:
        self.version = t._version
        # A block tensor (or a view of one) that requires grad is never kept itself:
        # its liveness is what tells the block which of its tensors are still in
        # memory (P3 [ values in memory are used ], P8 [ groups of separate counters ]).
        # ``alias``: not even one that does not (S4 [ a budget's choice is stored ]).
        if not alias and (not t.requires_grad or not (made_by_block or may_be_new_output(t))):
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


class Kept:
    """A block tensor a budget's plan stores (S4 [ a budget's choice is stored ]): ``inner``
    keeps it as S2 [ anything else as without the scope ] would (a :class:`Stored`, or a
    :class:`Foreign` made by the pair below ours), and it is served as its handle would be.
    ``owner``: its block's replay state."""

    __slots__ = ("inner", "alias", "owner", "var", "version", "replay_version", "view", "itself", "__weakref__")

    def __init__(
        self, inner: Stored | Foreign, owner: Any, var: Var, t: Tensor, view: ViewSpec | None, replay_version: int
    ) -> None:
        self.inner = inner
        # P9 [ stored values serve replays ]: what replays may read
        self.alias = inner.t if type(inner) is Stored else None
        self.owner = owner
        self.var = var
        self.version = t._version
        self.replay_version = replay_version
        self.view = view
        self.itself = view is None and not may_be_new_output(t)  # autograd would keep t itself

    def unpack(self) -> Tensor:
        var, owner = self.var, self.owner
        t: Tensor | None = var()
        if t is not None and t._version != self.version:  # as a handle does (P3 [ values in memory are used ])
            raise inplace_error(f"{t.type()} {list(t.shape)}", self.version, t._version)
        owner.touched()
        if t is not None and self.itself and moved(var, t):
            with _recorder.paused():  # autograd's saved input sees the swap (`.data = ...`)
                return t.detach()
        alias = self.alias
        if alias is not None and alias._version != self.version:
            # Written by a consumer of this backward pass, or nothing left to replay it
            # from (its block kept every value and was released,
            # P9 [ stored values serve replays ]): as without hooks.
            if owner.handed_out(var) or owner.record is None:
                raise inplace_error(var.describe(), self.version, alias._version)
            value: Tensor = owner.replay_saved(var, self.replay_version, self.view)
            return value
        if alias is not None:
            owner.hand_out(var)
        return self.inner.unpack()


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
    if seq is not None:  # S5 [ a steady run's saves go to its sequencer ]
        return seq.pack(below, serial, t)
    return pack_as_usual(below, serial, t)


def pack_as_usual(below: HookPair | None, serial: int, t: Tensor) -> Any:
    """S1..S4 for ``t``, found by the registry."""
    entry, view, made_by_block = find(t)
    if entry is not None and (below is None or entry.frame.serial >= serial):
        _recorder.settle()
        frame = entry.frame
        # asked for every save (M3 [ a plan follows its structure ])
        store = frame.store(entry, t) if frame.store is not None else False
        var = replayable(entry, t, view)
        if var is not None:
            if store and not frame.debug:
                return store_chosen(store, frame.owner, var, t, view, below)  # S4 [ a budget's choice is stored ]
            return _handle(var, t, view)  # S1 [ block tensors become handles ]
    stack = getattr(_regions, "stack", None)
    if stack and entry is None:
        packed = stack[-1](t, _may_take(below))  # S6 [ a region's saves go to its observer ]
        if packed is not None:
            if _listeners:
                notify_listeners(t, packed)
            return packed
    return store_as_usual(below, t, made_by_block)


def unpack(packed: Any) -> Tensor:
    return packed.unpack()  # type: ignore[no-any-return]
