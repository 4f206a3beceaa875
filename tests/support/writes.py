"""Writes to a tensor between forward and backward, by every route (shared by the
hidden-write and fuzz tests). Each multiplies the values by 3; ``inplace`` and
``set_`` bump the version counter, the others do not (``data_assign`` and ``set_`` give
the tensor another storage)."""

import torch


def _inplace(t: torch.Tensor) -> None:
    with torch.no_grad():
        t.mul_(3.0)


def _data_inplace(t: torch.Tensor) -> None:
    t.data.mul_(3.0)


def _data_assign(t: torch.Tensor) -> None:
    t.data = t.data * 3.0


def _numpy(t: torch.Tensor) -> None:
    arr = t.detach().numpy()
    arr *= 3.0


def _untyped_storage(t: torch.Tensor) -> None:
    new = (t.detach() * 3.0).contiguous()
    t.untyped_storage().copy_(new.untyped_storage())


def _set(t: torch.Tensor) -> None:
    with torch.no_grad():
        t.set_((t.detach() * 3.0).clone())


WRITES = {
    "inplace": _inplace,
    "set_": _set,
    "data_assign": _data_assign,
    "data_inplace": _data_inplace,
    "numpy": _numpy,
    "untyped_storage": _untyped_storage,
}
