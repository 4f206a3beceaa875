"""Budgets under ``torch.compile`` at their edges (issue 37, items 2 and 3): a budget of
plain's bytes gives plain's compiled program, and the figures are the compiled graph's;
under dynamic shapes the plan is made at the traced sizes, binds there, and says so.

Memory is measured with the benchmarks' probe (``benchmarks._harness.memory.measure``);
backward ops are counted with a dispatch mode while the compiled backward runs
(``aot_eager`` runs the graph's aten ops one by one).
"""

from __future__ import annotations

import collections
import gc
import warnings
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

import gradient_scope._adapters.compile.graph as gs_compile
from benchmarks._harness.memory import measure
from gradient_scope import Budget, apply_recompute

from support import ResidualMLP as Block
from support import pinned_cpu_rates

pytestmark = pytest.mark.skipif(
    gs_compile._MISSING is not None,
    reason=f"torch {torch.__version__} lacks {gs_compile._MISSING}: compiled scopes run eagerly",
)

# Views and aliases a backward makes of what it reads (the compiled graph with scopes
# saves a base where plain's saves a view of it): no compute.
_METADATA_OPS = {"aten.view", "aten._unsafe_view", "aten.t", "aten.alias", "aten.detach", "aten.expand"}


@pytest.fixture(autouse=True)
def _fixed_rates():
    with pinned_cpu_rates():
        yield
    torch._dynamo.reset()


class _BackwardOps(TorchDispatchMode):
    """Counts the aten ops that run while it is on (metadata ops left out)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = str(func.overloadpacket)
        if func.namespace == "aten" and name not in _METADATA_OPS:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def _run(budget: Budget | None, length: int = 8, dynamic: Any = None, mark: bool = False) -> dict:
    """Three pre-norm blocks (eval: no dropout) compiled with ``aot_eager``, scoped with
    ``budget`` (None: no scopes); the second call at ``length`` is measured: held after
    forward (the output left out), the backward's ops, the gradients."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(*[Block(16) for _ in range(3)]).eval()
    if budget is not None:
        apply_recompute(model, check_fn=Block, budget=budget)
    compiled = torch.compile(model, backend="aot_eager", dynamic=dynamic)
    x = torch.randn(2, length, 16, generator=torch.Generator().manual_seed(1))
    if mark:
        torch._dynamo.mark_dynamic(x, 1)
    compiled(x).sum().backward()  # compiles; the plan is made here
    model.zero_grad(set_to_none=True)
    gc.collect()
    out, held, _ = measure(lambda: compiled(x), lambda o: None)
    held -= out.untyped_storage().nbytes()
    counter = _BackwardOps()
    with counter:
        out.sum().backward()
    return {"held": held, "ops": counter.ops, "grads": [p.grad.clone() for p in model.parameters()]}


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_a_budget_of_plains_bytes_compiles_plains_program():
    """At plain's held bytes, and above them, the compiled backward reruns no forward op
    (before: native_layer_norm reran while planned_bytes said plain's 30,080 B and the
    forward kept 26,624), holds plain's bytes, and the figures say so."""
    plain = _run(None)
    for nbytes in (plain["held"], 10**9):
        budget = Budget(nbytes)
        got = _run(budget)
        assert got["ops"] == plain["ops"], f"recomputed in backward: {got['ops'] - plain['ops']}"
        assert got["held"] == plain["held"] == budget.planned_bytes
        assert budget.predicted_recompute == 0.0
        assert _same(got["grads"], plain["grads"])


def test_below_plains_bytes_the_figures_are_the_compiled_graphs():
    """Below plain's bytes the compiled forward keeps exactly ``planned_bytes`` (the
    version check's int64s included), within the budget, and recomputes what the plan
    predicts a cost for; gradients stay plain's."""
    plain = _run(None)
    for nbytes in (plain["held"] - 2000, plain["held"] // 2, 9000):
        budget = Budget(nbytes)
        got = _run(budget)
        assert got["held"] == budget.planned_bytes <= nbytes
        assert budget.predicted_recompute > 0 and got["ops"] != plain["ops"]
        assert _same(got["grads"], plain["grads"])


@pytest.mark.parametrize("how", ["dynamic=True", "mark_dynamic"])
def test_under_dynamic_shapes_the_budget_is_planned_at_the_traced_sizes(how):
    """Symbolic sizes are counted at their hint: the plan binds at the traced sizes
    (before: every size counted 0 bytes, planned_bytes 0, nothing kept for the budget;
    and with mark_dynamic the FLOP count specialised the graph, a ConstraintViolationError),
    one warning says the plan is for those sizes, and gradients are plain's."""
    dynamic, mark = (True, False) if how == "dynamic=True" else (None, True)
    plain = _run(None, dynamic=dynamic, mark=mark)
    budget = Budget(plain["held"] // 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _run(budget, dynamic=dynamic, mark=mark)
    assert budget.floor_bytes < budget.planned_bytes <= budget.bytes
    assert got["held"] == budget.planned_bytes
    assert _same(got["grads"], plain["grads"])
    said = [str(c.message) for c in caught if "dynamic shapes" in str(c.message)]
    assert len(said) == 1 and "planned at the sizes of the call that compiled the graph" in said[0]
