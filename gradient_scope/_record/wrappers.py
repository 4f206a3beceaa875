"""Wrapper subclasses (DTensor, ``AsyncCollectiveTensor``) and functional collectives as block ops.

Tensor parallelism builds tensors that no aten op returns: ``DTensor.from_local`` and
``redistribute`` wrap a local tensor (``DTensor(local, spec)``), ``to_local`` reads the
wrapper's local tensor, and a functional collective's result is wrapped in an
``AsyncCollectiveTensor`` until it is waited for. The dispatch mode sees only the aten ops
around them. This module gives each of these steps an entry of the block's record, so that
the tensors TP's module hooks build are block tensors that replay (R11..R12 in
``_record.entry``). Three record ops, each one object for the life of the process (the
signature keys ops by ``id``):

* :data:`REWRAP`: ``REWRAP(cls, ctx, size, stride, others, names, *inner)`` rebuilds a
  wrapper from its inner tensors (``cls.__tensor_unflatten__``), detached;
* :data:`INNER`: ``INNER(wrapper, name)`` is the wrapper's inner tensor ``name``;
* :func:`collective`: the record op of a functional collective (``_c10d_functional``):
  the collective, waited for (a :class:`Collective`; ``.op`` is the ``OpOverload``).

A record op is a plain callable with ``_op`` (what ``_restore`` calls) and a name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .._base.subclass import is_wrapper
from . import registry as _registry
from .registry import _LIVE, register
from .types import NO_KWARGS, Group, OpRecord, Var, new_var

if TYPE_CHECKING:
    from .entry import OpenBlock

Tensor = torch.Tensor
_new_tuple = tuple.__new__

__all__ = ["RecordOp", "Collective", "REWRAP", "INNER", "collective", "is_collective", "rewrapped", "note_inner"]


class RecordOp:
    """An op of a record that is no ``OpOverload``: ``fn`` run by replay, ``name`` for people.

    Example::

        >>> op = RecordOp("gradient_scope::inner", getattr)
        >>> str(op), op._op(object(), "__class__") is object
        ('gradient_scope::inner', True)
    """

    # ``_restore.structure`` calls ``_op`` (``_base.torch_compat.overload_kernel``); a view:
    # its output shares its argument's data (``_budget.measure`` counts no bytes moved).
    is_view = True

    __slots__ = ("name", "_op")

    def __init__(self, name: str, fn: Any) -> None:
        self.name = name
        self._op = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._op(*args, **kwargs)

    def __str__(self) -> str:
        return self.name

    __repr__ = __str__


def _rewrap(
    cls: Any, ctx: Any, size: Any, stride: Any, others: dict[str, Any], names: tuple[str, ...], *inner: Any
) -> Any:
    t = cls.__tensor_unflatten__({**others, **dict(zip(names, inner))}, ctx, size, stride)
    # forward's wrapper was an autograd output (from_local's); a replayed value is data only
    return t.detach() if t.requires_grad else t


REWRAP = RecordOp("gradient_scope::rewrap", _rewrap)
INNER = RecordOp("gradient_scope::inner", getattr)


class Collective(RecordOp):
    """The record op of a functional collective ``op``: it runs ``op`` and waits for it.
    Replay must have the collective's result before any reader runs, and leaves no work
    pending in the functional collectives' registry. Every rank of the group replays the
    same collectives in the same order exactly when every rank runs the same plan
    (the invariant ``_budget`` keeps by agreeing plans per process group).

    Example::

        >>> import torch
        >>> c = collective(torch.ops._c10d_functional.all_reduce.default)
        >>> str(c), c.op is torch.ops._c10d_functional.all_reduce.default, c is collective(c.op)
        ('_c10d_functional::all_reduce', True, True)
    """

    is_view = False
    __slots__ = ("op",)

    def __init__(self, op: Any) -> None:
        wait = torch.ops._c10d_functional.wait_tensor.default

        def run(*args: Any, **kwargs: Any) -> Any:
            return wait(op(*args, **kwargs))

        super().__init__(str(op._schema.name), run)
        self.op = op


_COLLECTIVES: dict[Any, Collective] = {}


def collective(op: Any) -> Collective:
    """The one record op of the functional collective ``op`` (an ``OpOverload``)."""
    c = _COLLECTIVES.get(op)
    if c is None:
        c = _COLLECTIVES[op] = Collective(op)
    return c


def is_collective(func: Any) -> bool:
    """Whether a record's op ``func`` is a functional collective (replayed as one)."""
    return type(func) is Collective


