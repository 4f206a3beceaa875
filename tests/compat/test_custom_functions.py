"""Custom ``torch.autograd.Function`` classes with scopes: block tensors a Function saves with
``ctx.save_for_backward`` (inside the block or after it) are recomputed and give the
plain gradients; an outside tensor it saves comes back as itself; saving its own output
under the scope's hooks keeps nothing alive.
"""

from __future__ import annotations

import weakref

import pytest
import torch

from gradient_scope import recompute_scope

from support import grads, run_both
from support.contract import leaf


class _ExpSavesOutput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        with torch.enable_grad():  # makes autograd nodes during forward
            (x.detach().requires_grad_() * 2.0).sum()
        y = x.exp()
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * y


def test_custom_function_saving_its_output_under_the_hooks_leaks_nothing(device):
    """A custom Function's output saved by the Function itself, while the scope's hooks
    are on the stack, is kept as a detached alias (as autograd keeps an output): holding
    the output itself would be a reference cycle through its own node."""
    w = leaf(4, device=device)
    with recompute_scope():
        h = w * 2.0
    y = _ExpSavesOutput.apply(w)
    probe = weakref.ref(y)
    (y * h).sum().backward()
    del y
    assert probe() is None  # without gc.collect()
    assert torch.equal(w.grad, w.exp() * (w * 2.0) + w.exp() * 2.0)


@pytest.mark.parametrize("where", ["inside", "after_block_hooks_alive"])
def test_outside_tensor_saved_by_function_comes_back_as_same_object(where, device):
    """PyTorch's checkpoint identity test, with a scope: an autograd.Function saves an
    outside tensor (no grad) with ctx.save_for_backward; backward gets that very object."""
    seen = []

    class SaveOther(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, y):
            ctx.save_for_backward(y)
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            (saved,) = ctx.saved_tensors
            seen.append(saved)
            return g * saved, None

    a = leaf(3, device=device)
    b = torch.randn(3, device=device)
    keep = None
    if where == "inside":
        with recompute_scope():
            out = SaveOther.apply(a, b)
    else:
        with recompute_scope():
            keep = a.sin()
        out = SaveOther.apply(a, b)
    out.sum().backward()
    del out, keep
    ok = seen[0] is b
    seen.clear()
    assert ok, "ctx.saved_tensors does not return the outside tensor itself"
    assert torch.equal(a.grad, b)


class _SaveAndUse(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g * w, g * x


def test_custom_function_saving_block_tensors(device):
    def program(scope):
        a = torch.randn(4, 3, requires_grad=True, device=device)
        w = torch.randn(4, 3, requires_grad=True, device=device)
        with scope():
            x = a.exp()
            z = _SaveAndUse.apply(x, w)  # saved inside the block
            u = z.sin()
        v = _SaveAndUse.apply(u, w)  # block tensor saved by ctx after the block
        ref = weakref.ref(u)
        del x, z, u
        if scope.real:
            assert ref() is None
        v.sum().backward()
        return dict(v=v.detach(), **grads(dict(a=a, w=w)))

    run_both(program)
