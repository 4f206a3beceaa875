"""Tensor subclasses read by a block: wrappers without a real storage (the quantised
weights users train adapters on, torchao's NF4, are in ``test_hf_qlora.py``).

A wrapper made with ``torch.Tensor._make_wrapper_subclass`` has a placeholder
storage, and each of its aliases (``detach()``) is a new wrapper with a new
placeholder: "was given another storage" must mean what it means for a plain
tensor (the tensor's own storage changed), not "an alias has another one".
"""


import pytest
import torch
from torch.utils._pytree import tree_map

from gradient_scope import RecomputeError, recompute_scope

from support import PlainScopes, Scopes, assert_all_same, assert_interception_gone, grads


class SizesWrapper(torch.Tensor):
    """A wrapper subclass with a custom size policy and no real storage."""

    @staticmethod
    def __new__(cls, inner):
        return torch.Tensor._make_wrapper_subclass(
            cls,
            inner.shape,
            dtype=inner.dtype,
            device=inner.device,
            requires_grad=inner.requires_grad,
            dispatch_sizes_strides_policy="sizes",
        )

    def __init__(self, inner):
        self.inner = inner

    def __repr__(self):
        return f"SizesWrapper({self.inner!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.sym_size.default:
            return args[0].inner.size()

        def unwrap(t):
            return t.inner if isinstance(t, SizesWrapper) else t

        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))
        if func in (torch.ops.aten.detach.default, torch.ops.aten.alias.default):
            return SizesWrapper(out)
        if func._schema.name.endswith("_") and isinstance(args[0], SizesWrapper):
            return args[0]  # an in-place op returns its (wrapper) argument
        return out


def _wrapper_program(scope):
    w = SizesWrapper(torch.randn(3, 4))
    x = torch.randn(2, 3, requires_grad=True)

    def fwd():
        with scope():
            y = (x * 2.0) @ w
        return y.sin().sum()

    fwd().backward()
    return grads({"x": x})


def test_wrapper_without_storage_read_by_block():
    torch.manual_seed(0)
    expected = _wrapper_program(PlainScopes())
    torch.manual_seed(0)
    actual = _wrapper_program(Scopes())
    assert_all_same(actual, expected)
    assert_interception_gone()


def test_wrapper_written_after_block_raises():
    w = SizesWrapper(torch.randn(3, 4))
    x = torch.randn(2, 3, requires_grad=True)

    def fwd():
        with recompute_scope():
            y = (x * 2.0) @ w
        return y.sin().sum()

    loss = fwd()
    with torch.no_grad():
        w.mul_(2.0)
    with pytest.raises(RecomputeError, match="modified in place"):
        loss.backward()
    del loss
    assert_interception_gone()


def test_interception_gone_after_replay_raised():
    # A RecomputeError raised from a replay in backward leaves no hook pair once
    # the graph is released (not only at the next backward).
    x = torch.randn(4, requires_grad=True)
    src = torch.randn(4)

    def fwd():
        with recompute_scope():
            y = (src * x).exp()
        return y.sum()

    loss = fwd()
    src.add_(1.0)
    with pytest.raises(RecomputeError):
        loss.backward()
    del loss
    assert_interception_gone()
