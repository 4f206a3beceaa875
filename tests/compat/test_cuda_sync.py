"""No synchronizing CUDA call in a scoped training step, in a replay, or in a budgeted step.

Each runs under ``torch.cuda.set_sync_debug_mode("error")`` (restored after, also when
the run fails), in which any call that makes the host wait for the GPU -- a copy from
the device to the host, ``.item()``, ``nonzero``, ``torch.cuda.synchronize()`` -- raises
``RuntimeError``.  The plain program runs under the same mode first, so a failure here is
the library's.  The results are then compared with the plain program's, bitwise, outside
the mode (the comparison itself synchronizes).

The model-level steps run both ways a function-form scope runs on CUDA: recorded
(``GRADIENT_SCOPE_FAST=0``: every step checked) and in the steady state (the default on
CUDA: the first step, which dynamo captures, runs before the check; the later ones, bound
from the template, under it -- and they must have run steady).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from gradient_scope import Budget, apply_recompute
from gradient_scope._adapters.steady import run as steady

from support import HAS_CUDA, NO_CUDA_REASON, PlainScopes, Scopes, assert_all_same, stat

pytestmark = pytest.mark.skipif(not HAS_CUDA, reason=NO_CUDA_REASON)

D = 64
STEPS = 3  # the first step of a structure records (and, with a budget, measures); the others reuse it


@contextlib.contextmanager
def sync_is_an_error():
    """Any synchronizing CUDA call in the ``with`` block raises; the mode is put back."""
    torch.cuda.synchronize()  # (what earlier code queued is not the block's)
    before = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(before)


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.fc1(self.ln(x)))
        return x + self.fc2(F.dropout(h, 0.1, self.training))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[Block(D) for _ in range(3)], nn.LayerNorm(D)).to("cuda")


def _train(model: nn.Module, checked_from: int = 0) -> dict[str, list[torch.Tensor]]:
    """STEPS optimizer steps, those from ``checked_from`` on under the sync check; the
    losses and the parameters after."""
    torch.manual_seed(1)
    x = torch.randn(8, 32, D, device="cuda")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(STEPS):
        with sync_is_an_error() if step >= checked_from else contextlib.nullcontext():
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return {"losses": losses, "params": [p.detach() for p in model.parameters()]}


@pytest.fixture(params=["recorded", "steady"])
def path(request, monkeypatch):
    """How function-form scopes run: ``(name, steady runs so far)``; "steady" starts with
    no graph captured and no function given up on."""
    calls: list[int] = []
    if request.param == "recorded":
        monkeypatch.setenv("GRADIENT_SCOPE_FAST", "0")
    else:
        monkeypatch.delenv("GRADIENT_SCOPE_FAST", raising=False)  # CUDA arguments: on by default
        torch._dynamo.reset()
        monkeypatch.setattr(steady, "_failed", type(steady._failed)())
        monkeypatch.setattr(steady, "_failures", type(steady._failures)())
        monkeypatch.setattr(steady, "_eager", type(steady._eager)())
        real = steady._steady

        def counting(*args):
            calls.append(1)
            return real(*args)

        monkeypatch.setattr(steady, "_steady", counting)
    return request.param, calls


def _train_scoped(model: nn.Module, path) -> dict[str, list[torch.Tensor]]:
    name, steady_runs = path
    if name == "recorded":
        return _train(model)
    result = _train(model, checked_from=1)
    # every block call of the checked steps ran steady (3 blocks a step)
    assert len(steady_runs) >= 3 * (STEPS - 1), f"{len(steady_runs)} steady runs"
    return result


def test_the_check_is_armed():
    """The mode catches a synchronizing call (else the tests below would pass vacuously)."""
    t = torch.ones(3, device="cuda")
    with pytest.raises(RuntimeError, match="synchroniz"), sync_is_an_error():
        t.sum().item()
    assert torch.cuda.get_sync_debug_mode() == 0


def test_scoped_training_step_makes_no_synchronizing_call(path):
    expected = _train(_model())
    model = _model()
    apply_recompute(model, check_fn=Block)
    actual = _train_scoped(model, path)
    assert_all_same(actual, expected)


def test_budgeted_training_step_makes_no_synchronizing_call(path):
    """A budget between the floor and everything: the first step measures, the later
    ones store part of the block tensors and recompute the rest."""
    expected = _train(_model())
    model = _model()
    budget = Budget(1_000_000)
    apply_recompute(model, check_fn=Block, budget=budget)
    actual = _train_scoped(model, path)
    assert_all_same(actual, expected)
    assert budget.floor_bytes < budget.planned_bytes <= budget.bytes, (budget.floor_bytes, budget.planned_bytes)
    assert budget.stored_ops() and budget.predicted_recompute > 0, "the plan should store part, recompute part"


def test_replay_of_random_ops_makes_no_synchronizing_call():
    """A block with dropout, rand_like and bernoulli (RNG states captured and set back),
    replayed by a partial ``autograd.grad`` and again by a full backward."""

    def program(scope):
        a = torch.randn(64, 32, device="cuda", requires_grad=True)
        b = torch.randn(32, 16, device="cuda", requires_grad=True)
        c = torch.randn(64, 16, device="cuda", requires_grad=True)
        with sync_is_an_error():
            with scope():
                h = F.dropout(a.sin(), 0.3, training=True) @ b
                r = torch.rand_like(h) * torch.bernoulli(torch.sigmoid(h.detach()))
                x = (h * r).tanh()
            y = x * c
            del h, r, x
            torch.rand(5, device="cuda")  # random work between forward and backward
            (gc,) = torch.autograd.grad(y.sum(), [c], retain_graph=True)
            y.sum().backward()
        return {"y": y.detach(), "gc": gc, "a": a.grad, "b": b.grad, "after": torch.rand(3, device="cuda")}

    torch.manual_seed(0)
    expected = program(PlainScopes())
    scopes = Scopes()
    torch.manual_seed(0)
    actual = program(scopes)
    assert_all_same(actual, expected)
    assert stat(scopes.created[0], "replays") >= 2
