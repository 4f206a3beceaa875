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

import threading
from dataclasses import dataclass
from typing import Any, Callable, Union

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from . import _registry, _rng
from ._registry import ThreadState

__all__ = ["ScopeStats", "Region", "Node", "ExternalRef", "OpRecord", "RecordingMode"]

Tensor = torch.Tensor
_is_grad_enabled = torch.is_grad_enabled


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


class ExternalRef:
    """A tensor from outside the block, kept alive with the version it was read at.

    ``snapshot`` is True when the block later wrote to the tensor: ``tensor`` is
    then a private copy of its value before that write. ``mutations`` lists the
    block's writes to it (or to block-made views of it).
    """

    __slots__ = ("tensor", "version", "snapshot", "mutations")

    def __init__(self, tensor: Tensor) -> None:
        self.tensor = tensor
        self.version = tensor._version
        self.snapshot = False
        self.mutations: list[tuple[int, int]] = []


class Node:
    """A tensor created in the block: where it came from, and what it looked like."""

    __slots__ = (
        "key",
        "op",
        "size",
        "stride",
        "dtype",
        "device",
        "version",
        "root",
        "mutations",
        "final_version",
        "debug_value",
        "stats",
    )

    # No reference to the region: the region holds its nodes (a cycle would keep
    # a block's inputs alive until the garbage collector runs).
    def __init__(self, op: int, t: Tensor, root: Group | None) -> None:
        self.key = id(t)
        self.op = op
        self.size = t.shape
        self.stride = t.stride()
        self.dtype = t.dtype
        self.device = t.device
        self.version = t._version
        self.root: Group = self if root is None else root
        self.mutations: list[tuple[int, int]] = []  # (op index, version before) on a root
        self.final_version: int | None = None
        self.debug_value: Tensor | None = None
        self.stats: ScopeStats | None = None  # of the scope that created it

    def describe(self) -> str:
        return f"tensor of shape {list(self.size)} ({self.dtype}, {self.device})"


Group = Union[Node, ExternalRef]
Ref = Union[Node, ExternalRef]


class OpRecord:
    __slots__ = ("func", "args", "kwargs", "outs", "rng")

    def __init__(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], rng: Any) -> None:
        self.func = func
        self.args = args
        self.kwargs = kwargs
        self.rng = rng
        self.outs: tuple[Node | None, ...] = ()


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


class OpInfo:
    __slots__ = ("seeded", "writes", "outs", "view_arg")

    def __init__(self, func: Any) -> None:
        schema = func._schema
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
        self.view_arg = view_arg


_INFO: dict[Any, OpInfo] = {}


