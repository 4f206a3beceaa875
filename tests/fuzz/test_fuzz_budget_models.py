"""The budget fuzzer's model half: random models under a model-level budget, with random
bounded host pools (``offload=`` sizes, on the host-copy stand-in) and sequence lengths
that alternate from step to step (issue 37 items 1 and 4).

A model is a random stack of scoped blocks -- pre-norm MLPs with dropout, gated MLPs,
attention over the sequence (its saved tensors grow with the length squared) -- with code
outside the scopes (an input projection, a final norm and head) or none. Each example
runs the plain model once per length, then the budgeted model for a random sequence of
lengths, and checks at every step:

* gradients bitwise those of the plain model at that length;
* the bytes held after forward within what the plan says (``planned_bytes``), and so
  within the budget whenever the plan is;
* what the pool holds when backward starts is ``offloaded_bytes``; its reserved bytes are what
  the stand-in's pinned allocations really hold (rounded as CUDA's), within ``offload=``;
  no copy is refused;
* one plan per length (structure), and each length shows its first figures again.

The random-program half (scopes written by hand, offload sizes too) is in
``tests/fuzz/test_fuzz_differential.py``. Size: GS_BUDGET_FUZZ_EXAMPLES examples (default
8, a few seconds each); derandomized unless GS_DIFF_RANDOM=1.
"""

from __future__ import annotations

import gc
import os
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st

from benchmarks._harness.memory import measure
from gradient_scope import Budget, apply_recompute
from gradient_scope._budget import run as _run_module
from gradient_scope._budget.streams import host_copy_stand_in

from support import assert_all_same, older_objects_out_of_sight, pinned_cpu_rates

N_EXAMPLES = int(os.environ.get("GS_BUDGET_FUZZ_EXAMPLES", "8"))
RANDOM = os.environ.get("GS_DIFF_RANDOM", "") not in ("", "0")


class PreNormMLP(nn.Module):
    def __init__(self, d: int, mult: int, p: float) -> None:
        super().__init__()
        self.ln, self.fc1, self.fc2, self.p = nn.LayerNorm(d), nn.Linear(d, mult * d), nn.Linear(mult * d, d), p

    def forward(self, x):
        return x + self.fc2(F.dropout(F.gelu(self.fc1(self.ln(x))), self.p, self.training))


class GatedMLP(nn.Module):
    def __init__(self, d: int, mult: int, p: float) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.up, self.gate, self.down = nn.Linear(d, mult * d), nn.Linear(d, mult * d), nn.Linear(mult * d, d)

    def forward(self, x):
        h = self.ln(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Attention(nn.Module):
    def __init__(self, d: int, mult: int, p: float) -> None:
        super().__init__()
        self.ln, self.qkv, self.out, self.p = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d), p
        # A tensor, not a Python number: autograd keeps a number an op saves (a 0-dim
        # double, 8 bytes) without asking any saved-tensor hook (docs/limitations.md).
        self.register_buffer("scale", torch.tensor(d**-0.5))

    def forward(self, x):
        q, k, v = self.qkv(self.ln(x)).chunk(3, dim=-1)
        w = torch.softmax(q @ k.transpose(-1, -2) * self.scale, dim=-1)
        return x + self.out(F.dropout(w, self.p, self.training) @ v)


KINDS = {"mlp": PreNormMLP, "gated": GatedMLP, "attention": Attention}


def build(spec: dict) -> nn.Module:
    torch.manual_seed(spec["seed"])
    d = spec["d"]
    layers: list[nn.Module] = [nn.Linear(d, d)] if spec["outside"] else []
    layers += [KINDS[kind](d, mult, p) for kind, mult, p in spec["blocks"]]
    if spec["outside"]:
        layers += [nn.LayerNorm(d), nn.Linear(d, 4)]
    return nn.Sequential(*layers)


