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
from typing import Any, NamedTuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ..._base.torch_compat import storage_id

__all__ = ["NodeValues", "Found", "locate", "with_extra_outputs", "take", "copy_of", "COPIED"]

Tensor = torch.Tensor
#: The element a capture names where the graph's extra output is the tensor itself: a copy
#: made as soon as its node has run (:func:`copy_of`), not a value to :func:`take` it from.
COPIED = -2
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
    weak reference to the storage of every tensor value, and its version then."""

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        super().__init__(gm)
        self.seen: list[tuple[torch.fx.Node, int, StorageWeakRef, int | None]] = []

    def run_node(self, n: torch.fx.Node) -> Any:
        value = super().run_node(n)
        if n.op in ("call_function", "call_method", "call_module", "get_attr"):
            for j, t in _tensors(value):
                if t.layout == torch.strided:
                    version = None if t.is_inference() else t._version
                    self.seen.append((n, j, StorageWeakRef(t.untyped_storage()), version))
        return value


class Found(NamedTuple):
    """Where a tensor is in a graph's values: the node, the element of its value (-1: the
    value itself), the tensor's layout there, and whether later runs take a copy made as
    soon as the node has run (the block wrote to it)."""

    node: torch.fx.Node
    element: int
    layout: Layout
    copy: bool


def locate(values: NodeValues, tensors: Sequence[tuple[Tensor, int | None, bool]]) -> list[Found] | None:
    """For each of ``tensors`` (alive; with the version it had where the record copied it, and
    whether it did), the first node whose value holds its storage (at that version, for a
    copy), with the tensor's layout; None if no node does."""
    found = []
    for t, version, copy in tensors:
        cdata = storage_id(t)
        for n, j, ref, seen in values.seen:
            # A copy's node left the storage at the version it was copied at: no write lies
            # between the node and the copy the record holds.
            if ref.cdata == cdata and not ref.expired() and (not copy or seen == version):
                layout = (t.dtype, t.shape, tuple(t.stride()), int(t.storage_offset()))
                found.append(Found(n, j, layout, copy))
                break
        else:
            return None
    return found


def with_extra_outputs(gm: torch.fx.GraphModule, found: Sequence[Found]) -> torch.fx.GraphModule:
    """A copy of ``gm`` that returns, after its own outputs, the values of the ``found`` nodes,
    or a copy of the tensor taken as soon as its node has run."""
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    copies: dict[int, torch.fx.Node] = {}
    for n in gm.graph.nodes:
        if n.op == "output":
            outs = n.args[0]
            own = tuple(outs) if isinstance(outs, (tuple, list)) else (outs,)
            extra = tuple(copies[e] if f.copy else env[f.node] for e, f in enumerate(found))
            graph.output(tuple(torch.fx.map_arg(own, lambda a: env[a])) + extra)
            continue
        env[n] = graph.node_copy(n, lambda a: env[a])
        for e, f in enumerate(found):
            if f.copy and f.node is n:
                copies[e] = graph.call_function(copy_of, (env[n], f.element, f.layout))
    return torch.fx.GraphModule(gm, graph)


def take(value: Any, element: int, layout: Layout) -> Tensor:
    """The tensor with ``layout`` on the storage of a node's ``value`` (or of its element)."""
    t = value if element < 0 else value[element]
    dtype, size, stride, offset = layout
    out = torch.empty(0, dtype=dtype, device=t.device)
    with torch.no_grad():
        out.set_(t.untyped_storage(), offset, size, stride)
    return out


def copy_of(value: Any, element: int, layout: Layout) -> Tensor:
    """A copy of what :func:`take` takes, made as ``Input.take_snapshot`` makes one."""
    with torch.no_grad():
        return take(value, element, layout).clone(memory_format=torch.preserve_format)
