"""Differential fuzzing of the steady state (``_adapters.steady``): random functions of
tensors, run by ``gradient_scope.checkpoint`` (or with a ``save=`` policy, or a budget)
with ``GRADIENT_SCOPE_FAST=1`` for several steps -- new values, the same Python constants
or changed ones, a branch taken or not, another shape, autocast on; backward whole,
partial or twice with a retained graph -- against the same function without a scope,
same seeds: losses and gradients bitwise equal at every step, and at least one step of
every program bound from its template (a steady run) unless dynamo cannot capture it.

A program is straight-line Python source (elementwise and matmul ops, views, in-place
writes to intermediates and to top-k's stored values, dropout, softmax, layer norm, a branch
on an argument), compiled
once with ``exec`` so that every step calls the same function object, as a model's layer
is called every step.

Size: GS_STEADY_EXAMPLES programs (default 6; each pays dynamo's capture, about a second);
the draws are fixed unless GS_DIFF_RANDOM=1.
"""

from __future__ import annotations

import functools
import os
import random
import warnings

import pytest
import torch
import torch.nn.functional as F

import gradient_scope
from gradient_scope._adapters.steady import run as steady

N_PROGRAMS = int(os.environ.get("GS_STEADY_EXAMPLES", "6"))
RANDOM = os.environ.get("GS_DIFF_RANDOM", "") not in ("", "0")

# name -> (arity, source with {a} {b} for the operands, {c} for the constant argument)
_OPS = {
    "add": (2, "{a} + {b}"),
    "mul": (2, "{a} * {b}"),
    "mm": (2, "{a} @ {b}"),
    "sin": (1, "torch.sin({a})"),
    "tanh": (1, "torch.tanh({a})"),
    "gelu": (1, "F.gelu({a})"),
    "scale": (1, "{a} * c"),
    "softmax": (1, "torch.softmax({a}, dim=-1)"),
    "norm": (1, "F.layer_norm({a}, ({a}.shape[-1],))"),
    "dropout": (1, "F.dropout({a}, 0.25, training=True)"),
    "t": (1, "{a}.t()"),
    "slice": (1, "torch.cat([{a}[:, 2:], {a}[:, :2]], dim=1)"),
    "view": (1, "{a}.reshape(-1).reshape({a}.shape)"),
    "exp_neg": (1, "torch.exp(-{a}.abs())"),
    "chunk": (1, "torch.cat({a}.chunk(3, dim=0)[::-1], dim=0)"),
    "unbind": (1, "torch.stack([r * (i + 1) for i, r in enumerate({a}.unbind(0))])"),
    "where": (2, "torch.where({a} > 0, {a}, {b})"),
    "rand": (1, "{a} * torch.rand_like({a})"),
    "sum_keep": (1, "{a} - {a}.sum(dim=1, keepdim=True) / 6.0"),
    "view_write": (1, "torch.relu({a}).clone().transpose(0, 1).contiguous().mul_(0.5)"),
    "slice_write": (1, "_slice_write({a})"),
    "topk_norm": (1, "_topk_norm({a})"),
}


def _slice_write(a: torch.Tensor) -> torch.Tensor:
    """A write through a view of an intermediate (its base is saved before and after)."""
    b = a.sin()
    b[:, :2].mul_(3.0)
    return b * a


def _topk_norm(a: torch.Tensor) -> torch.Tensor:
    """Mixtral's router: top-k's values (stored, never recomputed) divided in place, read
    before the write and after it."""
    v, i = torch.softmax(a, dim=-1).topk(2, dim=-1)
    v /= v.sum(dim=-1, keepdim=True)
    return a.scatter(1, i, v * a.gather(1, i))


_INPLACE = ("add_", "mul_", "clamp_")


