"""Process-wide defaults changed between forward and backward (``torch.set_default_dtype``,
``torch.set_default_device``): a replay makes what forward made, so the gradients are the
plain program's.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from support.contract import check, leaf, weighted_sum

FACTORIES = {
    "ones": lambda: torch.ones(4, 4),
    "zeros_plus": lambda: torch.zeros(4, 4) + 0.5,
    "full": lambda: torch.full((4, 4), 0.25),
    "arange": lambda: torch.arange(16.0).view(4, 4),
    "linspace": lambda: torch.linspace(0, 1, 16).view(4, 4),
    "eye": lambda: torch.eye(4),
    "rand": lambda: torch.rand(4, 4),
    "randn": lambda: torch.randn(4, 4),
    "tensor_literal": lambda: torch.tensor([[1.0, 2.0, 3.0, 4.0]]).expand(4, 4),
    "empty_fill": lambda: torch.empty(4, 4).fill_(0.75),
    "scalar_tensor": lambda: torch.scalar_tensor(1.5).expand(4, 4),
    "complex_randn": lambda: torch.randn(4, 4, dtype=torch.complex64).abs(),
}


def _made_on(device):
    """Factories without a device make their tensors on ``device`` (on CUDA through
    ``with torch.device(...)``; on CPU nothing is changed)."""
    return contextlib.nullcontext() if device == "cpu" else torch.device(device)


@pytest.mark.parametrize("factory", list(FACTORIES))
def test_set_default_dtype_between_forward_and_backward(factory, device):
    """Factories replay with the dtype forward resolved, whatever the default is when
    backward runs."""

    def program(scope):
        a = leaf(4, 4, device=device)
        with _made_on(device), scope():
            h = a * FACTORIES[factory]()
            h = h.sin()
        y = h * h
        del h
        loss = weighted_sum(y)
        old = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        try:
            loss.backward()
        finally:
            torch.set_default_dtype(old)
        return [a.grad]

    check(program, must_work=True)


def test_set_default_device_between_forward_and_backward(device):
    def program(scope):
        a = leaf(4, 4, device=device)
        with _made_on(device), scope():
            h = (a * torch.ones(4, 4)).sin() + torch.arange(4.0)
        y = h * h
        del h
        loss = weighted_sum(y)
        torch.set_default_device("meta")
        try:
            loss.backward()
        finally:
            torch.set_default_device(None)
            if getattr(torch._GLOBAL_DEVICE_CONTEXT, "device_context", False) is None:
                # torch < 2.9 leaves None there, on which get_default_device raises.
                del torch._GLOBAL_DEVICE_CONTEXT.device_context
        return [a.grad]

    check(program, must_work=True)
