"""Differential fuzzing of scopes under ``torch.compile``: random programs, run three
ways -- eager without scopes (ground truth), compiled without scopes, compiled with
scopes -- must agree, or the scoped run raises ``RecomputeError``. Never anything else.

Two shapes of program:

* ``inside``: a compiled function whose body holds scopes (nested, side by side, with
  ``save=``), graph breaks inside and outside them, and in-place writes: to fresh
  tensors and views of them, to block tensors after their block, to a buffer argument
  (``b.add_``, ``b.mul_``, through a view) and, under ``no_grad``, to a parameter
  argument, before or after a block reads it.
* ``outside``: an eager program with scopes that calls compiled functions on block
  tensors and on the buffer; a compiled function may write its arguments in place.

Oracle. A program whose eager or compiled plain run raises is rejected (invalid). The
scoped compiled run must be bitwise equal to the plain compiled run, or close to both
it and eager (the contract's promise under compile: the partition differs, and with it
the graphs around a graph break and inductor's fused kernels), or -- where the plain
compiled run is itself wrong (not close to eager) -- close to eager. (Torch 2.13's
partitioner recomputes pointwise reads of inputs the graph writes: plain compile's own
gap; a graph with a scope stores those reads.) The outcomes are counted apart.
Compared: the outputs, every gradient, and the final values of the buffer and the
parameter. After each run no saved-tensor hooks,
dispatch modes or dynamo callbacks are left.

Budgets: the same programs with a Budget given to every scope without ``save=`` (not
applied inside compiled code; eager scopes around compiled functions follow it), three
steps without resetting dynamo: each step must give what the scoped run without a budget
gives, bitwise (``GS_DIFF_COMPILED_BUDGET_EXAMPLES``, default 2, and two fixed programs).
Under dynamic shapes (``dynamic=True``, ``mark_dynamic``, automatic dynamic after a length
change) with alternating lengths: pre-norm blocks with a Budget give, at every length,
the outputs and gradients of the program without scopes, and the plan (made at the traced
sizes) is above 0 bytes and within a budget above the floor
(``GS_DIFF_COMPILED_DYNAMIC_EXAMPLES``, default 2, and two fixed programs).

Size: ``GS_DIFF_COMPILED_EXAMPLES`` examples (default 10: each compiles two graphs),
derandomized unless ``GS_DIFF_RANDOM=1``; backend ``aot_eager``, or inductor with
``GS_DIFF_INDUCTOR=1``. ``GS_DIFF_COUNTS=path`` appends one line per example (its
outcome) to ``path``. Long run, e.g.
``GS_DIFF_COMPILED_EXAMPLES=2000 GS_DIFF_RANDOM=1 python -m pytest -q tests/fuzz/test_fuzz_compiled.py``.
"""

from __future__ import annotations

import contextlib
import gc
import os
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, Phase, event, example, given, reject, settings
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument

import gradient_scope._adapters.compile.graph as gs_compile
from gradient_scope import Budget, RecomputeError, recompute_scope

from support import dispatch_depth, top_hooks

N_EXAMPLES = int(os.environ.get("GS_DIFF_COMPILED_EXAMPLES", "10"))
RANDOM = os.environ.get("GS_DIFF_RANDOM", "") not in ("", "0")
BACKEND = "inductor" if os.environ.get("GS_DIFF_INDUCTOR", "") not in ("", "0") else "aot_eager"
COUNTS = os.environ.get("GS_DIFF_COUNTS")
N_BUDGET_EXAMPLES = int(os.environ.get("GS_DIFF_COMPILED_BUDGET_EXAMPLES", "2"))
BUDGET_STEPS = 3

pytestmark = pytest.mark.skipif(
    gs_compile._MISSING is not None,
    reason=f"torch {torch.__version__} lacks {gs_compile._MISSING}: compiled scopes run eagerly",
)

N = 4

