"""Graph inputs that a compiled graph writes: never recomputed through.

AOTAutograd's joint graph is functional: a write to a graph input is a new value
plus either a ``copy_`` into the input's placeholder at the end of the forward (a
write kept in the graph) or an extra forward output that the runtime wrapper copies
into the input after the compiled forward (an input that requires grad: the graph
reads it through a ``clone``). Either way, when the compiled backward runs the
input holds its *new* value. A forward node that reads such an input and is
recomputed in the backward would read the new value: a read made before the write
is then wrong, and a write's own new value would be applied twice.

:func:`pin_reads_of_written_inputs` therefore marks every forward node that reads a
written input ``MUST_SAVE``: the partitioner stores it if the backward needs it
(as it does for any value it does not recompute) and recomputes only what follows
it. Views of a written input are followed to the ops that read their data (saving
a view would save an alias of the input, not its value). Nodes the backward does
not need are not stored: ``MUST_SAVE`` only forbids recomputing them.

Which inputs are written: every placeholder that a forward op writes in place
(``copy_`` and any op whose schema marks an argument written), and the inputs
AOTAutograd's metadata (``ViewAndMutationMeta.input_info``) says are mutated (data,
metadata or storage), which covers writes it applies after the graph. The metadata
is read from the frame of AOTAutograd's partitioning step that calls
``joint_custom_pass`` (torch 2.13); where that frame is not found, only writes
kept in the graph are seen.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from ..._base.torch_compat import op_schema

__all__ = ["written_inputs", "pin_reads_of_written_inputs", "caller_locals", "is_alias"]

# The AOTAutograd function that calls joint_custom_pass, and its local that holds
# the metadata of the graph's (flattened, subclass-desugared) inputs.
_CALLER = "_partition_joint_graph_into_fw_bw"
_META_LOCAL = "inner_meta"


def caller_locals(function: str, max_depth: int = 8) -> dict[str, Any]:
    """The locals of the nearest caller frame running ``function`` (an AOTAutograd
    function that calls the joint-graph pass); empty where none is found."""
    frame: Any = sys._getframe(1)
    for _ in range(max_depth):
        if frame is None:
            return {}
        if frame.f_code.co_name == function:
            return dict(frame.f_locals)
        frame = frame.f_back
    return {}


def _caller_input_info() -> list[Any] | None:
    """``input_info`` of the graph being partitioned, from AOTAutograd's frame."""
    info = getattr(caller_locals(_CALLER).get(_META_LOCAL), "input_info", None)
    return list(info) if info is not None else None


def _writes(node: torch.fx.Node) -> list[Any]:
    """The arguments an in-place op writes."""
    schema = op_schema(node.target)
    if schema is None:
        return []
    written = []
    for arg, formal in zip(node.args, schema.arguments):
        if formal.alias_info is not None and formal.alias_info.is_write:
            written.append(arg)
    return written


def _mutated(info: Any) -> bool:
    return any(
        bool(getattr(info, name, False)) for name in ("mutates_data", "mutates_metadata", "mutates_storage_metadata")
    )


def written_inputs(gm: torch.fx.GraphModule, input_info: list[Any] | None) -> set[torch.fx.Node]:
    """The placeholders of ``gm`` (a joint graph) that the graph writes."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    primals = [n for n in placeholders if n.name.startswith("primals")]
    found: set[torch.fx.Node] = set()
    if input_info is not None and len(input_info) == len(primals):
        found.update(node for node, info in zip(primals, input_info) if _mutated(info))
    inputs = set(placeholders)
    for node in gm.graph.nodes:
        if node.op == "call_function":
            found.update(arg for arg in _writes(node) if arg in inputs)
    return found


def is_alias(node: torch.fx.Node) -> bool:
    schema = op_schema(node.target)
    if schema is None or not schema.returns:
        return False
    alias = schema.returns[0].alias_info
    return alias is not None and not alias.is_write


def pin_reads_of_written_inputs(gm: torch.fx.GraphModule, backward: set[torch.fx.Node]) -> int:
    """Mark the forward readers of written graph inputs ``MUST_SAVE``; returns how many."""
    from torch.utils.checkpoint import CheckpointPolicy

    written = written_inputs(gm, _caller_input_info())
    stack = list(written)
    seen: set[torch.fx.Node] = set(stack)
    pinned = 0
    while stack:
        source = stack.pop()
        for user in source.users:
            if user in seen or user in backward or user.op != "call_function":
                continue
            seen.add(user)
            if source in _writes(user):
                continue  # the write itself (copy_ at the end of the forward)
            if is_alias(user):
                stack.append(user)  # a view: its readers read the input
                continue
            val = user.meta.get("val")
            targets = [u for u in user.users if u not in backward] if isinstance(val, (tuple, list)) else [user]
            for node in targets:
                node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
                pinned += 1
    return pinned
