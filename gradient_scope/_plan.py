"""Restore, the replay itself: which recorded ops of a block rebuild a value, which
values to keep for the rest of the backward pass, and running them (``_replay``
P1, P4, P5, P6).

A plan is a sorted list of op indices. Every argument of a recorded op was made
by an earlier op, so the closure is found in one pass over the ops, from the
last one down. Running a plan drops each intermediate value as soon as no later
op of the plan reads it, except the values the other pending handles of the
pass will ask for (P4): those it returns, each with the handle that will ask.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any, TypeVar

import torch

from . import _rng
from ._errors import INPUT_WRITTEN, WEIGHT_UPDATE, RecomputeError, internal_error
from ._record import NO_KWARGS, BlockRecord, Input, MetaArg, OpRecord, Ref, Var, live_value
from ._subclass import data_storage_id, storage_freed
from ._torch_compat import overload_kernel, without_autocast

__all__ = [
    "Instr",
    "Derived",
    "op_refs",
    "compile_op",
    "closure",
    "replay",
    "same_values",
    "add_freed_storage_handler",
]

Tensor = torch.Tensor
H = TypeVar("H")  # whoever holds a kept value (a pending handle)
Key = tuple[Var, int]  # a value: (var, number of its group's writes applied)

_freed_storage_handlers: list[Callable[[Tensor], bool]] = []


def add_freed_storage_handler(fn: Callable[[Tensor], bool]) -> None:
    """Register ``fn(tensor) -> bool``, asked (in order) to bring back the freed
    storage of an outside tensor a replay is about to read; True if it did."""
    _freed_storage_handlers.append(fn)


def _freed(t: Tensor) -> bool:
    return any(fn(t) for fn in _freed_storage_handlers)


def same_values(a: Tensor, b: Tensor) -> bool:
    """The debug comparison: bitwise on CPU, close elsewhere (kernels may differ run to run)."""
    if a.device.type == "cpu":
        return bool(torch.equal(a, b))
    return bool(torch.allclose(a, b, rtol=1e-5, atol=1e-8, equal_nan=True))


def _input_value(r: Input, func: Any) -> Tensor:
    """An outside tensor's value as the block read it (P6), or a RecomputeError."""
    t = r.tensor
    if r.snapshot:
        return t.clone(memory_format=torch.preserve_format)  # replay writes into a copy (R1)
    if storage_freed(t) and not _freed(t):
        raise RecomputeError(
            f"gradient_scope: cannot recompute the output of {func}: its input tensor of shape "
            f"{list(t.shape)} ({t.dtype}), read from outside the recompute_scope, has had its "
            "storage freed since forward, and it belongs to no FSDP2 parameter group (those are "
            "gathered again for a replay). Likely cause: code that frees storages by hand "
            "(`untyped_storage().resize_(0)`) or a sharding/offloading framework other than FSDP2. "
            "Fix: do not free storages a block read until backward has run, or keep this op out "
            "of the recompute_scope."
        )
    if t._version != r.version:
        src = r.source()  # a parameter (or another leaf that requires grad): a weight update
        weight = src is not None and (isinstance(src, torch.nn.Parameter) or (src.is_leaf and src.requires_grad))
        raise RecomputeError(
            f"gradient_scope: cannot recompute the output of {func}: its input "
            f"{'parameter' if weight else 'tensor'} of shape {list(t.shape)} ({t.dtype}), read from "
            f"outside the recompute_scope, was modified in place after the block (version "
            f"{r.version} -> {t._version}) and before backward. " + (WEIGHT_UPDATE if weight else INPUT_WRITTEN)
        )
    src = r.source()
    if src is not None and t.layout == torch.strided and data_storage_id(src) != data_storage_id(t):
        raise RecomputeError(
            f"gradient_scope: cannot recompute the output of {func}: its input tensor of shape "
            f"{list(t.shape)} ({t.dtype}), read from outside the recompute_scope, was given another "
            "storage after the block (`tensor.data = ...` or `set_()`). Likely cause: weights "
            "loaded, tied or converted by assigning `.data` between forward and backward. Fix: "
            "replace the data of tensors a block read only after backward has run."
        )
    return t