def run_step(model: nn.Module, x: torch.Tensor, backend=None, budget=None):
    """``(held after forward, gradients, pool bytes in use when backward starts)``."""
    model.zero_grad(set_to_none=True)
    x.grad = None
    torch.manual_seed(7)
    gc.collect()
    engine = budget._run.engine if budget is not None else None
    reserved = engine.reserved_bytes if engine is not None else 0
    seen = {"slabs": 0, "host": None}

    def forward():
        out = model(x)
        if backend is not None:
            backend.drain()
        if engine is not None:
            # The stand-in's "pinned" slabs are CPU memory: a slab made in this forward
            # is host memory, not what the device holds.
            seen["slabs"] = engine.reserved_bytes - reserved
        return out

    def backward(out):
        loss = out.square().sum()  # (saves the output: a block's, where no code follows the blocks)
        if engine is not None:
            seen["host"] = engine.live_bytes
        loss.backward()

    out, held, _ = measure(forward, backward, x.device)
    held -= out.untyped_storage().nbytes() + seen["slabs"]
    return held, [p.grad.clone() for p in model.parameters()] + [x.grad.clone()], seen["host"]


def inputs(spec: dict, length: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(spec["seed"] + length)
    return torch.randn(2, length, spec["d"], generator=g).requires_grad_()


def check(spec: dict) -> str:
    lengths = sorted(set(spec["steps"]))
    plain = {}
    for n in lengths:
        model = build(spec)
        plain[n] = run_step(model, inputs(spec, n))
    budget_bytes = int(spec["fraction"] * max(h for h, _, _ in plain.values()))
    plans: list[int] = []
    planner = _run_module._plan

    def counting(*args, **kwargs):
        plans.append(1)
        return planner(*args, **kwargs)

    _run_module._plan = counting
    try:
        with host_copy_stand_in() as backend, warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*below the floor")
            warnings.filterwarnings("error", message=".*stayed on the device")
            model = build(spec)
            b = Budget(budget_bytes, offload=spec["offload"])
            blocks = tuple({type(m) for m in model if type(m) in KINDS.values()})
            apply_recompute(model, check_fn=blocks, budget=b)
            first: dict[int, tuple] = {}
            seen: set[int] = set()
            for i, n in enumerate(spec["steps"]):
                held, grads, host = run_step(model, inputs(spec, n), backend, b)
                assert_all_same(grads, plain[n][1])
                figures = (b.planned_bytes, b.floor_bytes, b.offloaded_bytes, b.predicted_recompute)
                first.setdefault(n, figures)
                assert figures == first[n], f"step {i}, length {n}: {figures} after {first[n]}"
                if n in seen:  # planned: the plan of this length applied
                    assert held <= b.planned_bytes, f"step {i}, length {n}: held {held} > {b.planned_bytes}"
                    if b.planned_bytes <= b.bytes:
                        assert held <= b.bytes
                    if host is not None:
                        assert host == b.offloaded_bytes, f"step {i}: pool {host} != {b.offloaded_bytes}"
                seen.add(n)
            engine = b._run.engine
            if engine is not None:
                assert engine.reserved_bytes == backend.pinned_bytes()
                assert b.offload is None or engine.reserved_bytes <= b.offload
    finally:
        _run_module._plan = planner
    assert len(plans) == len(lengths), f"{len(plans)} plans for {len(lengths)} lengths"
    offloaded = "offloads" if b.offloaded_bytes else "offloads nothing"
    return f"{len(lengths)} lengths, {offloaded}"


spec_st = st.fixed_dictionaries(
    {
        "seed": st.integers(0, 2**16),
        "d": st.sampled_from([4, 8, 12]),
        "blocks": st.lists(
            st.tuples(st.sampled_from(sorted(KINDS)), st.integers(1, 4), st.sampled_from([0.0, 0.1])),
            min_size=1,
            max_size=4,
        ),
        "outside": st.booleans(),
        "fraction": st.floats(0.0, 1.3),
        "offload": st.one_of(
            st.none(), st.just(True), st.integers(0, 6000), st.sampled_from(["600B", "1500B", "3KiB"])
        ),
        "steps": st.lists(st.sampled_from([3, 5, 8]), min_size=2, max_size=3, unique=True).flatmap(
            lambda ls: st.integers(3, 6).map(lambda k: [ls[i % len(ls)] for i in range(k)])
        ),
    }
)


# about 50 full collections (one per step: ``run_step``)
_older = pytest.fixture(autouse=True, scope="module")(older_objects_out_of_sight)


@settings(
    max_examples=N_EXAMPLES,
    deadline=None,
    derandomize=not RANDOM,
    database=None,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(spec=spec_st)
def test_random_models_with_bounded_pools_and_alternating_lengths(spec):
    with pinned_cpu_rates():
        event(check(spec))
