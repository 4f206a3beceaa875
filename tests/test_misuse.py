"""Misuse and failures (docs/api.md and docs/troubleshooting.md): re-entering a scope object, exiting out
of order, invalid options, an exception in the block, an exception during replay, a replay
of a different shape, a debug=True value mismatch.  After each: the saved-tensor hook
stack, the dispatch mode stack and grad mode are as before, and a later training step
gives the plain program's results."""

import contextlib

import pytest
import torch
import torch.nn.functional as F

from gradient_scope import RecomputeError, recompute, recompute_scope

from _interop import clean_stacks, expect_clean_failure, repair_hook_stack  # noqa: F401
from conftest import PlainScopes, Scopes, dispatch_depth, top_hooks

# ----------------------------------------------------------------------------------------
# custom ops with Python state (no autograd formula: used on tensors that do not require
# grad; their outputs are saved by later ops for the gradient of a parameter)

CALLS = {"flaky": 0, "shapey": 0, "drift": 0}
SHAPE = {"n": 4}


@torch.library.custom_op("gs_misuse::flaky", mutates_args=())
def flaky(x: torch.Tensor) -> torch.Tensor:
    CALLS["flaky"] += 1
    if CALLS["flaky"] % 2 == 0:  # every second call (i.e. the replay) fails
        raise ValueError("flaky: second call fails")
    return x * 2


@torch.library.custom_op("gs_misuse::shapey", mutates_args=())
def shapey(x: torch.Tensor) -> torch.Tensor:
    CALLS["shapey"] += 1
    return x[: SHAPE["n"]].clone()


@torch.library.custom_op("gs_misuse::drift", mutates_args=())
def drift(x: torch.Tensor) -> torch.Tensor:
    CALLS["drift"] += 1
    return x * CALLS["drift"]


def snapshot():
    return (top_hooks(), dispatch_depth(), torch.is_grad_enabled(),
            torch.is_inference_mode_enabled())


def training_step_equals_plain():
    """A small correct training step with scopes after the failure: equal to plain."""

    def step(scope):
        torch.manual_seed(5)
        w1 = torch.randn(6, 8, requires_grad=True)
        w2 = torch.randn(8, 3, requires_grad=True)
        x = torch.randn(4, 6)
        with scope():
            h = F.gelu(x @ w1)
            h = F.dropout(h, 0.25, True)
        loss = (h @ w2).tanh().pow(2).sum()
        del h
        loss.backward()
        return [loss.detach(), w1.grad, w2.grad]

    got, want = step(Scopes()), step(PlainScopes())
    for g, w in zip(got, want):
        assert torch.equal(g, w)


@pytest.fixture
def after_check(clean_stacks):
    before = snapshot()

    def check():
        assert snapshot() == before, f"state changed: {before} -> {snapshot()}"
        clean_stacks()
        training_step_equals_plain()
        assert snapshot() == before
        clean_stacks()

    return check


# ----------------------------------------------------------------------------------------
# re-entering, exiting out of order


def test_enter_same_scope_twice(after_check):
    a = torch.randn(3, requires_grad=True)
    s = recompute_scope()
    with pytest.raises(RuntimeError):
        with s:
            x = a.exp()
            with s:
                pass
    # a fresh use of the same object afterwards is fine
    with s:
        y = a.sin()
    (y * y).sum().backward()
    assert torch.equal(a.grad, (2 * a.sin() * a.cos()).detach())
    del x, y
    after_check()


def test_enter_same_scope_twice_as_decorator_object(after_check):
    s = recompute_scope()
    a = torch.randn(3, requires_grad=True)
    s.__enter__()
    with pytest.raises(RuntimeError):
        s.__enter__()
    x = a.exp()
    s.__exit__(None, None, None)
    (x * x).sum().backward()
    del x
    after_check()


def test_exit_out_of_order(after_check):
    a = torch.randn(3, requires_grad=True)
    s1, s2 = recompute_scope(), recompute_scope()
    s1.__enter__()
    x = a.exp()
    s2.__enter__()
    y = x.sin()
    with pytest.raises(RuntimeError):
        s1.__exit__(None, None, None)
    # the failed exit changed nothing: the right order still works
    s2.__exit__(None, None, None)
    s1.__exit__(None, None, None)
    loss = (x * y).sum()
    del x, y
    loss.backward()
    x = a.exp()
    expect = (x * x.sin()).sum()
    (g,) = torch.autograd.grad(expect, a)
    assert torch.equal(a.grad, g)
    del loss, expect, x
    after_check()


def test_exit_without_enter_and_twice(after_check):
    s = recompute_scope()
    with pytest.raises(RuntimeError):
        s.__exit__(None, None, None)
    with s:
        pass
    with pytest.raises(RuntimeError):
        s.__exit__(None, None, None)
    after_check()


def test_exit_inner_after_outer_with_decorator(after_check):
    """Out-of-order exits of side-by-side (not nested) scopes from a decorated function."""
    a = torch.randn(3, requires_grad=True)
    s1, s2 = recompute_scope(), recompute_scope()
    s1.__enter__()
    s2.__enter__()

    @recompute
    def f(t):
        return t.exp()

    y = f(a)
    with pytest.raises(RuntimeError):
        s1.__exit__(None, None, None)
    s2.__exit__(None, None, None)
    s1.__exit__(None, None, None)
    (y * y).sum().backward()
    del y
    after_check()


