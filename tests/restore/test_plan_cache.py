"""Replay plans are shared by records of the same structure (docs/concepts.md, Performance).

Blocks that record the same ops, wired the same way, on values of the same shapes and
dtypes -- every layer of a model, every step -- share one plan per requested value:
a repeated step plans nothing. A block of another structure gets its own plans, and a
shared plan is used only where the values it found in memory are in memory again.
Gradients are those of the program without scopes, bitwise.
"""

import weakref

import pytest
import torch

from gradient_scope import recompute_scope
from gradient_scope._record import signature as _signature
from gradient_scope._restore import structure as _structure

from support import Transformer, dead, grads, run_both, stat


@pytest.fixture
def planned(monkeypatch):
    """Counts the closures worked out from scratch (plan-cache misses), from an empty
    table of structures: plans cached by earlier tests of the session (same model
    shapes) would otherwise be hits from the first step on."""
    monkeypatch.setattr(_structure, "_structures", {})
    monkeypatch.setattr(_structure, "_by_key_id", {})
    calls = []
    real = _structure.Structure._closure

    def counting(self, target, available):
        calls.append(target)
        return real(self, target, available)

    monkeypatch.setattr(_structure.Structure, "_closure", counting)
    return calls


def _step(model, x, scope):
    model.zero_grad(set_to_none=True)
    model(x, scope).square().sum().backward()
    return grads(dict(model=model))


def test_repeated_step_plans_nothing(planned):
    """The second step of a model with identical layers computes no closure: every
    plan comes from the first step's first layer."""
    torch.manual_seed(0)
    model = Transformer(d=16, n_layers=3, mode="outer")
    x = torch.randn(2, 5, 16, requires_grad=True)
    _step(model, x, recompute_scope)
    first = len(planned)
    assert first > 0
    _step(model, x, recompute_scope)
    assert len(planned) == first  # all hits
    # Three layers share what one of them planned: fewer misses than layers x targets.
    targets_per_layer = first
    assert len(set(planned)) == targets_per_layer


def test_cached_plan_gives_bitwise_gradients():
    """Steps 1..3 (cold, then cached plans) give the gradients of the program without
    scopes, bitwise."""

    def program(scope):
        model = Transformer(d=16, n_layers=2, mode="both")
        x = torch.randn(2, 6, 16, requires_grad=True)
        out = {}
        for step in range(3):
            for k, v in _step(model, x, scope).items():
                out[f"{step}.{k}"] = v.clone()
        return out

    scopes, _ = run_both(program)
    assert sum(stat(s, "replays") for s in scopes.created) >= 6  # replays ran in each step


def _block_key(fn, *inputs):
    """The structural signature of the block ``fn(*inputs)`` records."""
    seen = []
    real = _structure.structure_of

    def spy(record):
        seen.append(_signature.signature(record)[0])
        return real(record)

    import gradient_scope._restore.replay as plan

    plan.structure_of = spy
    try:
        with recompute_scope():
            y = fn(*inputs)
        (y * y).sum().backward()
    finally:
        plan.structure_of = real
    assert seen, "the block was not replayed"
    return seen[0]


def test_signature_tells_structures_apart():
    a = torch.randn(4, 3, requires_grad=True)
    b = torch.randn(4, 3, requires_grad=True)
    same = _block_key(lambda p, q: (p * q).sin(), a, b)
    assert _block_key(lambda p, q: (p * q).sin(), a.detach().clone().requires_grad_(), b) == same
    assert _block_key(lambda p, q: (p * q).sin(), torch.randn(5, 3, requires_grad=True), b[:1]) != same  # shape
    assert _block_key(lambda p, q: (p * q).sin(), a.double(), b.double()) != same  # dtype
    assert _block_key(lambda p, q: (p * q).cos(), a, b) != same  # op sequence
    assert _block_key(lambda p, q: (p * p).sin(), a, b) != same  # wiring


def test_other_shape_and_op_sequence_get_their_own_plans(planned):
    def block(x, op):
        with recompute_scope():
            y = op(x.exp()).sin()
        return (y * y).sum()

    x = torch.randn(3, 4, requires_grad=True)
    block(x, torch.tanh).backward()
    n = len(planned)
    block(x, torch.tanh).backward()
    assert len(planned) == n  # same structure: hit
    block(torch.randn(3, 5, requires_grad=True), torch.tanh).backward()
    assert len(planned) > n  # another shape: planned anew
    n = len(planned)
    block(x, torch.sigmoid).backward()
    assert len(planned) > n  # another op sequence: planned anew


def test_plan_follows_values_in_memory():
    """A cached plan is reused only where the values it found in memory are there
    again (P3): a block whose intermediate the user keeps alive replays fewer ops,
    on the same structure, with the same gradients."""

    def run(keep):
        torch.manual_seed(0)
        x = torch.randn(8, requires_grad=True)
        s = recompute_scope()
        with s:
            y = x.exp()
            z = y.sin()
            w = z.cos()
        loss = (w * w).sum()
        del z, w
        if not keep:
            del y
        loss.backward()
        return s.stats.ops_replayed, x.grad

    cold, g0 = run(False)
    kept, g1 = run(True)
    again, g2 = run(False)
    assert kept < cold and again == cold
    assert torch.equal(g0, g1) and torch.equal(g0, g2)


def test_cached_structures_hold_no_tensors():
    """The shared plan table keeps no block tensor or input alive (checked without gc)."""
    x = torch.randn(16, 16, requires_grad=True)
    with recompute_scope():
        y = (x @ x).relu()
    (y * y).sum().backward()
    assert _structure.cached_structures() >= 1
    refs = [weakref.ref(x), weakref.ref(y)]
    del x, y
    assert dead(*refs)
