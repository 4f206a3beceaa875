"""A budget's predicted step is anchored to its measuring step (rule N5 in ``_budget.step``,
``_budget.timing``): each block's forward and backward as timed there, less the measuring's
own code and the replays, plus the plan's recompute scaled to what that step's replays took.
Where the figures are compared exactly, the timings are pinned; how close the prediction
comes to a measured step is the budget benchmark's to say (``python -m benchmarks.budget``).
"""

import itertools
import time
import types

import pytest
import torch
import torch.nn as nn

import gradient_scope
from gradient_scope import Budget, apply_recompute
from gradient_scope._budget import block as block_module
from gradient_scope._budget.planner import recompute_cost
from gradient_scope._budget.timing import Stopwatch, Timing

from support import PINNED_RATES, pinned_cpu_rates
from support import ResidualMLP as Block

pytestmark = pytest.mark.filterwarnings(r"ignore:.*Budget\(0 B\) is below the floor")


def make_model(layers=3, d=32):
    torch.manual_seed(0)
    return nn.Sequential(*[Block(d) for _ in range(layers)], nn.LayerNorm(d), nn.Linear(d, 8))


def planned(nbytes, model=None):
    """A budget of ``nbytes`` over the Blocks of ``model``, planned on one step at the pinned
    rates; and its model."""
    model = model if model is not None else make_model()
    budget = Budget(nbytes)
    apply_recompute(model, check_fn=lambda m: isinstance(m, Block), budget=budget)
    x = torch.randn(16, 32, requires_grad=True)
    with pinned_cpu_rates():
        budget.plan(lambda: model(x).square().sum().backward())
    return budget, model


def timings(budget):
    """(site, occurrence, structure) -> the seconds its measuring step was timed at."""
    return {key: seen[4] for key, seen in budget._run.seen.items()}


@pytest.fixture
def pinned_timings(monkeypatch):
    """The measuring step's blocks, in order, timed at ``Timing(1 + k, 0.5 + k, 0.25 + k)``
    seconds (k = 0, 1, ...)."""
    counter = itertools.count()

    def timing(self):
        k = next(counter)
        return Timing(1.0 + k, 0.5 + k, 0.25 + k)

    monkeypatch.setattr(Stopwatch, "timing", timing)


def test_the_measuring_step_times_each_block():
    budget, model = planned("64MiB")
    r = budget._run.result
    seconds = list(timings(budget).values())
    assert r.timed and len(seconds) == 3
    assert all(t is not None and t.forward > 0 and t.backward > 0 and t.replay > 0 for t in seconds), (
        seconds,
        gradient_scope.model_stats(model).recorded_why,
    )
    assert r.measured > 0 and r.scale > 0


def test_step_is_the_measured_blocks_plus_the_scaled_recompute(pinned_timings):
    """Three blocks of one structure count as the middle one (2 s forward, 1.5 s backward,
    1.25 s replay) each. At 0 bytes the plan replays what the measuring step replayed: every
    saved value but those in memory anyway (each block's output, which the next block keeps
    for its replay, is saved by the next block's first op), so its recompute is predicted
    at the measured replays."""
    budget, model = planned(0)
    measuring = gradient_scope.model_stats(model, reset=True)
    r = budget._run.result
    assert r.timed and r.measured == pytest.approx(3 * 3.5)
    assert r.recompute == pytest.approx(3 * 1.25)
    assert budget.predicted_recompute == r.recompute
    full = sum(recompute_cost(bs.graph, set()) for bs in r.seen)
    assert r.scale > 3 * 1.25 / full  # the values in memory anyway are not in its replays
    x = torch.randn(16, 32, requires_grad=True)
    with pinned_cpu_rates():
        model(x).square().sum().backward()
    step = gradient_scope.model_stats(model, reset=True)
    assert step.ops_replayed == measuring.ops_replayed == r.replayed > 0
    assert budget.predicted_step_time == pytest.approx(r.measured + r.recompute + r.transfer)
    for point in budget.curve().points:  # the same anchor at every budget
        assert point.step == pytest.approx(r.measured + point.recompute + point.transfer)


