"""Decorator forms (docs/api.md), enabled=False, and misuse (docs/troubleshooting.md)."""

import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from gradient_scope import recompute, recompute_scope

from conftest import (
    assert_interception_gone,
    dispatch_depth,
    global_state,
    grads,
    stat,
)


def _compare(make_fn, inputs_fn, seed=0):
    """make_fn(decorate) -> function; decorate is the identity for the plain program.
    Runs fn(*inputs).sum().backward() for the decorated and the plain function."""
    results = []
    for decorated in (True, False):
        torch.manual_seed(seed)
        fn = make_fn(decorated)
        inputs = inputs_fn()
        out = fn(*inputs)
        torch.rand(3)  # random work between forward and backward
        out.float().sum().backward()
        results.append([out.detach()] + [t.grad for t in inputs if t.requires_grad])
    got, want = results
    for i, (g, w) in enumerate(zip(got, want)):
        assert g is not None and w is not None, i
        assert torch.equal(g, w), f"result {i} differs from the plain program"


def _body(h, w):
    return F.dropout(F.gelu(h @ w), 0.3, training=True).sin()


def _inputs():
    return [torch.randn(4, 6, requires_grad=True), torch.randn(6, 6, requires_grad=True)]


def test_recompute_scope_call_decorator():
    probes = []

    def make(decorated):
        def f(h, w):
            t = _body(h, w)
            probes.append(weakref.ref(t))
            return t * 2

        return recompute_scope()(f) if decorated else f

    _compare(make, _inputs)
    assert probes[0]() is None  # decorated: the intermediate died


def test_decorator_syntax_forms():
    @recompute_scope()
    def f1(h, w):
        return _body(h, w) * 2

    @recompute
    def f2(h, w):
        return _body(h, w) * 2

    @recompute(preserve_rng_state=False)
    def f3(h, w):
        return torch.tanh(h @ w).exp() * 2  # deterministic: exact even without RNG capture

    @recompute()
    def f4(h, w):
        return _body(h, w) * 2

    def plain(h, w):
        return _body(h, w) * 2

    def plain3(h, w):
        return torch.tanh(h @ w).exp() * 2

    for fn, ref in ((f1, plain), (f2, plain), (f3, plain3), (f4, plain)):
        _compare(lambda d, fn=fn, ref=ref: fn if d else ref, _inputs)
    assert_interception_gone()


def test_decorator_preserves_return_structure_and_kwargs():
    @recompute
    def f(h, *, w, scale=1.0):
        t = torch.tanh(h @ w)
        return {"out": t * scale, "aux": (t.exp(), 3)}

    h, w = _inputs()
    res = f(h, w=w, scale=2.0)
    assert set(res) == {"out", "aux"} and res["aux"][1] == 3
    (res["out"].sum() + res["aux"][0].sum()).backward()
    h2, w2 = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    t = torch.tanh(h2 @ w2)
    ((t * 2.0).sum() + t.exp().sum()).backward()
    assert torch.equal(h.grad, h2.grad) and torch.equal(w.grad, w2.grad)


def test_each_call_is_its_own_region():
    calls = []

    @recompute_scope()
    def block(h):
        calls.append(1)
        return torch.sigmoid(h * 3).exp()

    def plain(h):
        return torch.sigmoid(h * 3).exp()

    torch.manual_seed(0)
    a = torch.randn(5, requires_grad=True)
    y = block(a) * block(a.flip(0))  # two regions alive side by side
    z = block(y)  # a third one reading their product
    z.sum().backward()
    a2 = a.detach().clone().requires_grad_()
    plain(plain(a2) * plain(a2.flip(0))).sum().backward()
    assert torch.equal(a.grad, a2.grad)
    assert len(calls) == 3  # Python body ran once per call, never during backward


class _Core(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 8)
        self.calls = 0
        self.probe = None

    def body(self, x):
        self.calls += 1
        h = F.gelu(self.fc1(x))
        self.probe = weakref.ref(h)
        return self.fc2(F.dropout(h, 0.1, training=True))


class PlainMod(_Core):
    def forward(self, x):
        return self.body(x)


class BareMod(_Core):
    @recompute
    def forward(self, x):
        return self.body(x)


class CallMod(_Core):
    @recompute_scope()
    def forward(self, x):
        return self.body(x)


class NoRngMod(_Core):
    @recompute(preserve_rng_state=False)
    def forward(self, x):
        self.calls += 1
        h = torch.tanh(self.fc1(x))
        self.probe = weakref.ref(h)
        return self.fc2(h)


class NoRngPlain(_Core):
    def forward(self, x):
        self.calls += 1
        h = torch.tanh(self.fc1(x))
        self.probe = weakref.ref(h)
        return self.fc2(h)


@pytest.mark.parametrize("cls,ref_cls", [(BareMod, PlainMod), (CallMod, PlainMod), (NoRngMod, NoRngPlain)])
def test_module_forward_decorated(cls, ref_cls):
    results = []
    for c in (cls, ref_cls):
        torch.manual_seed(0)
        m = c()
        hook_calls = []
        m.fc1.register_forward_hook(lambda *a: hook_calls.append(1))
        x = torch.randn(3, 5, 8, requires_grad=True)  # 3-D: F.linear reshapes
        for _ in range(2):
            out = m(x) + m(x * 2)
            if c is cls:
                assert m.probe() is None, "decorated forward keeps its activation alive"
            torch.rand(4)
            out.pow(2).sum().backward()
        results.append((grads(dict(x=x, m=m)), m.calls, len(hook_calls)))
        del out
    (g1, calls1, hooks1), (g2, calls2, hooks2) = results
    assert calls1 == calls2 == 4 and hooks1 == hooks2 == 4
    for k in g2:
        assert torch.equal(g1[k], g2[k]), k
    assert_interception_gone()


