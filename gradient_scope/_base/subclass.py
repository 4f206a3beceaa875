"""Tensor subclasses that wrap other tensors (DTensor, ...): where their data is.

A traceable wrapper subclass (``DTensor`` and other ``__tensor_flatten__``
subclasses) keeps its values in inner tensors; its own storage is a
placeholder: it has no data pointer, and it keeps its size when the inner
storage is freed. ``as_strided`` on it is not supported (DTensor raises), and
``torch.empty`` cannot recreate it from shape alone. Code that works on
storages asks this module for the plain tensors instead.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from .torch_compat import is_traceable_wrapper_subclass, storage_id

__all__ = [
    "PLAIN",
    "is_wrapper",
    "data_tensors",
    "data_tensor",
    "storage_freed",
    "data_storage_id",
    "data_address",
    "own_storage",
]

#: The tensor types that are never wrappers.
PLAIN = (torch.Tensor, torch.nn.Parameter)


def is_wrapper(t: torch.Tensor) -> bool:
    """True for a tensor whose data lives in inner tensors (e.g. a DTensor)."""
    return type(t) not in PLAIN and is_traceable_wrapper_subclass(t)


def data_tensors(t: torch.Tensor) -> Iterator[torch.Tensor]:
    """The plain tensors holding ``t``'s data: ``t`` itself, or the inner tensors
    of a wrapper subclass (a DTensor's local tensor), recursively."""
    if not is_wrapper(t):
        yield t
        return
    attrs, _ = t.__tensor_flatten__()  # type: ignore[attr-defined]
    for name in attrs:
        inner = getattr(t, name)
        if isinstance(inner, torch.Tensor):
            yield from data_tensors(inner)


def data_tensor(t: torch.Tensor) -> torch.Tensor:
    """The first plain tensor holding ``t``'s data (``t`` unless it is a wrapper)."""
    return next(data_tensors(t), t)


def _freed_plain(t: torch.Tensor) -> bool:
    return t.layout == torch.strided and t.numel() > 0 and t.untyped_storage().nbytes() == 0


def storage_freed(t: torch.Tensor) -> bool:
    """True when ``t`` has elements but the storage holding them has size 0 (FSDP2
    resizes unsharded parameter storage to 0 after forward); looks inside wrappers,
    whose own placeholder storage keeps its size."""
    if not is_wrapper(t):
        return _freed_plain(t)
    return any(_freed_plain(d) for d in data_tensors(t))


def data_storage_id(t: torch.Tensor) -> int | None:
    """Which storage holds ``t``'s data (``_base.torch_compat.storage_id`` of its first
    plain tensor); None for a tensor without one (sparse)."""
    try:
        return storage_id(data_tensor(t))
    except (RuntimeError, NotImplementedError):
        return None


def data_address(t: torch.Tensor) -> int | None:
    """Where ``t``'s data is in memory: the address of the storage holding it, which
    two storage objects over the same memory (``torch.from_numpy`` of one array
    twice) share; None for tensors without one (sparse) or with a freed one."""
    try:
        storage = data_tensor(t).untyped_storage()  # a wrapper's own storage has no data
    except (RuntimeError, NotImplementedError):
        return None
    return storage.data_ptr() if storage.nbytes() else None


def own_storage(t: torch.Tensor) -> torch.UntypedStorage | None:
    """For a subclass whose aliases do not share its storage (a wrapper made with
    ``_make_wrapper_subclass`` that does not say where its data is: each
    ``detach()`` is a new wrapper with a placeholder storage of its own), that
    storage, to be kept: ``t`` was given another one exactly when
    ``t.untyped_storage()`` is no longer it. None for every other tensor (its
    aliases share its storage, or its inner tensors' for a traceable wrapper)."""
    if type(t) in PLAIN or is_traceable_wrapper_subclass(t) or t.layout != torch.strided:
        return None
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
