"""Run a plan: recorded ops of one block, in recorded order (``_replay`` P1, P5, P6).

Intermediate values are dropped as soon as no later op of the plan reads them.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any, Callable

import torch

from . import _rng
from ._block import BlockRecord, Input, MetaArg, Var
from ._errors import RecomputeError
from ._registry import _LIVE
from ._subclass import data_tensor, storage_freed
from ._torch_compat import without_autocast

__all__ = ["run_plan"]

Tensor = torch.Tensor


def _storage_id(t: Tensor) -> int:
    return data_tensor(t).untyped_storage()._cdata  # type: ignore[no-any-return]


def _input_value(r: Input, func: Any, freed: Callable[[Tensor], bool]) -> Tensor:
    """An outside tensor's value as the block read it (P6), or a RecomputeError."""
    t = r.tensor
    if r.snapshot:
        return t.clone(memory_format=torch.preserve_format)  # replay writes into a copy (R1)
    if storage_freed(t) and not freed(t):
        raise RecomputeError(
            f"gradient_scope: cannot recompute the output of {func}: its input tensor of shape "
            f"{list(t.shape)} ({t.dtype}), read from outside the recompute_scope, has had its "
            "storage freed since forward, and it belongs to no FSDP2 parameter group (those are "
            "gathered again for a replay). Do not free storages a block read until backward has "
            "run, or keep this op out of the recompute_scope."
        )
    if t._version != r.version:
        raise RecomputeError(
            f"gradient_scope: cannot recompute the output of {func}: its input tensor of shape "
            f"{list(t.shape)} ({t.dtype}), read from outside the recompute_scope, was modified in "
            f"place after the block (version {r.version} -> {t._version}) and before backward. "
            "Do not modify tensors a block read until backward has run, or pass a clone into the block."
        )
    src = r.source()
    if src is not None and t.layout == torch.strided and _storage_id(src) != _storage_id(t):
        raise RecomputeError(
            f"gradient_scope: cannot recompute the output of {func}: its input tensor of shape "
            f"{list(t.shape)} ({t.dtype}), read from outside the recompute_scope, was given another "
            "storage after the block (`tensor.data = ...` or `set_()`). Do not replace the data of "
            "tensors a block read until backward has run."
        )
    return t


def _check(func: Any, var: Var, value: Any, debug_values: dict[Var, Tensor]) -> None:
    """P5: a replayed output must look like forward's."""
    if not isinstance(value, Tensor):
        raise RecomputeError(
            f"gradient_scope: replaying {func} returned {type(value).__name__} where forward "
            f"produced a {var.describe()}. The op does not replay faithfully; keep its output "
            "with save=[...] or move it out of the recompute_scope."
        )
    shape_ok = var.size is None or value.shape == var.size
    if not shape_ok or value.dtype != var.dtype or value.device != var.device:
        raise RecomputeError(
            f"gradient_scope: replaying {func} produced a tensor of shape {list(value.shape)} "
            f"({value.dtype}, {value.device}) where forward produced a {var.describe()}. The op "
            "does not replay faithfully; keep its output with save=[...] or move it out of the "
            "recompute_scope."
        )
    ref = debug_values.get(var) if debug_values else None
    if ref is not None:
        same = (
            torch.equal(value, ref)
            if value.device.type == "cpu"
            else torch.allclose(value, ref, rtol=1e-5, atol=1e-8, equal_nan=True)
        )
        if not same:
            raise RecomputeError(
                f"gradient_scope (debug): replaying {func} gave different values for a "
                f"{var.describe()} than forward did. The op is not deterministic, or read state "
                "that changed without a version bump (`.data`, a NumPy array, untyped_storage()); "
                "keep its output with save=[...] or move it out of the recompute_scope."
            )


def run_plan(
    record: BlockRecord,
    plan: list[int],
    target: Var,
    cache: dict[tuple[Var, int], Tensor],
    keep: Collection[Var],
    produced: dict[Var, Tensor],
    freed: Callable[[Tensor], bool],
) -> Tensor:
    """Run ``plan``; return ``target``'s value and put the values of ``keep`` vars
    (as they stand at the end, for groups written to) into ``produced``."""
    ops = record.ops
    last_use: dict[int, int] = {}
    for i in plan:
        rec = ops[i]
        for a in rec[1]:
            if isinstance(a, list):
                for x in a:
                    last_use[id(x)] = i
            else:
                last_use[id(a)] = i
        for a in rec[2].values():
            last_use[id(a)] = i
    env: dict[int, Tensor] = {}

    def value_of(r: Any, func: Any) -> Any:
        if isinstance(r, Var):
            v = env.get(id(r))
            if v is not None:
                return v
            v = cache.get((r, 0)) if not r.root.writes else None
            if v is None:
                e = _LIVE.get(r.key)
                t = e() if e is not None and e.var is r else None
                if t is None or t.is_inference() or t._version != r.version:
                    raise RecomputeError(
                        f"gradient_scope: internal error: no value for a {r.describe()} needed by "
                        f"{func}. Please report this."
                    )
                v = t.detach()
            env[id(r)] = v
            return v
        if isinstance(r, Input):
            v = env.get(id(r))
            if v is None:
                v = env[id(r)] = _input_value(r, func, freed)
            return v
        if isinstance(r, MetaArg):
            return r.empty()
        return r

    # (value_of must not call itself: a closure that refers to its own cell is a
    # reference cycle, which would keep env and cache alive until gc runs.)
    def arg(r: Any, func: Any) -> Any:
        return [value_of(x, func) for x in r] if isinstance(r, list) else value_of(r, func)

    stats = target.frame.stats
    debug_values = record.debug_values
    result: Tensor | None = None
    with without_autocast():
        for i in plan:
            func, rargs, rkwargs, rng, outs = ops[i]
            args = [arg(a, func) for a in rargs]
            kwargs = {k: arg(a, func) for k, a in rkwargs.items()} if rkwargs else {}
            try:
                out = _rng.replay_with_state(rng, func, args, kwargs) if rng is not None else func(*args, **kwargs)
            except RecomputeError:
                raise
            except Exception as e:
                raise RecomputeError(f"gradient_scope: replaying {func} failed during backward: {e}") from e
            del args, kwargs
            if outs:
                values = (out,) if isinstance(out, Tensor) else out
                for var, v in zip(outs, values):
                    if var is None:
                        continue
                    _check(func, var, v, debug_values)
                    env[id(var)] = v
                    if var is target:
                        result = v
                    if var in keep:
                        produced[var] = v
            # Drop what no later op of this plan reads.
            for a in (*rargs, *rkwargs.values()):
                for x in a if isinstance(a, list) else (a,):
                    if last_use.get(id(x)) == i and x is not target:
                        env.pop(id(x), None)
            for var in outs:
                if var is not None and var is not target and id(var) not in last_use:
                    env.pop(id(var), None)
    stats.replays += 1
    stats.ops_replayed += len(plan)
    if result is None:
        raise RecomputeError(
            f"gradient_scope: internal error: replay did not produce the {target.describe()}. Please report this."
        )
    return result