# ----------------------------------------------------------------------------------------
# invalid options


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(preserve_rng_state=1),
        dict(preserve_rng_state="yes"),
        dict(preserve_rng_state=None),
        dict(enabled="no"),
        dict(debug=0),
        dict(save=42),
        dict(save=[42]),
        dict(save="mm"),
        dict(save=[torch.ops.aten.mm, "sin"]),
        dict(bogus=True),
    ],
    ids=lambda k: ",".join(f"{a}={v!r}" for a, v in k.items()),
)
def test_invalid_options(kwargs, after_check):
    with pytest.raises((TypeError, ValueError)):
        recompute_scope(**kwargs)
    with pytest.raises((TypeError, ValueError)):

        @recompute(**kwargs)
        def f(x):
            return x

    after_check()


def test_positional_option_rejected(after_check):
    with pytest.raises(TypeError):
        recompute_scope(True)
    after_check()


# ----------------------------------------------------------------------------------------
# an exception in the block


def test_exception_in_block(after_check):
    a = torch.randn(4, requires_grad=True)
    b = torch.randn(4, requires_grad=True)
    with pytest.raises(ZeroDivisionError):
        with recompute_scope():
            x = a.exp()
            y = x * b
            1 / 0
    # tensors made before the exception are still usable and give the right gradient
    loss = (y * x).sum()
    del x, y
    loss.backward()
    ga, gb = a.grad.clone(), b.grad.clone()
    a.grad = b.grad = None
    x = a.exp()
    ((x * b) * x).sum().backward()
    assert torch.equal(ga, a.grad) and torch.equal(gb, b.grad)
    del x, loss
    after_check()


def test_exception_in_nested_block_and_decorated_function(after_check):
    a = torch.randn(4, requires_grad=True)

    @recompute
    def bad(t):
        u = t.sin()
        raise KeyError("boom")

    with recompute_scope():
        x = a.exp()
        with pytest.raises(KeyError):
            bad(x)
        y = x.tanh()
    (y * x).sum().backward()
    g = a.grad.clone()
    a.grad = None
    x2 = a.exp()
    (x2.tanh() * x2).sum().backward()
    assert torch.equal(g, a.grad)
    del x, y, x2
    after_check()


# ----------------------------------------------------------------------------------------
# failures during replay


def test_exception_during_replay(after_check):
    CALLS["flaky"] = 0
    x = torch.randn(5)
    w = torch.randn(5, requires_grad=True)
    with recompute_scope():
        y = flaky(x)  # does not require grad; created in the block
    z = (y * w).sum()  # saves y for dz/dw
    del y
    with pytest.raises(RecomputeError) as info:
        z.backward()
    msg = str(info.value)
    assert "flaky" in msg, msg
    del info, z
    after_check()


def test_replay_different_shape(after_check):
    SHAPE["n"] = 4
    x = torch.randn(6)
    w = torch.randn(4, requires_grad=True)
    with recompute_scope():
        y = shapey(x)
    z = (y * w).sum()
    del y
    SHAPE["n"] = 3  # the replay now produces a tensor of another shape
    try:
        with pytest.raises(RecomputeError) as info:
            z.backward()
    finally:
        SHAPE["n"] = 4
    msg = str(info.value)
    assert "shapey" in msg, msg
    assert "[4]" in msg or "(4" in msg or "4]" in msg, msg
    del info, z
    after_check()


def test_replay_different_shape_shape_checked_without_debug(after_check):
    """Shape is always checked, whatever the debug option."""
    SHAPE["n"] = 5
    x = torch.randn(6)
    w = torch.randn(5, requires_grad=True)
    with recompute_scope(debug=False):
        y = shapey(x).exp()
    z = (y * w).sum()
    del y
    SHAPE["n"] = 6
    try:
        with pytest.raises(RecomputeError):
            z.backward()
    finally:
        SHAPE["n"] = 4
    del z
    after_check()


def test_debug_value_mismatch(after_check):
    CALLS["drift"] = 0
    x = torch.randn(5)
    w = torch.randn(5, requires_grad=True)
    with recompute_scope(debug=True):
        y = drift(x)  # the replay returns 2 * x instead of 1 * x
    z = (y * w).sum()
    del y
    with pytest.raises(RecomputeError) as info:
        z.backward()
    assert "drift" in str(info.value), str(info.value)
    del info, z
    after_check()


def test_debug_no_false_positive(after_check):
    """debug=True on a faithful program (with random ops) raises nothing."""

    def run(scope):
        torch.manual_seed(0)
        a = torch.randn(4, 6, requires_grad=True)
        with scope:
            h = F.dropout(a.exp(), 0.5, True)
            k = torch.randn_like(h) * h
        loss = (k * h).sum()
        del h, k
        loss.backward()
        return a.grad

    out = {}
    err = expect_clean_failure(lambda: out.setdefault("g", run(recompute_scope(debug=True))))
    assert err is None, f"debug=True raised on a faithful program: {err}"
    assert torch.equal(out["g"], run(contextlib.nullcontext()))
    del out
    after_check()


def test_failed_replay_then_retry_backward(after_check):
    """After a failed replay (retain_graph=True), a second backward replays again."""
    CALLS["flaky"] = 0
    x = torch.randn(5)
    w = torch.randn(5, requires_grad=True)
    with recompute_scope():
        y = flaky(x)  # call 1
    z = (y * w).sum()
    expect = (x * 2).clone()
    del y
    with pytest.raises(RecomputeError):
        z.backward(retain_graph=True)  # call 2 raises
    z.backward()  # call 3 succeeds
    assert torch.equal(w.grad, expect)
    del z
    after_check()