def _check(func: Any, var: Var, value: Any, debug_values: dict[Var, Tensor]) -> None:
    """P5: a replayed output must look like forward's."""
    if not isinstance(value, Tensor):
        raise RecomputeError(
            f"gradient_scope: replaying {func} returned {type(value).__name__} where forward "
            f"produced a {var.describe()}. Likely cause: the op's result depends on more than its "
            "arguments (a custom op reading global state). Fix: keep its output with save=[...] "
            "or move it out of the recompute_scope."
        )
    shape_ok = var.size is None or value.shape == var.size
    if not shape_ok or value.dtype != var.dtype or value.device != var.device:
        raise RecomputeError(
            f"gradient_scope: replaying {func} produced a tensor of shape {list(value.shape)} "
            f"({value.dtype}, {value.device}) where forward produced a {var.describe()}. Likely "
            "cause: the op's result depends on more than its arguments (a custom op reading "
            "global state, a data-dependent output shape). Fix: keep its output with save=[...] "
            "or move it out of the recompute_scope."
        )
    ref = debug_values.get(var) if debug_values else None
    if ref is not None and not same_values(value, ref):
        raise RecomputeError(
            f"gradient_scope (debug): replaying {func} gave different values for a "
            f"{var.describe()} than forward did. Likely cause: the op is not deterministic, or "
            "it read state that changed without a version bump (`.data`, a NumPy array, "
            "untyped_storage()). Fix: keep its output with save=[...] or move it out of the "
            "recompute_scope."
        )


def op_refs(rec: OpRecord) -> tuple[Ref, ...]:
    """The Vars and Inputs an op record reads (in argument order)."""
    out: list[Ref] = []
    for a in (*rec.args, *rec.kwargs.values()):
        if type(a) is Var or type(a) is Input:
            out.append(a)
        elif type(a) is list:
            out.extend(x for x in a if type(x) is Var or type(x) is Input)
    return tuple(out)


#: An op compiled for replay: ``(op, func, template args, (position, ref id) slots,
#: other slots or None, kwargs template or None, rng, ((output index, Var), ...))``.
Instr = tuple[Any, Any, list[Any], tuple[tuple[int, int], ...], Any, Any, Any, tuple[tuple[int, Var], ...]]


def compile_op(rec: OpRecord) -> Instr:
    """``rec`` as an instruction: what varies between replays is looked up by slot."""
    func, rargs, rkwargs, rng, outs = rec
    tmpl = list(rargs)
    slots: list[tuple[int, int]] = []
    other: list[tuple[int, Any]] = []  # MetaArgs and Tensor[] arguments
    for pos, a in enumerate(rargs):
        if type(a) is Var or type(a) is Input:
            slots.append((pos, id(a)))
            tmpl[pos] = None
        elif type(a) is MetaArg or type(a) is list:
            other.append((pos, a))
    outputs = tuple((k, v) for k, v in enumerate(outs) if v is not None)
    return (overload_kernel(func), func, tmpl, tuple(slots), tuple(other) or None, rkwargs or None, rng, outputs)


def _value(a: Any, env: dict[int, Any]) -> Any:
    if type(a) is Var or type(a) is Input:
        return env[id(a)]
    if type(a) is MetaArg:
        return a.empty()
    if type(a) is list:
        return [env[id(x)] if type(x) is Var or type(x) is Input else x for x in a]
    return a


def closure(
    refs: Sequence[tuple[Ref, ...]], var: Var, bound: int, available: Callable[[Var], bool] | None
) -> list[int]:
    """The ops needed to rebuild ``var`` as it is before op ``bound``, sorted.

    ``refs[i]`` is ``op_refs`` of op ``i``. A Var for which ``available`` is true
    (its value is in a cache or alive, and its group was never written to) is
    not rebuilt.
    """
    need = bytearray(bound)
    need[var.op] = 1
    for j, _ in var.root.writes:
        if j >= bound:
            break
        need[j] = 1
    # Hot loop (every replay of a record's first request): the group root is read
    # from ``base`` inline rather than through the ``root`` property.
    for i in range(bound - 1, -1, -1):
        if not need[i]:
            continue
        for r in refs[i]:
            if type(r) is Var:
                base = r.base
                writes = r.writes if base is None else base.writes
                if writes or available is None or not available(r):
                    need[r.op] = 1
            else:  # an Input: its own root
                writes = r.writes
            for j, _ in writes:
                if j >= i:
                    break
                need[j] = 1
    return [i for i in range(bound) if need[i]]


