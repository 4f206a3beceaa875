"""Recording: a TorchDispatchMode writes every op of a block into a small op graph.

Tensors created in the block become :class:`Node` objects (metadata only, never
the tensor); tensors from outside become :class:`ExternalRef` objects that keep
the tensor alive with the version it had when the block read it. In-place ops
are recorded as *mutations* of the storage group (a tensor and its views) they
write to, so a partial replay can rebuild any version of a tensor. An op that
writes to a tensor from outside the block records a private snapshot of it
first: replay writes into copies of that snapshot, never into the real tensor
(BatchNorm's running statistics change exactly once per forward).
"""

from __future__ import annotations

import operator
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from . import _registry, _rng
from ._registry import _LIVE, ThreadState, register

__all__ = ["ScopeStats", "Region", "Node", "ExternalRef", "MetaRef", "OpRecord", "RecordingMode"]

Tensor = torch.Tensor
_current_task = torch._C._current_graph_task_id
_OpOverload = torch._ops.OpOverload
_NO_KWARGS: dict[str, Any] = {}  # shared, never written


@dataclass
class ScopeStats:
    """Counters of one scope, readable after the block and updated in backward.

    Example::

        >>> import torch
        >>> from gradient_scope import recompute_scope
        >>> a = torch.randn(4, requires_grad=True)
        >>> scope = recompute_scope()
        >>> with scope:
        ...     x = a.sin()
        >>> (x * x).sum().backward()
        >>> scope.stats.ops_recorded, scope.stats.tensors_packed
        (1, 2)
    """

    ops_recorded: int = 0  #: operations recorded in the block
    tensors_packed: int = 0  #: saved-for-backward tensors replaced by handles
    bytes_packed: int = 0  #: bytes autograd did not keep because of those handles
    replays: int = 0  #: recomputation passes run
    ops_replayed: int = 0  #: operations executed by those passes


class MetaRef:
    """An argument of which the op reads only metadata (``empty_like(x)``): replay
    passes a fresh uninitialised tensor of that shape instead of recomputing x."""

    __slots__ = ("size", "stride", "dtype", "device")

    def __init__(self, t: Tensor) -> None:
        self.size = t.shape
        self.stride = t.stride()
        self.dtype = t.dtype
        self.device = t.device

    def empty(self) -> Tensor:
        return torch.empty_strided(self.size, self.stride, dtype=self.dtype, device=self.device)


_INPLACE_OR_VIEW = torch._C.DispatchKey.ADInplaceOrView
_is_excluded = torch._C._dispatch_tls_is_dispatch_key_excluded
_set_excluded = torch._C._dispatch_tls_set_dispatch_key_excluded


def _alias(t: Tensor) -> Tensor:
    """``t.detach()`` that shares ``t``'s version counter, also below autograd.

    Inside ``__torch_dispatch__`` the ADInplaceOrView key (which makes detach
    share the version counter) is excluded; include it for this one call.
    """
    if _is_excluded(_INPLACE_OR_VIEW):
        _set_excluded(_INPLACE_OR_VIEW, False)
        try:
            return t.detach()
        finally:
            _set_excluded(_INPLACE_OR_VIEW, True)
    return t.detach()


class ExternalRef:
    """A tensor from outside the block, kept alive with the version it was read at.

    ``tensor`` is a detached alias (same storage and version counter, no autograd
    history): holding the tensor itself could close a reference cycle through
    the autograd graph (its history may hold this block's handles, e.g. for the
    output of an op kept by ``save=``) that the garbage collector cannot see.
    ``snapshot`` is True when the block later wrote to the tensor: ``tensor`` is
    then a private copy of its value before that write. ``mutations`` lists the
    block's writes to it (or to block-made views of it).
    """

    __slots__ = ("tensor", "source", "version", "snapshot", "mutations")

    def __init__(self, tensor: Tensor) -> None:
        self.tensor = _alias(tensor)
        self.source = weakref.ref(tensor)  # to recognise the tensor when read again
        self.version = tensor._version
        self.snapshot = False
        self.mutations: list[tuple[int, int]] | tuple[()] = ()

    def take_snapshot(self) -> None:
        """Replace the tensor by a private copy of its current value."""
        self.tensor = self.tensor.detach().clone(memory_format=torch.preserve_format)
        self.snapshot = True