def test_recompute_is_the_modelled_one_scaled(pinned_timings, monkeypatch):
    budget, _ = planned(0)
    r = budget._run.result
    monkeypatch.setattr(Stopwatch, "timing", lambda self: None)  # not timed: the modelled figures
    bare, _ = planned(0)
    b = bare._run.result
    assert not b.timed and b.scale == 1.0
    assert r.recompute == pytest.approx(r.scale * b.recompute)
    assert b.step == pytest.approx(b.compute + b.library + b.recompute - b.replayed * PINNED_RATES.replay)


def test_blocks_of_another_structure_count_on_their_own(pinned_timings):
    """A block in eval mode (no dropout) has another signature: it counts its own timing."""
    model = make_model()
    model[2].eval()
    budget, _ = planned("64MiB", model)
    r = budget._run.result
    assert r.measured == pytest.approx(2 * 1.5 + (3.0 + 2.5))


def test_keeping_everything_predicts_the_measured_blocks(pinned_timings):
    budget, _ = planned("64MiB")
    r = budget._run.result
    assert r.recompute == 0 and r.transfer == 0
    assert budget.predicted_step_time == pytest.approx(3 * 3.5)


@pytest.mark.parametrize(
    ("seconds", "counted"),
    [
        ([(9.0, 8.0, 7.0), (1.0, 0.6, 0.3), (1.2, 0.4, 0.2), (1.1, 0.5, 0.4)], (1.1, 0.5, 0.3)),  # a slow first
        ([(3.0, 2.0, 1.0), (1.0, 0.5, 0.5), (2.0, 1.0, 0.75)], (2.0, 1.0, 0.75)),  # one fast block: not it
    ],
)
def test_blocks_of_one_structure_count_as_their_lower_median(monkeypatch, seconds, counted):
    """The first block of a structure pays what runs once (its replay's program made,
    caches filled), and any block may be slowed or favoured by the machine: the lower
    median of each figure counts, for every block of the structure (with two blocks, the
    lesser: ``test_blocks_of_another_structure_count_on_their_own``)."""
    it = iter(seconds)
    monkeypatch.setattr(Stopwatch, "timing", lambda self: Timing(*next(it)))
    budget, _ = planned(0, make_model(layers=len(seconds)))
    r = budget._run.result
    assert r.measured == pytest.approx(len(seconds) * (counted[0] + counted[1]))
    assert r.recompute == pytest.approx(len(seconds) * counted[2])  # all it replayed (above)


def test_summary_says_what_the_predicted_step_includes():
    text = planned(0)[0].summary()
    assert "the library's own cost per op -- recording, packing --" in text
    assert "replay's bookkeeping included" in text and "not the code outside the scopes" in text


COST = 0.05  # CPU seconds: more than a tiny block's forward, also on a busy machine


def test_the_measuring_code_is_not_counted(monkeypatch):
    """Where each save ran is read in the measuring step only: its time is not in the
    forward of the block it ran in (here made to cost 50 ms of CPU per save). A block's
    output is saved by the op after the block (the next block's norm, or the model's): that
    measuring runs in the next block's forward, or in none."""
    real = block_module.running_module_path

    def slow():
        end = time.process_time() + COST
        while time.process_time() < end:
            pass
        return real()

    monkeypatch.setattr(block_module, "running_module_path", slow)
    seen = []
    close = Stopwatch.close

    def closing(self):
        close(self)
        seen.append(self)

    monkeypatch.setattr(Stopwatch, "close", closing)
    budget, _ = planned("64MiB")
    saves = [len(bs.where) for bs in budget._run.result.seen]  # of each block's values, by any op
    inside = [saves[0] - 1, *saves[1:]]  # the saves made in each block's forward
    assert len(seen) == 3 and min(saves) >= 3
    for watch, n in zip(seen, inside):
        assert COST * n <= watch.own[1] < COST * (n + 1)
        assert watch.timing().forward < COST  # less than one save's measuring


def test_only_the_measuring_step_is_timed():
    """The measuring step's replay states time their unpacks until that step is planned;
    a planned step's blocks carry no stopwatch (on CPU its marks cost two clock reads at
    the block's entry)."""
    model = make_model()
    budget = Budget("64MiB")
    apply_recompute(model, check_fn=lambda m: isinstance(m, Block), budget=budget)
    x = torch.randn(16, 32, requires_grad=True)
    with pinned_cpu_rates():
        loss = model(x).square().sum()
        states = [bp.state() for bp in budget._run.step]
        assert all(s.timer is bp.watch is not None for s, bp in zip(states, budget._run.step))
        loss.backward()
        assert budget.floor_bytes is not None  # the step ends: planned
        assert all(s.timer is None for s in states)
        loss = model(x).square().sum()
        assert all(bp.known and bp.watch is None and bp.state().timer is None for bp in budget._run.step)
        loss.backward()