class Derived:
    """What replay derives from a block's record: each op's refs and compiled form,
    and what replaying each Var may read. Kept once the record is closed (its op
    list no longer changes)."""

    __slots__ = ("refs", "code", "reads")

    def __init__(self) -> None:
        self.refs: list[tuple[Ref, ...]] | None = None
        self.code: list[Instr | None] | None = None
        self.reads: dict[Var, tuple[tuple[int, Var], ...]] = {}

    def op_refs(self, record: BlockRecord) -> list[tuple[Ref, ...]]:
        if record.open:
            return [op_refs(rec) for rec in record.ops]
        if self.refs is None:
            self.refs = [op_refs(rec) for rec in record.ops]
        return self.refs

    def compiled(self, record: BlockRecord, plan: list[int]) -> list[Instr]:
        """The compiled form of (at least) the ops of ``plan``."""
        ops = record.ops
        if record.open:
            code: list[Any] = [None] * len(ops)
        else:
            if self.code is None:
                self.code = [None] * len(ops)
            code = self.code
        for i in plan:
            if code[i] is None:
                code[i] = compile_op(ops[i])
        return code

    def reads_of(self, record: BlockRecord, refs: Sequence[tuple[Ref, ...]], var: Var) -> Sequence[tuple[int, Var]]:
        """``(i, r)`` for each op ``i`` of the ``closure`` of ``var`` (at the end of
        the record) and each Var ``r`` it reads whose group is never written to:
        the values a replay of ``var`` may read. Memoised once the record is closed."""
        if not record.open:
            pairs = self.reads.get(var)
            if pairs is not None:
                return pairs
        found: list[tuple[int, Var]] = []
        for i in closure(refs, var, len(record.ops), None):
            for r in refs[i]:
                if type(r) is Var and not r.root.writes:
                    found.append((i, r))
        pairs = tuple(found)
        if not record.open:
            self.reads[var] = pairs
        return pairs


def replay(
    record: BlockRecord, derived: Derived, target: Var, cache: dict[Key, Tensor], wanted: Sequence[tuple[Var, H]]
) -> tuple[Tensor, list[tuple[H, Key, Tensor]]]:
    """Rebuild ``target`` (P1): values in ``cache`` or alive are not rebuilt.
    ``wanted`` lists the values other pending handles of the pass will ask for
    (P4); returns the value and ``(holder, key, value)`` for each wanted value this
    replay made on the way: what the pass keeps."""

    def available(r: Var) -> bool:
        return (r, 0) in cache or live_value(r) is not None

    refs = derived.op_refs(record)
    plan = closure(refs, target, len(record.ops), available)
    code = derived.compiled(record, plan)
    targets, frontier = _kept(derived, record, refs, wanted, plan)
    env, drops = _load_env(record, refs, plan, target, cache)
    value, produced = _run(record, code, plan, target, env, drops, targets.keys() | frontier.keys())
    holds: list[tuple[H, Key, Tensor]] = []
    for n, v in produced.items():
        k = len(n.root.writes)
        holds.extend((h, (n, k), v) for h in targets.get(n, ()))
        if not k:
            holds.extend((h, (n, 0), v) for h in frontier.get(n, ()))
    return value, holds


def _kept(
    derived: Derived,
    record: BlockRecord,
    refs: Sequence[tuple[Ref, ...]],
    wanted: Sequence[tuple[Var, H]],
    plan: list[int],
) -> tuple[dict[Var, list[H]], dict[Var, list[H]]]:
    """Which values of ``plan`` to keep for ``wanted`` (P4): the wanted values it
    makes (targets), and the values the wanted values' own replays would read
    (frontier)."""
    targets: dict[Var, list[H]] = {}
    frontier: dict[Var, list[H]] = {}
    if not wanted:
        return targets, frontier
    in_plan = set(plan)
    for n2, h2 in wanted:
        if n2.op in in_plan:
            targets.setdefault(n2, []).append(h2)
            continue
        for i, r in derived.reads_of(record, refs, n2):
            if r.op in in_plan and i not in in_plan:
                frontier.setdefault(r, []).append(h2)
    return targets, frontier


