"""T6 [ kept ops' outputs taken from the graph ]: the outside tensors a block makes itself
(outputs of ops ``save=`` keeps), taken from the captured graph's values.

An op that a ``save=`` policy keeps is not recorded (R2 [ kept ops are not recorded ]): its
output is an ordinary tensor, which the record reads as an outside tensor. A steady run does not
record, so it must take that tensor from somewhere else: from the value of the graph node that
holds its storage (the kept op's output itself, a view of it as ``F.linear`` returns on
3-D input, or the ``_unsafe_view`` that ``matmul`` returns). :class:`NodeValues` runs a
graph node by node once, remembering where each value's storage is;
:func:`with_extra_outputs` makes the graph return the values found; :func:`take` rebuilds
the tensor from such a value.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ..._base.torch_compat import storage_id

__all__ = ["NodeValues", "locate", "with_extra_outputs", "take"]

Tensor = torch.Tensor
#: (dtype, size, stride, storage offset) of a tensor taken from a node's value.
Layout = tuple[torch.dtype, torch.Size, tuple[int, ...], int]


def _tensors(value: Any) -> list[tuple[int, Tensor]]:
    """The tensors of a node's value: ``(-1, t)`` for a tensor, ``(j, t)`` for element ``j``."""
    if type(value) is Tensor:
        return [(-1, value)]
    if isinstance(value, (tuple, list)):
        return [(j, v) for j, v in enumerate(value) if type(v) is Tensor]
    return []


class NodeValues(torch.fx.Interpreter):
    """Runs a graph node by node (values freed as the graph frees them), remembering a
    weak reference to the storage of every tensor value."""

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        super().__init__(gm)
        self.seen: list[tuple[torch.fx.Node, int, StorageWeakRef]] = []

    def run_node(self, n: torch.fx.Node) -> Any:
        value = super().run_node(n)
        if n.op in ("call_function", "call_method", "call_module", "get_attr"):
            for j, t in _tensors(value):
                if t.layout == torch.strided:
                    self.seen.append((n, j, StorageWeakRef(t.untyped_storage())))
        return value


def locate(values: NodeValues, tensors: Sequence[Tensor]) -> list[tuple[torch.fx.Node, int, Layout]] | None:
    """For each of ``tensors`` (alive), the first node whose value holds its storage, with
    the tensor's layout; None if one is held by no node."""
    found = []
    for t in tensors:
        cdata = storage_id(t)
        for n, j, ref in values.seen:
            if ref.cdata == cdata and not ref.expired():
                layout = (t.dtype, t.shape, tuple(t.stride()), int(t.storage_offset()))
                found.append((n, j, layout))
                break
        else:
            return None
    return found


def with_extra_outputs(gm: torch.fx.GraphModule, nodes: Sequence[torch.fx.Node]) -> torch.fx.GraphModule:
    """A copy of ``gm`` that returns the values of ``nodes`` after its own outputs."""
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for n in gm.graph.nodes:
        if n.op == "output":
            outs = n.args[0]
            own = tuple(outs) if isinstance(outs, (tuple, list)) else (outs,)
            graph.output(tuple(torch.fx.map_arg(own, lambda a: env[a])) + tuple(env[x] for x in nodes))
        else:
            env[n] = graph.node_copy(n, lambda a: env[a])
    return torch.fx.GraphModule(gm, graph)


def take(value: Any, element: int, layout: Layout) -> Tensor:
    """The tensor with ``layout`` on the storage of a node's ``value`` (or of its element)."""
    t = value if element < 0 else value[element]
    dtype, size, stride, offset = layout
    out = torch.empty(0, dtype=dtype, device=t.device)
    with torch.no_grad():
        out.set_(t.untyped_storage(), offset, size, stride)
    return out
