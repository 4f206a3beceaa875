"""The differential fuzzer's programs (``tests/fuzz/test_fuzz_differential.py``, reused by
``tests/restore/test_replay_code.py``): hypothesis strategies that draw a program -- ops of
``support.fuzz_ops`` and scopes (nested, side by side, with options, aborted) on a pool of
tensors, writes between forward and backward (``support.writes``), a backward mode -- and
``check_program``, which runs one with scopes and without and requires the same results
bitwise, or ``RecomputeError`` from the scoped run. ``FAMILIES`` and ``_family_program``: a
fixed program per op family.
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
from hypothesis import HealthCheck, Phase, event, reject, settings
from hypothesis import strategies as st

from gradient_scope import RecomputeError, recompute_scope

from support import dispatch_depth, patchable, top_hooks
from support.fuzz_ops import (
    BINARY,
    COMPLEX,
    MODULES,
    MULTI,
    NEWEST,
    OP_NAMES,
    OPS,
    RANDOM_OPS,
    SCRATCH,
    UNARY,
    VIEWS,
    Ctx,
    N,
)
from support.writes import WRITES

N_EXAMPLES = int(os.environ.get("GS_DIFF_EXAMPLES", os.environ.get("GS_HYPOTHESIS_EXAMPLES", "200")))
RANDOM = os.environ.get("GS_DIFF_RANDOM", "") not in ("", "0")

SHRINK = os.environ.get("GS_DIFF_SHRINK", "") not in ("", "0")

DIFF_SETTINGS = settings(
    max_examples=N_EXAMPLES,
    deadline=None,
    derandomize=not RANDOM,
    database=None if not RANDOM else settings.default.database,
    # Shrinking a failure can take minutes on a 2-core CPU: off unless asked for (the
    # failure message prints the whole program either way).
    phases=[Phase.explicit, Phase.reuse, Phase.generate] + ([Phase.shrink] if SHRINK else []),
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
)

# --------------------------------------------------------------------------------------
# writes between forward and backward


# Seen by a check without reading values (version counter, tensor identity); the rest
# only by debug=True (docs/limitations.md), so only in programs whose scopes all debug.
VISIBLE_WRITES = ("inplace", "set_", "data_assign")


def _apply_writes(
    ctx: Ctx, writes: list[tuple[str, str, int]], debug_all: bool, keep: list[Any], hit_saved: bool = False
) -> None:
    """``hit_saved``: versioned writes may hit block tensors autograd saved (plain raises
    PyTorch's error, the scopes may replay the value as saved: budget programs compare
    the scopes with and without a budget there)."""
    for target, route, k in writes:
        if route not in VISIBLE_WRITES and not debug_all:
            route = VISIBLE_WRITES[k % len(VISIBLE_WRITES)]
        if target == "xr":
            t = ctx.xr
        elif target == "x":
            t = ctx.x
        elif target == "leaf":
            if route in ("inplace", "set_"):
                continue  # a leaf that requires grad: not writable in place
            t = ctx.leaves[k % len(ctx.leaves)]
        else:  # a live block tensor, kept alive until after backward (or not, in debug)
            idx = ctx.live(lambda e: e.block and not e.t.is_complex() and e.t._base is None)
            if not idx:
                continue
            t = ctx.pool[idx[k % len(idx)]].t
            versioned = route in ("inplace", "set_")
            if versioned and not hit_saved:
                continue  # versioned writes to saved tensors: PyTorch's own error
            if not (debug_all and k % 2) and not (versioned and k % 2):
                keep.append(t)  # (a versioned write to a tensor then dropped: its handle replays)
        WRITES[route](t)


# --------------------------------------------------------------------------------------
# running a program


class _Abort(Exception):
    pass


def _run_items(items: list, ctx: Ctx, factory: Callable[[str], Any]) -> None:
    for item in items:
        if item[0] == "scope":
            _, option, body = item
            if option == "raise":
                try:
                    with factory("plain"):
                        ctx.depth += 1
                        try:
                            _run_items(body, ctx, factory)
                        finally:
                            ctx.depth -= 1
                        raise _Abort
                except _Abort:
                    pass
                continue
            with factory(option):
                ctx.depth += 1
                try:
                    _run_items(body, ctx, factory)
                finally:
                    ctx.depth -= 1
        else:
            name, i, j, k = item
            OPS[name](ctx, i, j, k)


def _scope_options(option: str, debug_all: bool) -> dict[str, Any]:
    opts: dict[str, Any] = {}
    if option == "save_mm":
        opts["save"] = [torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm]
    elif option == "save_fn":
        opts["save"] = lambda op: "lstm" in str(op) or "rnn" in str(op) or "softmax" in str(op)
    elif option == "disabled":
        opts["enabled"] = False
    elif option == "debug":
        opts["debug"] = True
    if debug_all:
        opts["debug"] = True
    return opts


def _real_loss_term(t: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    p = t * w
    if p.is_complex():
        p = torch.view_as_real(p)
    return p.sum()


def run_program(program: dict, scoped: bool, made: list[weakref.ref] | None = None, budget: Any = None) -> list:
    """One run; returns every value to compare (tensors, None, plain values). ``made``
    receives weak references to the tensors the program made. ``budget``: a Budget
    given to every scope that takes one (not with ``save=``)."""
    seed = program["seed"]
    debug_all = program["debug_all"]

    def factory(option: str):
        if not scoped:
            return contextlib.nullcontext()
        opts = _scope_options(option, debug_all)
        if budget is not None and "save" not in opts:
            opts["budget"] = budget
        return recompute_scope(**opts)

    ctx = Ctx(seed, [] if made is None else made)
    _run_items(program["items"], ctx, factory)
    wgen = torch.Generator().manual_seed(seed + 2)
    outs = [e.t for e in ctx.pool if e is not None][-4:]
    loss = sum(_real_loss_term(t, torch.randn(N, N, generator=wgen)) for t in outs)
    values = [t.detach().clone() for t in outs]
    keep: list[Any] = []
    _apply_writes(ctx, program["writes"], debug_all, keep, program.get("hit_saved", False))
    del outs
    # The block tensors die (unless kept): backward must recompute them. A backward in
    # another thread gets them and drops them there (the forward thread's last block
    # tensor dies in another thread).
    pool, ctx.pool = ctx.pool, []
    if program["backward"] != "thread":
        del pool
    results: list[Any] = [loss.detach().clone(), *values]
    grad_leaves = [*ctx.leaves, ctx.cleaf, *ctx.params()]
    mode = program["backward"]
    if loss.requires_grad:
        if mode == "backward":
            loss.backward()
        elif mode == "backward_inputs":
            loss.backward(inputs=[ctx.leaves[0], ctx.cleaf, *ctx.modules["lstm"].parameters()])
        elif mode == "grad_inputs":
            got = torch.autograd.grad(loss, [ctx.leaves[1], ctx.cleaf, ctx.leaves[2]], allow_unused=True)
            results.extend(got)
        elif mode == "retain_twice":
            loss.backward(retain_graph=True)
            loss.backward()
        elif mode == "retain_kept":  # the graph lives on into the next run (a loop's `loss`)
            loss.backward(retain_graph=True)
            _RETAINED[:] = [loss]
        elif mode == "thread":

            def backward_and_drop() -> None:
                loss.backward()
                pool.clear()

            _in_thread(backward_and_drop)
        elif mode == "create_graph":
            got = torch.autograd.grad(loss, ctx.leaves, create_graph=True, allow_unused=True)
            second = [(g * g).sum() for g in got if g is not None and g.requires_grad]
            results.extend(None if g is None else g.detach() for g in got)
            if second:
                sum(second).backward()
            del got, second
    del loss
    results.extend(p.grad for p in grad_leaves)
    results.extend(b.detach().clone() for b in ctx.modules["bn"].buffers())
    results.append(torch.get_rng_state())
    results.append(ctx.gen.get_state())
    del keep, ctx
    return results


_RETAINED: list[Any] = []  # the graph of the last "retain_kept" run


def _in_thread(fn: Callable[[], None]) -> None:
    """Run ``fn`` in another thread (as autograd's device threads do); re-raise its error."""
    box: list[BaseException] = []

    def target() -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001
            box.append(e)

    t = threading.Thread(target=target)
    t.start()
    t.join(120)
    if box:
        raise box[0]


def _same(a: Any, e: Any) -> bool:
    if isinstance(e, torch.Tensor):
        if not isinstance(a, torch.Tensor) or a.shape != e.shape or a.dtype != e.dtype:
            return False
        if a.is_complex():
            a = torch.view_as_real(a.resolve_conj().resolve_neg())
            e = torch.view_as_real(e.resolve_conj().resolve_neg())
        if a.is_floating_point():
            nan_a, nan_e = torch.isnan(a), torch.isnan(e)
            return torch.equal(nan_a, nan_e) and torch.equal(a[~nan_a], e[~nan_e])
        return torch.equal(a, e)
    return a is None and e is None if e is None else a == e


def check_program(program: dict, generated: bool = False) -> str:
    """Plain vs scoped: "equal" or "RecomputeError"; raises AssertionError otherwise.
    A generated program whose plain run raises is rejected (hypothesis); a fixed one is
    a bug of the test."""
    if generated and program["backward"] == "create_graph" and _uses(program["items"], SCRATCH):
        # A backward writing its unpacked tensors in place, differentiated again: with
        # any saved-tensor hooks PyTorch builds another double-backward graph than
        # without (docs/limitations.md; test_custom_function_backward.py).
        event("custom backward writing saved tensors under create_graph")
        reject()
    state0 = (top_hooks(), dispatch_depth(), patchable(), torch.is_grad_enabled())
    made: list[weakref.ref] = []
    try:
        expected = run_program(program, scoped=False, made=made)
    except Exception as e:  # noqa: BLE001  (the program is not valid PyTorch)
        invalid = f"{type(e).__name__}: {e}"
        expected = None
    if expected is None:
        if not generated:
            raise AssertionError(f"test bug: the plain program raises {invalid}\nprogram={program!r}")
        event(f"plain raises {invalid.split(':')[0]}")
        reject()
    if _debugs(program) and any(r() is not None for r in made):
        gc.collect()
        if any(r() is not None for r in made):
            # PyTorch's own reference cycle (e.g. `u.copy_(u.cos())`: u's new node reaches
            # CosBackward, which saved u itself) keeps tensors of the plain run alive for
            # ever. debug=True keeps a saved block tensor as autograd does, so the scoped
            # run keeps them too, and the hooks with them (docs/limitations.md): the state
            # check cannot pass. Without debug a handle breaks the cycle (test_memory.py).
            if not generated:
                raise AssertionError(f"test bug: the plain program leaks a reference cycle\nprogram={program!r}")
            event("plain run leaks a reference cycle (debug program)")
            reject()
    outcome = "equal"
    failure = None
    try:
        actual = run_program(program, scoped=True)
    except RecomputeError:
        outcome = "RecomputeError"
        actual = None
    except Exception as e:  # noqa: BLE001
        failure = f"scoped run raised {type(e).__name__}: {e}"
        actual = None
    if actual is not None:
        if len(actual) != len(expected):
            failure = f"{len(actual)} results, plain has {len(expected)}"
        else:
            for n, (a, e) in enumerate(zip(actual, expected)):
                if not _same(a, e):
                    failure = f"result {n} differs from the plain program (silently wrong)"
                    break
    del actual, expected
    if outcome == "RecomputeError":
        # PyTorch's engine keeps the nodes a failed backward had made ready to run (in
        # its thread-local ready queue) until the next backward on this thread: their
        # handles, hence the hooks, stay until then (docs/limitations.md).
        torch.ones((), requires_grad=True).backward()
    left = (top_hooks(), dispatch_depth(), patchable(), torch.is_grad_enabled())
    if left != state0 and failure is None:
        gc.collect()  # an exception's frames may hold block tensors in a cycle
        if (top_hooks(), dispatch_depth(), patchable(), torch.is_grad_enabled()) != state0:
            failure = "global state left changed (hooks, dispatch modes, patches or grad mode)"
        elif outcome == "equal":
            failure = "saved-tensor hooks / patches outlived every block tensor (freed only by gc)"
    if failure is not None:
        raise AssertionError(f"{failure}\nprogram={program!r}")
    return outcome


# --------------------------------------------------------------------------------------
# strategies

OPTIONS = ["plain", "plain", "plain", "save_mm", "save_fn", "debug", "disabled", "raise"]
idx_st = st.one_of(st.just(NEWEST), st.integers(0, NEWEST - 1))  # often the newest tensor
op_st = st.tuples(st.sampled_from(OP_NAMES), idx_st, idx_st, st.integers(0, 99))
scope_st = st.recursive(
    st.tuples(st.just("scope"), st.sampled_from(OPTIONS), st.lists(op_st, min_size=1, max_size=7)),
    lambda inner: st.tuples(
        st.just("scope"), st.sampled_from(OPTIONS), st.lists(st.one_of(op_st, inner), min_size=1, max_size=6)
    ),
    max_leaves=6,
)
# a program: a few ops, then blocks (nested or not), each followed by ops that use (and
# save) what the block made
segment_st = st.tuples(scope_st, st.lists(op_st, min_size=0, max_size=6))
items_st = st.tuples(st.lists(op_st, max_size=3), st.lists(segment_st, min_size=1, max_size=4)).map(
    lambda t: [*t[0], *[x for scope, after in t[1] for x in (scope, *after)]]
)
write_st = st.tuples(
    st.sampled_from(["xr", "xr", "x", "leaf", "block"]), st.sampled_from(list(WRITES)), st.integers(0, 99)
)
program_st = st.fixed_dictionaries(
    {
        "items": items_st,
        "seed": st.integers(0, 2**16),
        "debug_all": st.booleans(),
        "writes": st.lists(write_st, max_size=2),
        "backward": st.sampled_from(
            ["backward", "backward", "backward_inputs", "grad_inputs", "retain_twice", "create_graph"]
        ),
    }
)


def _debugs(program: dict) -> bool:
    """Whether some scope of the program runs with debug=True."""
    return program["debug_all"] or _has_debug(program["items"])


def _has_debug(items: list) -> bool:
    return any(it[0] == "scope" and (it[1] == "debug" or _has_debug(it[2])) for it in items)


def _uses(items: list, names: dict) -> bool:
    return any(_uses(it[2], names) if it[0] == "scope" else it[0] in names for it in items)


def _count(items: list, what: str) -> int:
    n = 0
    for it in items:
        if it[0] == "scope":
            n += (what == "scopes") + _count(it[2], what)
        else:
            n += what == "ops"
    return n


# --------------------------------------------------------------------------------------
# fixed programs: one per family, so every family runs in CI whatever hypothesis draws


def _fixed(items, *, seed=3, debug_all=False, writes=(), backward="backward"):
    return {"items": items, "seed": seed, "debug_all": debug_all, "writes": list(writes), "backward": backward}


def _family_program(name: str, option: str = "plain", view_after: bool = False) -> dict:
    """A real and a complex block tensor, the op on them (in the block, or after it),
    its output saved by an op after the block."""
    op = (name, NEWEST, NEWEST, 2)
    body = [("scale", NEWEST, 0, 0), ("times_j", NEWEST, 0, 0)] + ([] if view_after else [op])
    return _fixed([("sin", 0, 0, 0), ("scope", option, body), *([op] if view_after else []), ("save_last", 0, 0, 0)])


FAMILIES = {
    "unary": list(UNARY),
    "binary": list(BINARY),
    "multi_output": list(MULTI),
    "views": list(VIEWS),
    "complex": list(COMPLEX),
    "random": list(RANDOM_OPS),
    "modules": list(MODULES),
    "inplace": ["inplace"],
    "scratch": list(SCRATCH),
}
