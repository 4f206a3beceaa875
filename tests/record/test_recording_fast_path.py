"""The recorder's hot path (``_record.recorder``) and the registry's deferred deaths (``_record.registry``).

The hot path records fresh-output and single-view ops without ``OpenBlock.run_and_record``;
its records must be those the general path makes (a scope with a ``save=`` policy always
takes the general path; one that keeps nothing records every op). Registry entries get no
death callback while their block is open: a tensor made at the address of one that died in
the block must still count as a block tensor, and no dead entry may outlive the block.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from typing import Any

import torch

from gradient_scope import recompute_scope
from gradient_scope._record.recorder import innermost
from gradient_scope._record.registry import _LIVE
from gradient_scope._record.types import BlockRecord, Input, Var

from support import ROOT


def _program(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Views of every kind the hot path takes (view, transpose, t, expand, the hidden
    view ``_unsafe_view`` of a 3-D matmul), int-list arguments, a Python float, an op
    that reads the numeric context (``mm``) under a changed one (R9)."""
    h = (x * 1.5).view(2, 3, 4)
    mkldnn = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = not mkldnn
    try:
        h = h.transpose(1, 2) @ w  # (2, 4, 3) @ (3, 5): view, mm, _unsafe_view
    finally:
        torch.backends.mkldnn.enabled = mkldnn
    h = h + h.t() if h.dim() == 2 else h + h.sum(0).expand(2, 4, 5)
    h = h.reshape(8, 5).t().contiguous().view(-1)
    return (h.sin() * h.view(5, 8)[1:].sum()).exp()


def _record_of(run: Any, **options: Any) -> tuple[BlockRecord, torch.Tensor]:
    got: list[BlockRecord] = []
    with recompute_scope(**options):
        out = run()
        block = innermost()
        assert block is not None
        got.append(block.record)
    return got[0], out


def _structure(record: BlockRecord) -> list[Any]:
    """The record with each Var named by (producing op, output position)."""
    where = {v: (i, k) for i, rec in enumerate(record.ops) for k, v in enumerate(rec.outs) if v is not None}

    def ref(a: Any) -> Any:
        if isinstance(a, Var):
            return ("var", where.get(a))
        if isinstance(a, Input):
            return ("input", a.version)
        if isinstance(a, list):
            return [ref(x) for x in a]
        return a

    def out(v: Var | None) -> Any:
        if v is None:
            return None
        root = "self" if v.base is None else ref(v.base)
        return (root, v.op, v.version, tuple(v.size), v.dtype, v.device, list(v.writes))

    ops = [
        (str(r.func), ref(r.args), {k: ref(a) for k, a in r.kwargs.items()}, r.rng, [out(v) for v in r.outs])
        for r in record.ops
    ]
    return [*ops, sorted(where[r] for r in record.loose), record.contexts]


def test_hot_path_records_what_the_general_path_records():
    # Seeded: about one draw in fifteen overflows the final exp, and NaN gradients compare unequal.
    g = torch.Generator().manual_seed(0)
    x = torch.randn(24, generator=g, requires_grad=True)
    w = torch.randn(3, 5, generator=g, requires_grad=True)
    hot, out_hot = _record_of(lambda: _program(x, w))
    general, out_general = _record_of(lambda: _program(x, w), save=lambda func: False)
    assert any(rec.func is torch.ops.aten._unsafe_view.default for rec in hot.ops)
    assert hot.loose  # _unsafe_view's output has a version counter of its own
    (_, first), (at, second) = hot.contexts  # the block's; from mm on, mkldnn flipped
    assert hot.ops[at].func is torch.ops.aten.mm.default and first != second
    assert _structure(hot) == _structure(general)
    assert torch.equal(out_hot, out_general)
    g_hot = torch.autograd.grad(out_hot.sum(), (x, w))
    g_ref = torch.autograd.grad(_program(x, w).sum(), (x, w))
    assert all(torch.isfinite(a).all() and torch.equal(a, b) for a, b in zip(g_hot, g_ref))


def test_tensors_made_where_block_tensors_died_are_block_tensors():
    # Each sin saves its input, a block tensor, most of them made at the address of one
    # that died earlier in the block (its entry still there, dead).
    n = 200
    x = torch.randn(8, requires_grad=True)
    scope = recompute_scope()
    with scope:
        h = x
        for _ in range(n):
            h = torch.sin(h * 1.0001)
    assert scope.stats.tensors_packed == n
    (g,) = torch.autograd.grad(h.sum(), x)
    h_ref = x
    for _ in range(n):
        h_ref = torch.sin(h_ref * 1.0001)
    (g_ref,) = torch.autograd.grad(h_ref.sum(), x)
    assert torch.equal(g, g_ref)


def test_no_dead_registry_entry_outlives_its_block():
    x = torch.randn(8, requires_grad=True)
    with recompute_scope():
        h = x
        for _ in range(100):
            h = h * 1.0001
        assert any(e() is None for e in list(_LIVE.values()))  # deaths are deferred...
    assert not [e for e in list(_LIVE.values()) if e() is None]  # ...to the block's close
    assert [e for e in _LIVE.values() if e() is h]  # the live one stays a block tensor
    del h
    assert not [e for e in _LIVE.values() if isinstance(e, Var)]  # its tracker dropped it


_COLLECTION_UNDER_LOCK = """
import gc, torch
from gradient_scope import recompute_scope
from gradient_scope._record import registry as _registry
x = torch.randn(4, requires_grad=True)
gc.disable()
with recompute_scope():
    a = x * 2  # alive at the close: tracked
cycle = [a]
cycle.append(cycle)
del a, cycle  # garbage in a reference cycle, for the collector


class Collecting(_registry._Tracker):
    __slots__ = ()

    def __new__(cls, *args):
        gc.collect()  # as an allocation under the registry's lock may: a's tracker fires
        return super().__new__(cls, *args)


_registry._Tracker = Collecting
with recompute_scope():
    b = x * 3
assert not [e for e in _registry._LIVE.values() if e() is None]
print("ok")
"""


def test_a_collection_while_the_registry_is_locked_does_not_deadlock():
    # A tracker's callback takes the registry's lock; a garbage collection can run it in
    # the thread that holds the lock (closing a block allocates the live tensors' trackers).
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    code = textwrap.dedent(_COLLECTION_UNDER_LOCK)
    try:
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        raise AssertionError("closing a block deadlocked on the registry's lock") from None
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