def _storage_key(t: Tensor) -> int | None:
    storage = t.untyped_storage()
    return storage.data_ptr() if storage.nbytes() else None


class Node:
    """A tensor created in the block: where it came from, and what it looked like."""

    __slots__ = (
        "key",
        "op",
        "size",
        "dtype",
        "device",
        "version",
        "root",
        "mutations",
        "stats",
        "serial",
    )

    # No reference to the region: the region holds its nodes (a cycle would keep
    # a block's inputs alive until the garbage collector runs).
    def __init__(self, op: int, t: Tensor, root: Group | None, stats: ScopeStats, serial: int) -> None:
        self.key = id(t)
        self.op = op
        self.size = t.shape
        self.dtype = t.dtype
        self.device = t.device
        self.version = t._version
        self.root: Group = self if root is None else root
        # (op index, version before) of each write to this storage group; on roots.
        self.mutations: list[tuple[int, int]] | tuple[()] = ()
        self.stats = stats  # of the scope that created it
        self.serial = serial  # of the block (scope entry) that created it

    def describe(self) -> str:
        return f"tensor of shape {list(self.size)} ({self.dtype}, {self.device})"


Group = Node | ExternalRef
Ref = Node | ExternalRef


class OpRecord(tuple):  # type: ignore[type-arg]
    """One recorded op: ``(func, args, kwargs, rng, outs)``. A tuple: cheap to make."""

    __slots__ = ()
    func = property(operator.itemgetter(0))
    args = property(operator.itemgetter(1))
    kwargs = property(operator.itemgetter(2))
    rng = property(operator.itemgetter(3))
    outs = property(operator.itemgetter(4))


_new_record = tuple.__new__


# ------------------------------------------------------------------ op facts

# Ops that write to their running-statistics arguments without saying so in
# their schema (and without bumping their version counters).
_HIDDEN_WRITES: dict[str, tuple[int, ...]] = {
    "aten::native_batch_norm": (3, 4),
    "aten::cudnn_batch_norm": (3, 4),
    "aten::miopen_batch_norm": (3, 4),
    "aten::_batch_norm_impl_index": (3, 4),
}
# Ops whose result aliases their first input although the schema does not say so.
_HIDDEN_VIEWS = {"aten::_unsafe_view", "aten::_reshape_alias"}

_NEW, _INPLACE, _VIEW = 0, 1, 2


# Collectives replayed in backward can hang or corrupt data when ranks replay in
# different orders: their outputs are always stored.
_NEVER_REPLAY_NAMESPACES = {"c10d", "_c10d_functional", "_c10d_functional_autograd", "c10d_functional"}


