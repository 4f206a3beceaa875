"""Save policies: which ops' outputs are stored instead of recomputed."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["make_save_policy"]


def make_save_policy(save: Iterable[Any] | Callable[[Any], bool] | None) -> Callable[[Any], bool] | None:
    """Turn the ``save=`` option into ``op -> bool`` (or None: recompute everything)."""
    if save is None:
        return None
    if isinstance(save, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        save = [save]
    if callable(save):
        return save
    if isinstance(save, (str, bytes)) or not isinstance(save, Iterable):
        raise TypeError(
            "recompute_scope: save= takes an iterable of ops (e.g. [torch.ops.aten.mm]) "
            f"or a callable op -> bool, got {type(save).__name__}"
        )
    overloads: set[Any] = set()
    packets: set[Any] = set()
    for op in save:
        if isinstance(op, torch._ops.OpOverload):
            overloads.add(op)
        elif isinstance(op, torch._ops.OpOverloadPacket):
            packets.add(op)
        else:
            raise TypeError(
                "recompute_scope: save= entries must be ops such as torch.ops.aten.mm or "
                f"torch.ops.aten.mm.default, got {op!r}"
            )

    def policy(op: Any) -> bool:
        return op in overloads or op.overloadpacket in packets

    return policy