def _load_env(
    record: BlockRecord, refs: Sequence[tuple[Ref, ...]], plan: list[int], target: Var, cache: dict[Key, Tensor]
) -> tuple[dict[int, Any], dict[int, list[int]]]:
    """Before running: the values the plan reads from outside it (Inputs, cached or
    live values), by ref id, with a slot for each value it makes and reads later;
    and after which op each value is read for the last time (to drop it then)."""
    ops = record.ops
    env: dict[int, Any] = {}
    made: set[int] = set()
    last_use: dict[int, int] = {}
    for i in plan:
        for r in refs[i]:
            rid = id(r)
            last_use[rid] = i
            if rid not in made and rid not in env:
                env[rid] = _load(r, ops[i].func, cache)
        for out_var in ops[i].outs:
            if out_var is not None:
                made.add(id(out_var))
    drops: dict[int, list[int]] = {}
    for rid, i in last_use.items():
        env.setdefault(rid, None)  # made by the plan: filled when made
        if rid != id(target):
            drops.setdefault(i, []).append(rid)
    return env, drops


def _run(
    record: BlockRecord,
    code: Sequence[Instr],
    plan: list[int],
    target: Var,
    env: dict[int, Any],
    drops: dict[int, list[int]],
    keep: Collection[Var],
) -> tuple[Tensor, dict[Var, Tensor]]:
    """Run ``plan``; return ``target``'s value and the values of ``keep`` vars (as
    they stand at the end, for groups written to). Values with a slot in ``env``
    are stored there until their last reader has run."""
    debug_values = record.debug_values
    produced: dict[Var, Tensor] = {}
    result: Tensor | None = None
    with without_autocast():
        for i in plan:
            op, func, tmpl, slots, other, kw, rng, outputs = code[i]
            args = tmpl.copy()
            for pos, rid in slots:
                args[pos] = env[rid]
            if other is not None:
                for pos, a in other:
                    args[pos] = _value(a, env)
            kwargs = {k: _value(a, env) for k, a in kw.items()} if kw is not None else NO_KWARGS
            try:
                out = _rng.replay_with_state(rng, func, args, kwargs) if rng is not None else op(*args, **kwargs)
            except RecomputeError:
                raise
            except Exception as e:
                raise RecomputeError(f"gradient_scope: replaying {func} failed during backward: {e}. {_FAILED}") from e
            del args, kwargs
            for k, var in outputs:
                v = out if k == 0 and isinstance(out, Tensor) else out[k]
                if (
                    type(v) is not Tensor
                    or v.dtype != var.dtype
                    or (var.size is not None and v.shape != var.size)
                    or v.device != var.device
                    or debug_values
                ):
                    _check(func, var, v, debug_values)
                if var is target:
                    result = v
                if id(var) in env:
                    env[id(var)] = v
                if var in keep:
                    produced[var] = v
            if i in drops:
                for rid in drops[i]:
                    env.pop(rid, None)
    stats = target.frame.stats
    stats.replays += 1
    stats.ops_replayed += len(plan)
    if result is None:
        internal_error(f"replay did not produce the {target.describe()}")
    return result, produced


_FAILED = (
    "Likely cause: something the op depends on changed between forward and backward without the "
    "block seeing it, or the op cannot run twice. Fix: keep its output with save=[...] or move it "
    "out of the recompute_scope."
)


def _load(r: Ref, func: Any, cache: dict[Key, Tensor]) -> Tensor:
    """The value of a ref a plan reads but does not make."""
    if isinstance(r, Input):
        return _input_value(r, func)
    v = cache.get((r, 0)) if not r.root.writes else None
    if v is None:
        t = live_value(r)
        if t is None:
            internal_error(f"no value for a {r.describe()} needed by {func}")
        v = t.detach()
    return v
