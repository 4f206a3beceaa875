"""model_stats (API.md section 6): the stats of the scopes that apply_recompute and
checkpoint run, summed per module and in total, checked against the same program
with explicit scopes."""

import dataclasses
import functools
import weakref

import pytest
import torch
import torch.nn as nn
import transformers

import gradient_scope
from gradient_scope import ModelStats, ScopeStats, apply_recompute, model_stats, recompute_scope, remove_recompute

from support import ResidualFF

FIELDS = ("ops_recorded", "ops_saved", "tensors_packed", "bytes_packed", "replays", "ops_replayed")


def as_tuple(stats):
    return tuple(getattr(stats, f) for f in FIELDS)


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(ResidualFF(), ResidualFF(), nn.Linear(16, 4))


def explicit_scopes(model, x):
    """The same program with one explicit scope per block call: the expected stats."""
    scopes = []
    for block in model[:2]:
        scopes.append(recompute_scope())
        with scopes[-1]:
            x = block(x)
    loss = model[2](x).sum()
    del x  # as inside a model: no block output stays alive (alive ones are not replayed)
    loss.backward()
    return [s.stats for s in scopes]


def test_public_names():
    for name in ("model_stats", "ModelStats"):
        assert name in gradient_scope.__all__
        assert ">>>" in getattr(gradient_scope, name).__doc__


def test_apply_recompute_stats_per_module_and_total():
    x = torch.randn(8, 16, requires_grad=True)
    expected = explicit_scopes(make_model(), x)
    model = apply_recompute(make_model(), check_fn=ResidualFF)
    before = model_stats(model)  # nothing ran yet: the scoped modules, with zeros
    assert list(before.modules) == ["0", "1"] and as_tuple(before) == (0,) * len(FIELDS)
    model(x).sum().backward()
    stats = model_stats(model)
    assert list(stats.modules) == ["0", "1"]
    for name, exp in zip(("0", "1"), expected):
        assert as_tuple(stats.modules[name]) == as_tuple(exp)
        assert exp.replays > 0 and exp.tensors_packed > 0
    assert as_tuple(stats) == tuple(map(sum, zip(*(as_tuple(e) for e in expected))))
    assert isinstance(stats.modules["0"], ScopeStats) and isinstance(stats, ScopeStats)


def test_counts_accumulate_until_reset_and_apply_recompute_starts_afresh():
    model = apply_recompute(make_model(), check_fn=ResidualFF)
    x = torch.randn(8, 16, requires_grad=True)
    model(x).sum().backward()
    once = as_tuple(model_stats(model))
    model(x).sum().backward()
    assert as_tuple(model_stats(model, reset=True)) == tuple(2 * v for v in once)
    assert as_tuple(model_stats(model)) == (0,) * len(FIELDS)
    model(x).sum().backward()
    assert as_tuple(model_stats(model)) == once
    apply_recompute(model, check_fn=ResidualFF)  # applied again: counts from here
    assert model_stats(model).modules["0"] == ScopeStats()
    remove_recompute(model)
    assert model_stats(model) == ModelStats()


def test_checkpoint_blocks_count_for_the_module_they_run():
    x = torch.randn(8, 16, requires_grad=True)
    expected = explicit_scopes(make_model(), x)
    model = make_model()
    h = gradient_scope.checkpoint(model[0], x)  # the module
    h = gradient_scope.checkpoint(functools.partial(model[1].__call__), h)  # as transformers calls it
    loss = model[2](h).sum()
    del h
    loss.backward()
    stats = model_stats(model)
    assert list(stats.modules) == ["0", "1"]
    for name, exp in zip(("0", "1"), expected):
        assert as_tuple(stats.modules[name]) == as_tuple(exp)
    # A plain function has no module to count for.
    gradient_scope.checkpoint(lambda a: model[0](a), x).sum().backward()
    assert as_tuple(model_stats(model, reset=True).modules["0"]) == as_tuple(expected[0])
    assert model_stats(model) == ModelStats()


def test_checkpoint_stats_do_not_keep_the_module_alive():
    block = ResidualFF()
    gradient_scope.checkpoint(block, torch.randn(2, 16, requires_grad=True)).sum().backward()
    assert model_stats(block).tensors_packed > 0
    probe = weakref.ref(block)
    del block
    assert probe() is None  # without gc.collect()


def test_transformers_layers_through_gradient_checkpointing():
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=12,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).train()
    model._set_gradient_checkpointing(True, gradient_checkpointing_func=gradient_scope.checkpoint)
    ids = torch.randint(3, 64, (2, 12))
    model(input_ids=ids, labels=ids).loss.backward()
    stats = model_stats(model)
    assert list(stats.modules) == ["model.layers.0", "model.layers.1"]
    assert all(s.tensors_packed > 0 and s.replays > 0 for s in stats.modules.values())


def test_bad_model():
    with pytest.raises(TypeError, match="must be a torch.nn.Module"):
        model_stats(lambda x: x)


def _but_how_calls_ran(stats):
    """``stats`` with the counts of how function-form calls ran (steady or recorded) zeroed."""
    def blank(s):
        return dataclasses.replace(s, calls_steady=0, calls_recorded=0, recorded_why={})

    return dataclasses.replace(blank(stats), modules={k: blank(v) for k, v in stats.modules.items()})


def test_per_step_counts_by_difference():
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh())
    apply_recompute(model, check_fn=nn.Tanh)
    steps = []
    for _ in range(3):
        before = model_stats(model)
        model(torch.randn(4, 8)).sum().backward()
        steps.append(model_stats(model) - before)
    # each step alone, while the totals grow; how its calls ran may change over the first
    # steps (the steady state records a function's first calls, GRADIENT_SCOPE_FAST=1)
    assert _but_how_calls_ran(steps[0]) == _but_how_calls_ran(steps[1]) == _but_how_calls_ran(steps[2])
    assert all(s.calls_steady + s.calls_recorded == 2 for s in steps)
    assert steps[0].replays == 2 and steps[0].tensors_packed == 3
    assert model_stats(model).replays == 6
    assert set(steps[0].modules) == {"1", "3"} and steps[0].modules["1"].replays == 1
