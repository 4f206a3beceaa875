"""A memory budget inside compiled code: the joint-graph pass keeps (``MUST_SAVE``) the
block values the budget's planner picks, and recomputes the rest.

For each budget, the forward nodes of its scopes in one joint graph are one block: each
node's cost is its FLOPs and bytes (from the nodes' ``meta["val"]``, fake tensors) at
the device's measured rates, as an eager block's ops (``_budget.measure``); the values the
backward reads are the candidates; what the scopes' nodes read from outside them and the
backward needs for their recompute is the floor. The same closure-aware chain and
prefix choice as in eager (``_budget.planner``) picks what to keep within the budget's
bytes; no offload here.

The plan is the compiled graph's: the partitioner saves or recomputes an op, never one
output of a multi-output op, so such an op's outputs are one candidate (kept together),
and what the plan keeps is ``MUST_SAVE`` (the partitioner recomputes none of it). In a
graph whose plan recomputes something, the version check of the parameters
(``.versions``) saves one int64 per parameter checked: on a CPU device those bytes are
held with the activations, so the plan leaves room for them.

Dynamic shapes (``torch.compile(dynamic=True)``, ``mark_dynamic``, automatic dynamic
after a size change): a symbolic size is counted at its hint, the size the graph was
traced with (no guard is added: the graph stays dynamic). The plan is then the plan at
those sizes; other sizes run the same graph, whose kept tensors grow or shrink with them
(one warning says so).
"""

from __future__ import annotations

import contextlib
import operator
from typing import Any

import torch
from torch.utils.flop_counter import flop_registry

from ..._base.ops import facts
from ..._base.torch_compat import OpOverload, op_schema
from ..._budget.planner import BlockGraph, Candidate, Item, build_chain, decide
from ..._budget.rates import rates_for, seconds

__all__ = ["keep_within", "nbytes", "hint", "is_symbolic", "VERSION_BYTES"]

VERSION_BYTES = 8  # one int64 version counter per parameter checked (``.versions``)

Node = torch.fx.Node
_ALIASES = (torch.ops.aten.detach.default, torch.ops.aten.alias.default)


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, Node) else None


def hint(n: Any) -> int:
    """A size as an int: a symbolic size at its hint (the size traced), without adding
    a guard; an unbacked size with no hint counts 0."""
    if isinstance(n, int):
        return n
    if not isinstance(n, torch.SymInt):
        return 0
    from torch.fx.experimental import symbolic_shapes

    optimization_hint = getattr(symbolic_shapes, "optimization_hint", None)
    if optimization_hint is not None:
        with contextlib.suppress(Exception):
            return int(optimization_hint(n, fallback=0))
    found = getattr(n.node, "hint", None)
    return found if isinstance(found, int) else 0


def is_symbolic(val: Any) -> bool:
    """Whether a node's value has a symbolic size."""
    if isinstance(val, (tuple, list)):
        return any(is_symbolic(v) for v in val)
    return isinstance(val, torch.Tensor) and not all(isinstance(d, int) for d in val.shape)


def nbytes(val: Any) -> int:
    """The bytes of a node's value (at the hints of symbolic sizes); 0 for a non-tensor."""
    if not isinstance(val, torch.Tensor):
        return 0
    return hint(val.numel()) * val.element_size()


def _hinted(val: Any) -> Any:
    return torch.Size([hint(d) for d in val.shape]) if isinstance(val, torch.Tensor) else val


def _shape(a: Any) -> Any:
    v = _val(a)
    if isinstance(v, torch.Tensor):
        return _hinted(v)
    if isinstance(a, (list, tuple)):
        return [_shape(x) for x in a]
    return hint(a) if isinstance(a, torch.SymInt) else a


def _is_view(node: Node) -> bool:
    schema = op_schema(node.target)
    if schema is None or not schema.returns:
        return False
    alias = schema.returns[0].alias_info
    return alias is not None and not alias.is_write


def _work(node: Node) -> tuple[float, float]:
    """``(FLOPs, bytes moved)`` of one node, as ``_budget.measure.op_work`` for a record."""
    if node.target is operator.getitem or not isinstance(node.target, OpOverload):
        return 0.0, 0.0
    flops = 0.0
    formula = flop_registry.get(getattr(node.target, "overloadpacket", None))
    if formula is not None:
        try:
            out = _val(node)  # (shapes at their hints: a symbolic FLOP count would add a guard)
            out_val = tuple(map(_hinted, out)) if isinstance(out, (tuple, list)) else _hinted(out)
            flops = float(formula(*[_shape(a) for a in node.args], out_val=out_val,
                                  **{k: _shape(a) for k, a in node.kwargs.items()}))  # fmt: skip
        except Exception:  # noqa: BLE001  (a formula that cannot read this call: bytes only)
            flops = 0.0
    if _is_view(node):
        return flops, 0.0
    moved = sum(nbytes(_val(a)) for a in node.all_input_nodes) + nbytes(_val(node))
    return flops, float(moved)


def _needed_by(node: Node, backward: set[Node]) -> bool:
    """Whether the backward reads ``node``'s value, directly or through views of it."""
    stack, seen = list(node.users), set()
    while stack:
        u = stack.pop()
        if u in seen:
            continue
        seen.add(u)
        if u in backward:
            return True
        if u.target in _ALIASES or u.target is operator.getitem or (isinstance(u.target, OpOverload) and _is_view(u)):
            stack.extend(u.users)
    return False


