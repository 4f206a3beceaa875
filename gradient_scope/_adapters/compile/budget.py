"""A memory budget inside compiled code: the joint-graph pass keeps (``MUST_SAVE``) the
block values the budget's planner picks, and recomputes the rest.

For each budget, the forward nodes of its scopes in one joint graph are one block: each
node's cost is its FLOPs and bytes (from the nodes' ``meta["val"]``, fake tensors) at
the device's measured rates, as an eager block's ops (``_budget.measure``); the values the
backward reads are the candidates; what the scopes' nodes read from outside them and the
backward needs for their recompute is the floor. The same closure-aware chain and
prefix choice as in eager (``_budget.planner``) picks what to keep within the budget's
bytes; no offload here. Dynamic sizes count 0 bytes (they are not known at compile time).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch.utils.flop_counter import flop_registry

from ..._base.ops import facts
from ..._base.torch_compat import OpOverload, op_schema
from ..._budget.planner import BlockGraph, Candidate, Item, build_chain, decide
from ..._budget.rates import rates_for, seconds

__all__ = ["keep_within"]

Node = torch.fx.Node
_ALIASES = (torch.ops.aten.detach.default, torch.ops.aten.alias.default)


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, Node) else None


def _nbytes(val: Any) -> int:
    if not isinstance(val, torch.Tensor):
        return 0
    n = val.numel()
    return n * val.element_size() if isinstance(n, int) else 0


def _shape(a: Any) -> Any:
    v = _val(a)
    if isinstance(v, torch.Tensor):
        return v.shape
    if isinstance(a, (list, tuple)):
        return [_shape(x) for x in a]
    return a


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
            out = _val(node)
            flops = float(formula(*[_shape(a) for a in node.args], out_val=getattr(out, "shape", out),
                                  **{k: _shape(a) for k, a in node.kwargs.items()}))  # fmt: skip
        except Exception:  # noqa: BLE001  (a formula that cannot read this call: bytes only)
            flops = 0.0
    if _is_view(node):
        return flops, 0.0
    moved = sum(_nbytes(_val(a)) for a in node.all_input_nodes) + _nbytes(_val(node))
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


def _block(region: list[Node], backward: set[Node], rates: Any) -> tuple[BlockGraph, list[int]]:
    """One region of scopes as the planner's block, and the values the backward reads."""
    index = {n: i for i, n in enumerate(region)}
    costs = tuple(seconds(*_work(n), rates) if isinstance(n.target, OpOverload) else 0.0 for n in region)
    reads = tuple(tuple(index[a] for a in n.all_input_nodes if a in index) for n in region)
    saved = [
        i for i, n in enumerate(region)
        if isinstance(_val(n), torch.Tensor) and not (isinstance(n.target, OpOverload) and _is_view(n))
        and _needed_by(n, backward)
    ]  # fmt: skip
    graph = BlockGraph("compiled", costs, reads, tuple(range(len(region))), (True,) * len(region),
                       ((),) * len(region), tuple(saved))  # fmt: skip
    return graph, saved


def _kept_always(blocks: list[list[Node]]) -> dict[Node, int]:
    """The read outputs of the blocks' collectives and routing ops (``_base.ops``), with
    their bytes: stored whatever the plan (``MUST_SAVE``), so part of the floor."""
    out: dict[Node, int] = {}
    for nodes in blocks:
        for n in nodes:
            if not (isinstance(n.target, OpOverload) and facts(n.target).never_replay):
                continue
            outs = [n] if isinstance(_val(n), torch.Tensor) else [u for u in n.users if u.target is operator.getitem]
            out.update((o, _nbytes(_val(o))) for o in outs if o.users)
    return out


def keep_within(budget: Any, regions: dict[Any, list[Node]], backward: set[Node]) -> set[Node]:
    """The nodes to keep of ``budget``'s scopes (forward nodes in graph order, by region
    -- the partitioner's ``ac_graph_id``): the planner's choice within ``budget.bytes``.
    Notes the plan's figures on the budget."""
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
                    outside[a] = _nbytes(_val(a))
    for n, nbytes in _kept_always(blocks).items():
        outside.setdefault(n, nbytes)
    graphs, cands = [], []
    for b, nodes in enumerate(blocks):
        graph, saved = _block(nodes, backward, rates)
        graphs.append(graph)
        cands += [Candidate(b, (i,), 0 if nodes[i] in outside else _nbytes(_val(nodes[i]))) for i in saved]
    floor = [Item(nbytes, i, False) for i, nbytes in enumerate(outside.values())]
    chain = build_chain(graphs, cands)
    d = decide(chain, [Item(c.nbytes, i, False) for i, c in enumerate(cands)], floor, budget.bytes, None)
    kept = {blocks[cands[c].block][cands[c].values[0]] for c in chain.order[: d.kept]}
    budget._note_compiled(d.device, d.recompute, sum(outside.values()))
    return kept
