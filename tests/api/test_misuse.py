"""Misuse and failures (``docs/troubleshooting.md``): re-entering a scope object, exiting
out of order, invalid options, an exception in the block, an exception during replay, a
replay of a different shape, a debug=True value mismatch, a dispatch mode left open in a
block, a copy of a scope inside its own block.  After each: global state as found (the
saved-tensor hook stack, the dispatch mode stack, grad mode, ...), and a later training
step gives the plain program's results.

The wording of the messages is checked in ``test_error_messages.py``; that of the option
errors (types, positional arguments, misspelled names) in ``test_scope_options.py``."""

import contextlib
import copy
import gc
import signal
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode

from gradient_scope import RecomputeError, recompute, recompute_scope

from support import (
    PlainScopes,
    Scopes,
    assert_interception_gone,
    assert_stacks_clean,
    dispatch_depth,
    stat,
    top_hooks,
)
from support.contract import leaf, plain_grad
from support.interop import expect_clean_failure

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


def after_check():
    """Global state as found at the start of the test (checked without gc: the test has
    dropped its tensors), and a later training step with scopes still gives the plain
    program's results."""
    assert_interception_gone()
    assert_stacks_clean()
    training_step_equals_plain()
    assert_interception_gone()
    assert_stacks_clean()


# ----------------------------------------------------------------------------------------
# re-entering, exiting out of order


def test_entering_an_open_scope_again_raises():
    """Re-entering a scope inside its own block raises there and changes nothing: caught in
    the block, the block goes on and its tensors give the plain gradients; let through,
    it closes the block; either way the object can be entered again afterwards."""
    s = recompute_scope()
    a = torch.randn(4, requires_grad=True)
    with s:
        x = a.sin()
        with pytest.raises(RuntimeError):
            with s:
                pass
        y = x.exp()  # the outer block still works
    z = (y * x).sum()
    del x, y
    z.backward()
    a2 = a.detach().clone().requires_grad_()
    x2 = a2.sin()
    (x2.exp() * x2).sum().backward()
    assert torch.equal(a.grad, a2.grad)
    with pytest.raises(RuntimeError):
        with s:
            x = a.exp()
            with s:
                pass
    a.grad = None
    with s:  # a fresh use of the same object
        y = a.sin()
    (y * y).sum().backward()
    assert torch.equal(a.grad, (2 * a.sin() * a.cos()).detach())
    del x, y, z
    after_check()


def test_enter_same_scope_twice_as_decorator_object():
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


def test_exiting_out_of_order_raises():
    """A wrong-order exit raises and changes nothing: ops run after it, with both scopes
    still open, give the plain gradients, and the right order still closes them."""
    s1, s2 = recompute_scope(), recompute_scope()
    a = torch.randn(4, requires_grad=True)
    s1.__enter__()
    x = a.sin()
    s2.__enter__()
    y = x.exp()
    with pytest.raises(RuntimeError):
        s1.__exit__(None, None, None)
    # the failed call changed nothing: s2 is still innermost, then s1
    z = y * x
    s2.__exit__(None, None, None)
    s1.__exit__(None, None, None)
    del x, y
    z.sum().backward()
    a2 = a.detach().clone().requires_grad_()
    x2 = a2.sin()
    (x2.exp() * x2).sum().backward()
    assert torch.equal(a.grad, a2.grad)
    del z
    after_check()


def test_exit_without_enter_and_twice():
    s = recompute_scope()
    with pytest.raises(RuntimeError):
        s.__exit__(None, None, None)
    with s:
        pass
    with pytest.raises(RuntimeError):
        s.__exit__(None, None, None)
    after_check()


def test_exit_inner_after_outer_with_decorator():
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
        dict(debug="x"),
        dict(save=42),
        dict(save=[42]),
        pytest.param(dict(save=[object()]), id="save=[object()]"),
        dict(save=["not an op"]),
        dict(save="mm"),
        dict(save=[torch.ops.aten.mm, "sin"]),
        dict(bogus=True),
    ],
    ids=lambda k: ",".join(f"{a}={v!r}" for a, v in k.items()),
)
def test_invalid_options(kwargs):
    with pytest.raises((TypeError, ValueError)):
        recompute_scope(**kwargs)
    with pytest.raises((TypeError, ValueError)):

        @recompute(**kwargs)
        def f(x):
            return x

    after_check()


# ----------------------------------------------------------------------------------------
# an exception in the block


def test_exception_in_block():
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


def test_exception_in_nested_block_and_decorated_function():
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


def test_exception_during_replay():
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


