"""Restore, the replay itself: which recorded ops of a block rebuild a value, which
values to keep for the rest of the backward pass, and running them (``_restore.handles``
P1 [ only the closure runs ], P4 [ each op at most once per pass ],
P5 [ replayed outputs are checked ], P6 [ outside tensors must be unchanged ]).

A plan is a sorted list of op indices. Every argument of a recorded op was made
by an earlier op, so the closure is found in one pass over the ops, from the
last one down. Running a plan drops each intermediate value as soon as no later
op of the plan reads it, except the values the other pending handles of the
pass will ask for (P4 [ each op at most once per pass ]): those it returns, each with the handle
that will ask. Plans, and when each value is dropped, are worked out once per record structure
(``_restore.structure``): every layer and every step with the same structure shares them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from .._base import rng as _rng
from .._base.errors import INPUT_WRITTEN, WEIGHT_UPDATE, RecomputeError, internal_error
from .._base.stats import ScopeStats
from .._base.subclass import data_storage_id, storage_freed
from .._base.torch_compat import NumericContext, numeric_context, set_numeric_context, storage_id, without_autocast
from .._record.types import BlockRecord, Input, OpRecord, Ref, Var, live_value
from .codegen import compiled, failed
from .structure import Fill, Program, Slots, Structure, structure_of

__all__ = ["Derived", "op_refs", "replay", "same_values", "add_freed_storage_handler", "restore_freed"]

Tensor = torch.Tensor
H = TypeVar("H")  # whoever holds a kept value (a pending handle)
Key = tuple[Var, int]  # a value: (var, number of its group's writes applied)

_freed_storage_handlers: list[Callable[[Tensor], bool]] = []


def add_freed_storage_handler(fn: Callable[[Tensor], bool]) -> Callable[[], None]:
    """Register ``fn(tensor) -> bool``, asked (in order) to bring back the freed
    storage of an outside tensor a replay is about to read; True if it did. Returns a
    function that removes it."""
    _freed_storage_handlers.append(fn)

    def remove() -> None:
        if fn in _freed_storage_handlers:
            _freed_storage_handlers.remove(fn)

    return remove


def restore_freed(t: Tensor) -> bool:
    """Ask the freed-storage handlers to bring ``t``'s storage back; True if one did
    (P6 [ outside tensors must be unchanged ])."""
    return any(fn(t) for fn in _freed_storage_handlers)


def same_values(a: Tensor, b: Tensor) -> bool:
    """The debug comparison: bitwise on CPU, close elsewhere (kernels may differ run to run)."""
    if a.device.type == "cpu":
        return bool(torch.equal(a, b))
    return bool(torch.allclose(a, b, rtol=1e-5, atol=1e-8, equal_nan=True))


def _same_storage(r: Input, src: Tensor) -> bool:
    """Whether ``src`` still has the storage the block read it with
    (P6 [ outside tensors must be unchanged ])."""
    if r.storage is not None:  # a wrapper whose alias has its own placeholder storage
        return storage_id(src) == r.storage._cdata  # type: ignore[no-any-return]
    return data_storage_id(src) == data_storage_id(r.tensor)


def _input_value(r: Input, func: Any) -> Tensor:
    """An outside tensor's value as the block read it
    (P6 [ outside tensors must be unchanged ]), or a RecomputeError."""
    t = r.tensor
    if r.snapshot:
        # replay writes into a copy (R1 [ a written input is copied ])
        return t.clone(memory_format=torch.preserve_format)
    if storage_freed(t) and not restore_freed(t):
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
    if src is not None and t.layout == torch.strided and not _same_storage(r, src):
        raise RecomputeError(
            f"gradient_scope: cannot recompute the output of {func}: its input tensor of shape "
            f"{list(t.shape)} ({t.dtype}), read from outside the recompute_scope, was given another "
            "storage after the block (`tensor.data = ...` or `set_()`). Likely cause: weights "
            "loaded, tied or converted by assigning `.data` between forward and backward. Fix: "
            "replace the data of tensors a block read only after backward has run."
        )
    return t


def _check(func: Any, var: Var, value: Any, debug_values: dict[Var, Tensor]) -> None:
    """P5 [ replayed outputs are checked ]: a replayed output must look like forward's."""
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


class Derived:
    """What replay derives from one block's record: its structure (shared with every
    record of the same signature) and its slots. Kept once the record is closed (its
    op list no longer changes)."""

    __slots__ = ("structure", "slots")

    def __init__(self) -> None:
        self.structure: Structure | None = None
        self.slots: Slots | None = None

    def of(self, record: BlockRecord) -> tuple[Structure, Slots]:
        if record.open:
            return structure_of(record)
        if self.structure is None or self.slots is None:
            self.structure, self.slots = structure_of(record)
        return self.structure, self.slots


