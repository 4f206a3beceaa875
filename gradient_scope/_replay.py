"""Replay: recompute the value a handle stands for from a block's record.

Only the recorded ops in the dependency closure of the requested value run,
in recorded order, below autograd and with autocast switched off (the record
is already below autocast, so it holds the casts forward made). Each random op
runs with the generator state it had in forward, inside a fork that restores
the ambient state. Intermediates are dropped as soon as nothing in the replay
needs them.

Within one backward pass (one graph task) each op runs at most once: values
that other still-packed handles of the block depend on are cached until those
handles are served, and the cache is dropped when the pass ends.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from . import _rng
from ._errors import RecomputeError
from ._record import ExternalRef, MetaRef, Node, Region
from ._registry import live_tensor, thread_state

if TYPE_CHECKING:
    from ._saving import Handle

__all__ = ["materialize"]

_AUTOCAST_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)
for _k in ("AutocastCUDA", "AutocastXPU", "AutocastMPS", "AutocastHPU", "AutocastPrivateUse1"):
    if hasattr(torch._C.DispatchKey, _k):
        _AUTOCAST_KEYS = _AUTOCAST_KEYS | torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, _k))


def _op_name(func: Any) -> str:
    return str(func)


def _refs_of(args: Any) -> Iterator[Node | ExternalRef]:
    for a in args:
        if isinstance(a, (Node, ExternalRef)):
            yield a
        elif isinstance(a, list):
            for x in a:
                if isinstance(x, (Node, ExternalRef)):
                    yield x


def _inputs(rec: Any) -> Iterator[Node | ExternalRef]:
    yield from _refs_of(rec.args)
    if rec.kwargs:
        yield from _refs_of(rec.kwargs.values())


def _closure(region: Region, node: Node, bound: int, available: Any = None) -> set[int]:
    """Indices of the ops needed to rebuild ``node`` as it was before op ``bound``."""
    ops = region.ops
    need: set[int] = set()
    seen: set[tuple[int, int]] = set()
    stack: list[tuple[Node | ExternalRef, int]] = [(node, bound)]

    def add(i: int) -> None:
        if i not in need:
            need.add(i)
            for r in _inputs(ops[i]):
                stack.append((r, i))

    while stack:
        n, t = stack.pop()
        key = (id(n), t)
        if key in seen:
            continue
        seen.add(key)
        if isinstance(n, ExternalRef):
            group: Node | ExternalRef = n
        else:
            group = n.root
            if available is not None and not group.mutations and available(n):
                continue
            add(n.op)
        for j, _pre in group.mutations:
            if j >= t:
                break
            add(j)
    return need


def _applied(root: Node | ExternalRef, bound: int) -> int:
    """How many of a storage group's recorded writes come before op ``bound``."""
    k = 0
    for j, _pre in root.mutations:
        if j >= bound:
            break
        k += 1
    return k


class _Pass:
    """Replay state of one block within one backward pass.

    ``cache`` holds values that still-packed handles will ask for: their own
    values (keyed by node and number of writes applied to its storage group)
    and the values their remaining replay reads (the frontier). ``holds`` says
    which cache entries each pending handle keeps; an entry is dropped when
    no pending handle keeps it.
    """

    def __init__(self, region: Region, task: int) -> None:
        self.task = task
        self.cache: dict[tuple[Node, int], torch.Tensor] = {}
        self.refs: dict[tuple[Node, int], int] = {}
        self.holds: dict[Any, list[tuple[Node, int]]] = {}
        self.pending: set[Any] = set(region.handles or ())

    def hold(self, h: Handle, key: tuple[Node, int]) -> None:
        self.holds.setdefault(h, []).append(key)
        self.refs[key] = self.refs.get(key, 0) + 1

    def serve(self, h: Handle) -> None:
        self.pending.discard(h)
        for key in self.holds.pop(h, ()):
            c = self.refs[key] - 1
            if c:
                self.refs[key] = c
            else:
                del self.refs[key]
                self.cache.pop(key, None)


def _memo_closure(region: Region, node: Node, bound: int) -> set[int] | frozenset[int]:
    if region.open:
        return _closure(region, node, bound)
    key = (node, bound)
    ops = region.closures.get(key)
    if ops is None:
        ops = region.closures[key] = frozenset(_closure(region, node, bound))
    return ops


