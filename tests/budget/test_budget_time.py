"""A budget's modelled step (rules N5 in ``_budget.step``: the figure where the measuring
step was not timed, and the model whose recompute the timed one scales) counts what
autograd and the library cost per op: recording each op of the blocks, packing each tensor
they save, and replay's bookkeeping for each op replayed, at per-op rates measured once per
device (``_budget.rates``, calibrated by ``_api.calibrate``). The figures are pinned here,
with the measuring step's timing off; the step anchored to it is
``test_budget_predict.py``'s. How close the prediction comes to a measured step is the
budget benchmark's to say (``python -m benchmarks.budget``), not a timed test's.
"""

import dataclasses
import threading

import pytest
import torch
import torch.nn as nn

import gradient_scope
from gradient_scope import Budget, apply_recompute, recompute_scope
from gradient_scope._api.calibrate import library_costs
from gradient_scope._budget import rates as rates_module
from gradient_scope._budget.rates import LIBRARY_COSTS, Rates, pinned_rates, rates_for
from gradient_scope._budget.timing import Stopwatch

from support import PINNED_RATES
from support import ResidualMLP as Block

# Budgets of 0 bytes (every block recomputes all it can) are below the floor, and say so.
pytestmark = pytest.mark.filterwarnings(r"ignore:.*Budget\(0 B\) is below the floor")

@pytest.fixture(autouse=True)
def untimed(monkeypatch):
    """No block's measuring step is timed: plans predict the modelled step."""
    monkeypatch.setattr(Stopwatch, "timing", lambda self: None)


# The pinned rates without the per-op costs: what a plan predicts from kernels alone.
KERNELS_ONLY = dataclasses.replace(PINNED_RATES, **{k: 0.0 for k in LIBRARY_COSTS})


def make_model(layers=3, d=32):
    torch.manual_seed(0)
    return nn.Sequential(*[Block(d) for _ in range(layers)], nn.LayerNorm(d), nn.Linear(d, 8))


def planned(nbytes, rates, layers=3):
    """A budget of ``nbytes`` over ``layers`` blocks, planned at ``rates``; and its model."""
    model = make_model(layers)
    budget = Budget(nbytes)
    apply_recompute(model, check_fn=lambda m: isinstance(m, Block), budget=budget)
    x = torch.randn(16, 32, requires_grad=True)
    with pinned_rates("cpu", rates):
        budget.plan(lambda: model(x).square().sum().backward())
    return budget, model, x


def test_pinned_rates_count_the_library():
    assert all(getattr(PINNED_RATES, k) > 0 for k in LIBRARY_COSTS)


@pytest.mark.parametrize("nbytes", [0, "64MiB"])
def test_step_counts_each_recorded_op_and_each_save(nbytes):
    """N5: the step is the kernels' figure plus record per op and save per saved tensor
    (and replay per replayed op): a plan over N ops predicts at least N * record more."""
    budget, model, _ = planned(nbytes, PINNED_RATES)
    bare, _, _ = planned(nbytes, KERNELS_ONLY)
    r = budget._run.result
    recorded = gradient_scope.model_stats(model).ops_recorded
    assert not r.timed and r.scale == 1.0
    assert r.ops_recorded == recorded > 0 and r.saves > 0
    extra = budget.predicted_step_time - bare.predicted_step_time
    library = recorded * PINNED_RATES.record + r.saves * PINNED_RATES.save + r.replayed * PINNED_RATES.replay
    assert extra == pytest.approx(library + recorded * PINNED_RATES.train, rel=1e-9)
    assert r.library == pytest.approx(library, rel=1e-9)
    assert budget.predicted_step_time >= recorded * PINNED_RATES.record


