"""Custom ``autograd.Function`` backwards that write into the tensors they unpack.

Fused-loss and memory-saving kernels reuse a saved tensor as scratch
(``t.mul_(0).add_(...)``). Autograd hands each unpack its own saved tensor; a
replay that serves several handles from one computed value must notice such a
write and never rebuild another handle's value from the written one (P4).
"""

import contextlib

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from gradient_scope import recompute_scope

from support import PlainScopes, Scopes, assert_all_same, grads
from support.fuzz_ops import ScratchInput as ScratchBackward
from support.fuzz_ops import ScratchIntermediate as ScratchSavedIntermediate
from support.fuzz_ops import ScratchPair


def _forward_frontier(scope, a, w, view):
    # Scratch runs first in backward (made last); exp's saved output is rebuilt from
    # x, which the replay for Scratch's handle also made.
    with scope():
        x = a * 3
        e = x.exp()
    xs = x.t() if view else x
    return (e * w).sum() + ScratchBackward.apply(xs).sum()


def _leaves(device):
    return torch.randn(4, 3, requires_grad=True, device=device), torch.randn(4, 3, requires_grad=True, device=device)


@pytest.mark.parametrize("view", [False, True], ids=["tensor", "view_after_block"])
def test_write_to_unpacked_tensor_does_not_reach_other_handles(view, device):
    def program(scope):
        a, w = _leaves(device=device)
        _forward_frontier(scope, a, w, view).backward()
        return grads({"a": a, "w": w})

    torch.manual_seed(0)
    expected = program(PlainScopes())
    torch.manual_seed(0)
    actual = program(Scopes())
    assert_all_same(actual, expected)

    # torch.utils.checkpoint gives the same gradients.
    torch.manual_seed(0)
    a, w = _leaves(device=device)
    loss = checkpoint(lambda a, w: _forward_frontier(PlainScopes(), a, w, view), a, w, use_reentrant=False)
    loss.backward()
    assert_all_same(grads({"a": a, "w": w}), expected)


def test_intermediate_saved_by_forward_written_by_backward(device):
    # The Function's own forward ops are recorded into the block (R3); its saved
    # exp(x) is a block tensor, and so is the copy of exp(x) read after it.
    def program(scope):
        a, w = _leaves(device=device)

        def fwd():
            with scope():
                x = a * 3
                y = ScratchSavedIntermediate.apply(x)
                e = x.exp()
            return (e * w).sum() + y.sum()

        fwd().backward()
        return grads({"a": a, "w": w})

    torch.manual_seed(0)
    expected = program(PlainScopes())
    torch.manual_seed(0)
    actual = program(Scopes())
    assert_all_same(actual, expected)


def test_second_unpack_of_the_written_tensor_raises_as_plain(device):
    # Two saves of the same tensor: the second unpack sees the first backward's write.
    # PyTorch raises its in-place error; so must the scope (never the rebuilt value of
    # a tensor that autograd would hand back written).
    def program(scope):
        a, _ = _leaves(device=device)

        def fwd():
            with scope():
                x = a * 3
            return x.sin().sum() + ScratchBackward.apply(x).sum()

        fwd().backward()

    torch.manual_seed(0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        program(PlainScopes())
    torch.manual_seed(0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        program(Scopes())


def test_served_value_is_not_copied(device):
    # The common path hands out the replayed value itself (no defensive copy): two
    # handles of one tensor unpacked in one pass get the same storage.
    seen = []

    class Peek(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            (t,) = ctx.saved_tensors
            seen.append(t.data_ptr())
            return g

    a, _ = _leaves(device=device)

    def fwd():
        with Scopes()():
            x = a * 3
        return Peek.apply(x).sum() + Peek.apply(x).sum()

    fwd().backward()
    assert len(seen) == 2 and seen[0] == seen[1]


@pytest.mark.parametrize("debug", [False, True], ids=["default", "debug"])
def test_two_saves_of_one_tensor_share_storage_as_in_plain(debug, device):
    # Plain autograd hands both unpacks the same storage, so the backward's writes
    # compound; the scope's two handles must get one value too (with debug=True as
    # well, where the tensor is kept alive for the comparison but still replayed).
    def program(scope):
        a0, w = _leaves(device=device)

        def fwd():
            with scope():
                a = a0 * 0.5
                y = ScratchPair.apply(a, a)
            return (y * w).sum()

        fwd().backward()
        return grads({"a0": a0, "w": w})

    torch.manual_seed(0)
    expected = program(PlainScopes())
    torch.manual_seed(0)
    actual = program(Scopes(debug=debug))
    assert_all_same(actual, expected)


def test_double_backward_of_a_writing_backward_follows_saved_tensor_hooks(device):
    # Differentiating again (create_graph=True) through a backward that writes its
    # unpacked tensors in place: under *any* saved-tensor hooks, even identity ones,
    # PyTorch builds another double-backward graph than without hooks, so the scope
    # gives what PyTorch gives under hooks, not what it gives without
    # (docs/limitations.md). First-order gradients are plain's.
    def program(ctx_for_block, ctx_for_all):
        torch.manual_seed(0)
        a0 = torch.randn(4, 4, requires_grad=True, device=device)
        w = torch.randn(4, 4, device=device)
        with ctx_for_all():
            with ctx_for_block():
                y = a0[:, torch.randperm(4, device=device)]
            z = ScratchPair.apply(y, y)
        loss = (z * w).sum()
        del y
        (g,) = torch.autograd.grad(loss, [a0], create_graph=True)
        (g * g).sum().backward()
        return g.detach(), a0.grad

    def identity():
        return torch.autograd.graph.saved_tensors_hooks(lambda x: x, lambda x: x)

    plain = program(contextlib.nullcontext, contextlib.nullcontext)
    under_hooks = program(contextlib.nullcontext, identity)
    scoped = program(recompute_scope, contextlib.nullcontext)
    assert not torch.equal(under_hooks[1], plain[1])  # PyTorch's own difference
    assert torch.equal(scoped[0], plain[0])  # first order: plain's
    assert torch.equal(scoped[1], under_hooks[1])  # second order: PyTorch's under hooks
