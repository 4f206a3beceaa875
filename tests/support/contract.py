"""The contract every scoped program is held to: it returns exactly what the same program
returns without any scope (``torch.equal``, same seed, on CPU and on CUDA), or it raises
``RecomputeError`` (``check``); and small helpers of the programs written against it, which
make their tensors on the test's ``device``.

A scoped run drops its traceback before failing: a stored traceback keeps block tensors,
and with them the scope's interception, alive into the next test.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import pytest
import torch

from gradient_scope import RecomputeError

from support import PlainScopes, Scopes, assert_same

Program = Callable[[Any], list]


def _outcome(program: Program, scopes: Any, seed: int) -> tuple[str, Any]:
    """Run ``program(scopes)``; ("ok", results) or ("RecomputeError"/"error", message).
    Only the message survives an exception (no traceback, no frames, no tensors)."""
    torch.manual_seed(seed)
    try:
        return "ok", program(scopes)
    except RecomputeError as e:
        return "RecomputeError", f"RecomputeError: {e}"
    except Exception as e:  # noqa: BLE001
        return "error", f"{type(e).__name__}: {e}"


def check(
    program: Program, *, must_work: bool = False, seed: int = 0, cuda_inexact: str | None = None, **options: Any
) -> Scopes:
    """The contract: the scoped program equals the plain one bitwise, or raises
    RecomputeError (only equality counts when ``must_work``). ``cuda_inexact``: see
    ``support.assert_same``. Returns the Scopes used."""
    kind, expected = _outcome(program, PlainScopes(), seed)
    assert kind == "ok", f"test bug: the plain program fails: {expected}"
    scopes = Scopes(**options)
    kind, actual = _outcome(program, scopes, seed)
    if kind != "ok":
        gc.collect()  # frames of the failure may hold block tensors in cycles
    if kind == "RecomputeError" and not must_work:
        return scopes
    if kind != "ok":
        what = "must work like the plain program, but raised" if must_work else "raised"
        pytest.fail(f"scoped program {what} {actual}", pytrace=False)
    msg = None
    try:
        assert len(actual) == len(expected)
        for i, (a, e) in enumerate(zip(actual, expected)):
            if e is None:
                assert a is None, f"result {i}: plain has None, scoped has a value"
            else:
                assert_same(a, e, f"result {i}", cuda_inexact=cuda_inexact)
    except AssertionError as e:
        msg = f"scoped program is silently different from the plain program: {e}"
    if msg:
        pytest.fail(msg, pytrace=False)
    return scopes


def plain_grad(f: Callable[[torch.Tensor], torch.Tensor], a: torch.Tensor) -> torch.Tensor:
    """Ground truth: d sum(f(a)) / da computed by plain autograd, no scope."""
    x = a.detach().clone().requires_grad_()
    f(x).sum().backward()
    return x.grad


def scribble_free_memory(nbytes: int = 4096, device: str = "cpu") -> None:
    """Fill memory the allocator will hand out next with a sentinel, so that a replay
    reading an uninitialised buffer gets garbage, not by chance the freed forward value."""
    for n in (nbytes // 4, 30, 24, 16):  # the sizes the programs here allocate
        bufs = [torch.full((n,), 12345.0, device=device) for _ in range(8)]
        del bufs


def leaf(*shape: int, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> torch.Tensor:
    return torch.randn(*shape, dtype=dtype, device=device).requires_grad_()


def weighted_sum(t: torch.Tensor) -> torch.Tensor:
    """A loss that weights every element differently (a plain sum hides sign errors of
    symmetric terms); real-valued for complex tensors."""
    w = torch.linspace(-1.0, 2.0, t.numel(), device=t.device).reshape(t.shape).to(t.dtype)
    out = t * w
    if out.is_complex():
        out = torch.view_as_real(out)
    return out.sum()
