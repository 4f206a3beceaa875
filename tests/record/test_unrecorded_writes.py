"""Writes to a block's tensors that the recorder does not see.

A ``torch.compile``'d function called inside an eager block runs its graph
unrecorded (its graph stores what it decides), including in-place writes to the
block's tensors, directly or through a view; an op on a list of tensors writes
them without naming one. The record knows the version each read happened at: a
later read of such a tensor must use its written value (kept, as for an outside
tensor), never a replay without the write; a value saved before the write cannot
be rebuilt and raises, as PyTorch raises for it.
"""

import pytest
import torch

from gradient_scope import RecomputeError

from support import PlainScopes, Scopes, assert_all_same, grads


@torch.compile(backend="aot_eager")
def _scale_(t):
    t.mul_(2.0)


@torch.compile(backend="aot_eager")
def _scale_row_(t):
    t[0].mul_(2.0)


@torch.compile(backend="aot_eager")
def _scale_through_view_(t):
    t.view(-1)[1:5].add_(1.0)


def _foreach_scale_(t):
    torch._foreach_mul_([t], 2.0)


WRITERS = {
    "compiled": _scale_,
    "compiled_row": _scale_row_,
    "compiled_view": _scale_through_view_,
    "foreach": _foreach_scale_,
}


def _run_both(program):
    torch.manual_seed(0)
    expected = program(PlainScopes())
    torch.manual_seed(0)
    actual = program(Scopes())
    assert_all_same(actual, expected)


@pytest.mark.parametrize("grad_mode", ["no_grad", "grad"])
@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_read_after_unrecorded_write(writer, grad_mode, device):
    write = WRITERS[writer]

    def program(scope):
        a = torch.randn(3, 4, requires_grad=True, device=device)
        c = torch.randn(3, 4, requires_grad=True, device=device)

        def fwd():
            with scope():
                x = a * 2.0  # saves nothing of x
                if grad_mode == "no_grad":
                    with torch.no_grad():
                        write(x)
                else:
                    write(x)
                y = x.sin()  # reads x after the write; y's backward needs x
                z = y * 1.5
            return (z * c).sum()

        fwd().backward()
        return grads({"a": a, "c": c})

    _run_both(program)


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_write_of_a_view_made_in_block(writer, device):
    write = WRITERS[writer]

    def program(scope):
        a = torch.randn(3, 4, requires_grad=True, device=device)
        c = torch.randn(4, requires_grad=True, device=device)

        def fwd():
            with scope():
                x = a * 2.0
                row = x[1]
                with torch.no_grad():
                    write(row)
                y = x.cos()  # reads the base after a write through its view
            return (y * c).sum()

        fwd().backward()
        return grads({"a": a, "c": c})

    _run_both(program)


def test_saved_before_unrecorded_write_raises(device):
    # sin saved x before the compiled write: PyTorch raises its in-place error; the
    # scope cannot rebuild the saved value and raises too (a RuntimeError either way).
    def program(scope):
        a = torch.randn(3, 4, requires_grad=True, device=device)

        def fwd():
            with scope():
                x = a * 2.0
                y = x.sin()
                with torch.no_grad():
                    _scale_(x)
            return y.sum()

        fwd().backward()

    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        program(PlainScopes())
    with pytest.raises(RecomputeError, match="torch.compile"):
        program(Scopes())


def test_tensor_saved_after_unrecorded_write_is_stored(device):
    # Saved after the write (by an op after the block): stored, not replayed.
    def program(scope):
        a = torch.randn(3, 4, requires_grad=True, device=device)

        def fwd():
            with scope():
                x = a * 2.0
                with torch.no_grad():
                    _scale_(x)
            return x.exp().sum()  # exp saves its output, not x; x.pow saves x
            # (both paths: see below)

        def fwd2():
            with scope():
                x = a * 2.0
                with torch.no_grad():
                    _scale_(x)
            return x.pow(3).sum()

        fwd().backward()
        g1 = a.grad.clone()
        a.grad = None
        fwd2().backward()
        return {"g1": g1, "g2": a.grad}

    _run_both(program)
