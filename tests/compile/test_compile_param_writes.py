"""A weight written between a compiled forward and its backward (issue 37, item 8).

Where the compiled backward recomputes something that reads a weight, a write to that
weight after the forward (a step under ``no_grad``, an optimizer step) raises
RecomputeError naming it, before autograd's own version check of AOTAutograd's saved
tensors could raise PyTorch's in-place error (gradient_scope/_adapters/compile/versions.py).

The first tests are the case that raised PyTorch's error: weights that are not
``nn.Parameter`` s but leaves that require grad (``torch.zeros(8, requires_grad=True)``,
as a global or an argument), which AOTAutograd does not count among its static inputs.
The matrix below pins what a search for other cases found right: a weight saved by a kept
op and read by a recomputed one, RMSNorm weights, biases under a partial budget, an
optimizer step over all of them. Reference: the same program compiled without scopes,
which raises PyTorch's error where it saves the weight (or nothing where it does not).
"""

import contextlib
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import gradient_scope._adapters.compile.graph as gs_compile
from gradient_scope import Budget, RecomputeError, apply_recompute, recompute_scope

pytestmark = [
    pytest.mark.skipif(
        gs_compile._MISSING is not None,
        reason=f"torch {torch.__version__} lacks {gs_compile._MISSING}: compiled scopes run eagerly",
    ),
    pytest.mark.usefixtures("fresh_dynamo"),  # tests/conftest.py
]

WRITTEN = (
    r"the backward of compiled code with a recompute_scope reads the parameter {name} of shape "
    r"\[{shape}\] \(torch.float32\), which was modified in place after the compiled forward "
    r"\(version \d+ -> \d+\) and before backward. .*Fix: call optimizer.step\(\) after backward"
)


def backward_outcome(y):
    """What backward says: 'ok', ('RecomputeError', message) or ('PyTorch', message)."""
    try:
        y.float().square().sum().backward()
    except RecomputeError as e:
        return "RecomputeError", str(e)
    except RuntimeError as e:
        assert "modified by an inplace operation" in str(e), e
        return "PyTorch", str(e)
    return "ok"


# ------------------------------------------------------------------ leaves that require grad


def _weights():
    g = torch.Generator().manual_seed(0)
    return torch.randn(8, 8, generator=g, requires_grad=True), torch.zeros(8, requires_grad=True)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("passed", ["global", "argument"])
@pytest.mark.parametrize("written", ["b", "w"])
def test_a_weight_that_is_a_leaf_tensor_raises_recompute_error(backend, passed, written):
    """``w``, ``b``: plain leaf tensors that require grad (not nn.Parameters), read by the
    block the compiled backward recomputes. Written after the forward: RecomputeError
    naming the one written (before: PyTorch's in-place error), no gradient out."""
    w, b = _weights()
    x = torch.randn(4, 8, requires_grad=True)

    def f(x, w, b):
        with recompute_scope():
            h = torch.tanh(x @ w + b)
        return (h @ w).sin()

    if passed == "global":
        y = torch.compile(lambda x: f(x, w, b), backend=backend)(x)
    else:
        y = torch.compile(f, backend=backend)(x, w, b)
    target = {"w": w, "b": b}[written]
    with torch.no_grad():
        target.add_(1)
    outcome = backward_outcome(y)
    assert outcome[0] == "RecomputeError", outcome
    shape = "8, 8" if written == "w" else "8"
    assert re.search(WRITTEN.format(name=written, shape=shape), outcome[1]), outcome[1]
    assert x.grad is None and w.grad is None and b.grad is None


def test_an_optimizer_step_over_leaf_weights_raises_recompute_error():
    w, b = _weights()

    def f(x):
        with recompute_scope():
            h = torch.tanh(x @ w + b)
        return (h @ w).sin()

    opt = torch.optim.SGD([w, b], lr=0.1, foreach=True)
    y = torch.compile(f, backend="aot_eager")(torch.randn(4, 8))
    w.grad, b.grad = torch.ones_like(w), torch.ones_like(b)
    opt.step()  # writes both
    outcome = backward_outcome(y)
    assert outcome[0] == "RecomputeError" and "reads the parameter" in outcome[1], outcome


def test_leaf_weights_train_as_without_the_scope():
    """Checked without a write: gradients bitwise those of the program compiled without
    the scope (aot_eager runs the same aten ops), over two steps with an optimizer."""

    def train(scoped):
        torch._dynamo.reset()
        w, b = _weights()

        def f(x):
            with recompute_scope() if scoped else contextlib.nullcontext():
                h = torch.tanh(x @ w + b)
            return (h @ w).sin()

        compiled = torch.compile(f, backend="aot_eager")
        opt = torch.optim.SGD([w, b], lr=0.1)
        grads = []
        for step in range(2):
            opt.zero_grad()
            compiled(torch.full((4, 8), 0.1 * (step + 1))).sum().backward()
            grads += [w.grad.clone(), b.grad.clone()]
            opt.step()
        return grads

    for a, e in zip(train(True), train(False)):
        assert torch.equal(a, e)