def flatten(t: torch.Tensor) -> tuple[list[tuple[str, torch.Tensor]], dict[str, Any], Any]:
    """A wrapper's inner tensors by name, its other inner attributes (a DTensor's mesh), its
    flatten context."""
    names, ctx = t.__tensor_flatten__()  # type: ignore[attr-defined]
    tensors: list[tuple[str, torch.Tensor]] = []
    others: dict[str, Any] = {}
    for name in names:
        inner = getattr(t, name)
        if isinstance(inner, torch.Tensor):
            tensors.append((name, inner))
        else:
            others[name] = inner
    return tensors, others, ctx


def wrapper(t: torch.Tensor) -> bool:
    """Whether ``t`` is a wrapper subclass (cheap for plain tensors); a jagged nested tensor is
    none here (R8 [ jagged nested tensors are not recorded ])."""
    return type(t) is not torch.Tensor and not t.is_nested and is_wrapper(t)


def rewrapped(block: OpenBlock, t: Tensor) -> Var | None:
    """R12 [ wrappers of block tensors are block tensors ]: the Var of wrapper ``t``, rebuilt
    by a ``REWRAP`` of its inner tensors, if each is a tensor of ``block`` at its recorded
    version (or such a wrapper itself); else None."""
    tensors, others, ctx = flatten(t)
    refs: list[Var] = []
    for _, inner in tensors:
        e = _LIVE.get(id(inner))
        if e is not None and e.frame.owner is block.owner and e() is inner and _version(inner) == e.version:  # type: ignore[attr-defined]
            refs.append(e)  # type: ignore[arg-type]  # this block's entries are Vars
            continue
        # (a dead entry at its id is none of ``inner``'s: ``_record.registry`` invariant 1)
        v = rewrapped(block, inner) if (e is None or e() is not inner) and wrapper(inner) else None
        if v is None:
            return None
        refs.append(v)
    if not refs:
        return None
    ops = block.record.ops
    var = _loose_var(block, t, len(ops), refs[0].root)
    names = tuple(name for name, _ in tensors)
    args = [type(t), ctx, t.shape, t.stride(), others, names, *refs]
    ops.append(_new_tuple(OpRecord, (REWRAP, args, NO_KWARGS, None, (var,))))
    return var


def note_inner(block: OpenBlock, var: Var, t: Tensor) -> None:
    """R12 [ wrappers of block tensors are block tensors ]: the inner tensors of ``t``, the
    tensor of ``var`` if it is a wrapper, become block tensors (``INNER`` of it)."""
    if not wrapper(t):
        return
    for name, inner in flatten(t)[0]:
        if _registry.lookup(inner) is not None:
            continue
        ops = block.record.ops
        v = _loose_var(block, inner, len(ops), var.root)
        ops.append(_new_tuple(OpRecord, (INNER, [var, name], NO_KWARGS, None, (v,))))
        note_inner(block, v, inner)


def _loose_var(block: OpenBlock, t: Tensor, index: int, root: Group) -> Var:
    """The registered Var of ``t``, made by op ``index``, in ``root``'s storage group (a version
    counter of its own, not a loose member: R12 [ wrappers of block tensors are block tensors ])."""
    var = new_var(t, index, block.frame, root, _version(t))
    register(var)
    return var


def _version(t: Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # inference tensors have no version counter
        return 0