def _end_pass(region: Region, task: int) -> None:
    with region.lock:
        ps = region.pass_state
        if ps is not None and ps.task == task:
            region.pass_state = None


def materialize(h: Handle) -> torch.Tensor:
    node = h.node
    state = thread_state()
    state.bypass += 1  # nothing below is to be recorded by an open block
    try:
        with torch.no_grad():
            t = live_tensor(node)
            if t is None or t._version != h.version:
                t = _replay(h.region, h)
            else:
                t = t.detach()
            if h.view is not None:
                size, stride, offset = h.view
                t = t.as_strided(size, stride, t.storage_offset() + offset)
            return t
    finally:
        state.bypass -= 1


def _replay(region: Region, h: Handle) -> torch.Tensor:
    with region.lock:
        task = torch._C._current_graph_task_id()
        ps: _Pass | None = None
        if task != -1:
            ps = region.pass_state
            if ps is None or ps.task != task:
                ps = region.pass_state = _Pass(region, task)
                torch.autograd.Variable._execution_engine.queue_callback(
                    lambda: _end_pass(region, task)
                )
        node = h.node
        key = (node, _applied(node.root, h.bound))
        if ps is not None:
            cached = ps.cache.get(key)
            if cached is not None:
                ps.serve(h)
                return cached
        cache = ps.cache if ps is not None else {}

        def available(n: Node) -> bool:
            if not n.root.mutations and (n, 0) in cache:
                return True
            t = live_tensor(n)
            return t is not None and t._version == n.version and not n.root.mutations

        plan = sorted(_closure(region, node, h.bound, available))
        if ps is None:
            return _run(region, plan, node, cache, {}, {})
        # What the other pending handles will ask for: their own values if this
        # replay makes them, and the values of this replay that their own
        # replays would read.
        plan_set = set(plan)
        targets: dict[Node, list[Handle]] = {}
        frontier: dict[Node, list[Handle]] = {}
        ops = region.ops
        for h2 in ps.pending:
            if h2 is h:
                continue
            n2 = h2.node
            key2 = (n2, _applied(n2.root, h2.bound))
            if key2 in cache:
                continue
            if n2.op in plan_set:
                targets.setdefault(n2, []).append(h2)
                continue
            for i in _memo_closure(region, n2, h2.bound):
                if i in plan_set:
                    continue
                for r in _inputs(ops[i]):
                    if isinstance(r, Node) and r.op in plan_set and not r.root.mutations:
                        frontier.setdefault(r, []).append(h2)
        produced: dict[Node, torch.Tensor] = {}
        value = _run(region, plan, node, cache, targets.keys() | frontier.keys(), produced)
        ps.serve(h)
        for n, v in produced.items():
            k = 0
            for j, _pre in n.root.mutations:
                if j in plan_set:
                    k += 1
            for h2 in targets.get(n, ()):
                if _applied(n.root, h2.bound) == k:
                    ps.hold(h2, (n, k))
                    cache[(n, k)] = v
            if not n.root.mutations:
                for h2 in frontier.get(n, ()):
                    ps.hold(h2, (n, 0))
                    cache[(n, 0)] = v
        return value


def _check(region: Region, func: Any, node: Node, value: Any) -> None:
    if not isinstance(value, torch.Tensor):
        raise RecomputeError(
            f"gradient_scope: replaying {_op_name(func)} returned {type(value).__name__} "
            f"where forward produced a {node.describe()}."
        )
    if value.shape != node.size or value.dtype != node.dtype or value.device != node.device:
        raise RecomputeError(
            f"gradient_scope: replaying {_op_name(func)} produced a tensor of shape "
            f"{list(value.shape)} ({value.dtype}, {value.device}) where forward produced a "
            f"{node.describe()}. The op does not replay faithfully; keep its output with "
            "save=[...] or move it out of the recompute_scope."
        )
    ref = region.debug_values.get(node) if region.debug_values else None
    if ref is not None:
        same = (
            torch.equal(value, ref)
            if value.device.type == "cpu"
            else torch.allclose(value, ref, rtol=1e-5, atol=1e-8, equal_nan=True)
        )
        if not same:
            raise RecomputeError(
                f"gradient_scope (debug): replaying {_op_name(func)} gave different values "
                f"for a {node.describe()} than forward did. The op is not deterministic or "
                "read state that changed; keep its output with save=[...] or move it out "
                "of the recompute_scope."
            )


