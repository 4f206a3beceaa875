"""The decorator forms (``@recompute``, ``@recompute(...)``, ``@recompute_scope()``) on
functions, methods, recursive and re-entrant calls, generator functions, coroutines,
async generators and classes; ``enabled=False``. Misuse of a scope object (re-entering,
exiting out of order, invalid options) is in ``test_misuse.py``."""

import inspect
import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from gradient_scope import recompute, recompute_scope

from support import (
    assert_interception_gone,
    assert_stacks_clean,
    dispatch_depth,
    global_state,
    grads,
    stat,
)
from support.contract import leaf, plain_grad


def _compare(make_fn, inputs_fn, seed=0):
    """make_fn(decorate) -> function; decorate is the identity for the plain program.
    Runs fn(*inputs).sum().backward() for the decorated and the plain function."""
    results = []
    for decorated in (True, False):
        torch.manual_seed(seed)
        fn = make_fn(decorated)
        inputs = inputs_fn()
        out = fn(*inputs)
        torch.rand(3, device=inputs[0].device)  # random work between forward and backward
        out.float().sum().backward()
        results.append([out.detach()] + [t.grad for t in inputs if t.requires_grad])
    got, want = results
    for i, (g, w) in enumerate(zip(got, want)):
        assert g is not None and w is not None, i
        assert torch.equal(g, w), f"result {i} differs from the plain program"


def _body(h, w):
    return F.dropout(F.gelu(h @ w), 0.3, training=True).sin()


def _inputs(device):
    return [torch.randn(4, 6, requires_grad=True, device=device), torch.randn(6, 6, requires_grad=True, device=device)]


def test_recompute_scope_call_decorator(device):
    probes = []

    def make(decorated):
        def f(h, w):
            t = _body(h, w)
            probes.append(weakref.ref(t))
            return t * 2

        return recompute_scope()(f) if decorated else f

    _compare(make, lambda: _inputs(device))
    assert probes[0]() is None  # decorated: the intermediate died


def test_decorator_syntax_forms(device):
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
        _compare(lambda d, fn=fn, ref=ref: fn if d else ref, lambda: _inputs(device))
    assert_interception_gone()


def test_decorator_preserves_return_structure_and_kwargs(device):
    @recompute
    def f(h, *, w, scale=1.0):
        t = torch.tanh(h @ w)
        return {"out": t * scale, "aux": (t.exp(), 3)}

    h, w = _inputs(device)
    res = f(h, w=w, scale=2.0)
    assert set(res) == {"out", "aux"} and res["aux"][1] == 3
    (res["out"].sum() + res["aux"][0].sum()).backward()
    h2, w2 = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    t = torch.tanh(h2 @ w2)
    ((t * 2.0).sum() + t.exp().sum()).backward()
    assert torch.equal(h.grad, h2.grad) and torch.equal(w.grad, w2.grad)


def test_each_call_is_its_own_region(device):
    calls = []

    @recompute_scope()
    def block(h):
        calls.append(1)
        return torch.sigmoid(h * 3).exp()

    def plain(h):
        return torch.sigmoid(h * 3).exp()

    torch.manual_seed(0)
    a = torch.randn(5, requires_grad=True, device=device)
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
def test_module_forward_decorated(cls, ref_cls, device):
    results = []
    for c in (cls, ref_cls):
        torch.manual_seed(0)
        m = c().to(device)
        hook_calls = []
        m.fc1.register_forward_hook(lambda *a: hook_calls.append(1))
        x = torch.randn(3, 5, 8, requires_grad=True, device=device)  # 3-D: F.linear reshapes
        for _ in range(2):
            out = m(x) + m(x * 2)
            if c is cls:
                assert m.probe() is None, "decorated forward keeps its activation alive"
            torch.rand(4, device=device)
            out.pow(2).sum().backward()
        results.append((grads(dict(x=x, m=m)), m.calls, len(hook_calls)))
        del out
    (g1, calls1, hooks1), (g2, calls2, hooks2) = results
    assert calls1 == calls2 == 4 and hooks1 == hooks2 == 4
    for k in g2:
        assert torch.equal(g1[k], g2[k]), k
    assert_interception_gone()


def test_decorated_method_on_instances_is_bound_correctly(device):
    a, b = BareMod().to(device), BareMod().to(device)
    with torch.no_grad():
        for p in b.parameters():
            p.mul_(2)
    x = torch.randn(2, 8, device=device)
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
def test_recursive(fn, ref, device):
    results = []
    for f in (fn, ref):
        torch.manual_seed(0)
        h = torch.randn(3, 4, requires_grad=True, device=device)
        w = torch.randn(4, 4, requires_grad=True, device=device)
        out = f(h, w, 5)
        torch.randn(3, device=device)
        out.sum().backward(retain_graph=True)
        out.sum().backward()
        results.append((out.detach(), h.grad, w.grad))
    for g, p in zip(*results):
        assert torch.equal(g, p)
    assert_interception_gone()


def test_reentrant_decorated_calls_decorated(device):
    results = []
    for f in (_outer_dec, _outer_plain):
        torch.manual_seed(0)
        h = torch.randn(4, 4, requires_grad=True, device=device)
        w = torch.randn(4, 4, requires_grad=True, device=device)
        out = f(h, w)
        out.sum().backward()
        results.append((out.detach(), h.grad, w.grad))
    for g, p in zip(*results):
        assert torch.equal(g, p)


# --------------------------------------------------------------------------------------
# enabled=False


def test_enabled_false_is_a_plain_block(device):
    before = global_state()
    s = recompute_scope(enabled=False)
    a = torch.randn(5, requires_grad=True, device=device)
    c = torch.randn(5, requires_grad=True, device=device)
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


