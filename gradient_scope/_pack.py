"""What a save becomes: a handle, the tensor as stored, or whatever the pair below ours makes.

Rules (cited as S1..S3):

S1. A block tensor, or a view of one, saved while our pair applies to its
    block, becomes a :class:`~gradient_scope._replay.Handle` -- unless replay
    says it must be stored (it changed in a way the block did not record).
S2. Anything else goes to the pair below ours, exactly as without the scope.
    With no pair below it is stored as autograd stores it: the tensor itself
    (``saved is t`` when it does not require grad, as without hooks; a later
    ``.data = ...`` is seen), but an output of the node that saves it, or what
    may be one, as a detached alias (holding it would make a reference cycle
    through the graph that the garbage collector cannot free). Its version is
    checked at unpack: hooks switch PyTorch's own in-place check off.
S3. Packing never reads the data of the tensor it packs: some kernels save an
    argument before they write it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from . import _recorder
from ._registry import lookup
from ._replay import ViewSpec, inplace_error, may_be_new_output
from ._torch_compat import HookPair, without_python_dispatch

__all__ = ["pack", "unpack", "add_pack_listener", "Stored", "Foreign"]

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
        h = entry.frame.owner.handle(entry, t, view)  # S1
        if h is not None:
            for fn in _listeners:
                fn(t, h)
            return h
    if below is not None:
        return Foreign(below[1], below[0](t))
    return Stored(t, made_by_block)


def unpack(packed: Any) -> Tensor:
    return packed.unpack()  # type: ignore[no-any-return]
