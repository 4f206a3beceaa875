"""What the pack hook stores: handles for block tensors, pass-through otherwise.

A handle names a node of a block's record and the version the tensor had when
autograd saved it; unpacking it asks :mod:`._replay` for the value. A tensor
that is not ours is handed to the hook pair below ours if there is one,
exactly as without the scope; otherwise it is stored detached (a pack hook that
returns its input leaks through a reference cycle) together with its version,
because saved-tensor hooks switch off PyTorch's own in-place check.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from . import _interception, _replay
from ._record import ExternalRef, Node, Region
from ._registry import lookup, thread_state

__all__ = ["Handle"]

_INF = 1 << 62
_no_python_dispatch = torch._C._DisableTorchDispatch


class Handle:
    """Stands in for a block-created tensor that autograd saved."""

    __slots__ = ("region", "node", "version", "bound", "view", "__weakref__")

    def __init__(
        self, region: Region, node: Node, version: int, bound: int, view: tuple[Any, Any, int] | None
    ) -> None:
        self.region = region
        self.node = node
        self.version = version
        self.bound = bound  # ops at or after this index had not happened yet
        self.view = view  # (size, stride, offset from base) of a view taken after the block

    def unpack(self) -> torch.Tensor:
        return _replay.materialize(self)


class _Plain:
    __slots__ = ("t", "version")

    def __init__(self, t: torch.Tensor, state: Any) -> None:
        # Our dispatch mode must not record this detach. For plain tensors skip
        # Python dispatch altogether (cheap); subclasses must see their detach.
        if type(t) is torch.Tensor or type(t) is torch.nn.Parameter:
            with _no_python_dispatch():
                self.t = t.detach()
        else:
            state.bypass += 1
            try:
                self.t = t.detach()
            finally:
                state.bypass -= 1
        self.version = t._version

    def unpack(self) -> torch.Tensor:
        t = self.t
        if t._version != self.version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been "
                f"modified by an inplace operation: [{t.type()} {list(t.shape)}] is at "
                f"version {t._version}; expected version {self.version} instead. "
                "(Checked by gradient_scope, which stands in for PyTorch's own check "
                "while its saved-tensor hooks are active.)"
            )
        return t


class _Foreign:
    __slots__ = ("unpack_fn", "packed")

    def __init__(self, unpack_fn: Callable[[Any], torch.Tensor], packed: Any) -> None:
        self.unpack_fn = unpack_fn
        self.packed = packed

    def unpack(self) -> torch.Tensor:
        return self.unpack_fn(self.packed)


def _make_handle(
    region: Region, node: Node, t: torch.Tensor, view: tuple[Any, Any, int] | None
) -> Handle | None:
    root = node.root
    if isinstance(root, ExternalRef):
        # A view of an outside tensor: storing it costs nothing extra.
        return None
    v = t._version
    bound = _INF
    if region.open:
        # Ops recorded from now on (including one whose autograd kernel saves
        # its argument before writing to it) are not part of this value.
        bound = len(region.ops)
        if not root.mutations and v != node.version:
            return None  # changed by something the block did not record
    elif root.mutations:
        final = region.final_versions.get(root)
        if final is None or v != final:
            return None  # modified after the block: store it as usual
    elif v != node.version:
        return None
    h = Handle(region, node, v, bound, view)
    with region.lock:
        if region.handles is None:
            region.handles = weakref.WeakSet()
        region.handles.add(h)
        stats = node.stats
        stats.tensors_packed += 1
        stats.bytes_packed += t.numel() * t.element_size()
    return h


def pack(hook: _interception.Entry, t: torch.Tensor) -> Any:
    state = thread_state()
    state.busy += 1
    try:
        entry = lookup(t)
        view: tuple[Any, Any, Any] | None = None
        if entry is None:
            base = t._base
            if base is not None:
                entry = lookup(base)
                if entry is not None:
                    view = (t.size(), t.stride(), t.storage_offset() - base.storage_offset())
        if entry is not None and (hook.below is None or entry.node.serial >= hook.serial):
            h = _make_handle(entry.region, entry.node, t, view)
            if h is not None:
                return h
        below = hook.below
        if below is not None:
            return _Foreign(below[1], below[0](t))
        return _Plain(t, state)
    finally:
        state.busy -= 1


def unpack(packed: Handle | _Plain | _Foreign) -> torch.Tensor:
    state = thread_state()
    state.busy += 1
    try:
        return packed.unpack()
    finally:
        state.busy -= 1


_interception.pack_impl = pack
_interception.unpack_impl = unpack