def test_enabled_false_decorator(device):
    calls = []

    @recompute(enabled=False)
    def f(h):
        calls.append(1)
        t = h.exp()
        calls.append(weakref.ref(t))
        return t * h

    a = torch.randn(4, requires_grad=True, device=device)
    y = f(a)
    assert calls[1]() is not None  # plain autograd keeps exp's output
    y.sum().backward()
    a2 = a.detach().clone().requires_grad_()
    (a2.exp() * a2).sum().backward()
    assert torch.equal(a.grad, a2.grad)


# --------------------------------------------------------------------------------------
# generator functions, coroutines, async generators and classes


DECORATORS = {
    "recompute_scope()": lambda f: recompute_scope()(f),
    "recompute": lambda f: recompute(f),
    "recompute(opts)": lambda f: recompute(preserve_rng_state=True)(f),
}


def _drive(coro):
    """Run a coroutine that awaits only _Yield() to completion, without an event loop."""
    try:
        while True:
            coro.send(None)
    except StopIteration as stop:
        return stop.value


class _Yield:
    def __await__(self):
        yield


def _recomputable(holder: list, index: int) -> bool:
    """holder[index] is a block tensor: once an op saves it (mul saves it for the other
    operand's gradient) and every reference is dropped, nothing keeps it alive.  (A tensor
    made outside any block stays alive, held by the graph.)  Takes it out of holder."""
    t = holder[index]
    holder[index] = None
    y = t * leaf(*t.shape, device=t.device)
    r = weakref.ref(t)
    del t
    alive = r() is not None
    del y
    return not alive


def test_recomputable_probe_tells_block_tensors_apart(device):
    a = leaf(5, device=device)
    assert not _recomputable([a.sin()], 0)
    with recompute_scope():
        h = a.sin()
    assert _recomputable([h], 0) is False  # the name h still holds it
    with recompute_scope():
        held = [a.sin()]
    assert _recomputable(held, 0)


@pytest.mark.parametrize("deco", list(DECORATORS))
def test_decorated_generator_function(deco, device):
    """A generator function: TypeError at decoration, or each resumption recorded (the
    tensors it makes between yields are recomputable) with plain gradients."""

    def gen(x):
        y = x.sin()
        yield y
        z = y.exp()
        yield z

    try:
        g = DECORATORS[deco](gen)
    except TypeError:
        assert_stacks_clean()
        return
    assert inspect.isgeneratorfunction(g) or inspect.isgenerator(g(leaf(1, device=device))), (
        "decorating a generator function gave a function that is not a generator function"
    )
    a = leaf(5, device=device)
    c = torch.randn(5, device=device)
    outs = list(g(a))
    assert _recomputable(outs, 0), "tensor made before the first yield is not recorded"
    assert _recomputable(outs, 1), "tensor made after a resumption is not recorded"
    outs = list(g(a))
    loss = (outs[0] * outs[1] * c).sum()
    del outs
    loss.backward()
    assert torch.equal(a.grad, plain_grad(lambda t: (lambda o: o[0] * o[1] * c)(list(gen(t))), a))
    del loss
    # a generator abandoned half-way leaves no block open
    it = g(a)
    first = next(it)
    it.close()
    del it, first
    assert_stacks_clean()


@pytest.mark.parametrize("deco", list(DECORATORS))
def test_decorated_async_function(deco, device):
    async def co(x):
        y = x.sin()
        await _Yield()
        return y, y.exp()

    try:
        f = DECORATORS[deco](co)
    except TypeError:
        assert_stacks_clean()
        return
    assert inspect.iscoroutinefunction(f), "decorating an async def gave a function that is not async"
    a = leaf(5, device=device)
    c = torch.randn(5, device=device)
    held = list(_drive(f(a)))
    assert _recomputable(held, 0), "tensor made before the await is not recorded"
    assert _recomputable(held, 1), "tensor made after the await is not recorded"
    y, z = _drive(f(a))
    loss = (y * z * c).sum()
    del y, z
    loss.backward()
    assert torch.equal(a.grad, plain_grad(lambda t: (lambda o: o[0] * o[1] * c)(_drive(co(t))), a))
    del loss
    assert_stacks_clean()


@pytest.mark.parametrize("deco", list(DECORATORS))
def test_decorated_async_generator(deco, device):
    async def agen(x):
        y = x.sin()
        yield y
        await _Yield()
        yield y.exp()

    try:
        f = DECORATORS[deco](agen)
    except TypeError:
        assert_stacks_clean()
        return
    assert inspect.isasyncgenfunction(f), "decorating an async generator gave something else"

    async def collect(x):
        return [v async for v in f(x)]

    a = leaf(5, device=device)
    outs = _drive(collect(a))
    assert _recomputable(outs, 0), "tensor made before the first yield is not recorded"
    assert _recomputable(outs, 1), "tensor made after a resumption is not recorded"
    del outs
    assert_stacks_clean()


@pytest.mark.parametrize("deco", list(DECORATORS))
def test_decorated_class(deco, device):
    """A class: TypeError at decoration, or still a class whose instances' forward runs
    in a scope (not silently replaced by a function)."""

    class Block(nn.Module):
        def forward(self, x):
            return x.sin()

    try:
        C = DECORATORS[deco](Block)
    except TypeError:
        assert_stacks_clean()
        return
    assert inspect.isclass(C), f"decorating a class returned {type(C).__name__}, not a class"
    m = C()
    assert isinstance(m, C) and isinstance(m, nn.Module)
    a = leaf(5, device=device)
    assert _recomputable([m(a)], 0), "the decorated class's forward is not recorded"
    assert_stacks_clean()
