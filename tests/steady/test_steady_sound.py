"""The steady state (``_adapters.steady``, ``GRADIENT_SCOPE_FAST=1``) is sound where dynamo does
not guard (issue 35): module hooks, constants that only dynamo's branch changes, what it keeps
alive, user exceptions, its switch, several models of one class. Every case against the plain
program, bitwise on CPU."""

from __future__ import annotations

import gc
import logging
import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import gradient_scope
from gradient_scope import Budget, apply_recompute, checkpoint
from gradient_scope._adapters.steady import run as steady


class Block(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


def _models(layers=3):
    torch.manual_seed(0)
    plain = nn.Sequential(*(Block() for _ in range(layers)))
    torch.manual_seed(0)
    scoped = nn.Sequential(*(Block() for _ in range(layers)))
    apply_recompute(scoped, check_fn=Block)
    return plain, scoped


def _step(model, x):
    loss = model(x).square().mean()
    loss.backward()
    out = (loss.detach(), [p.grad.clone() for p in model.parameters()])
    model.zero_grad(set_to_none=True)
    return out


def _same(a, b):
    (la, ga), (lb, gb) = a, b
    return torch.equal(la, lb) and all(torch.equal(x, y) for x, y in zip(ga, gb))


_HOOKS = {
    "forward": lambda m: m.register_forward_hook(lambda mod, args, out: out * 1.5),
    "pre": lambda m: m.register_forward_pre_hook(lambda mod, args: (args[0] * 0.5,)),
    "backward": lambda m: m.register_full_backward_hook(lambda mod, gin, gout: (gin[0] * 2.0,)),
    "backward_pre": lambda m: m.register_full_backward_pre_hook(lambda mod, gout: (gout[0] * 3.0,)),
}


@pytest.mark.parametrize("kind", sorted(_HOOKS))
def test_a_hook_added_after_capture_runs(fast, kind):
    plain, scoped = _models()
    x = torch.randn(4, 8, 16, requires_grad=True)
    for step in range(3):  # captured, bound from the template
        assert _same(_step(plain, x), _step(scoped, x)), step
    assert fast
    handles = [_HOOKS[kind](m[1].fc1) for m in (plain, scoped)]
    for step in range(2):
        assert _same(_step(plain, x), _step(scoped, x)), ("hooked", step)
    for h in handles:
        h.remove()
    before = len(fast)
    for step in range(2):
        assert _same(_step(plain, x), _step(scoped, x)), ("removed", step)
    assert len(fast) > before  # without the hook, steady again


@pytest.mark.parametrize("kind", sorted(_HOOKS))
def test_a_hook_on_one_instance_from_the_start_runs(fast, kind):
    """A hook on a submodule of the last layer only: the other layers' graph must not serve it."""
    plain, scoped = _models()
    for m in (plain, scoped):
        _HOOKS[kind](m[2].fc2)
    x = torch.randn(4, 8, 16, requires_grad=True)
    for step in range(4):
        assert _same(_step(plain, x), _step(scoped, x)), step
    stats = gradient_scope.model_stats(scoped)
    assert stats.modules["2"].calls_steady == 0 and stats.modules["2"].recorded_why == {"module hook": 4}
    assert stats.modules["1"].calls_steady > 0


def test_a_hook_on_the_first_layer_only_records_that_layer_only(fast):
    """Not blamed on an is_compiling() branch: the class keeps its steady state."""
    plain, scoped = _models()
    for m in (plain, scoped):
        m[0].fc1.register_forward_hook(lambda mod, args, out: out.relu())
    x = torch.randn(4, 8, 16, requires_grad=True)
    for step in range(4):
        assert _same(_step(plain, x), _step(scoped, x)), step
    stats = gradient_scope.model_stats(scoped)
    assert stats.modules["0"].recorded_why == {"module hook": 4}
    assert stats.modules["1"].calls_steady + stats.modules["2"].calls_steady >= 5
    assert not list(steady._failed)


def test_a_hook_on_a_module_a_closure_calls_runs(fast):
    torch.manual_seed(0)
    lin = nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)

    def f(y):
        return lin(y).tanh()

    expect = []
    for _ in range(3):
        checkpoint(f, x).sum().backward()
    assert fast
    h = lin.register_forward_hook(lambda mod, args, out: out * 2.0)
    for _ in range(2):
        x.grad = None
        checkpoint(f, x).sum().backward()
        expect.append(x.grad.clone())
    h.remove()
    x.grad = None
    lin.register_forward_hook(lambda mod, args, out: out * 2.0)
    f(x).sum().backward()
    assert all(torch.equal(g, x.grad) for g in expect)


def test_a_hugging_face_self_attn_hook_runs(fast):
    import gradient_scope.integrations.transformers as gs_hf

    from support.hf_models import SEQ, VOCAB, make_model

    plain, scoped = make_model("llama", 2, seed=0).train(), make_model("llama", 2, seed=0).train()
    gs_hf.enable(scoped)
    ids = torch.randint(0, VOCAB, (2, SEQ))

    def step(model):
        torch.manual_seed(1)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        out = (loss.detach(), [p.grad.clone() for p in model.parameters()])
        model.zero_grad(set_to_none=True)
        return out

    for _ in range(3):
        assert _same(step(plain), step(scoped))
    assert fast
    for m in (plain, scoped):
        m.model.layers[1].self_attn.register_forward_hook(lambda mod, args, out: (out[0] * 1.25, *out[1:]))
    for _ in range(2):
        assert _same(step(plain), step(scoped))