class OpInfo:
    __slots__ = (
        "seeded",
        "writes",
        "outs",
        "out0",
        "view_arg",
        "never_replay",
        "uninitialized",
        "meta_only",
        "simple",
    )

    def __init__(self, func: Any) -> None:
        schema = func._schema
        namespace, _, name = schema.name.partition("::")
        self.never_replay = namespace in _NEVER_REPLAY_NAMESPACES
        self.uninitialized = namespace == "aten" and (name.startswith("empty") or name.startswith("new_empty"))
        # Factories that read only the metadata of their first argument.
        self.meta_only = namespace == "aten" and (
            name in ("empty_like", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like")
            or name.startswith("randint_like")
            or name in ("new_empty", "new_empty_strided", "new_zeros", "new_ones", "new_full")
        )
        self.seeded = _rng.is_seeded(func)
        writes: list[int | str] = []
        sets: dict[str, int] = {}
        for i, arg in enumerate(schema.arguments):
            ai = arg.alias_info
            key: int | str = arg.name if arg.kwarg_only else i
            if ai is not None:
                if ai.is_write:
                    writes.append(key)
                for s in ai.before_set:
                    sets.setdefault(s, i)
        for i in _HIDDEN_WRITES.get(schema.name, ()):
            if i not in writes:
                writes.append(i)
        self.writes = tuple(writes)
        kinds = []
        view_arg = 0
        for ret in schema.returns:
            ai = ret.alias_info
            if ai is None:
                kinds.append(_VIEW if schema.name in _HIDDEN_VIEWS else _NEW)
            elif ai.is_write:
                kinds.append(_INPLACE)
            else:
                kinds.append(_VIEW)
                for s in ai.before_set:
                    view_arg = sets.get(s, 0)
        self.outs = tuple(kinds)
        self.out0 = kinds[0] if kinds else _NEW
        # Most ops: one fresh output, no writes, no randomness (the fast path).
        self.simple = (
            kinds == [_NEW] and not writes and not self.seeded and not self.never_replay and not self.meta_only
        )
        self.view_arg = view_arg


_INFO: dict[Any, OpInfo] = {}


def op_info(func: Any) -> OpInfo:
    info = _INFO.get(func)
    if info is None:
        info = _INFO[func] = OpInfo(func)
    return info


def _tensors(rargs: list[Any]) -> list[Tensor]:
    """The outside tensors among recorded arguments."""
    out = []
    for r in rargs:
        for x in r if isinstance(r, list) else (r,):
            if isinstance(x, ExternalRef):
                src = x.source()
                if src is not None:
                    out.append(src)
    return out


def _has_tensor(seq: Any) -> bool:
    for x in seq:
        if isinstance(x, Tensor):
            return True
    return False


# ------------------------------------------------------------------ regions


class Region:
    """The record of one block: its ops, inputs, options and counters."""

    def __init__(
        self,
        state: ThreadState,
        *,
        preserve_rng_state: bool,
        save: Callable[[Any], bool] | None,
        debug: bool,
        stats: ScopeStats,
        serial: int,
    ) -> None:
        self.state = state
        self.serial = serial
        self.task = _current_task()  # the backward pass it was opened in (-1: none)
        self.ops: list[OpRecord] = []
        self.open = True
        self._ext: dict[int, ExternalRef] = {}
        self._mutated_storages: set[int] = set()  # outside storages the block wrote to
        self.final_versions: dict[Node, int | None] = {}  # of written groups, at block exit
        self.debug_values: dict[Node, Tensor] = {}  # debug=True: what forward computed
        # Options of the innermost scope recording into this region. A scope
        # nested in an open one records into the same region (two regions
        # reading each other's tensors would form a reference cycle through
        # the autograd graph), with its own options and counters.
        self._frames: list[tuple[Any, ...]] = []
        self._count_from = 0  # ops from here on count for the current scope's stats
        self.preserve_rng = preserve_rng_state
        self.save = save
        self.debug = debug
        self.stats = stats
        self._saved_ops: dict[Any, bool] = {}
        self.mutated: list[Group] = []
        self.lock = threading.RLock()
        # Replay bookkeeping, owned by _replay.
        self.handles: Any = None
        self.pass_state: Any = None
        self.closures: dict[Any, frozenset[int]] = {}

    def push_frame(
        self,
        *,
        preserve_rng_state: bool,
        save: Callable[[Any], bool] | None,
        debug: bool,
        stats: ScopeStats,
        serial: int,
    ) -> None:
        n = len(self.ops)
        self.stats.ops_recorded += n - self._count_from  # the enclosing scope's so far
        self._count_from = n
        self._frames.append((self.preserve_rng, self.save, self.debug, self.stats, self.serial, self._saved_ops, n))
        self.preserve_rng, self.save, self.debug, self.stats = preserve_rng_state, save, debug, stats
        self.serial = serial
        self._saved_ops = {}

    def pop_frame(self, aborted: bool) -> None:
        n = len(self.ops)
        self.stats.ops_recorded += n - self._count_from
        self._count_from = n
        self.preserve_rng, self.save, self.debug, self.stats, self.serial, self._saved_ops, start = (
            self._frames.pop()
        )
        if aborted:
            _registry.unregister([n for rec in self.ops[start:] for n in rec.outs if n is not None])

    # -- inputs

    def external(self, t: Tensor) -> ExternalRef:
        key = id(t)
        ext = self._ext.get(key)
        if ext is None or ext.source() is not t or ext.version != t._version:
            ext = ExternalRef(t)
            if self._mutated_storages and _storage_key(t) in self._mutated_storages:
                # The block wrote to this storage, so the tensor's autograd history
                # may hold handles of this block: holding the tensor would make a
                # reference cycle through the graph. Keep a copy of its value.
                ext.take_snapshot()
            else:
                self._ext[key] = ext
        return ext

    def _ref(self, t: Tensor) -> Ref:
        entry = _LIVE.get(id(t))
        if entry is not None and entry.region is self and entry() is t:
            return entry.node
        return self.external(t)

    def refs(self, args: tuple[Any, ...]) -> list[Any]:
        """The recorded form of positional arguments: nodes, outside refs, values."""
        live_get = _LIVE.get
        rargs: list[Any] = []
        for a in args:
            if isinstance(a, Tensor):
                entry = live_get(id(a))
                if entry is not None and entry.region is self and entry() is a:
                    rargs.append(entry.node)
                else:
                    rargs.append(self.external(a))
            elif (type(a) is list or type(a) is tuple) and _has_tensor(a):
                rargs.append([self._ref(x) if isinstance(x, Tensor) else x for x in a])
            else:
                rargs.append(a)
        return rargs

    def _writes(self, info: OpInfo, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[tuple[Group, int]]:
        muts: list[tuple[Group, int]] = []
        for w in info.writes:
            t = kwargs.get(w) if isinstance(w, str) else (args[w] if w < len(args) else None)
            if not isinstance(t, Tensor):
                continue
            ref = self._ref(t)
            root = ref.root if isinstance(ref, Node) else ref
            if isinstance(root, ExternalRef) and not root.snapshot:
                # Keep the value before the write (replay writes into copies), and
                # stop holding anything that shares the storage (see external()).
                key = _storage_key(root.tensor)
                if key is not None:
                    self._mutated_storages.add(key)
                    for k, e in list(self._ext.items()):
                        if _storage_key(e.tensor) == key and e.version == e.tensor._version:
                            e.take_snapshot()
                            del self._ext[k]
                if not root.snapshot:
                    root.take_snapshot()
                if self._ext.get(id(t)) is root:
                    del self._ext[id(t)]
            muts.append((root, t._version))
        return muts

    def _is_saved(self, func: Any) -> bool:
        keep = self._saved_ops.get(func)
        if keep is None:
            keep = self._saved_ops[func] = bool(self.save(func))  # type: ignore[misc]  # save is set here
        return keep

    # -- the hot path: keep it lean, it runs for every op of every block

    def run(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        info = _INFO.get(func)
        if info is None:
            info = op_info(func)
        if info.never_replay or (
            # Stored, not recomputed: later ops read its outputs as inputs. An op
            # that writes to an argument is always recorded: its write must replay.
            self.save is not None and not info.writes and self._is_saved(func)
        ):
            return func(*args, **kwargs)
        rargs = self.refs(args)
        if info.meta_only and args and isinstance(args[0], Tensor) and args[0].layout == torch.strided:
            rargs[0] = MetaRef(args[0])
        rkwargs = kwargs
        if kwargs:
            rkwargs = {}
            for k, a in kwargs.items():
                if isinstance(a, Tensor):
                    a = self._ref(a)
                elif (type(a) is list or type(a) is tuple) and _has_tensor(a):
                    a = [self._ref(x) if isinstance(x, Tensor) else x for x in a]
                rkwargs[k] = a
        rng = _rng.capture(args, kwargs) if info.seeded and self.preserve_rng else None
        muts = self._writes(info, args, kwargs) if info.writes else None

        out = func(*args, **kwargs)

        ops = self.ops
        index = len(ops)
        if muts:
            for root, pre in muts:
                if not root.mutations:
                    root.mutations = []
                    self.mutated.append(root)
                root.mutations.append((index, pre))
        if isinstance(out, Tensor):
            kind = info.out0
            if kind != _INPLACE:
                for a in args:
                    if a is out:  # e.g. lift_fresh returns its input: not a new tensor
                        kind = _INPLACE
                        break
            outs: tuple[Node | None, ...] = (self._out(out, kind, info, rargs, index),)
        elif isinstance(out, (tuple, list)):
            kinds = info.outs
            outs = tuple(
                self._out(o, kinds[i] if i < len(kinds) else (kinds[0] if kinds else _NEW), info, rargs, index)
                if isinstance(o, Tensor)
                else None
                for i, o in enumerate(out)
            )
        else:
            outs = ()
        ops.append(_new_record(OpRecord, (func, rargs, rkwargs, rng, outs)))
        return out

    def _out(self, t: Tensor, kind: int, info: OpInfo, rargs: list[Any], index: int) -> Node | None:
        if kind == _INPLACE or _registry.lookup(t) is not None or any(t is a for a in _tensors(rargs)):
            return None  # not a new tensor (in-place, or an op that returned an input)
        root = None
        if kind == _VIEW:
            src = rargs[info.view_arg] if info.view_arg < len(rargs) else None
            if isinstance(src, list):  # e.g. unbind/split: Tensor[] returns
                src = src[0] if src else None
            if isinstance(src, Node):
                root = src.root
            elif isinstance(src, ExternalRef):
                root = src
        return self._new(t, index, root, info)

    def _new(self, t: Tensor, index: int, root: Group | None, info: OpInfo) -> Node:
        node = Node(index, t, root, self.stats, self.serial)
        # empty/empty_like/... outputs hold garbage: nothing to compare in debug.
        if self.debug and not info.uninitialized:
            self.debug_values[node] = t.detach().clone()
        register(t, node, self, self.state)
        return node

    # -- lifetime

    def nodes(self) -> list[Node]:
        return [n for rec in self.ops for n in rec.outs if n is not None]

    def close(self, aborted: bool) -> None:
        self.open = False
        self.stats.ops_recorded += len(self.ops) - self._count_from
        self._ext.clear()
        self._saved_ops.clear()
        if self.mutated:
            # The version each written group has at block exit, read off any live
            # member (views share their base's counter); None if all are dead.
            final = self.final_versions
            for root in self.mutated:
                if isinstance(root, Node):
                    final[root] = None
            for n in self.nodes():
                root = n.root
                if root in final and final[root] is None:
                    t = _registry.live_tensor(n)
                    if t is not None:
                        final[root] = t._version
        if aborted:
            # Tensors of a block that raised are ordinary tensors from now on.
            _registry.unregister(self.nodes())


class RecordingMode(TorchDispatchMode):
    """One per thread while any block is open; records into the innermost block."""

    # Higher-order operators (flex_attention, ...) reach __torch_dispatch__ and
    # run as they are: their outputs are stored, not recomputed.
    supports_higher_order_operators = True

    def __init__(self, state: ThreadState) -> None:
        super().__init__()
        self.state = state

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        if kwargs is None:
            kwargs = {}
        state = self.state
        # Ops under no_grad inside a block are recorded too: an autograd.Function's
        # forward runs under no_grad, and its outputs are block tensors. Ops of a
        # backward pass run inside a block that was opened outside it are not.
        regions = state.regions
        if state.bypass or not regions or type(func) is not _OpOverload:
            return func(*args, **kwargs)  # also higher-order operators: stored
        region = regions[-1]
        if region.task != _current_task():
            return func(*args, **kwargs)
        info = _INFO.get(func)
        if info is None or not info.simple or kwargs or region.save is not None or region.debug:
            return region.run(func, args, kwargs)
        # The fast path (most ops), inlined: positional arguments, one fresh output.
        rargs = region.refs(args)
        out = func(*args)
        ops = region.ops
        index = len(ops)
        outs: tuple[Node, ...] = ()
        if isinstance(out, Tensor):
            for a in args:
                if a is out:
                    break
            else:
                node = Node(index, out, None, region.stats, region.serial)
                register(out, node, region, state)
                outs = (node,)
        ops.append(_new_record(OpRecord, (func, rargs, _NO_KWARGS, None, outs)))
        return out