def _run(
    region: Region,
    plan: list[int],
    target: Node,
    cache: dict[tuple[Node, int], torch.Tensor],
    keep: Any,
    produced: dict[Node, torch.Tensor],
) -> torch.Tensor:
    """Run ``plan``; return ``target``'s value and put the values of ``keep`` nodes
    (as they stand at the end, for groups written to) into ``produced``."""
    ops = region.ops
    last_use: dict[int, int] = {}
    for i in plan:
        for r in _inputs(ops[i]):
            last_use[id(r)] = i
    env: dict[int, torch.Tensor] = {}

    def value_of(r: Node | ExternalRef, func: Any) -> torch.Tensor:
        v = env.get(id(r))
        if v is not None:
            return v
        if isinstance(r, ExternalRef):
            if r.snapshot:
                v = env[id(r)] = r.tensor.clone(memory_format=torch.preserve_format)
                return v
            t = r.tensor
            if t.untyped_storage().nbytes() == 0 and t.numel() > 0:
                raise RecomputeError(
                    f"gradient_scope: cannot recompute the output of {_op_name(func)}: its "
                    f"input tensor of shape {list(t.shape)} ({t.dtype}), read from outside "
                    "the recompute_scope, has had its storage freed since forward (FSDP2 "
                    "frees unsharded parameters after forward). Put the recompute_scope "
                    "around code that does not read such parameters (e.g. activations "
                    "only), use fully_shard(..., reshard_after_forward=False), or use "
                    "torch.utils.checkpoint for that module."
                )
            if t._version != r.version:
                raise RecomputeError(
                    f"gradient_scope: cannot recompute the output of {_op_name(func)}: its "
                    f"input tensor of shape {list(t.shape)} ({t.dtype}), read from outside "
                    f"the recompute_scope, was modified in place after the block (version "
                    f"{r.version} -> {t._version}) and before backward. Do not modify tensors "
                    "a block read until backward has run, or pass a clone into the block."
                )
            return t
        v = cache.get((r, 0)) if not r.root.mutations else None
        if v is None:
            live = live_tensor(r)
            if live is None or live._version != r.version:
                raise RecomputeError(
                    f"gradient_scope: internal error: no value for a {r.describe()} needed "
                    f"by {_op_name(func)}. Please report this."
                )
            v = live.detach()
        env[id(r)] = v
        return v

    def build(args: Any, func: Any) -> Any:
        out: list[Any] = []
        for a in args:
            if isinstance(a, (Node, ExternalRef)):
                out.append(value_of(a, func))
            elif isinstance(a, MetaRef):
                out.append(a.empty())
            elif isinstance(a, list):
                out.append([value_of(x, func) if isinstance(x, (Node, ExternalRef)) else x for x in a])
            else:
                out.append(a)
        return out

    stats = target.stats
    result: torch.Tensor | None = None
    with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_KEYS):
        for i in plan:
            rec = ops[i]
            func = rec.func
            args = build(rec.args, func)
            kwargs = dict(zip(rec.kwargs, build(list(rec.kwargs.values()), func))) if rec.kwargs else {}
            try:
                if rec.rng is not None:
                    out = _rng.replay_with_state(rec.rng, func, args, kwargs)
                else:
                    out = func(*args, **kwargs)
            except RecomputeError:
                raise
            except Exception as e:
                raise RecomputeError(
                    f"gradient_scope: replaying {_op_name(func)} failed during backward: {e}"
                ) from e
            del args, kwargs
            outs = rec.outs
            if outs:
                values = (out,) if isinstance(out, torch.Tensor) else out
                for n, v in zip(outs, values):
                    if n is None:
                        continue
                    _check(region, func, n, v)
                    env[id(n)] = v
                    if n is target:
                        result = v
                    if n in keep:
                        produced[n] = v
            # Drop what no later op of this replay reads.
            for r in list(_inputs(rec)):
                if last_use.get(id(r)) == i and r is not target:
                    env.pop(id(r), None)
            for n in outs:
                if n is not None and n is not target and id(n) not in last_use:
                    env.pop(id(n), None)
    stats.replays += 1
    stats.ops_replayed += len(plan)
    if result is None:
        raise RecomputeError(
            f"gradient_scope: internal error: replay did not produce the {target.describe()}. "
            "Please report this."
        )
    return result