def test_decorated_method_on_instances_is_bound_correctly():
    a, b = BareMod(), BareMod()
    with torch.no_grad():
        for p in b.parameters():
            p.mul_(2)
    x = torch.randn(2, 8)
    torch.manual_seed(1)
    ya = a(x)
    torch.manual_seed(1)
    yb = b(x)
    assert not torch.equal(ya, yb)
    assert a.calls == 1 and b.calls == 1


@recompute
def _rec_dec(h, w, n):
    if n == 0:
        return h.sin()
    t = torch.tanh(h @ w)
    return _rec_dec(t, w, n - 1) * 1.5 + t.exp()


def _rec_plain(h, w, n):
    if n == 0:
        return h.sin()
    t = torch.tanh(h @ w)
    return _rec_plain(t, w, n - 1) * 1.5 + t.exp()


@recompute_scope()
def _rec_scope(h, w, n):
    if n == 0:
        return h.sin()
    t = torch.tanh(h @ w)
    return _rec_scope(t, w, n - 1) * 1.5 + t.exp()


@recompute
def _outer_dec(h, w):
    return _inner_dec(torch.relu(h @ w), w) + _inner_dec(h, w).exp()


@recompute_scope()
def _inner_dec(h, w):
    return torch.sigmoid(h @ w.t()) * h


def _outer_plain(h, w):
    return _inner_plain(torch.relu(h @ w), w) + _inner_plain(h, w).exp()


def _inner_plain(h, w):
    return torch.sigmoid(h @ w.t()) * h


@pytest.mark.parametrize(
    "fn,ref",
    [(_rec_dec, _rec_plain), (_rec_scope, _rec_plain)],
    ids=["recompute", "recompute_scope()"],
)
def test_recursive(fn, ref):
    results = []
    for f in (fn, ref):
        torch.manual_seed(0)
        h = torch.randn(3, 4, requires_grad=True)
        w = torch.randn(4, 4, requires_grad=True)
        out = f(h, w, 5)
        torch.randn(3)
        out.sum().backward(retain_graph=True)
        out.sum().backward()
        results.append((out.detach(), h.grad, w.grad))
    for g, p in zip(*results):
        assert torch.equal(g, p)
    assert_interception_gone()


def test_reentrant_decorated_calls_decorated():
    results = []
    for f in (_outer_dec, _outer_plain):
        torch.manual_seed(0)
        h = torch.randn(4, 4, requires_grad=True)
        w = torch.randn(4, 4, requires_grad=True)
        out = f(h, w)
        out.sum().backward()
        results.append((out.detach(), h.grad, w.grad))
    for g, p in zip(*results):
        assert torch.equal(g, p)


# --------------------------------------------------------------------------------------
# enabled=False


def test_enabled_false_is_a_plain_block():
    before = global_state()
    s = recompute_scope(enabled=False)
    a = torch.randn(5, requires_grad=True)
    c = torch.randn(5, requires_grad=True)
    with s:
        assert dispatch_depth() == before["dispatch_stack_len"]
        x = a.sin() + 1
    ref = weakref.ref(x)
    assert_interception_gone(before)  # even though x is alive: nothing intercepted
    y = x * c
    del x
    assert ref() is not None, "with enabled=False autograd keeps x, as without a scope"
    y.sum().backward()
    assert stat(s, "ops_recorded") == 0
    assert stat(s, "tensors_packed") == 0
    assert stat(s, "replays") == 0
    assert torch.equal(c.grad, a.detach().sin() + 1)


def test_enabled_false_decorator():
    calls = []

    @recompute(enabled=False)
    def f(h):
        calls.append(1)
        t = h.exp()
        calls.append(weakref.ref(t))
        return t * h

    a = torch.randn(4, requires_grad=True)
    y = f(a)
    assert calls[1]() is not None  # plain autograd keeps exp's output
    y.sum().backward()
    a2 = a.detach().clone().requires_grad_()
    (a2.exp() * a2).sum().backward()
    assert torch.equal(a.grad, a2.grad)


# --------------------------------------------------------------------------------------
# misuse


def test_entering_same_scope_twice_raises():
    before = global_state()
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
    del z
    assert_interception_gone(before)


def test_exiting_out_of_order_raises():
    before = global_state()
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
    assert_interception_gone(before)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(preserve_rng_state="yes"),
        dict(preserve_rng_state=None),
        dict(enabled="no"),
        dict(debug="x"),
        dict(save=42),
        dict(save=[object()]),
        dict(save=["not an op"]),
        dict(bogus_option=True),
    ],
    ids=lambda k: next(iter(k)) + "=" + repr(next(iter(k.values())))[:12],
)
def test_invalid_options_raise(kwargs):
    before = global_state()
    with pytest.raises((TypeError, ValueError)):
        s = recompute_scope(**kwargs)
        with s:
            torch.randn(2, requires_grad=True).sin()
    with pytest.raises((TypeError, ValueError)):

        @recompute(**kwargs)
        def f(h):
            return h.sin()

        f(torch.randn(2, requires_grad=True))
    assert_interception_gone(before)


def test_positional_options_rejected():
    with pytest.raises(TypeError):
        recompute_scope(True)