# ------------------------------------------------------------------ the matrix (pinned)


def _scope(on):
    return recompute_scope() if on else contextlib.nullcontext()


class KeptScale(nn.Module):
    """``x * scale`` kept (outside the block: its backward saves ``scale``), ``(k + bias)``
    recomputed in the block."""

    def __init__(self, on):
        super().__init__()
        self.on = on
        self.scale, self.bias = nn.Parameter(torch.randn(8)), nn.Parameter(torch.randn(8))
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        k = x * self.scale
        with _scope(self.on):
            h = (k + self.bias).relu().sin()
        return self.fc(h) * k


class RMSNorms(nn.Module):
    """An RMSNorm in the block and one after it."""

    def __init__(self, on):
        super().__init__()
        self.on = on
        self.w, self.w2 = nn.Parameter(torch.randn(8)), nn.Parameter(torch.randn(8))
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        with _scope(self.on):
            h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.w
            h = self.fc(h).relu()
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * self.w2


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln, self.fc1, self.fc2 = nn.LayerNorm(8), nn.Linear(8, 16), nn.Linear(16, 8)
        self.g = nn.Parameter(torch.ones(8))

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.ln(x)))) * self.g


class Stack(nn.Module):
    def __init__(self, on, budget=None):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.norm, self.head = nn.LayerNorm(8), nn.Linear(8, 4)
        if on:
            apply_recompute(self, check_fn=Block, **({} if budget is None else {"budget": Budget(budget)}))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def _outcome(make, name, how, on):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = make(on)
    compiled = torch.compile(model, backend="aot_eager")
    y = compiled(torch.randn(2, 5, 8, requires_grad=True))
    if how == "no_grad":
        with torch.no_grad():
            dict(model.named_parameters())[name].add_(1)
    else:
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        torch.optim.SGD(model.parameters(), lr=0.1, foreach=True).step()
    return backward_outcome(y)


# (model, parameter written, how, what the scoped program says): "checked" = RecomputeError
# naming a parameter; "ok" = nothing the backward reads was written. ``expect_plain``: the
# program compiled without scopes (PyTorch's error where it saves the parameter).
MATRIX = [
    ("kept_scale", KeptScale, "scale", "no_grad", "checked", "PyTorch"),
    ("kept_scale", KeptScale, "bias", "no_grad", "checked", "ok"),
    ("kept_scale", KeptScale, "fc.bias", "no_grad", "ok", "ok"),
    ("kept_scale", KeptScale, "bias", "optimizer", "checked", "PyTorch"),
    ("rmsnorm", RMSNorms, "w", "no_grad", "checked", "PyTorch"),
    ("rmsnorm", RMSNorms, "fc.bias", "no_grad", "checked", "ok"),
    ("rmsnorm", RMSNorms, "w2", "no_grad", "checked", "PyTorch"),
    ("stack", Stack, "blocks.0.fc1.bias", "no_grad", "checked", "ok"),
    ("stack", Stack, "blocks.1.ln.weight", "no_grad", "checked", "PyTorch"),
    ("stack", Stack, "norm.bias", "optimizer", "checked", "PyTorch"),
    ("stack_budget", lambda on: Stack(on, budget=2000), "blocks.0.g", "no_grad", "checked", "PyTorch"),
    ("stack_budget", lambda on: Stack(on, budget=2000), "blocks.0.fc1.bias", "no_grad", "checked", "ok"),
    ("stack_budget", lambda on: Stack(on, budget=2000), "blocks.1.fc2.bias", "optimizer", "checked", "PyTorch"),
]


@pytest.mark.parametrize(
    ("make", "name", "how", "expect", "expect_plain"),
    [pytest.param(*case[1:], id=f"{case[0]}-{case[2]}-{case[3]}") for case in MATRIX],
)
def test_a_parameter_the_recomputation_reads_is_named(make, name, how, expect, expect_plain):
    plain = _outcome(make, name, how, False)
    assert (plain if plain == "ok" else plain[0]) == expect_plain
    scoped = _outcome(make, name, how, True)
    if expect == "ok":
        assert scoped == "ok"
        return
    assert scoped[0] == "RecomputeError", scoped
    assert re.search(r"reads the parameter self\.[\w.]+ of shape", scoped[1]), scoped[1]
    if how == "no_grad":  # the one written, by its path
        assert f"reads the parameter self.{name} of shape" in scoped[1], scoped[1]