def test_a_constant_only_dynamo_branch_changes_is_not_computed(fast):
    """D6 sees the Python numbers of the ops: after the first captured run (warned), every
    call computes the eager branch."""

    def f(y):
        return (y * (2.0 if torch.compiler.is_compiling() else 3.0)).sin()

    x = torch.randn(4, 8, requires_grad=True)
    with pytest.warns(UserWarning, match="runs other ops when dynamo traces it"):
        for i in range(6):
            out = checkpoint(f, x)
            if i != 1:  # the graph's first run computed dynamo's branch (D6)
                assert torch.equal(out, (x * 3.0).sin()), i
            out.sum().backward()


def test_a_model_whose_forward_checkpoints_a_lambda_over_self_is_freed(fast):
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            return checkpoint(lambda y: self.lin(y).tanh(), x)

    def train():
        m = M()
        x = torch.randn(2, 8, requires_grad=True)
        for _ in range(3):
            m(x).sum().backward()
        return weakref.ref(m)

    gc.collect()
    gc.disable()  # freed by reference counting, not by the cycle collector
    try:
        ref = train()
        assert ref() is None
    finally:
        gc.enable()
    assert fast


def test_a_closure_made_per_call_is_freed_each_step(fast):
    torch.manual_seed(0)
    lin = nn.Linear(8, 8)
    x = torch.randn(2, 8, requires_grad=True)
    refs = []

    def step():
        def inner(y):
            return lin(y).tanh()

        refs.append(weakref.ref(inner))
        checkpoint(inner, x).sum().backward()

    gc.collect()
    gc.disable()
    try:
        for _ in range(4):
            step()
        assert [r() for r in refs] == [None] * 4
    finally:
        gc.enable()
    assert fast


def test_user_exceptions_are_not_graph_breaks(fast):
    def f(y, bad):
        if bad:
            raise ValueError("bad input")
        return y.sin() * 2

    x = torch.randn(4, 8, requires_grad=True)
    checkpoint(f, x, False).sum().backward()  # the first call runs eagerly (D6)
    for _ in range(3):
        with pytest.raises(ValueError, match="bad input"):
            checkpoint(f, x, True)
    for _ in range(3):
        x.grad = None
        checkpoint(f, x, False).sum().backward()
        assert torch.equal(x.grad, 2 * x.detach().cos())
    assert fast and not list(steady._failed)


@pytest.mark.parametrize("word", ["true", " On ", "YES", "1"])
def test_the_switch_takes_the_words_of_disable_on(fast, monkeypatch, word):
    monkeypatch.setenv("GRADIENT_SCOPE_FAST", word)
    plain, scoped = _models(2)
    x = torch.randn(4, 8, 16, requires_grad=True)
    for _ in range(3):
        assert _same(_step(plain, x), _step(scoped, x))
    assert fast and gradient_scope.model_stats(scoped).calls_steady == len(fast)


@pytest.mark.parametrize("word", ["false", "Off", " no", "0", ""])
def test_the_switch_takes_the_words_of_disable_off(fast, monkeypatch, word):
    monkeypatch.setenv("GRADIENT_SCOPE_FAST", word)
    plain, scoped = _models(2)
    x = torch.randn(4, 8, 16, requires_grad=True)
    for _ in range(3):
        assert _same(_step(plain, x), _step(scoped, x))
    assert not fast and gradient_scope.model_stats(scoped).recorded_why == {"off": 6}


def test_the_switch_rejects_other_words(fast, monkeypatch):
    monkeypatch.setenv("GRADIENT_SCOPE_FAST", "fast")
    with pytest.raises(ValueError, match="GRADIENT_SCOPE_FAST='fast' is neither on"):
        checkpoint(lambda y: y.sin(), torch.randn(2, requires_grad=True))


def test_model_stats_say_how_calls_ran(fast):
    plain, scoped = _models(3)
    x = torch.randn(4, 8, 16, requires_grad=True)
    for _ in range(3):
        _step(scoped, x)
    stats = gradient_scope.model_stats(scoped)
    assert stats.calls_steady == len(fast) == 7
    assert stats.calls_recorded == 2 and stats.recorded_why == {"first call": 1, "first run of a graph": 1}
    step = gradient_scope.model_stats(scoped)
    _step(scoped, x)
    assert (gradient_scope.model_stats(scoped) - step).calls_steady == 3


def test_giving_up_on_a_function_is_said_once_at_info(fast, caplog):
    def f(y):
        torch._dynamo.graph_break()
        return y.sin()

    x = torch.randn(4, requires_grad=True)
    with caplog.at_level(logging.INFO, logger="gradient_scope"):
        for _ in range(5):
            checkpoint(f, x).sum().backward()
    said = [r for r in caplog.records if r.name == "gradient_scope" and "no steady state" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.INFO and "f" in said[0].getMessage()
    assert not fast


def test_two_models_of_one_layer_class_the_second_with_a_budget(fast):
    """Issue 35 item 3: the second model's first step is bound from the first model's
    template, and its budget measures that bound record."""
    import gradient_scope.integrations.transformers as gs_hf

    from support.hf_models import SEQ, VOCAB, make_model

    ids = torch.randint(0, VOCAB, (2, SEQ))

    def step(model):
        torch.manual_seed(1)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        out = (loss.detach(), [p.grad.clone() for p in model.parameters()])
        model.zero_grad(set_to_none=True)
        return out

    first = gs_hf.enable(make_model("llama", 2, seed=0).train())
    for _ in range(3):
        step(first)
    plain, second = make_model("llama", 2, seed=1).train(), make_model("llama", 2, seed=1).train()
    gs_hf.enable(second, budget=Budget(10**5))
    for _ in range(3):
        assert _same(step(plain), step(second))
    assert fast
