"""Differential test: random programs over a wide op vocabulary, run with scopes and
without, must give bitwise the same results -- or the scoped run raises RecomputeError.
Never anything else.

A program is a list of items: an op, or a scope (with options) holding a list of items,
so scopes nest and stand side by side; a scope may also end by raising (an aborted
block).  Ops work on a pool of 4x4 tensors, real and complex, and cover

* elementwise ops, matmul, reductions, multi-output ops (split, unbind, chunk, topk,
  max/min with dim, sort, kthvalue, var_mean, std_mean, aminmax, cummax);
* every kind of view: shape views (t, transpose, view, reshape, narrow, diagonal, expand,
  permute, movedim, as_strided, unflatten, unfold, select, split), views that carry bits
  (conj, _neg_view, mH, mT, adjoint) and dtype-changing views (real, imag,
  view_as_real, view_as_complex, Tensor.view(dtype)), and FFTs;
* in-place ops on fresh tensors, inside and after the block (on the tensor or a view of
  it), including random fills, rrelu_ and dropout(inplace=True), and writes to an
  outside tensor inside a block;
* random ops (dropout, alpha_dropout, rrelu, randn_like, rand_like, bernoulli, an
  explicit generator, randint / randperm / multinomial indices, uninitialised buffers
  filled by normal_ / uniform_);
* modules: LSTM, GRU, RReLU, BatchNorm1d (train; running statistics compared),
  Dropout, MultiheadAttention (with and without weights), LayerNorm, Linear;
* custom ``autograd.Function``s whose backward writes into the tensors it unpacks
  (its saved input, a view of it, an intermediate of its forward, both inputs).

After the forward, outside tensors may be written by every route (an in-place op,
``.data`` in place or assigned, a numpy view, ``untyped_storage()``, ``set_``) --
routes no check can see without values only in programs whose scopes all run with
``debug=True`` -- and live block tensors may be written the same way and kept alive.
Backward runs as ``backward()``, ``backward(inputs=)``, ``autograd.grad(inputs=)``,
twice with ``retain_graph=True``, or as a double backward (``create_graph=True``).

Compared, bitwise (NaNs in the same places): the loss, the final values, every gradient,
BatchNorm's running statistics, the default RNG state and an explicit generator's
state after backward.  After each run no saved-tensor hooks, dispatch modes or patched
functions are left.  A program whose plain run raises (e.g. PyTorch's own in-place
check) is rejected, not compared.

Budgets (``check_budget_program``): random programs run plain, with scopes, and with
scopes sharing one random Budget for three steps (plans apply from the second), with
versioned writes to saved block tensors after the block, ``.data`` swaps, a graph retained
into the next step, and backward in another thread that drops the block tensors. With a
budget each step must give what the program gives without one -- or, where that raises,
what plain gives -- and, once a budgeted block ran, a plan must exist (steps end). A
budget may offload (``offload=True`` or a bounded host pool of a random size, on the
host-copy stand-in): the pool then reserves what the stand-in's pinned allocations really
hold, within ``offload=``, and holds nothing once the program's graphs are gone.
Size: GS_DIFF_BUDGET_EXAMPLES examples (default 40). Models under a model-level budget,
with bounded pools and alternating lengths: ``tests/fuzz/test_fuzz_budget_models.py``.

Size: GS_DIFF_EXAMPLES (or GS_HYPOTHESIS_EXAMPLES) examples, default 200; derandomized
(the same examples every run) unless GS_DIFF_RANDOM=1; no shrinking unless
GS_DIFF_SHRINK=1.  Long run, e.g.
``GS_DIFF_EXAMPLES=2000 GS_DIFF_RANDOM=1 python -m pytest -q tests/fuzz/test_fuzz_differential.py``.
"""

from __future__ import annotations

import contextlib
import gc
import os
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import event, given, reject, settings
from hypothesis import strategies as st

from gradient_scope import Budget
from gradient_scope._budget.streams import host_copy_stand_in