def replay(
    record: BlockRecord,
    derived: Derived,
    target: Var,
    cache: dict[Key, Tensor],
    wanted: Sequence[tuple[Var, H]],
    stats: ScopeStats,
    live: bool = True,
) -> tuple[Tensor, list[tuple[H, Key, Tensor]]]:
    """Rebuild ``target`` (P1 [ only the closure runs ]): values in ``cache``, or alive where
    ``live`` (else P11 [ a replay that communicates reads no liveness ]), are not
    rebuilt. ``wanted`` lists the values other pending handles of the pass will ask for
    (P4 [ each op at most once per pass ]); returns the value and ``(holder, key, value)`` for
    each wanted value this replay made on the way: what the pass keeps. The pass is counted in
    ``stats``."""
    st, slots = derived.of(record)
    refs, of = slots.refs, slots.of

    # P3 [ values in memory are used ]: each value the plan reads as alive is held until the replay
    # has run. An outside holder in a reference cycle (a KV cache) may die in a collection any
    # allocation starts, between the plan and the load: the plan would not rebuild the value.
    alive: list[Tensor] = []

    def available(s: int) -> bool:
        r = refs[s]  # a Var: a weak reference to its tensor, dead for most values in backward
        if (r, 0) in cache:
            return True
        if not live:
            return False
        v = live_value(r) if r() is not None else None  # type: ignore[arg-type,operator]
        if v is not None:
            alive.append(v)
        return v is not None

    t = of[id(target)]
    program = st.program(st.closure(t, available), t, tuple(of[id(n)] for n, _ in wanted))
    starts = tuple(i for i, _ in record.contexts)
    code = compiled(st, program, starts, bool(record.debug_values), _RUNTIME)
    with without_autocast(), _Contexts(record.contexts) as contexts:
        if code is None:
            value, produced = _run(record, st, slots, program, t, cache, contexts)
        else:
            value, produced = code(record.ops, slots.refs, cache, contexts, record.debug_values)
    stats.replays += 1
    stats.ops_replayed += len(program.plan)
    holds: list[tuple[H, Key, Tensor]] = []
    for s, v in produced.items():
        n = refs[s]
        k = len(st.group_writes[s])
        holds.extend((wanted[w][1], (n, k), v) for w in program.targets.get(s, ()))  # type: ignore[misc]
        if not k:
            holds.extend((wanted[w][1], (n, 0), v) for w in program.frontier.get(s, ()))  # type: ignore[misc]
    return value, holds


def _arguments(rec: OpRecord, fills: tuple[Fill, ...], env: list[Any]) -> tuple[list[Any], dict[str, Any]]:
    """The arguments of one replayed op: the record's, with each ref's value filled in."""
    rargs, rkwargs = rec.args, rec.kwargs
    args = rargs.copy()
    kwargs = rkwargs
    for where, how in fills:
        if type(how) is int:
            v = env[how]
        else:
            a = rargs[where] if type(where) is int else rkwargs[where]
            v = a.empty() if how is None else [env[s] if s >= 0 else x for s, x in zip(how, a)]
        if type(where) is int:
            args[where] = v
        else:
            if kwargs is rkwargs:
                kwargs = dict(rkwargs)
            kwargs[where] = v
    return args, kwargs


def _run(
    record: BlockRecord,
    st: Structure,
    slots: Slots,
    program: Program,
    t: int,
    cache: dict[Key, Tensor],
    contexts: _Contexts,
) -> tuple[Tensor, dict[int, Tensor]]:
    """Run ``program`` (the interpreter; ``contexts`` entered by the caller); return
    ``target``'s value and the values of its kept slots (as they stand at the end, for
    groups written to). A value is held in the environment only until its last reader
    has run."""
    ops, refs, fills, positional, meta = record.ops, slots.refs, st.fills, st.positional, st.meta
    kernels, keep = st.kernels, program.keep
    env: list[Any] = [None] * len(refs)
    # what the plan reads but does not make (P3 [ values in memory are used ],
    # P6 [ outside tensors must be unchanged ])
    for s, i in program.loads:
        env[s] = _load(refs[s], ops[i].func, cache)
    debug_values = record.debug_values
    produced: dict[int, Tensor] = {}
    result: Tensor | None = None
    for i, outputs, frees in program.steps:
        contexts.at(i)
        rec = ops[i]
        func, rng = rec.func, rec.rng
        simple = positional[i]
        if simple is not None:
            args, kwargs = rec.args.copy(), rec.kwargs
            for pos, s in simple:
                args[pos] = env[s]
        else:
            args, kwargs = _arguments(rec, fills[i], env)
        try:
            if rng is None:
                out = kernels[i](*args, **kwargs)
            else:
                out = _rng.replay_with_state(rng, func, args, kwargs)
        except RecomputeError:
            raise
        except Exception as e:
            raise failed(func, e) from e
        del args, kwargs
        for k, s, store in outputs:
            v = out if k == 0 and isinstance(out, Tensor) else out[k]
            size, dtype, device = meta[s]
            if (
                type(v) is not Tensor
                or v.dtype != dtype
                or (size is not None and v.shape != size)
                or v.device != device
                or debug_values
            ):
                _check(func, refs[s], v, debug_values)  # type: ignore[arg-type]
            if s == t:
                result = v
            if store:
                env[s] = v
            if s in keep:
                produced[s] = v
        for s in frees:
            env[s] = None
    if result is None:
        internal_error(f"replay did not produce the value of slot {t}")
    return result, produced


class _Contexts:
    """R9 [ each op's numeric context ] (``_record.entry``) at replay: each op runs under the
    numeric context it was recorded in; the ambient context is restored on exit, also when
    replay raises."""

    __slots__ = ("contexts", "j", "ambient", "current")

    def __init__(self, contexts: list[tuple[int, NumericContext]]) -> None:
        self.contexts = contexts
        self.j = 0

    def __enter__(self) -> _Contexts:
        self.ambient = self.current = numeric_context()
        return self

    def at(self, i: int) -> None:
        """Enter the context of op ``i`` (ops come in increasing order)."""
        cs, j = self.contexts, self.j
        while j + 1 < len(cs) and cs[j + 1][0] <= i:
            j += 1
        self.j = j
        ctx = cs[j][1] if cs else self.ambient
        if ctx is not self.current:
            if ctx != self.current:
                set_numeric_context(ctx)
            self.current = ctx

    def __exit__(self, *exc: object) -> None:
        if self.current is not self.ambient and self.current != self.ambient:
            set_numeric_context(self.ambient)


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


#: What compiled programs call (``_restore.codegen``): the interpreter's own helpers.
_RUNTIME: dict[str, Any] = {"load": _load, "check": _check, "rng": _rng.replay_with_state}