class AddOne(nn.Module):
    def forward(self, x):
        return x + 1  # saves nothing


def test_a_block_that_saves_nothing_is_timed_without_backward(pinned_timings, monkeypatch):
    """Backward never unpacks such a block (nothing after it saves its output either): its
    forward counts, and no backward or replay."""
    monkeypatch.undo()  # the real stopwatch
    torch.manual_seed(0)
    model = nn.Sequential(Block(32), AddOne())
    budget = Budget("64MiB")
    apply_recompute(model, check_fn=lambda m: isinstance(m, (Block, AddOne)), budget=budget)
    x = torch.randn(16, 32, requires_grad=True)
    with pinned_cpu_rates():
        budget.plan(lambda: model(x).sum().backward())
    r = budget._run.result
    seconds = {"AddOne" in str(site): t for (site, _, _), t in timings(budget).items()}
    assert r.timed and len(seconds) == 2
    assert seconds[True].backward == seconds[True].replay == 0 and seconds[True].forward > 0
    assert seconds[False].replay > 0


class _Clock:
    """A CPU clock that only the fake runners advance: the benchmark's arithmetic is
    checked exactly, whatever else the machine is running."""

    def __init__(self):
        self.now = 0.0

    def process_time(self):
        return self.now


class _Busy:
    """A runner whose step spends ``cost`` seconds of ``clock`` and notes its name."""

    def __init__(self, name, cost, calls, clock):
        self.name, self.cost, self.calls, self.clock = name, cost, calls, clock

    def step(self, seed):
        self.calls.append(self.name)
        self.clock.now += self.cost


def test_the_benchmark_measures_the_blocks_in_alternating_rounds(monkeypatch):
    """``benchmarks.budget.blocks_steps``: one planned step of the budget first (the
    plan's first use), then rounds of one step each of the budget and of the code outside
    the layers (and of plain, where asked: the machine's speed), in alternating order; per
    round the difference of their CPU times (and plain's)."""
    import benchmarks.budget as bench

    clock = _Clock()
    monkeypatch.setattr(bench, "time", types.SimpleNamespace(process_time=clock.process_time))
    calls = []
    budget, outside = _Busy("budget", 0.004, calls, clock), _Busy("outside", 0.001, calls, clock)
    steps, ref = bench.blocks_steps(budget, outside, rounds=4)
    assert calls == ["budget", "budget", "outside", "outside", "budget", "budget", "outside", "outside", "budget"]
    assert steps == pytest.approx([0.003] * 4, abs=1e-12)
    assert ref == []
    calls.clear()
    steps, ref = bench.blocks_steps(budget, outside, rounds=2, reference=_Busy("plain", 0.002, calls, clock))
    assert calls == ["budget", "budget", "outside", "plain", "plain", "outside", "budget"]
    assert steps == pytest.approx([0.003] * 2, abs=1e-12)
    assert ref == pytest.approx([0.002] * 2, abs=1e-12)


def test_the_benchmark_repeats_one_plan_as_its_a_a():
    """``benchmarks.budget.targets``' A/A row: the two largest budgets, both keeping
    everything (one plan, from two measuring steps), give the spread of one step's figure;
    where one of them recomputes there is no such row."""
    import benchmarks.budget as bench

    def row(b, held, flops, predicted, measured):
        return {"budget": b, "held": held, "recompute_flops": flops, "predicted_step_s": predicted,
                "blocks_measured_s": measured}  # fmt: skip

    rows = [row(10, 10, 5, 0.5, 0.5), row(99, 100, 0, 0.040, 0.050), row(100, 100, 0, 0.050, 0.045)]
    assert bench._same_plan(rows, 100) == ((0.040, 0.050), (0.050, 0.045))
    assert bench._same_plan(rows[:2], 100) is None  # one of the two recomputes
    assert bench._same_plan([rows[0], rows[2]], 100) is None
