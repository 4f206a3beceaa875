"""``torch.profiler`` around scoped training steps: event names decode, and the ranges
``gradient_scope.record`` (each block's recorded region) and ``gradient_scope.replay``
(each replay pass, API.md section 6) hold the recorded and replayed ops.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.profiler import ProfilerActivity, profile

from gradient_scope import apply_recompute, recompute_scope


def test_profiler_python_function_names_decode_with_scopes():
    """torch.profiler(with_stack=True, profile_memory=True, record_shapes=True) around
    scoped training steps (nested scopes, debug, block tensors dying -- weakref callbacks --
    inside the profiled region, retain_graph): every event name decodes.

    PyTorch's python tracer keeps pointers to the names of the code objects it saw and
    reads them when the profile is post-processed; a code object freed in between (module
    code run by an import, code made by exec/compile) leaves a dangling name, hence the
    UnicodeDecodeError seen in some runs (pytorch/pytorch#64345, #121219).  The library
    makes and frees no code objects, so once one-time imports are done (the warm-up below
    runs them outside the profiled region), scoped steps must profile cleanly."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Dropout(0.1), nn.Linear(32, 16))

    def step(i: int) -> None:
        x = torch.randn(8, 16)
        with recompute_scope(debug=bool(i % 2)):
            h = model[2](model[1](model[0](x)))
            with recompute_scope():
                g = h.exp()
        loss = model[3](h * g).pow(2).mean()
        del h, g
        loss.backward(retain_graph=True)
        loss.backward()
        with torch.no_grad():  # (torch.optim's first step imports torch._dynamo: seconds)
            for p in model.parameters():
                p -= 0.01 * p.grad
                p.grad = None
        junk = [bytes([0xC3]) * n for n in range(8, 80)]  # reuse freed memory
        del junk

    step(0)
    with torch.profiler.profile(with_stack=True):
        step(1)  # the profiler's own lazy imports
    with torch.profiler.profile(with_stack=True, profile_memory=True, record_shapes=True) as prof:
        for i in range(3):
            step(i)
    names = [e.name for e in prof.events()]  # raises UnicodeDecodeError on a dangling name
    python_events = [n for n in names if ".py(" in n]
    if not python_events:
        pytest.skip(f"torch {torch.__version__}'s profiler records no Python frames here")
    assert any("gradient_scope" in n for n in python_events), "the library's frames were not profiled"
    assert all(n.isprintable() for n in names)


# --------------------------------------------------------------------------------------
# gradient_scope.record / gradient_scope.replay ranges


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
