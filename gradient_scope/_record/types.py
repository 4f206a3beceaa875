"""The record of a block: the types a recording is made of and replay reads.

Only ``_record`` creates and writes these objects: the recorder (``_record.recorder``,
through ``_record.entry``) for a recorded block, the binder (``_record.bind``) for a block
run in its steady state, from its template (``_record.template``). The save path
(``_save``) and replay (``_restore.handles``, ``_restore.replay``) read them.
In a record:

* each op is an :class:`OpRecord` ``(func, args, kwargs, rng, outs)``;

* a tensor the block made is a :class:`Var` (metadata only, never the tensor);
* a tensor from outside is an :class:`Input`, a history-free alias that keeps
  its value alive with the version it was read at;
* an argument of which the op reads only metadata (``empty_like(x)``) is a
  :class:`MetaArg`;
* an in-place write is an entry ``(op index, version after)`` in the
  ``writes`` of the storage group it writes to (a fresh tensor and its views
  form one group; its root is the fresh tensor's Var, or an Input); ``None``
  as the version marks a write that cannot be replayed (a collective's);
* a view of a block tensor taken after the block, saved, is a :class:`ViewSpec`.

A frame's ``owner`` (:class:`BlockOwner`) is its block's replay state: what the
save path asks for a handle.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import torch

from .._base.stats import ScopeStats
from .._base.subclass import own_storage
from .._base.torch_compat import NumericContext, alias_in_dispatch, neg_view, set_version
from ..policies import ContextPolicy
from .registry import Entry, Ledger, tensor_of

__all__ = [
    "Var",
    "Input",
    "MetaArg",
    "Frame",
    "BlockRecord",
    "OpRecord",
    "BlockOwner",
    "ViewSpec",
    "Group",
    "Ref",
    "Write",
    "NO_KWARGS",
    "new_var",
    "template_var",
    "data_ptr",
    "moved",
    "live_value",
]

Tensor = torch.Tensor
Write = tuple[int, int | None]  # (op index, version after; None: not replayable)
NO_KWARGS: dict[str, Any] = {}  # the kwargs of most records: shared, never written


class Var(Entry):
    """A tensor the block made: where it came from and what it looked like. It is
    also the tensor's registry entry (a weak reference to it): one object per op.
    Made by :func:`new_var` (a template's copy: :func:`template_var`)."""

    __slots__ = ("op", "size", "dtype", "device", "version", "ptr", "base", "writes")

    op: int  # index of the op that made it
    size: Any  # torch.Size; None for a jagged nested tensor (a fresh symbolic size each time)
    dtype: torch.dtype
    device: torch.device
    version: int
    ptr: int | None  # where its data is: `.data = ...` or set_() later moves it
    # The group's root, when not this Var itself (a Var must not refer to itself: a
    # reference cycle would leave its block to the garbage collector).
    base: Group | None
    writes: list[Write] | tuple[()]  # on roots: the block's writes to the group

    @property
    def root(self) -> Group:
        """The root of this Var's storage group (itself for a fresh tensor)."""
        return self if self.base is None else self.base

    def describe(self) -> str:
        shape = "nested" if self.size is None else str(list(self.size))
        return f"tensor of shape {shape} ({self.dtype}, {self.device})"


def new_var(t: Tensor, op: int, frame: Frame, root: Group | None, version: int) -> Var:
    """The Var of ``t``, made by op ``op`` (registered separately: ``_record.registry.register``)."""
    v = Var(t)
    v.key = id(t)
    v.frame = frame
    v.aliases = None
    v.op = op
    v.size = t.shape if type(t) is Tensor or not t.is_nested else None
    v.dtype = t.dtype
    v.device = t.device
    v.version = version
    if type(t) is Tensor:
        try:
            v.ptr = t.data_ptr()
        except RuntimeError:  # no storage (sparse)
            v.ptr = None
    else:
        v.ptr = None
    v.base = root
    v.writes = ()
    return v


def template_var(v: Var, anchor: Tensor, frame: Frame) -> Var:
    """A copy of ``v`` for a template (``_record.template``): its metadata, a weak reference to
    ``anchor`` instead of a tensor, ``frame`` instead of the run's, no data pointer; its
    ``base`` set by the caller once every copy exists."""
    c = Var(anchor)
    c.key, c.frame, c.aliases = 0, frame, None
    c.op, c.size, c.dtype, c.device, c.version, c.ptr = v.op, v.size, v.dtype, v.device, v.version, None
    c.base = None
    c.writes = list(v.writes) if v.writes else ()
    return c


def data_ptr(t: Tensor) -> int | None:
    """``t.data_ptr()`` of a plain strided tensor; None where there is none (sparse,
    subclasses)."""
    if type(t) is not Tensor:
        return None
    try:
        return t.data_ptr()
    except RuntimeError:
        return None


def moved(var: Var, t: Tensor) -> bool:
    """Whether ``t`` (the tensor ``var`` stands for) no longer holds the data the
    block made: its storage was swapped (`.data = ...`, ``set_()``)."""
    return var.ptr is not None and data_ptr(t) != var.ptr


def live_value(var: Var) -> Tensor | None:
    """The tensor ``var`` stands for, if alive and unchanged (an inference tensor,
    which has no version counter, is recomputed instead)."""
    t = tensor_of(var)
    if t is not None and not t.is_inference() and t._version == var.version and not moved(var, t):
        return t
    return None


class Input:
    """A tensor from outside the block, kept alive with the version it was read at.

    ``tensor`` is a detached alias (same storage and version counter, no history:
    holding the tensor itself could close a reference cycle through the autograd
    graph, which the garbage collector cannot see). ``snapshot``: ``tensor`` is a
    private copy (R1 [ a written input is copied ], or an inference tensor, which has no version
    counter).
    """

    __slots__ = ("tensor", "source", "version", "snapshot", "writes", "storage")

    def __init__(self, t: Tensor) -> None:
        self.tensor = alias_in_dispatch(t)
        self.source = weakref.ref(t)
        # A wrapper subclass whose alias has a storage of its own: the storage the
        # source had when read (a swap is a change of it); else None.
        self.storage = own_storage(t)
        self.snapshot = False
        self.writes: list[Write] | tuple[()] = ()
        self.version: int | None
        try:
            self.version = t._version
        except RuntimeError:  # an inference tensor: copy its value now
            self.version = None
            self.take_snapshot()

    def take_snapshot(self) -> None:
        self.tensor = self.tensor.detach().clone(memory_format=torch.preserve_format)
        self.snapshot = True

    @property
    def root(self) -> Input:
        return self


Group = Var | Input
Ref = Var | Input


class MetaArg:
    """An argument of which the op reads only metadata: replay passes a fresh
    uninitialised tensor like it instead of the tensor."""

    __slots__ = ("size", "stride", "dtype", "device")

    def __init__(self, t: Tensor) -> None:
        self.size, self.stride, self.dtype, self.device = t.shape, t.stride(), t.dtype, t.device

    def empty(self) -> Tensor:
        return torch.empty_strided(self.size, self.stride, dtype=self.dtype, device=self.device)


class OpRecord(NamedTuple):
    """One recorded op. ``args`` and ``kwargs`` hold Refs, MetaArgs and plain values
    (lists of them for ``Tensor[]``)."""

    func: Any  # the OpOverload
    args: list[Any]
    kwargs: dict[str, Any]
    rng: Any  # (generator, state) it drew from (``_base.rng.capture``), or None
    outs: tuple[Var | None, ...]  # one Var per new tensor output, None for the others


class ViewSpec:
    """A view of a block tensor taken after the block, rebuilt on the replayed base
    from its storage layout, dtype and conj/neg bits (``as_strided`` alone would
    lose the bits and cannot change the dtype)."""

    __slots__ = ("dtype", "size", "stride", "delta", "conj", "neg")

    def __init__(self, view: Tensor, base: Tensor) -> None:
        self.dtype = view.dtype
        self.size = view.size()
        self.stride = view.stride()
        # Offset from the base's first element, in bytes (dtypes may differ).
        self.delta = view.storage_offset() * view.element_size() - base.storage_offset() * base.element_size()
        self.conj = view.is_conj()
        self.neg = view.is_neg()

    @staticmethod
    def of(view: Tensor, base: Tensor) -> ViewSpec | None:
        """The spec of ``view`` (a view of ``base``), or None if it cannot be rebuilt."""
        if type(view) is not Tensor or view.layout != torch.strided or base.layout != torch.strided:
            return None
        return ViewSpec(view, base)

    def apply(self, base: Tensor) -> Tensor:
        """The view on ``base``: a tensor that shares its version counter
        (P4 [ each op at most once per pass ] in ``_restore.handles``: a consumer's write
        through it must be seen), but is no autograd view of it; for a dtype view, or a base
        with conj/neg bits, a copy of the storage (the same layout: kernels' bits may depend on
        it)."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        offset = (base.storage_offset() * base.element_size() + self.delta) // itemsize
        if self.dtype == base.dtype and not base.is_conj() and not base.is_neg():
            version = base._version
            v = base.detach()
            v.set_(base.untyped_storage(), offset, self.size, self.stride)
            set_version(v, version)  # set_ bumped the counter it shares with base
        else:
            v = torch.empty(0, dtype=self.dtype, device=base.device)
            v.set_(base.untyped_storage().clone(), offset, self.size, self.stride)
        if self.conj:
            v = v.conj()
        if self.neg:
            v = neg_view(v)
        return v


class BlockOwner(Protocol):
    """What a frame's owner (its block's replay state, ``_restore.handles.ReplayState``)
    provides to the save path (``_save.pack``)."""

    #: The block's record; None once released (P7 [ the record lives with its handles ] in
    #: ``_restore.handles``).
    record: BlockRecord | None

    def new_handle(self, var: Var, version: int, view: ViewSpec | None, check: Tensor | None, itself: bool) -> Any:
        """A pending handle of this block standing for ``var`` saved at ``version``."""

    def note_kept(self, kept: Any) -> None:
        """``kept`` (held by autograd) stores one of the block's values for a budget, or
        is what it was offloaded into (S4 [ a budget's choice is stored ])."""

    def touched(self) -> None:
        """A value of the block is being unpacked."""

    def replay_saved(self, var: Var, version: int, view: ViewSpec | None) -> Tensor:
        """``var``'s value as saved at ``version`` (``view`` of it), replayed."""

    def hand_out(self, var: Var) -> None:
        """A stored value of ``var`` is handed to the current backward pass."""

    def handed_out(self, var: Var) -> bool:
        """Whether the current backward pass was handed a stored value of ``var``."""


class Frame:
    """The options and counters of one scope recording into a block (nested
    scopes record into the enclosing block, each with its own frame)."""

    __slots__ = (
        "preserve_rng",
        "save",
        "debug",
        "stats",
        "serial",
        "plain",
        "owner",
        "ledger",
        "site",
        "_kept",
        "store",
        "contextual",
        "kept_any",
    )

    def __init__(
        self,
        preserve_rng: bool,
        save: Callable[[Any], bool] | None,
        debug: bool,
        stats: ScopeStats,
        serial: int,
        store: Callable[[Var, Tensor], bool] | None = None,
    ) -> None:
        self.preserve_rng = preserve_rng
        # A budget's decision (``_budget.budget`` M1 [ a block's plan decides each save ]):
        # asked by the pack hook whether to store a saved tensor of this frame instead of making
        # a handle (``_save.pack`` S4 [ a budget's choice is stored ]).
        self.store = store
        self.save = save
        self.debug = debug
        self.stats = stats
        self.serial = serial
        self.plain = save is None and not debug  # the hot path applies
        # Set when the frame starts recording: the block's replay state (its tensors'
        # registry entries reach it here) and the recording thread's ledger.
        self.owner: BlockOwner | None = None
        self.ledger: Ledger | None = None
        self.site: Any = None  # where the scope was entered (``_base.errors.Site``), for errors
        self._kept: dict[Any, bool] = {}
        # The policy takes an OpContext (``policies.ContextPolicy``): asked per op call,
        # after the op has run (``_record.entry``), never through ``keeps``.
        self.contextual = isinstance(save, ContextPolicy)
        self.kept_any = False  # on a block's outermost frame: some frame of the block kept an op

    def keeps(self, func: Any) -> bool | None:
        """Whether the ``save=`` policy stores ``func``'s outputs (asked once per op);
        None for a context policy (asked per call, once the op has run)."""
        kept = self._kept.get(func)
        if kept is None:
            if self.contextual:
                return None
            kept = self._kept[func] = bool(self.save(func))  # type: ignore[misc]
        return kept


class BlockRecord:
    """The record of one block. ``ops`` only grows while ``open``; then never changes."""

    __slots__ = (
        "ops",
        "open",
        "contexts",
        "debug_values",
        "scratch",
        "loose",
        "escaped",
        "signature",
        "registered",
        "renamed",
        "__weakref__",
    )

    def __init__(self) -> None:
        self.ops: list[OpRecord] = []
        self.open = True
        # Its signature and slots once closed (``_record.signature``: computed once,
        # for replay and a budget alike).
        self.signature: Any = None
        # The Vars registered for it, where not every Var of its ops is (a steady-state
        # run registers only the tensors that outlive it: ``_adapters.steady``); None: all.
        self.registered: list[Var] | None = None
        # A steady-state run's template Vars that its own Vars replaced in their ops'
        # outputs (an output's, D4 [ a steady run's record is bound ]): id(template Var) -> its
        # output index. Views made in the run still name the template's Var as their root.
        self.renamed: dict[int, int] = {}
        # (first op index, numeric context) from where each context applies, in op
        # order: the global flags the ops' results depend on (R9 [ each op's numeric context ]
        # in ``_record.entry``).
        self.contexts: list[tuple[int, NumericContext]] = []
        self.debug_values: dict[Var, Tensor] = {}  # debug=True: what forward computed
        self.scratch: set[Var] = set()  # debug=True: kernel scratch outputs, never compared
        # Storage groups with members that have version counters of their own
        # (``unsafe_chunk`` pieces): root -> those members.
        self.loose: dict[Var, list[Var]] = {}
        # At block exit, for each such group: its members alive then, with their
        # versions; a write through one of them later changes the others unseen.
        self.escaped: dict[Var, dict[Var, int]] = {}

    def vars(self) -> list[Var]:
        return [v for rec in self.ops for v in rec.outs if v is not None]

    def out_index(self, var: Var) -> int:
        """Which output of its op ``var`` is (also a template Var of a steady run that the
        run's own Var replaced, ``renamed``)."""
        for k, v in enumerate(self.ops[var.op].outs):
            if v is var:
                return k
        return self.renamed[id(var)]

    def registered_vars(self) -> list[Var]:
        """The Vars that may be in the registry: what closing the block looks up."""
        return self.vars() if self.registered is None else self.registered