@pytest.mark.parametrize("debug", [False, True])
def test_replay_different_shape(debug):
    """A replay that makes another shape raises, whatever the debug option (shapes are
    always checked), naming the op and the recorded shape."""
    SHAPE["n"] = 4
    x = torch.randn(6)
    w = torch.randn(4, requires_grad=True)
    with recompute_scope(debug=debug):
        y = shapey(x).exp()  # the op of another shape is not the block's last
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


def test_debug_value_mismatch():
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


def test_debug_no_false_positive():
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


def test_failed_replay_then_retry_backward():
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


# ----------------------------------------------------------------------------------------
# a dispatch mode left open in a block; a copy of a scope inside its own block


class _UserMode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_dispatch_mode_left_open_in_block_restores_state():
    """After the documented error ("a TorchDispatchMode entered inside the block is
    still active"), PyTorch's state is exactly as before the block (plus the user's mode,
    still open): nothing recorded afterwards, our mode off the stack, hooks gone once the
    block's tensors die, and the block's tensors still give plain gradients."""
    hooks0, depth0 = top_hooks(), dispatch_depth()
    a = leaf(4)
    scope = recompute_scope()
    mode = _UserMode()
    problems = []
    try:
        scope.__enter__()
        h = a.sin()
        mode.__enter__()
        try:
            scope.__exit__(None, None, None)
            problems.append("no error when leaving a block with a dispatch mode still open")
        except RuntimeError as e:
            if "TorchDispatchMode" not in str(e):
                problems.append(f"unexpected error: {e}")
        if _get_current_dispatch_mode() is not mode or dispatch_depth() != depth0 + 1:
            problems.append(
                f"dispatch stack after the error: depth {dispatch_depth()} (expected {depth0 + 1}, "
                "the user's mode only)"
            )
        mode.__exit__(None, None, None)
        n = stat(scope, "ops_recorded")
        x = (a * 3).exp()
        if stat(scope, "ops_recorded") != n:
            problems.append("ops after the failed exit are still recorded into the block")
        if dispatch_depth() != depth0:
            problems.append("a dispatch mode is left on the stack")
        y = (h * h).sum() + x.sum()  # the same expression as in plain_grad below
        del x
        y.backward()
        if not torch.equal(a.grad, plain_grad(lambda t: (lambda s: s * s)(t.sin()).sum() + (t * 3).exp().sum(), a)):
            problems.append("wrong gradient through the block's tensor")
        del h, y
        if top_hooks() != hooks0:
            problems.append("saved-tensor hooks left after the block's tensors died")
    finally:
        # hygiene for the next tests, whatever the outcome
        if _get_current_dispatch_mode() is mode:
            mode.__exit__(None, None, None)
        with contextlib.suppress(Exception):
            scope.__exit__(None, None, None)
        gc.collect()
    assert not problems, "; ".join(problems)
    assert_stacks_clean()


class _Timeout(Exception):
    pass


@contextlib.contextmanager
def _time_limit(seconds: float):
    def on_alarm(signum, frame):
        raise _Timeout(f"did not return within {seconds} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@pytest.mark.parametrize("which", ["deepcopy", "copy"])
def test_copy_of_scope_inside_its_own_block(which):
    """copy.deepcopy(scope) (and copy.copy) inside the scope's own block returns, and the
    block still works.  A deep copy is a scope with the same options that can be entered
    on its own (it must not copy the block's record, let alone record its own copying)."""
    fn = copy.deepcopy if which == "deepcopy" else copy.copy
    a = leaf(4)
    scope = recompute_scope(preserve_rng_state=False, debug=True)
    result: list[Any] = []
    err = None
    with scope:
        h = a.sin()
        try:
            with _time_limit(5.0):
                result.append(fn(scope))
        except (_Timeout, Exception) as e:  # noqa: BLE001
            err = f"{which}(scope) inside its block: {type(e).__name__}: {e}"
    if err is None and which == "deepcopy":
        dup = result[0]
        if not isinstance(dup, recompute_scope) or repr(dup) != repr(scope):
            err = f"deepcopy returned {dup!r}, not a scope with the options of {scope!r}"
        else:
            b = leaf(4)
            try:
                with dup:
                    g = b.cos()
                (g * g).sum().backward()
            except Exception as e:  # noqa: BLE001
                err = f"the deep copy is not a usable scope: {type(e).__name__}: {e}"
            else:
                if not torch.equal(b.grad, plain_grad(lambda t: (lambda g: g * g)(t.cos()), b)):
                    err = "wrong gradient through the deep copy"
            g = None
    result.clear()
    y = (h * h).sum()
    del h
    y.backward()
    del y
    gc.collect()
    assert err is None, err
    assert torch.equal(a.grad, plain_grad(lambda t: (lambda s: s * s)(t.sin()), a))
    assert_stacks_clean()