# --------------------------------------------------------------------------------------
# the vocabulary: (pool, i, j, bufs) -> new pool tensor (or None: nothing new)


def _fresh_write(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    c = a * 1.5
    c.mul_(b.tanh())
    return c


def _view_write(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    c = a + 0.5
    c[:2].add_(b[:2])
    c.t()[1].mul_(0.5)
    return c


OPS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "sin": lambda a, b: a.sin(),
    "exp": lambda a, b: (a * 0.3).exp(),
    "tanh": lambda a, b: torch.tanh(a),
    "sigmoid": lambda a, b: torch.sigmoid(a) * b,
    "mul": lambda a, b: a * b,
    "add": lambda a, b: a + b,
    "mm": lambda a, b: a @ b,
    "sub_t": lambda a, b: a - b.t(),
    "sum_keep": lambda a, b: a.sum(1, keepdim=True) * b,
    "cat": lambda a, b: torch.cat([a[:2], b[2:]]),
    "gelu": lambda a, b: F.gelu(a),
    "softmax": lambda a, b: a.softmax(-1),
    "reshape": lambda a, b: a.reshape(2, 8).cos().reshape(N, N),
    "dropout": lambda a, b: F.dropout(a, 0.3, True),
    "randn": lambda a, b: a + torch.randn_like(a),
    "fresh_write": _fresh_write,
    "view_write": _view_write,
}
OP_NAMES = sorted(OPS)
# Items that touch the buffer / parameter arguments or the pool in place.
SPECIAL = ["read_buf", "mm_buf", "write_buf", "write_buf_view", "mul_buf", "write_param", "write_pool"]


class Run:
    """One run's state: the pool and the arguments."""

    def __init__(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(N, N, generator=g, requires_grad=True)
        self.w = torch.randn(N, N, generator=g, requires_grad=True)
        self.p = torch.nn.Parameter(torch.randn(N, N, generator=g))
        self.buf = torch.randn(N, N, generator=g)
        self.loss_weights = [torch.randn(N, N, generator=g) for _ in range(3)]


def _special(name: str, a: torch.Tensor, b: torch.Tensor, buf: torch.Tensor, p: torch.Tensor) -> Any:
    if name == "read_buf":
        return (a + buf).sin()
    if name == "mm_buf":
        return a @ buf
    if name == "write_buf":
        buf.add_(1.0)
    elif name == "write_buf_view":
        buf[1:3].mul_(2.0)
    elif name == "mul_buf":
        buf.mul_(0.5)
    elif name == "write_param":
        with torch.no_grad():
            p.mul_(0.75)
    elif name == "write_pool":
        a.mul_(1.25)  # an existing tensor (maybe a block tensor): may be invalid PyTorch
    return None


def interpret(items: list, pool: list, buf: torch.Tensor, p: torch.Tensor, how: tuple) -> None:
    """Run ``items`` on ``pool`` (traced by dynamo in ``inside`` programs). ``how``:
    (scoped, the backend that compiles ``compiled`` items or None to run them eagerly,
    the Budget given to the scopes without ``save=`` or None)."""
    scoped, backend, budget = how
    for item in items:
        kind = item[0]
        if kind == "scope":
            save = [torch.ops.aten.mm] if item[1] == "save_mm" else None
            options = {"save": save} if save is not None or budget is None else {"budget": budget}
            with recompute_scope(**options) if scoped else contextlib.nullcontext():
                interpret(item[2], pool, buf, p, how)
        elif kind == "break":
            torch._dynamo.graph_break()
        elif kind == "compiled":
            fn = _compiled_part(item[1], scoped, budget)
            if backend is not None:
                fn = torch.compile(fn, backend=backend)
            pool.append(fn(pool[-1], pool[len(pool) // 2], buf))
        else:
            a, b = pool[item[1] % len(pool)], pool[item[2] % len(pool)]
            out = OPS[kind](a, b) if kind in OPS else _special(kind, a, b, buf, p)
            if out is not None:
                pool.append(out)


def _compiled_part(items: list, scoped: bool, budget: Any = None) -> Callable[..., torch.Tensor]:
    def part(a: torch.Tensor, b: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
        pool = [a, b]
        interpret(items, pool, buf, buf, (scoped, None, budget))
        return pool[-1] * 1.0

    return part


def run_program(program: dict, compiled: bool, scoped: bool, budget: Any = None) -> list[torch.Tensor | None]:
    """One run: eager (``compiled=False``: nothing compiled), or compiled with the
    program's backend (the whole body for ``inside``, the ``compiled`` items for
    ``outside``); returns the values to compare. Inductor draws random numbers with
    eager's generator here (``fallback_random``), so that eager stays a reference.
    ``budget``: a Budget for the scopes (dynamo is not reset: a step of a loop)."""
    if program["backend"] != "inductor":
        return _run(program, compiled, scoped, budget)
    with torch._inductor.config.patch(fallback_random=True):
        return _run(program, compiled, scoped, budget)


def _run(program: dict, compiled: bool, scoped: bool, budget: Any = None) -> list[torch.Tensor | None]:
    if budget is None:
        torch._dynamo.reset()
    torch.manual_seed(program["seed"])
    r = Run(program["seed"])
    backend = program["backend"]
    inside = program["shape"] == "inside"
    how = (scoped, backend if compiled and not inside else None, budget)

    def body(x: torch.Tensor, w: torch.Tensor, p: torch.Tensor, buf: torch.Tensor) -> list[torch.Tensor]:
        pool = [x, w, p]
        interpret(program["items"], pool, buf, p, how)
        return pool[-3:]

    if inside and compiled:
        body = torch.compile(body, backend=backend)
    outs = body(r.x, r.w, r.p, r.buf)
    terms = [(t * wt).sum() for t, wt in zip(outs, r.loss_weights) if t.requires_grad]
    if not terms:
        raise _NoBackward()
    values = [t.detach().clone() for t in outs]
    del outs
    sum(terms).backward()
    return [*values, r.x.grad, r.w.grad, r.p.grad, r.buf.clone(), r.p.detach().clone()]


class _NoBackward(Exception):
    """The program's outputs need no gradient: nothing to compare in backward."""


# --------------------------------------------------------------------------------------
# the oracle


def _state() -> tuple:
    return (top_hooks(), dispatch_depth(), torch.is_grad_enabled())


def _bitwise(a: list, e: list) -> bool:
    return all(
        (x is None and y is None) or (x is not None and y is not None and x.shape == y.shape and torch.equal(x, y))
        for x, y in zip(a, e)
    )


def _close(a: list, e: list) -> bool:
    try:
        for x, y in zip(a, e):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5, equal_nan=True)
    except AssertionError:
        return False
    return True


def _attempt(
    program: dict, compiled: bool, scoped: bool, budget: Any = None
) -> tuple[list | None, BaseException | None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (budget= inside compiled code: not applied there)
        try:
            return run_program(program, compiled, scoped, budget), None
        except RecomputeError as e:
            return None, e
        except Exception as e:  # noqa: BLE001  (judged by the caller)
            return None, e


def check_program(program: dict) -> str:
    state0 = _state()
    eager, err = _attempt(program, compiled=False, scoped=False)
    if isinstance(err, _NoBackward):
        return _invalid("no output needs grad")
    if eager is None:
        return _invalid(f"eager raises {type(err).__name__}")
    plain, err = _attempt(program, compiled=True, scoped=False)
    if plain is None:
        return _invalid(f"plain compiled raises {type(err).__name__}")
    scoped, err = _attempt(program, compiled=True, scoped=True)
    torch._dynamo.reset()
    if isinstance(err, RecomputeError):
        torch.ones((), requires_grad=True).backward()  # the engine's ready queue (README)
        outcome = "RecomputeError"
    elif err is not None:
        raise AssertionError(f"scoped run raised {type(err).__name__}: {err}\nprogram={program!r}")
    elif _bitwise(scoped, plain):
        outcome = "bitwise equal to plain compiled"
    elif not _close(plain, eager) and _close(scoped, eager):
        outcome = "plain compiled wrong, scoped close to eager"
    elif _close(scoped, plain) and _close(scoped, eager):
        outcome = "close to plain compiled and eager"
    else:
        raise AssertionError(f"scoped compiled run differs (silently wrong)\nprogram={program!r}")
    if _state() != state0:
        gc.collect()
        if _state() != state0:
            raise AssertionError(f"global state left changed\nprogram={program!r}")
    assert torch._C._dynamo.eval_frame.set_eval_frame(None) is None, "a dynamo callback was left set"
    _count(outcome)
    return outcome


def check_budget_program(program: dict) -> str:
    """The scoped compiled run without a budget, then ``BUDGET_STEPS`` steps with one
    Budget (dynamo not reset between them: the compiled graphs are reused and eager
    blocks follow their plan from the second step): every step gives what the run
    without a budget gives, bitwise -- or, where that raised RecomputeError, what the
    plain compiled run gives (a stored value needs no replay)."""
    state0 = _state()
    plain, err = _attempt(program, compiled=True, scoped=False)
    if plain is None:
        return _invalid(f"plain compiled raises {type(err).__name__}")
    unplanned, err = _attempt(program, compiled=True, scoped=True)
    if err is not None and not isinstance(err, RecomputeError):
        raise AssertionError(f"scoped run raised {type(err).__name__}: {err}\nprogram={program!r}")
    if err is not None:
        torch.ones((), requires_grad=True).backward()  # the engine's ready queue (README)
    budget = Budget(program["budget"])
    torch._dynamo.reset()
    for step in range(BUDGET_STEPS):
        got, err_b = _attempt(program, compiled=True, scoped=True, budget=budget)
        if err_b is not None:
            torch.ones((), requires_grad=True).backward()
        same = (got is None and unplanned is None and type(err_b) is type(err)) or (
            got is not None and unplanned is not None and _bitwise(got, unplanned)
        )
        if not same and not (err is not None and got is not None and _bitwise(got, plain)):
            raise AssertionError(
                f"step {step + 1} with a budget: {type(err_b).__name__ if err_b else 'a result'}; without one: "
                f"{type(err).__name__ if err else 'a result'}\nprogram={program!r}"
            )
    torch._dynamo.reset()
    if _state() != state0:
        gc.collect()
        if _state() != state0:
            raise AssertionError(f"global state left changed\nprogram={program!r}")
    planned = "unplanned" if budget.planned_bytes is None else "planned"
    outcome = f"{'RecomputeError' if err else 'a result'} without a budget, {planned}"
    _count(outcome)
    return outcome


def _invalid(why: str) -> str:
    _count(f"invalid: {why}")
    reject()
    return why


def _count(outcome: str) -> None:
    with contextlib.suppress(InvalidArgument):  # (outside a hypothesis test)
        event(outcome)
    if COUNTS:
        with open(COUNTS, "a") as f:
            f.write(outcome + "\n")


# --------------------------------------------------------------------------------------
# strategies

idx_st = st.integers(0, 40)
op_st = st.tuples(st.sampled_from(OP_NAMES + SPECIAL), idx_st, idx_st)
scope_st = st.recursive(
    st.tuples(
        st.just("scope"), st.sampled_from(["plain", "plain", "save_mm"]), st.lists(op_st, min_size=1, max_size=5)
    ),
    lambda inner: st.tuples(
        st.just("scope"),
        st.sampled_from(["plain", "save_mm"]),
        st.lists(st.one_of(op_st, inner, st.just(("break",))), min_size=1, max_size=5),
    ),
    max_leaves=5,
)
compiled_st = st.tuples(st.just("compiled"), st.lists(st.one_of(op_st, st.just(("break",))), min_size=1, max_size=4))
inside_items = st.lists(st.one_of(op_st, op_st, scope_st, st.just(("break",))), min_size=2, max_size=7)
outside_scope = st.tuples(
    st.just("scope"), st.just("plain"), st.lists(st.one_of(op_st, compiled_st), min_size=1, max_size=5)
)
outside_items = st.lists(st.one_of(op_st, outside_scope, compiled_st), min_size=2, max_size=6)
program_st = st.one_of(
    st.fixed_dictionaries({"shape": st.just("inside"), "items": inside_items}),
    st.fixed_dictionaries({"shape": st.just("outside"), "items": outside_items}),
).flatmap(lambda d: st.fixed_dictionaries({**{k: st.just(v) for k, v in d.items()}, "seed": st.integers(0, 2**16)}))


def _has_scope(items: list) -> bool:
    return any(it[0] == "scope" or (it[0] == "compiled" and _has_scope(it[1])) for it in items)


@settings(
    max_examples=N_EXAMPLES,
    deadline=None,
    derandomize=not RANDOM,
    database=None,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
)
@given(program=program_st)
# A block reads the buffer, the function writes it later / the block writes it first.
@example(
    program={"shape": "inside", "items": [("scope", "plain", [("read_buf", 0, 0)]), ("write_buf", 0, 0)], "seed": 1}
)
@example(program={"shape": "inside", "items": [("scope", "plain", [("mul_buf", 0, 0), ("read_buf", 0, 0)])], "seed": 2})
def test_compiled_programs_equal_plain_or_recompute_error(program):
    if not _has_scope(program["items"]):
        reject()
    check_program({**program, "backend": BACKEND})


budget_program_st = program_st.flatmap(
    lambda p: st.fixed_dictionaries(
        {**{k: st.just(v) for k, v in p.items()}, "budget": st.one_of(st.just(10**12), st.integers(0, 2000))}
    )
)


@settings(
    max_examples=N_BUDGET_EXAMPLES,
    deadline=None,
    derandomize=not RANDOM,
    database=None,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
)
@given(program=budget_program_st)
# An eager block with a budget calling a compiled function; a compiled block given one.
@example(
    program={
        "shape": "outside",
        "items": [("scope", "plain", [("sin", 0, 1), ("compiled", [("mm", 0, 1), ("tanh", 2, 2)]), ("mul", 3, 4)])],
        "seed": 3,
        "budget": 10**12,
    }
)
@example(
    program={"shape": "inside", "items": [("scope", "plain", [("mm", 0, 1), ("gelu", 3, 3)])], "seed": 4, "budget": 0}
)
def test_compiled_programs_with_budgets_behave_as_without(program):
    """Budgets given to scopes in compiled code (not applied there: one warning) and to
    eager scopes around compiled functions change no result."""
    if not _has_scope(program["items"]):
        reject()
    check_budget_program({**program, "backend": BACKEND})


# --------------------------------------------------------------------------------------
# compiled budgets under dynamic shapes, alternating lengths (issue 37)

N_DYNAMIC_EXAMPLES = int(os.environ.get("GS_DIFF_COMPILED_DYNAMIC_EXAMPLES", "2"))


class _Blocks(torch.nn.Module):
    """Pre-norm residual blocks (``conftest.ResidualMLP`` without dropout) whose
    forwards a program scopes: its ``ops`` pick what each block runs."""

    def __init__(self, n: int, ops: list[str]) -> None:
        super().__init__()
        from support import ResidualMLP

        self.blocks = torch.nn.ModuleList([ResidualMLP(8) for _ in range(n)])
        self.ops = ops

    def forward(self, x: torch.Tensor, budget: Any) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            with recompute_scope(budget=budget) if budget is not None else contextlib.nullcontext():
                h = block.ln(x)
                op = self.ops[i % len(self.ops)]
                h = {"gelu": F.gelu, "tanh": torch.tanh, "softmax": lambda t: t.softmax(-1)}[op](block.fc1(h))
                x = x + block.fc2(h)
        return x


def _dynamic_run(program: dict, budget: Any) -> list[list[torch.Tensor]]:
    """The program's lengths in turn, one compiled model (dynamo reset first): per
    length, the output and every gradient."""
    torch._dynamo.reset()
    torch.manual_seed(program["seed"])
    model = _Blocks(program["blocks"], program["ops"])
    dynamic = True if program["how"] == "dynamic=True" else None  # (None: static, then automatic dynamic)
    compiled = torch.compile(lambda x: model(x, budget), backend=BACKEND, dynamic=dynamic)
    g = torch.Generator().manual_seed(program["seed"])
    results = []
    for length in program["lengths"]:
        x = torch.randn(2, length, 8, generator=g, requires_grad=True)
        if program["how"] == "mark_dynamic":
            torch._dynamo.mark_dynamic(x, 1)
        model.zero_grad(set_to_none=True)
        out = compiled(x)
        out.square().sum().backward()
        results.append([out.detach(), x.grad, *(p.grad for p in model.parameters())])
    return results


def check_dynamic_budget_program(program: dict) -> str:
    """Every length's output and gradients with a budget equal those without scopes,
    bitwise (``aot_eager``) or close (inductor); the plan, made at traced sizes, is
    within the budget above the floor and never 0 bytes for a budget above the floor."""
    plain = _dynamic_run(program, None)
    budget = Budget(program["budget"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (below the floor; planned at the traced sizes)
        got = _dynamic_run(program, budget)
    torch._dynamo.reset()
    for a, e in zip(got, plain):
        if not (_bitwise(a, e) if BACKEND == "aot_eager" else _close(a, e)):
            raise AssertionError(f"a compiled budget changed a result\nprogram={program!r}")
    assert budget.planned_bytes is not None and budget.floor_bytes is not None
    if budget.bytes >= budget.floor_bytes:
        assert budget.planned_bytes <= budget.bytes, f"planned over the budget\nprogram={program!r}"
    assert budget.planned_bytes > 0, f"a plan of 0 bytes (sizes counted 0)\nprogram={program!r}"
    outcome = f"{program['how']}: {'within' if budget.bytes >= budget.floor_bytes else 'below the floor'}"
    _count(outcome)
    return outcome


dynamic_program_st = st.fixed_dictionaries(
    {
        "how": st.sampled_from(["dynamic=True", "mark_dynamic", "automatic"]),
        "blocks": st.integers(1, 3),
        "ops": st.lists(st.sampled_from(["gelu", "tanh", "softmax"]), min_size=1, max_size=3),
        "lengths": st.lists(st.integers(2, 9), min_size=2, max_size=4),
        "budget": st.one_of(st.just(10**9), st.integers(0, 12_000)),
        "seed": st.integers(0, 2**16),
    }
)


@settings(
    max_examples=N_DYNAMIC_EXAMPLES,
    deadline=None,
    derandomize=not RANDOM,
    database=None,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
)
@given(program=dynamic_program_st)
# Alternating lengths: automatic dynamic recompiles at the second length, then reuses it.
@example(program={"how": "automatic", "blocks": 3, "ops": ["gelu"], "lengths": [8, 5, 8, 5], "budget": 6000, "seed": 1})
@example(program={"how": "mark_dynamic", "blocks": 2, "ops": ["softmax"], "lengths": [6, 3], "budget": 4000, "seed": 2})
def test_compiled_budgets_under_dynamic_shapes_change_no_result(program):
    """Compiled budgets under ``dynamic=True``, ``mark_dynamic`` and automatic dynamic
    (alternating lengths): results equal the compiled program without scopes."""
    check_dynamic_budget_program(program)
