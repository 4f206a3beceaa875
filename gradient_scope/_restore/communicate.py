"""Restore: whether a block's replay communicates (``_restore.handles``
P11 [ a replay that communicates reads no liveness ]), asked of its replay state."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._record.types import Var
from .._record.wrappers import is_collective

if TYPE_CHECKING:
    from .handles import ReplayState

__all__ = ["communicates", "replay_communicates"]


def communicates(state: ReplayState) -> bool:
    """P11 [ a replay that communicates reads no liveness ]: whether ``state``'s record holds
    a collective (noted once the record is closed)."""
    record = state.record
    if record is None:
        return False
    found = any(is_collective(rec.func) for rec in record.ops)
    if not record.open:  # a closed record's ops no longer change
        state.collective = found
    return found


def replay_communicates(state: ReplayState, var: Var) -> bool:
    """Whether the closure of ``var`` in ``state``'s closed record holds a collective."""
    record = state.record
    if record is None or record.open:
        return False
    st, slots = state.derived.of(record)
    slot = slots.of[id(var)]
    known = state.communicating
    if known is None:
        known = state.communicating = {}
    found = known.get(slot)
    if found is None:
        funcs = st.funcs
        found = known[slot] = any(is_collective(funcs[i]) for i in st.closure(slot, None).plan)
    return found
