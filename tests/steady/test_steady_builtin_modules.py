"""Scoped modules of torch's own (``nn.Sequential`` and the like) under the steady state.

Dynamo skips the ``forward`` of torch's own modules as a frame it is handed (it inlines them only
from traced code): called through dynamo, such a call ran eagerly with the recorder off, and then,
``fullgraph=True`` having found no frame to compile, ran again recorded. Its random ops drew twice
(wrong gradients) and its saves reached a model budget's region observer as saves outside the
scopes, dead ones whose addresses the allocator reuses: the floor counted them, by a different
amount in every process. D1 [ which calls run steady ]: such a function is recorded.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import gradient_scope
from gradient_scope import Budget, apply_recompute

ROOT = Path(__file__).resolve().parents[2]


def _dropout_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.Linear(16, 8)) for _ in range(3)))


def _grads(model: nn.Module) -> list[torch.Tensor]:
    out = []
    for step in range(3):
        torch.manual_seed(10 + step)
        x = torch.randn(4, 8, requires_grad=True)
        loss = model(x).sum()
        loss.backward()
        out += [loss.detach(), x.grad, *(p.grad.clone() for p in model.parameters())]
        model.zero_grad()
    return out


def test_a_scoped_builtin_module_runs_once_per_call(fast):
    plain = _grads(_dropout_model())
    model = _dropout_model()
    apply_recompute(model, check_fn=lambda m: m in list(model))
    scoped = _grads(model)
    assert all(torch.equal(p, s) for p, s in zip(plain, scoped, strict=True))
    stats = gradient_scope.model_stats(model)
    assert stats.recorded_why == {"dynamo skips its code": 9}, stats.recorded_why


_FLOOR = """
import torch, torch.nn as nn
from gradient_scope import Budget, apply_recompute
torch.manual_seed(0)
model = nn.Sequential(*(nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)) for _ in range(4)))
budget = Budget("400KiB")
apply_recompute(model, check_fn=lambda m: m in list(model), budget=budget)
x = torch.randn(128, 64, requires_grad=True)
for step in range(3):
    model(x).sum().backward()
    print(budget.floor_bytes, budget.planned_bytes)
"""


def _figures(fast: str, seed: str) -> list[str]:
    env = {**os.environ, "GRADIENT_SCOPE_FAST": fast, "PYTHONHASHSEED": seed, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", _FLOOR], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300, check=True
    )
    return done.stdout.split("\n")[:-1]


@pytest.mark.fast_independent("sets GRADIENT_SCOPE_FAST for each process it starts")
def test_the_steady_floor_is_the_recorded_floor_in_every_process():
    # Fresh processes: what varied was which dead saves' addresses the allocator had reused.
    # the recorded path's figures (GRADIENT_SCOPE_FAST=0): 3 x 32 KiB inputs kept for replay,
    # 352 KiB planned
    recorded = ["98304 360448"] * 3
    for seed in ("1", "2"):
        assert _figures("1", seed) == recorded, f"PYTHONHASHSEED={seed}"


def test_a_budget_over_builtin_blocks_binds_as_recorded(fast):
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)) for _ in range(4)))
    budget = Budget("400KiB")
    apply_recompute(model, check_fn=lambda m: m in list(model), budget=budget)
    x = torch.randn(128, 64, requires_grad=True)
    for _ in range(2):
        model(x).sum().backward()
    assert (budget.floor_bytes, budget.planned_bytes) == (98304, 360448)