def _multi_output(node: Node) -> Node | None:
    """The op whose tuple ``node`` takes an element of (``getitem``), None for any other node."""
    parent = node.args[0] if node.target is operator.getitem and node.args else None
    return parent if isinstance(parent, Node) and isinstance(_val(parent), (tuple, list)) else None


def _block(region: list[Node], backward: set[Node], rates: Any) -> tuple[BlockGraph, list[tuple[int, ...]]]:
    """One region of scopes as the planner's block, and its candidates: the values the
    backward reads, grouped by the op that makes them. The partitioner saves or
    recomputes an op, never one output of it: the outputs of a multi-output op
    (``native_layer_norm``'s output, mean and rstd) are kept together or not at all."""
    index = {n: i for i, n in enumerate(region)}
    costs = tuple(seconds(*_work(n), rates) if isinstance(n.target, OpOverload) else 0.0 for n in region)
    reads = tuple(tuple(index[a] for a in n.all_input_nodes if a in index) for n in region)
    saved = [
        i for i, n in enumerate(region)
        if isinstance(_val(n), torch.Tensor) and not (isinstance(n.target, OpOverload) and _is_view(n))
        and _needed_by(n, backward)
    ]  # fmt: skip
    groups: dict[Node, list[int]] = {}
    for i in saved:
        groups.setdefault(_multi_output(region[i]) or region[i], []).append(i)
    graph = BlockGraph("compiled", costs, reads, tuple(range(len(region))), (True,) * len(region),
                       ((),) * len(region), tuple(saved))  # fmt: skip
    return graph, [tuple(values) for values in groups.values()]


def kept_always(node: Node) -> bool:
    """A collective or an op whose outputs decide shapes or routing (``_base.ops``): stored,
    as in eager (R2 [ kept ops are not recorded ] in ``_record.entry``), whatever ``save=`` or a
    budget says."""
    return isinstance(node.target, OpOverload) and facts(node.target).never_replay


def _kept_always(blocks: list[list[Node]]) -> dict[Node, int]:
    """The read outputs of the blocks' collectives and routing ops (:func:`kept_always`), with
    their bytes: stored whatever the plan (``MUST_SAVE``), so part of the floor."""
    out: dict[Node, int] = {}
    for nodes in blocks:
        for n in nodes:
            if not kept_always(n):
                continue
            outs = [n] if isinstance(_val(n), torch.Tensor) else [u for u in n.users if u.target is operator.getitem]
            out.update((o, nbytes(_val(o))) for o in outs if o.users)
    return out


def keep_within(
    budget: Any, regions: dict[Any, list[Node]], backward: set[Node], checked: int = 0
) -> tuple[set[Node], tuple[int, float, int]]:
    """The nodes to keep of ``budget``'s scopes (forward nodes in graph order, by region
    -- the partitioner's ``ac_graph_id``): the planner's choice within ``budget.bytes``,
    and its figures ``(bytes kept, predicted recompute, floor)``. ``checked``: how many
    parameters the version check may save if the plan recomputes anything (room is left
    for them on a CPU device)."""
    blocks = [[n for n in nodes if n.op == "call_function"] for nodes in regions.values()]
    members = {n: b for b, nodes in enumerate(blocks) for n in nodes}
    first = next((v for nodes in blocks for v in map(_val, nodes) if isinstance(v, torch.Tensor)), None)
    device = first.device if first is not None and first.device.type != "meta" else torch.device("cpu")
    rates = rates_for(device)
    outside: dict[Node, int] = {}  # read by a region from outside it: kept for its recompute
    for b, nodes in enumerate(blocks):
        for n in nodes:
            for a in n.all_input_nodes:
                if members.get(a) != b and a.op != "placeholder":  # (graph inputs: the caller's)
                    outside[a] = nbytes(_val(a))
    for n, nb in _kept_always(blocks).items():
        outside.setdefault(n, nb)
    if any(is_symbolic(_val(n)) for nodes in blocks for n in nodes):
        budget._run.warn_once(
            "dynamic shapes",
            f"gradient_scope: {budget!r} in a graph compiled with dynamic shapes is planned at the sizes "
            "of the call that compiled the graph: at other sizes the same graph keeps "
            "the same tensors, larger or smaller, and the budget binds only at those sizes. For a plan per "
            "size, compile with dynamic=False and without mark_dynamic (one graph per size).",
        )
    graphs, cands = [], []
    for b, nodes in enumerate(blocks):
        graph, groups = _block(nodes, backward, rates)
        graphs.append(graph)
        cands += [Candidate(b, vs, sum(0 if nodes[i] in outside else nbytes(_val(nodes[i])) for i in vs))
                  for vs in groups]  # fmt: skip
    floor = [Item(size, i, False) for i, size in enumerate(outside.values())]
    chain = build_chain(graphs, cands)
    items = [Item(c.nbytes, i, False) for i, c in enumerate(cands)]
    d = decide(chain, items, floor, budget.bytes, None)
    reserve = checked * VERSION_BYTES if device.type == "cpu" else 0
    if d.recompute > 0 and reserve:  # the version check's bytes, held with the activations
        d = decide(chain, items, floor, max(budget.bytes - reserve, 0), None)
    kept = {blocks[cands[c].block][i] for c in chain.order[: d.kept] for i in cands[c].values}
    kept |= {parent for parent in map(_multi_output, kept) if parent is not None}
    return kept, (d.device, d.recompute, sum(outside.values()))
