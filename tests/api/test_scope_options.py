"""The scope's options as users pass them: the real signature, the decorator forms,
NumPy bools, and the process-wide switch (``gradient_scope.disabled()``,
``GRADIENT_SCOPE_DISABLE``) that turns every scope into a no-op."""

import inspect
import pydoc
import threading

import numpy as np
import pytest
import torch
import torch.nn as nn

import gradient_scope
from gradient_scope import apply_recompute, checkpoint, recompute, recompute_scope

OPTIONS = ["preserve_rng_state", "save", "enabled", "debug", "budget"]


def test_signature_shows_the_options():
    sig = inspect.signature(recompute_scope)
    assert list(sig.parameters) == OPTIONS
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in sig.parameters.values())
    assert sig.parameters["preserve_rng_state"].default is True
    assert sig.parameters["enabled"].default is True
    text = pydoc.render_doc(recompute_scope, renderer=pydoc.plaintext)
    assert "recompute_scope(*, preserve_rng_state" in text.split("\n")[3]  # the class's own line
    assert sig.return_annotation is inspect.Signature.empty


def _program(x, w):
    h = (x @ w).tanh()
    return (h * h).sum()


def _grads(fn):
    torch.manual_seed(0)
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(8, 8, requires_grad=True)
    fn(x, w).backward()
    return x.grad, w.grad


def _scoped_ops(decorated, *args):
    """Whether calling ``decorated`` recorded its ops in a scope (a handle was packed)."""
    packed = []
    remove = gradient_scope._save.pack.add_pack_listener(lambda t, h: packed.append(h))
    try:
        decorated(*args).backward()
    finally:
        remove()
    return len(packed)


