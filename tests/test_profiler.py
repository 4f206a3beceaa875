"""``torch.profiler`` around scoped training steps.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from gradient_scope import recompute_scope


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
