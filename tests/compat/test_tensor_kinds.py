"""Tensors other than plain dense ones: ``torch.inference_mode()`` inside a block and
inference tensors read by it, sparse (COO, CSR) tensors read or made by a block, jagged
nested tensors made in a block. Each must work: the plain program's gradients, bitwise.
"""

from __future__ import annotations

import pytest
import torch

from gradient_scope import recompute_scope

from support import assert_stacks_clean
from support.contract import check, leaf, weighted_sum

INFERENCE = [
    "mode_inside_block",
    "mode_inside_reads_block_tensor",
    "mode_inside_reads_outside",
    "inference_tensor_read",
    "inference_tensor_cloned",
    "inference_tensor_read_later_scope",
]


@pytest.mark.parametrize("case", INFERENCE)
def test_inference_mode_and_inference_tensors(case, device):
    def program(scope):
        a = leaf(4, 4, device=device)
        b = torch.randn(4, 4, device=device)
        with torch.inference_mode():
            k_outside = torch.randn(4, 4, device=device)
        with scope():
            h = a.sin()
            if case == "mode_inside_block":
                with torch.inference_mode():
                    k = torch.ones(4, device=device) * 2
                g = h + k
            elif case == "mode_inside_reads_block_tensor":
                with torch.inference_mode():
                    k = h * 2 + 1
                g = h + k
            elif case == "mode_inside_reads_outside":
                with torch.inference_mode():
                    k = b.exp()
                g = (h + k).cos()
            elif case == "inference_tensor_read":
                g = (h + k_outside).sin()
            elif case == "inference_tensor_cloned":
                g = (h + k_outside.clone()).sin()
            else:
                g = h * 1
        if case == "inference_tensor_read_later_scope":
            with scope():
                g = (g + k_outside).exp()
        y = g * g
        del h, g
        weighted_sum(y).backward()
        return [a.grad]

    check(program, must_work=True)


def test_inference_mode_inside_block_state_clean(device):
    a = leaf(4, device=device)
    with recompute_scope():
        with torch.inference_mode():
            k = torch.ones(4, device=device)
        g = a.sin() + k
    del g, k
    assert_stacks_clean()


def _sparse(layout: str, t: torch.Tensor) -> torch.Tensor:
    return t.to_sparse() if layout == "coo" else t.to_sparse_csr()


SPARSE_OPS = {
    "matmul_sin": lambda s, a: (s @ a).sin(),
    "sparse_mm_tanh": lambda s, a: torch.sparse.mm(s, a).tanh(),
    "addmm": lambda s, a: torch.addmm(a, s, a).sin(),
    "to_dense_add": lambda s, a: (s.to_dense() + a).sin(),
    "to_dense_mul": lambda s, a: s.to_dense() * a,
    "mv": lambda s, a: (s @ a[:, 0]).exp().unsqueeze(1) * a,
}


# cuSPARSE's SpMM (the matmuls with a sparse operand on CUDA) may sum in another order
# from one run to the next.
CUSPARSE = "cuSPARSE SpMM, not bitwise reproducible"


@pytest.mark.parametrize("op", list(SPARSE_OPS))
@pytest.mark.parametrize("layout", ["coo", "csr"])
def test_sparse_tensor_read_by_block(layout, op, device):
    def program(scope):
        a = leaf(4, 4, device=device)
        s = _sparse(layout, torch.randn(4, 4, device=device).relu())
        with scope():
            g = SPARSE_OPS[op](s, a)
        y = g * g
        del g
        weighted_sum(y).backward()
        return [a.grad]

    check(program, must_work=True, cuda_inexact=None if op.startswith("to_dense") else CUSPARSE)


@pytest.mark.parametrize("layout", ["coo", "csr"])
def test_sparse_tensor_made_in_block(layout, device):
    def program(scope):
        a = leaf(4, 4, device=device)
        with scope():
            s = _sparse(layout, a.detach().relu())
            g = (s @ a).sin()
        y = g * g
        del g, s
        weighted_sum(y).backward()
        return [a.grad]

    check(program, must_work=True, cuda_inexact=CUSPARSE)


NESTED = {
    "from_jagged": lambda a, off: torch.nested.nested_tensor_from_jagged(a.sin(), offsets=off),
    "from_jagged_ops": lambda a, off: torch.nested.nested_tensor_from_jagged(a * 2, offsets=off).sin() * 2,
    "as_nested_tensor": lambda a, off: torch.nested.as_nested_tensor([a[:2].sin(), a[2:].cos()], layout=torch.jagged),
    "softmax": lambda a, off: torch.nested.nested_tensor_from_jagged(a * 2, offsets=off).softmax(-1),
}


@pytest.mark.parametrize("saved", ["inside", "after"])
@pytest.mark.parametrize("offsets", ["outside", "inside"])
@pytest.mark.parametrize("make", list(NESTED))
def test_jagged_nested_tensor_made_in_block(make, offsets, saved, device):
    def program(scope):
        a = leaf(5, 3, device=device)
        off_out = torch.tensor([0, 2, 5], device=device)
        with scope():
            off = off_out if offsets == "outside" else torch.tensor([0, 2, 5], device=device)
            nt = NESTED[make](a, off)
            if saved == "inside":
                g = nt * nt
        if saved == "after":
            g = nt.sin() * nt
        del nt
        weighted_sum(g.values()).backward()
        return [a.grad]

    check(program, must_work=True)