def test_bare_recompute_scope_decorator():
    @recompute_scope
    def block(x, w):
        return _program(x, w)

    assert block.__name__ == "block"
    assert [torch.equal(a, b) for a, b in zip(_grads(block), _grads(_program))] == [True, True]
    x, w = torch.randn(4, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
    assert _scoped_ops(block, x, w) > 0

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        @recompute_scope
        def forward(self, x):
            return self.lin(x).tanh()

    layer = Layer()
    assert _scoped_ops(lambda x: (layer(x) ** 2).sum(), x) > 0


def test_recompute_bare_and_with_options():
    @recompute
    def bare(x, w):
        return _program(x, w)

    @recompute(preserve_rng_state=False, save=[torch.ops.aten.mm])
    def with_options(x, w):
        return _program(x, w)

    plain = _grads(_program)
    for fn in (bare, with_options):
        assert all(torch.equal(a, b) for a, b in zip(_grads(fn), plain))
    x, w = torch.randn(4, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
    assert _scoped_ops(bare, x, w) > 0 and _scoped_ops(with_options, x, w) > 0


def test_bad_positional_arguments():
    with pytest.raises(TypeError, match="keyword options only"):
        recompute_scope(True)
    with pytest.raises(TypeError, match="keyword options only"):
        recompute_scope(_program, debug=True)
    with pytest.raises(TypeError, match="keyword options only"):
        recompute_scope(_program, _program)


@pytest.mark.parametrize("name", ["preserve_rng_state", "enabled", "debug"])
def test_numpy_bools_accepted(name):
    for value in (np.bool_(True), np.bool_(False), np.True_):
        scope = recompute_scope(**{name: value})
        assert type(scope._options[name]) is bool and scope._options[name] == bool(value)
    x, w = torch.randn(4, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
    with recompute_scope(enabled=np.bool_(False)):
        h = x @ w
    assert _scoped_ops(lambda: (h * h).sum()) == 0
    checkpoint(_program, x, w, preserve_rng_state=np.bool_(False), use_reentrant=np.bool_(False)).backward()


@pytest.mark.parametrize("value", [1, 0, "yes", None, torch.tensor(True), np.array([True])])
def test_non_bools_refused_clearly(value):
    with pytest.raises(TypeError, match=r"enabled must be a bool \(True or False; a numpy.bool_ is accepted too\)"):
        recompute_scope(enabled=value)
    with pytest.raises(TypeError, match="debug must be a bool"):
        checkpoint(_program, torch.randn(1, 8), torch.randn(8, 8), debug=value)
    with pytest.raises(TypeError, match="debug must be a bool"):
        apply_recompute(nn.Linear(2, 2), debug=value)


def _records(fn):
    """Ops recorded by the scope ``fn`` enters (its stats)."""
    x, w = torch.randn(4, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
    scope = recompute_scope()
    with scope:
        y = fn(x, w)
    y.backward()
    return scope.stats.ops_recorded


def test_disabled_turns_every_scope_off():
    assert "disabled" in gradient_scope.__all__
    assert _records(_program) > 0
    x, w = torch.randn(4, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
    model = apply_recompute(nn.Sequential(nn.Linear(8, 8), nn.Tanh()), check_fn=nn.Sequential)
    with gradient_scope.disabled():
        assert _records(_program) == 0
        assert _scoped_ops(lambda: (model(x) ** 2).sum()) == 0  # apply_recompute's scope
        assert _scoped_ops(lambda: checkpoint(_program, x, w)) == 0
        assert _scoped_ops(recompute(_program), x, w) == 0
        with gradient_scope.disabled():  # nests
            assert _records(_program) == 0
        assert _records(_program) == 0
    assert _records(_program) > 0
    assert _scoped_ops(lambda: (model(x) ** 2).sum()) > 0


def test_disabled_is_process_wide_and_a_decorator():
    seen = []
    entered, release = threading.Event(), threading.Event()

    def other():
        with gradient_scope.disabled():
            entered.set()
            release.wait(10)

    t = threading.Thread(target=other)
    t.start()
    entered.wait(10)
    try:
        seen.append(_records(_program))
    finally:
        release.set()
        t.join()
    assert seen == [0]

    @gradient_scope.disabled()
    def off():
        return _records(_program)

    assert off() == 0 and _records(_program) > 0


def test_disabled_exits_cleanly_when_the_block_raises():
    with pytest.raises(KeyError), gradient_scope.disabled():
        raise KeyError
    assert _records(_program) > 0


def test_blocks_entered_before_keep_recomputing():
    x, w = torch.randn(4, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
    scope = recompute_scope()
    with scope:
        h = (x @ w).tanh()
    with gradient_scope.disabled():
        (h * h).sum().backward()
    assert scope.stats.replays == 0 and scope.stats.tensors_packed > 0  # h alive: used as is
    del h


@pytest.mark.parametrize("value", ["1", "true", "YES", " on "])
def test_environment_variable_turns_scopes_off(monkeypatch, value):
    monkeypatch.setenv("GRADIENT_SCOPE_DISABLE", value)
    assert _records(_program) == 0  # read when the scope is entered
    monkeypatch.setenv("GRADIENT_SCOPE_DISABLE", "0")
    assert _records(_program) > 0


@pytest.mark.parametrize("value", ["0", "", "false", "off", "no"])
def test_environment_variable_off_values(monkeypatch, value):
    monkeypatch.setenv("GRADIENT_SCOPE_DISABLE", value)
    assert _records(_program) > 0


def test_environment_variable_bad_value(monkeypatch):
    monkeypatch.setenv("GRADIENT_SCOPE_DISABLE", "maybe")
    with pytest.raises(ValueError, match="GRADIENT_SCOPE_DISABLE='maybe' is neither on"):
        with recompute_scope():
            pass


@pytest.mark.parametrize("form", ["object", "budget"])
def test_a_scope_whose_entry_raised_can_be_entered_once_the_cause_is_fixed(monkeypatch, form):
    """A bad switch value makes ``__enter__`` raise; the same scope object is not left
    "already active": fixed, it enters, records and recomputes (also with a budget)."""
    scope = recompute_scope(budget=gradient_scope.Budget("1MiB")) if form == "budget" else recompute_scope()
    monkeypatch.setenv("GRADIENT_SCOPE_DISABLE", "maybe")
    for _ in range(2):
        with pytest.raises(ValueError, match="neither on"):
            with scope:
                pass
    monkeypatch.delenv("GRADIENT_SCOPE_DISABLE")
    x, w = torch.randn(4, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
    with scope:
        h = (x @ w).tanh()
    (h * h).sum().backward()
    assert scope.stats.ops_recorded == 2 and scope.stats.tensors_packed > 0


def test_disabled_lets_torch_func_run_scoped_code():
    def loss_fn(w, x):
        with recompute_scope():
            h = (x @ w).tanh()
        return (h * h).sum()

    w, x = torch.randn(4, 4), torch.randn(2, 4)
    with pytest.raises(RuntimeError, match=r"gradient_scope.disabled\(\)"):
        torch.func.grad(loss_fn)(w, x)
    with gradient_scope.disabled():
        g = torch.func.grad(loss_fn)(w, x)
    assert torch.equal(g, torch.func.grad(lambda w, x: ((x @ w).tanh() ** 2).sum())(w, x))


@pytest.mark.parametrize("form", ["bare", "checkpoint", "apply_recompute", "disabled"])
def test_forms_compile_fullgraph(form):
    """The bare decorator, checkpoint's and apply_recompute's labelled scopes and the
    switch trace with fullgraph=True (no graph break) and give plain gradients."""
    torch._dynamo.reset()
    lin = nn.Linear(8, 8)
    plain_model = nn.Sequential(lin, nn.Tanh())

    def plain(x):
        return (plain_model(x) ** 2).sum()

    if form == "bare":
        fn = recompute_scope(plain)
    elif form == "checkpoint":
        fn = lambda x: (checkpoint(plain_model, x, use_reentrant=False) ** 2).sum()
    elif form == "apply_recompute":
        inner = nn.Sequential(lin, nn.Tanh())
        model = apply_recompute(nn.Sequential(inner), check_fn=lambda m: m is inner)
        fn = lambda x: (model(x) ** 2).sum()
    else:

        def fn(x):
            with recompute_scope():
                h = plain_model(x)
            return (h**2).sum()

    x = torch.randn(4, 8, requires_grad=True)
    (gx,) = torch.autograd.grad(plain(x), x)
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    if form == "disabled":
        with gradient_scope.disabled():
            y = compiled(x)
    else:
        y = compiled(x)
    (g,) = torch.autograd.grad(y, x)
    torch.testing.assert_close(g, gx)
    torch._dynamo.reset()


def test_misspelled_options_name_the_valid_ones():
    valid = "the options are budget, debug, enabled, preserve_rng_state, save"
    misspelled = r"recompute_scope: unknown option 'presrve_rng_state' \(did you mean 'preserve_rng_state'\?\); "
    with pytest.raises(TypeError, match=misspelled + valid):
        recompute_scope(presrve_rng_state=False)
    with pytest.raises(TypeError, match=r"unknown option 'sav' \(did you mean 'save'\?\)"):

        @recompute(sav=[torch.ops.aten.mm])
        def f(x):
            return x

    with pytest.raises(TypeError, match=r"unknown options 'bogus', 'enable' \(did you mean 'enabled'\?\)"):
        recompute_scope(enable=False, bogus=1)
    with pytest.raises(TypeError, match=r"checkpoint: unknown option 'presrve_rng_state' .*no 'presrve_rng_state'"):
        checkpoint(nn.Linear(2, 2), torch.randn(1, 2), presrve_rng_state=False)

    def takes_it(x, debugs=1.0):  # a keyword of the function itself, near an option name: passed on
        return x * debugs

    assert torch.equal(checkpoint(takes_it, torch.ones(2), debugs=2.0), torch.full((2,), 2.0))