from support import dispatch_depth, older_objects_out_of_sight, patchable, top_hooks
from support.fuzz_ops import NEWEST
from support.fuzz_programs import (
    _RETAINED,
    DIFF_SETTINGS,
    FAMILIES,
    VISIBLE_WRITES,
    _count,
    _debugs,
    _family_program,
    _fixed,
    _same,
    check_program,
    program_st,
    run_program,
)
from support.writes import WRITES

# full collections in the checks (liveness, the host pool, state after an exception)
_older = pytest.fixture(autouse=True, scope="module")(older_objects_out_of_sight)


@DIFF_SETTINGS
@given(program=program_st)
def test_random_programs_equal_plain_or_recompute_error(program):
    if _count(program["items"], "ops") > 48:
        reject()
    outcome = check_program(program, generated=True)
    event(f"outcome: {outcome}")


# --------------------------------------------------------------------------------------
# budgets: a plan changes what is stored, never what is computed nor how the program behaves

N_BUDGET_EXAMPLES = int(os.environ.get("GS_DIFF_BUDGET_EXAMPLES", "40"))
BUDGET_STEPS = 3  # the first step measures, the next ones follow the plan


def _outcome(run: Callable[[], list]) -> tuple[str, Any]:
    """``("ok", values)`` or ``("raised", the error's type name)``; after an error the
    engine's ready queue is flushed (a failed backward's nodes keep their handles)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # below the floor; budget= in nested scopes
            return "ok", run()
    except Exception as e:  # noqa: BLE001  (judged by the caller)
        torch.ones((), requires_grad=True).backward()
        return "raised", type(e).__name__


def _same_outcome(a: tuple[str, Any], b: tuple[str, Any]) -> bool:
    if a[0] != b[0]:
        return False
    if a[0] == "raised":
        return bool(a[1] == b[1])
    return len(a[1]) == len(b[1]) and all(_same(x, y) for x, y in zip(a[1], b[1]))


def _describe(o: tuple[str, Any]) -> str:
    return f"raised {o[1]}" if o[0] == "raised" else "a result"


def check_budget_program(program: dict) -> str:
    """The program run plain, with scopes, and with scopes sharing one Budget for
    ``BUDGET_STEPS`` steps (plans apply from the second). With scopes it must give
    plain's result or RecomputeError (where plain runs); with a budget, at every step,
    what it gives without one -- or, where that raises, what plain gives (a stored value
    that needs no replay cannot fail to replay). Returns the outcome."""
    state0 = (top_hooks(), dispatch_depth(), patchable(), torch.is_grad_enabled())
    made: list[weakref.ref] = []
    plain = _outcome(lambda: run_program(program, scoped=False, made=made))
    _RETAINED.clear()
    if _debugs(program) and any(r() is not None for r in made):
        gc.collect()
        if any(r() is not None for r in made):  # PyTorch's own reference cycle: see check_program
            event("plain run leaks a reference cycle (debug program)")
            reject()
    unplanned = _outcome(lambda: run_program(program, scoped=True))
    _RETAINED.clear()
    failure = None
    if plain[0] == "ok" and not (_same_outcome(unplanned, plain) or unplanned == ("raised", "RecomputeError")):
        failure = f"with scopes: {_describe(unplanned)} where plain gives a result (or it differs)"
    offload = program.get("offload")
    budget = Budget(program["budget"], offload=offload)
    steps_ok = True
    plans = []
    with host_copy_stand_in() if offload is not None else contextlib.nullcontext() as backend:
        for step in range(BUDGET_STEPS):
            got = _outcome(lambda: run_program(program, scoped=True, budget=budget))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # below the floor
                plans.append(budget.planned_bytes)  # (a "retain_kept" graph is still alive)
            if not (_same_outcome(got, unplanned) or (unplanned[0] == "raised" and _same_outcome(got, plain))):
                failure = failure or (
                    f"step {step + 1} with a budget: {_describe(got)}; without one: {_describe(unplanned)}; "
                    f"plain: {_describe(plain)}"
                )
            if got[0] == "raised":
                steps_ok = False
        _RETAINED.clear()
        engine = budget._run.engine
        if engine is not None:
            gc.collect()
            if engine.reserved_bytes != backend.pinned_bytes() or engine.reserved_bytes > budget.offload:
                failure = failure or f"host pool: reserved {engine.reserved_bytes}, pinned {backend.pinned_bytes()}"
            if engine.live_bytes or engine.in_flight:
                failure = failure or f"host pool: {engine.live_bytes} bytes still in use after the program"
    if (top_hooks(), dispatch_depth(), patchable(), torch.is_grad_enabled()) != state0:
        gc.collect()  # an exception's frames may hold block tensors in a cycle
        if (top_hooks(), dispatch_depth(), patchable(), torch.is_grad_enabled()) != state0:
            failure = failure or "global state left changed (hooks, dispatch modes, patches or grad mode)"
    # Steps end with their backward (also with a retained graph): a budget that blocks
    # used has planned after the first. (With debug=True a block tensor in one of
    # PyTorch's own reference cycles lives until gc, as in plain PyTorch, and so does its
    # step: see check_program.)
    if steps_ok and None in plans and _budgeted(program["items"]) and not _debugs(program):
        failure = failure or f"no plan after steps {[i + 1 for i, p in enumerate(plans) if p is None]}"
    if failure is not None:
        raise AssertionError(f"{failure}\nprogram={program!r}")
    planned = "planned" if budget.planned_bytes is not None else "unplanned"
    if offload is not None:
        pool = "unbounded pool" if offload is True else "bounded pool"
        planned += f", {pool} {'used' if budget.offloaded_bytes else 'unused'}"
    return f"{_describe(unplanned)} without a budget, {planned}"


def _budgeted(items: list) -> bool:
    """Whether a block of the program follows the budget (an outermost scope that records
    and has no ``save=``)."""
    return any(it[0] == "scope" and it[1] in ("plain", "debug") for it in items)


def _budget_example(items: list, backward: str = "backward", writes: tuple = (), hit_saved: bool = False,
                    budget: int = 10**12, offload: Any = None) -> dict:  # fmt: skip
    return {"items": items, "seed": 5, "debug_all": False, "writes": list(writes), "backward": backward,
            "budget": budget, "hit_saved": hit_saved, "offload": offload}  # fmt: skip


_BLOCK = ("scope", "plain", [("mul", 0, 1, 0), ("exp_tanh", NEWEST, 0, 0)])
# Found before each class was fixed (issue 28): a .data swap of a stored block tensor a
# later op saved; a block tensor written in place after its block, then dropped; a graph
# retained into the next step; backward in another thread.
BUDGET_EXAMPLES = [
    _budget_example([_BLOCK, ("save_last", 2, 0, 0)], writes=[("block", "data_assign", 1)]),
    _budget_example([_BLOCK, ("save_last", 2, 0, 0)], writes=[("block", "inplace", 1)], hit_saved=True),
    _budget_example([_BLOCK, ("save_last", 2, 0, 0)], backward="retain_kept"),
    _budget_example([_BLOCK, ("save_last", 2, 0, 0)], backward="thread"),
    # A bounded host pool whose graph lives into the next step (issue 37).
    _budget_example([_BLOCK, _BLOCK, ("save_last", 2, 0, 0)], backward="retain_kept", budget=0, offload=600),
]


budget_program_st = program_st.flatmap(
    lambda p: st.fixed_dictionaries(
        {
            **{k: st.just(v) for k, v in p.items() if k != "backward"},
            "backward": st.sampled_from(
                ["backward", "backward", "retain_kept", "thread", "retain_twice", "grad_inputs"]
            ),
            "budget": st.one_of(st.sampled_from([0, 10**12]), st.integers(0, 3000)),
            "hit_saved": st.booleans(),
            "offload": st.one_of(st.none(), st.none(), st.just(True), st.integers(0, 8192)),
        }
    )
)


@pytest.mark.parametrize("n", range(len(BUDGET_EXAMPLES)))
def test_budget_examples(n):
    check_budget_program(BUDGET_EXAMPLES[n])


@settings(DIFF_SETTINGS, max_examples=N_BUDGET_EXAMPLES)
@given(program=budget_program_st)
def test_random_programs_with_budgets_behave_as_without(program):
    if _count(program["items"], "ops") > 48:
        reject()
    event(check_budget_program(program))


def _check_all(programs: dict[str, dict]) -> None:
    failures = []
    for name, program in programs.items():
        try:
            check_program(program)
        except AssertionError as e:
            failures.append(f"{name}: {str(e).splitlines()[0]}")
    assert not failures, f"{len(failures)} of {len(programs)} programs:\n" + "\n".join(failures)


@pytest.mark.parametrize("option", ["plain", "save_mm", "debug"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_op_family(family, option):
    """Every op of a family, once each, on block tensors, its output saved after the
    block and dropped (backward recomputes it): equal to plain, or RecomputeError."""
    _check_all({name: _family_program(name, option) for name in FAMILIES[family]})


def test_inplace_variants_inside_and_after_block():
    programs = {}
    for kind in range(15):
        for cplx in (False, True):
            j = 6 if cplx else 0
            for where in ("inside", "after"):
                clone = ("clone", NEWEST, 0, 4 if cplx else 0)
                op = ("inplace", 0, j, kind)
                body = [("scale", NEWEST, 0, 0), ("times_j", NEWEST, 0, 0), clone] + ([op] if where == "inside" else [])
                items = [("scope", "plain", body), *([op] if where == "after" else []), ("save_last", 1, 0, 0)]
                programs[f"kind{kind}-{'cplx' if cplx else 'real'}-{where}"] = _fixed(items)
    _check_all(programs)


@pytest.mark.parametrize("family", ["views", "complex", "multi_output"])
def test_views_taken_after_the_block(family):
    """A view (or dtype change, or multi-output op) of a block tensor taken after the
    block, then saved."""
    _check_all({name: _family_program(name, view_after=True) for name in FAMILIES[family]})


@pytest.mark.parametrize("family", ["views", "complex"])
def test_views_in_block_then_shape_view_after(family):
    """A view made in the block (possibly with conj / neg / dtype bits), then a plain
    shape view of it after the block, saved."""
    programs = {}
    for name in FAMILIES[family]:
        op = (name, NEWEST, NEWEST, 2)
        body = [("scale", NEWEST, 0, 0), ("times_j", NEWEST, 0, 0), op]
        for after in ("movedim", "cmovedim"):
            programs[f"{name}+{after}"] = _fixed(
                [("sin", 0, 0, 0), ("scope", "plain", body), (after, NEWEST, 0, 0), ("save_last", 0, 0, 0)]
            )
    _check_all(programs)


@pytest.mark.parametrize("route", list(WRITES))
@pytest.mark.parametrize("target", ["xr", "x", "leaf", "block"])
def test_writes_between_forward_and_backward(target, route):
    """Every route to every target; the routes no check can see without values run in
    a program whose scopes all debug."""
    items = [
        (
            "scope",
            "plain",
            [("read_xr", 0, 0, 0), ("mul", NEWEST, 1, 0), ("sin", NEWEST, 0, 0), ("scale", NEWEST, 0, 0)],
        ),
        ("save_last", 2, 0, 0),
    ]
    debug_all = route not in VISIBLE_WRITES
    programs = {f"k{k}": _fixed(items, debug_all=debug_all, writes=[(target, route, k)]) for k in (0, 1)}
    _check_all(programs)


@pytest.mark.parametrize("mode", ["backward", "backward_inputs", "grad_inputs", "retain_twice", "create_graph"])
def test_backward_modes(mode):
    items = [
        ("scope", "plain", [("matmul", 0, 1, 0), ("tanh", NEWEST, 0, 0), ("cmul", 3, 3, 0)]),
        ("scope", "plain", [("gru", NEWEST, 0, 0), ("scope", "debug", [("sigmoid", NEWEST, 0, 0)])]),
        ("mul", NEWEST, 1, 0),
        ("save_last", 0, 0, 0),
    ]
    check_program(_fixed(items, backward=mode))


def test_nested_side_by_side_and_aborted_scopes():
    items = [
        (
            "scope",
            "plain",
            [
                ("sin", 0, 0, 0),
                ("scope", "save_mm", [("matmul", NEWEST, 1, 0), ("dropout", NEWEST, 0, 0)]),
                ("mul", NEWEST, 2, 0),
            ],
        ),
        ("scope", "raise", [("tanh", 1, 0, 0), ("batchnorm", NEWEST, 0, 0)]),
        ("scope", "plain", [("add", NEWEST, 6, 0), ("clone", NEWEST, 0, 0), ("inplace", 0, 0, 2)]),
        ("inplace", 0, 1, 0),
        ("save_last", 1, 0, 0),
        ("drop", 5, 0, 0),
    ]
    check_program(_fixed(items))


# Programs a randomized run found (kept as they were printed).
FOUND = {
    # A view taken after the block (its dtype differs from the base's) was handed out
    # as a dense copy: kernels reading it with other strides gave other bits.
    "dtype_view_after_block_keeps_layout": {
        "backward": "create_graph",
        "seed": 565,
        "debug_all": True,
        "writes": [],
        "items": [
            (
                "scope",
                "save_mm",
                [
                    ("scope", "disabled", [("unflatten", 99, 99, 40)]),
                    ("scope", "save_fn", [("real", 82, 21, 25), ("lstm", 99, 99, 24)]),
                    (
                        "scope",
                        "plain",
                        [
                            ("save_last", 99, 74, 27),
                            (
                                "scope",
                                "save_mm",
                                [
                                    ("div", 43, 80, 29),
                                    ("abs_c", 99, 99, 97),
                                    ("linear", 66, 27, 37),
                                    ("inplace", 64, 88, 53),
                                    ("mT", 99, 99, 31),
                                    ("cmovedim", 99, 60, 24),
                                    ("multinomial", 56, 99, 1),
                                ],
                            ),
                            ("randint_index", 99, 23, 67),
                            ("unbind_stack", 99, 52, 99),
                            (
                                "scope",
                                "disabled",
                                [
                                    ("inplace", 99, 56, 98),
                                    ("conj_t", 85, 65, 96),
                                    ("resolve_conj", 99, 99, 86),
                                    ("slice_cat", 22, 31, 97),
                                ],
                            ),
                            ("cadd", 94, 99, 22),
                        ],
                    ),
                    ("cfft", 57, 99, 2),
                    ("scope", "plain", [("split_cat", 99, 14, 51)]),
                    ("real", 99, 99, 15),
                ],
            ),
            ("conj_slice_cat", 59, 99, 41),
            ("mha", 99, 41, 62),
            ("mH", 27, 37, 20),
            ("cmatmul", 99, 99, 90),
            (
                "scope",
                "save_mm",
                [
                    ("scope", "disabled", [("unflatten", 99, 99, 40)]),
                    ("scope", "save_fn", [("real", 82, 21, 25), ("lstm", 99, 99, 24)]),
                    ("tanh", 99, 21, 25),
                    ("cfft", 57, 99, 2),
                    ("scope", "plain", [("split_cat", 99, 14, 51)]),
                    ("real", 99, 99, 15),
                ],
            ),
            ("conj_slice_cat", 59, 99, 41),
            ("mha", 99, 41, 62),
            ("mH", 27, 37, 20),
            ("cmatmul", 99, 99, 90),
        ],
    },
}


@pytest.mark.parametrize("name", sorted(FOUND))
def test_programs_found_by_random_runs(name):
    check_program(FOUND[name])
