"""What backward gets for a saved tensor when scopes are about: a tensor that is not the
scope's comes back as itself (no copy), and a block tensor whose value is still held (by
a later scope or by the user) is used as it is, not recomputed.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from gradient_scope import recompute_scope

from support import stat
from support.contract import check, leaf, weighted_sum


def _outside(kind: str, device: str) -> torch.Tensor:
    if kind == "leaf":
        return leaf(3, device=device)
    if kind == "parameter":
        return nn.Parameter(torch.randn(3, device=device))
    if kind == "nonleaf":
        return leaf(3, device=device) * 2
    if kind == "view":
        return torch.randn(6, device=device)[1:4]
    return torch.randn(3, device=device)


@pytest.mark.parametrize("where", ["inside", "after_block_hooks_alive"])
@pytest.mark.parametrize("kind", ["no_grad", "view"])
def test_outside_tensor_saved_comes_back_as_same_object(kind, where, device):
    """A tensor that is not the scope's (from outside the block), saved by an op, comes
    back from autograd as the same object, as without hooks (PyTorch's own checkpoint
    test checks ``saved is b`` the same way, and torch.utils.checkpoint passes it).

    Only for tensors that do not require grad: for those that do, PyTorch itself re-wraps
    whatever an unpack hook returns into a new tensor object (SavedVariable::unpack), even
    for ``saved_tensors_hooks(lambda x: x, lambda x: x)`` -- see the next test."""
    a = leaf(3, device=device)
    b = _outside(kind, device)
    y0 = a * b  # ground truth: no hooks
    assert y0.grad_fn._saved_other is b
    del y0
    keep = None
    if where == "inside":
        with recompute_scope():
            y = a * b
    else:
        with recompute_scope():
            keep = a.sin()  # a live block tensor: the interception is active after the block
        y = a * b
    same = y.grad_fn._saved_other is b
    del y, keep
    assert same, "saved outside tensor b does not come back as b"


@pytest.mark.parametrize("where", ["inside", "after_block_hooks_alive"])
@pytest.mark.parametrize("kind", ["leaf", "parameter", "nonleaf"])
def test_outside_tensor_requiring_grad_saved_is_not_copied(kind, where, device):
    """For tensors that require grad, object identity is out of any hook's reach (see
    above); what a scope must still give is b itself re-wrapped: the same storage, offset
    and version, no copy."""
    a = leaf(3, device=device)
    b = _outside(kind, device)
    keep = None
    if where == "inside":
        with recompute_scope():
            y = a * b
    else:
        with recompute_scope():
            keep = a.sin()
        y = a * b
    saved = y.grad_fn._saved_other
    ok = (
        saved.data_ptr() == b.data_ptr()
        and saved._version == b._version
        and saved.shape == b.shape
        and saved.stride() == b.stride()
    )
    del y, keep, saved
    assert ok


@pytest.mark.parametrize("read", ["add", "mul", "view", "inplace_on_clone"])
def test_block_tensor_held_by_later_scope_is_not_recomputed(read, device):
    """A block tensor that a later scope read (and so keeps in memory) is used as it is
    in backward: its own scope replays nothing."""

    def program(scope):
        a = leaf(4, 4, device=device)
        w = leaf(4, 4, device=device)
        c = torch.randn(4, 4, device=device)
        with scope():
            h = a.exp()
        with scope():
            if read == "add":
                g = h + w
            elif read == "mul":
                g = h * w
            elif read == "view":
                g = h.t() + w
            else:
                g = h.clone().mul_(w)
        y = h * c  # saves h: a handle of the first scope
        del h
        loss = weighted_sum(y) + weighted_sum(g * g)
        loss.backward()
        res = [a.grad, w.grad]
        del g  # the later scope's tensor lives until after backward
        return res

    scopes = check(program, must_work=True)
    first = scopes.created[0]
    assert stat(first, "tensors_packed") >= 1
    assert stat(first, "ops_replayed") == 0 and stat(first, "replays") == 0, (
        f"the first scope recomputed a tensor whose value the later scope holds: {first.stats}"
    )


def test_block_tensor_kept_by_user_is_not_recomputed(device):
    def program(scope):
        a = leaf(4, 4, device=device)
        c = torch.randn(4, 4, device=device)
        with scope():
            h = a.exp()
        y = h.sin() * c
        weighted_sum(y * h).backward()
        return [a.grad, h.detach().clone()]

    scopes = check(program, must_work=True)
    assert stat(scopes.created[0], "ops_replayed") == 0