def op_info(func: Any) -> OpInfo:
    info = _INFO.get(func)
    if info is None:
        info = _INFO[func] = OpInfo(func)
    return info


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
    ) -> None:
        self.state = state
        self.ops: list[OpRecord] = []
        self.open = True
        self._ext: dict[int, ExternalRef] = {}
        # Options of the innermost scope recording into this region. A scope
        # nested in an open one records into the same region (two regions
        # reading each other's tensors would form a reference cycle through
        # the autograd graph), with its own options and counters.
        self._frames: list[tuple[Any, ...]] = []
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
        self, *, preserve_rng_state: bool, save: Callable[[Any], bool] | None, debug: bool, stats: ScopeStats
    ) -> None:
        self._frames.append(
            (self.preserve_rng, self.save, self.debug, self.stats, self._saved_ops, len(self.ops))
        )
        self.preserve_rng, self.save, self.debug, self.stats = preserve_rng_state, save, debug, stats
        self._saved_ops = {}

    def pop_frame(self, aborted: bool) -> None:
        self.preserve_rng, self.save, self.debug, self.stats, self._saved_ops, start = self._frames.pop()
        if aborted:
            _registry.unregister([n for rec in self.ops[start:] for n in rec.outs if n is not None])

    # -- inputs

    def _ref(self, t: Tensor) -> Ref:
        entry = _registry.lookup(t)
        if entry is not None and entry.region is self:
            return entry.node
        key = id(t)
        ext = self._ext.get(key)
        if ext is None or ext.tensor is not t or ext.version != t._version:
            ext = self._ext[key] = ExternalRef(t)
        return ext

    def _refs(self, args: Any) -> Any:
        out = []
        for a in args:
            if isinstance(a, Tensor):
                out.append(self._ref(a))
            elif type(a) in (list, tuple) and any(isinstance(x, Tensor) for x in a):
                out.append([self._ref(x) if isinstance(x, Tensor) else x for x in a])
            else:
                out.append(a)
        return out

    def _writes(self, info: OpInfo, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[tuple[Group, int]]:
        muts = []
        for w in info.writes:
            t = kwargs.get(w) if isinstance(w, str) else (args[w] if w < len(args) else None)
            if not isinstance(t, Tensor):
                continue
            entry = _registry.lookup(t)
            if entry is not None and entry.region is self:
                root = entry.node.root
            else:
                root = self._ref(t)  # an ExternalRef
            if isinstance(root, ExternalRef):
                if not root.snapshot:
                    # Keep the value before the write: replay writes into copies.
                    root.tensor = root.tensor.detach().clone(memory_format=torch.preserve_format)
                    root.snapshot = True
                    if self._ext.get(id(t)) is root:
                        del self._ext[id(t)]
                muts.append((root, t._version))
            else:
                muts.append((root, t._version))
        return muts

    # -- the hot path

    def run(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not _is_grad_enabled():
            return func(*args, **kwargs)
        save = self.save
        if save is not None:
            keep = self._saved_ops.get(func)
            if keep is None:
                keep = self._saved_ops[func] = bool(save(func))
            if keep:
                # Stored, not recomputed: later ops read its outputs as inputs.
                return func(*args, **kwargs)
        info = _INFO.get(func) or op_info(func)
        rargs = self._refs(args)
        rkwargs = dict(zip(kwargs, self._refs(kwargs.values()))) if kwargs else kwargs
        rng = _rng.capture(args, kwargs) if info.seeded and self.preserve_rng else None
        muts = self._writes(info, args, kwargs) if info.writes else None
        out = func(*args, **kwargs)
        index = len(self.ops)
        rec = OpRecord(func, tuple(rargs), rkwargs, rng)
        self.ops.append(rec)
        self.stats.ops_recorded += 1
        if muts:
            for root, pre in muts:
                if not root.mutations:
                    self.mutated.append(root)
                root.mutations.append((index, pre))
        kinds = info.outs
        state = self.state
        if isinstance(out, Tensor):
            rec.outs = (self._new(out, kinds[0] if kinds else _NEW, info, rargs, index, state),)
        elif isinstance(out, (tuple, list)):
            nodes: list[Node | None] = []
            for i, o in enumerate(out):
                if isinstance(o, Tensor):
                    kind = kinds[i] if i < len(kinds) else (kinds[0] if kinds else _NEW)
                    nodes.append(self._new(o, kind, info, rargs, index, state))
                else:
                    nodes.append(None)
            rec.outs = tuple(nodes)
        return out

    def _new(self, t: Tensor, kind: int, info: OpInfo, rargs: list[Any], index: int, state: ThreadState) -> Node | None:
        if kind == _INPLACE:
            return None
        root = None
        if kind == _VIEW:
            src = rargs[info.view_arg] if info.view_arg < len(rargs) else None
            if isinstance(src, list):  # e.g. unbind/split: Tensor[] returns
                src = src[0] if src else None
            if isinstance(src, Node):
                root = src.root
            elif isinstance(src, ExternalRef):
                root = src
        node = Node(index, t, root)
        node.stats = self.stats
        if self.debug:
            node.debug_value = t.detach().clone()
        _registry.register(t, node, self, state)
        return node

    # -- lifetime

    def nodes(self) -> list[Node]:
        return [n for rec in self.ops for n in rec.outs if n is not None]

    def close(self, aborted: bool) -> None:
        self.open = False
        self._ext.clear()
        self._saved_ops.clear()
        for root in self.mutated:
            if isinstance(root, Node):
                root.final_version = self._current_version(root)
        if aborted:
            # Tensors of a block that raised are ordinary tensors from now on.
            _registry.unregister(self.nodes())

    def _current_version(self, root: Node) -> int | None:
        for n in self.nodes():
            if n.root is root:
                t = _registry.live_tensor(n)
                if t is not None:
                    return t._version
        return None


class RecordingMode(TorchDispatchMode):
    """One per thread while any block is open; records into the innermost block."""

    def __init__(self, state: ThreadState) -> None:
        super().__init__()
        self.state = state

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        if kwargs is None:
            kwargs = {}
        state = self.state
        if state.bypass or not state.regions:
            return func(*args, **kwargs)
        return state.regions[-1].run(func, args, kwargs)
