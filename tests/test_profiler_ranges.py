"""Profiler ranges (API.md section 6): ``gradient_scope.record`` around each block's
recorded region, ``gradient_scope.replay`` around each replay pass, so that
replayed ops are attributed in ``torch.profiler`` traces."""

import torch
import torch.nn as nn
from torch.profiler import ProfilerActivity, profile

from gradient_scope import apply_recompute, recompute_scope


def ranges(prof, name):
    return [e for e in prof.events() if e.name == name]


def inside(event, ranges_):
    t = event.time_range
    return any(
        r.thread == event.thread and r.time_range.start <= t.start and t.end <= r.time_range.end for r in ranges_
    )


def test_ranges_appear_and_hold_the_recorded_and_replayed_ops():
    w = torch.randn(64, 64, requires_grad=True)
    x = torch.randn(32, 64)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            scope = recompute_scope()
            with scope:
                h = torch.tanh(x @ w).exp()  # tanh's and exp's outputs: handles
            (h * 2).sum().backward()
            del h
    record, replay = ranges(prof, "gradient_scope.record"), ranges(prof, "gradient_scope.replay")
    assert len(record) == 2  # one per block
    assert len(replay) == 2 * scope.stats.replays and scope.stats.replays > 0  # one per replay pass
    tanh = [e for e in prof.events() if e.name == "aten::tanh"]
    # Each block runs tanh in forward (the recorder's mode shows it twice) and replays
    # it once in backward, below the mode.
    assert all(inside(e, record) or inside(e, replay) for e in tanh)
    assert sum(inside(e, replay) for e in tanh) == 2
    assert any(inside(e, replay) for e in prof.events() if e.name == "aten::mm")
    # Forward's other ops stay outside the ranges; replay runs no op outside the plan.
    assert not any(inside(e, record) or inside(e, replay) for e in prof.events() if e.name == "aten::sum")


def test_model_blocks_are_ranges_too():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16), nn.GELU())
    apply_recompute(model, check_fn=nn.GELU)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        model(torch.randn(4, 16)).sum().backward()
    assert len(ranges(prof, "gradient_scope.record")) == 2
    gelu = [e for e in prof.events() if e.name == "aten::gelu"]
    assert sum(inside(e, ranges(prof, "gradient_scope.replay")) for e in gelu) >= 1


def test_ranges_are_not_recorded_as_ops():
    w = torch.randn(8, 8, requires_grad=True)
    outer, inner = recompute_scope(), recompute_scope()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with outer:
            with inner:  # a nested block's range opens while the outer block records
                h = w.sin()
        loss = h.cos().sum()
        del h  # not alive in backward: replayed
        loss.backward()
    # (The profiler folds a range into its parent of the same name when it is its only child.)
    assert len(ranges(prof, "gradient_scope.record")) == 1
    assert outer.stats.ops_recorded + inner.stats.ops_recorded == 1  # sin only
    assert outer.stats.replays + inner.stats.replays == 1