def test_replayed_ops_are_the_ops_backward_replays():
    """The replay term counts the ops replay runs under the plan: at a budget of 0 every
    block replays, and the count is what the next step's backward replays."""
    budget, model, x = planned(0, PINNED_RATES)
    predicted = budget._run.result.replayed
    with pinned_rates("cpu", PINNED_RATES):
        before = gradient_scope.model_stats(model).ops_replayed
        model(x).square().sum().backward()
        replayed = gradient_scope.model_stats(model).ops_replayed - before
    assert predicted == replayed > 0
    bare, _, _ = planned(0, KERNELS_ONLY)
    assert budget.predicted_recompute - bare.predicted_recompute == pytest.approx(replayed * PINNED_RATES.replay)


def test_keeping_everything_costs_no_replay():
    budget, _, _ = planned("64MiB", PINNED_RATES)
    r = budget._run.result
    assert r.replayed == 0 and budget.predicted_recompute == 0
    assert r.library == pytest.approx(r.ops_recorded * PINNED_RATES.record + r.saves * PINNED_RATES.save)


def test_curve_steps_count_the_library():
    budget, _, _ = planned(0, PINNED_RATES)
    bare, _, _ = planned(0, KERNELS_ONLY)
    r = budget._run.result
    top, bare_top = budget.curve().points[-1], bare.curve().points[-1]  # nothing recomputed there
    assert top.recompute == bare_top.recompute == 0
    assert top.step - bare_top.step == pytest.approx(
        r.ops_recorded * (PINNED_RATES.record + PINNED_RATES.train) + r.saves * PINNED_RATES.save
    )


def test_summary_names_what_the_step_counts():
    budget, _, _ = planned(0, PINNED_RATES)
    r = budget._run.result
    text = budget.summary()
    assert "predicted library cost per step" in text
    assert f"recording {r.ops_recorded} ops,\n  packing {r.saves} saved tensors" in text
    assert f"replaying {r.replayed} ops" in text
    assert "not the code outside the scopes" in text


def test_calibration_measures_every_cost():
    costs = library_costs(torch.device("cpu"))
    assert sorted(costs) == sorted(LIBRARY_COSTS)
    assert all(isinstance(v, float) for v in costs.values())
    assert costs["record"] > 0  # a recorded op costs a Python call per op at least


@pytest.fixture
def unmeasured():
    """No cached rates for the CPU while the test runs; the cache as found after it."""
    before = dict(rates_module._CACHE)
    rates_module._CACHE.pop(("cpu", None), None)
    yield
    rates_module._CACHE.clear()
    rates_module._CACHE.update(before)


def test_rates_measured_inside_an_open_block_leave_it_alone(unmeasured):
    """A plan is made when a block closes: the calibration it starts runs its scopes in a
    thread of its own, so the open block records none of them, and its gradients are
    the plain program's."""
    a = torch.randn(8, requires_grad=True)
    y = a.sin()
    (y.cos() * y).sum().backward()
    expected, a.grad = a.grad, None
    threads = threading.active_count()
    scope = recompute_scope()
    with scope:
        y = a.sin()
        rates = rates_for("cpu")
        z = y.cos()
    loss = (z * y).sum()
    del y, z  # backward replays them
    loss.backward()
    assert scope.stats.ops_recorded == scope.stats.ops_replayed == 2
    assert torch.equal(a.grad, expected)
    assert isinstance(rates, Rates) and rates.record > 0
    assert rates_for("cpu") is rates  # measured once, then cached
    assert threading.active_count() == threads  # the calibration's thread has ended


def test_a_failed_calibration_raises_and_is_measured_again(unmeasured, monkeypatch):
    def broken(device):
        raise RuntimeError("calibration failed")

    monkeypatch.setattr(rates_module, "_calibration", [broken])
    with pytest.raises(RuntimeError, match="calibration failed"):
        rates_for("cpu")
    assert ("cpu", None) not in rates_module._CACHE
    monkeypatch.setattr(rates_module, "_calibration", [lambda d: {k: 1e-6 for k in LIBRARY_COSTS}])
    assert rates_for("cpu").record == 1e-6