def _program(rng: random.Random) -> tuple[str, int]:
    """Source of ``f(x, w, c, flag)`` and how many of its values it returns."""
    lines = ["def f(x, w, c, flag):", "    v0 = x", "    v1 = w"]
    n = 2
    for _ in range(rng.randint(3, 12)):
        name = rng.choice(list(_OPS))
        arity, src = _OPS[name]
        a, b = f"v{rng.randrange(n)}", f"v{rng.randrange(n)}"
        lines.append(f"    v{n} = " + src.format(a=a, b=b))
        n += 1
        roll = rng.random()
        if roll < 0.12 and n > 3:  # an in-place write to a fresh intermediate (a clone: never an input)
            op = rng.choice(_INPLACE)
            arg = "(-1.0, 1.0)" if op == "clamp_" else "(0.5)"
            lines.append(f"    v{n} = v{n - 1}.clone()")
            lines.append(f"    v{n}.{op}{arg}")
            n += 1
        elif roll < 0.2:  # a branch on a Python argument
            lines.append("    if flag:")
            lines.append(f"        v{n} = torch.cos(v{n - 1})")
            lines.append("    else:")
            lines.append(f"        v{n} = v{n - 1} * 2.0")
            n += 1
    outs = sorted({n - 1, rng.randrange(2, n)})
    lines.append("    return " + ", ".join(f"v{i}" for i in outs) + ",")
    return "\n".join(lines), len(outs)


def _run(
    fn, scoped, step: int, c: float, flag: bool, size: int, backward: str, autocast: bool = False
) -> list[torch.Tensor | None]:
    """One step of ``fn``, run by ``scoped`` (a function-form scope of it) or plainly
    (``autocast``: the forward under CPU bfloat16 autocast)."""
    torch.manual_seed(100 + step)
    x = torch.randn(size, size, requires_grad=True)
    w = torch.randn(size, size, requires_grad=True)
    torch.manual_seed(200 + step)  # the random ops' draws
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        outs = scoped(x, w, c, flag) if scoped is not None else fn(x, w, c, flag)
    g = torch.Generator().manual_seed(step)
    loss = sum((o.float() * torch.randn(o.shape, generator=g)).sum() for o in outs)
    if backward == "grad_x":  # a partial backward: only what x's gradient needs
        return [loss.detach(), *torch.autograd.grad(loss, [x], allow_unused=True)]
    if backward == "retain_twice":
        loss.backward(retain_graph=True)
    loss.backward()
    return [loss.detach(), x.grad, w.grad]


@pytest.mark.parametrize("n", range(N_PROGRAMS))
def test_steady_runs_equal_plain(n, fast):
    rng = random.Random(None if RANDOM else 7919 * n + 1)
    source, _ = _program(rng)
    scope: dict = {"torch": torch, "F": F, "_slice_write": _slice_write, "_topk_norm": _topk_norm}
    exec(compile(source, f"<steady program {n}>", "exec"), scope)
    fn = scope["f"]
    # How it is scoped: checkpoint, a save= policy (the outputs it keeps come from the graph,
    # T6), or a budget (planned from step 2 on).
    how = ("checkpoint", "save_matmuls", "budget")[n % 3]
    if how == "checkpoint":
        scoped_fn = functools.partial(gradient_scope.checkpoint, fn)
    elif how == "save_matmuls":
        scoped_fn = gradient_scope.recompute_scope(save=gradient_scope.save_matmuls)(fn)
    else:
        scoped_fn = gradient_scope.recompute_scope(budget=gradient_scope.Budget(rng.choice([0, 600, 2000, 10**9])))(fn)
    # Steps 0-1 the same constants (the second is bound from the first's template); then a
    # changed constant, a changed branch, another shape (dynamo's guards must see them: a
    # new graph), and the first graph again.
    plan = [(0.5, True, 6), (0.5, True, 6), (1.5, True, 6), (1.5, False, 6), (0.5, True, 5), (0.5, True, 6)]
    plan += [(0.5, True, 6, True), (0.5, True, 6, True), (0.5, True, 6)]  # autocast on: another graph
    backwards = [rng.choice(("backward", "backward", "grad_x", "retain_twice")) for _ in plan]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a budget below its floor says so
        for step, (c, flag, size, *amp) in enumerate(plan):
            plain = _run(fn, None, step, c, flag, size, backwards[step], bool(amp))
            try:
                scoped = _run(fn, scoped_fn, step, c, flag, size, backwards[step], bool(amp))
            except Exception as e:
                raise AssertionError(f"{how}, step {step} (c={c}, flag={flag}, size={size}) raised\n{source}") from e
            for p, s in zip(plain, scoped):
                same = p is s if p is None or s is None else torch.equal(p, s)  # None: no path to it
                assert same, f"{how}, step {step} (c={c}, flag={flag}, size={size}) differs\n{source}"
    if not steady._failed:
        assert fast, f"{how}: no step was a steady run\n{source}"
