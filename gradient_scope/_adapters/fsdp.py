"""FSDP2: gather the parameters a replay reads when FSDP2 has freed them.

FSDP2 (``torch.distributed.fsdp.fully_shard``) frees the storage of a
parameter group's unsharded parameters after forward (``resize_(0)``) and
regrows the *same* storage when it unshards the group again, keeping the
version counter. A block's record holds detached aliases of the parameters it
read, so once the group is unsharded again the aliases read the gathered values.

FSDP2 unshards a group in backward when the gradient of the group's module
output arrives (its pre-backward hook), or earlier as a prefetch. A block
tensor saved by an op after the block can be unpacked before that, and a
second backward pass may unpack it after the group's post-backward has
resharded it. :func:`regather` then unshards the owning group with FSDP2's
own ``unshard()`` + ``wait_for_unshard()`` (what FSDP2 itself does when
``torch.utils.checkpoint`` reruns a module in backward). A group FSDP2 is
already prefetching is waited for, not gathered again, and FSDP2's own
pre-backward later finds the group unsharded and does not gather it either.
Replays run in autograd's execution order, the same on every rank, so every
rank issues these all-gathers in the same order.

At the end of the backward pass, every group unsharded here that is still
unsharded is resharded, unless the group keeps its parameters unsharded after
backward on purpose (``set_reshard_after_backward(False)``). Groups whose pre-
and post-backward come later in the pass are resharded by FSDP2 itself; this
covers the rest (the post-backward already ran, or never runs in this pass).

A block that runs a fully_shard'ed module's forward (a scope around the
module) also records FSDP2's own all-gather; on the group's first all-gather
that allocates the buffers FSDP2 keeps for the module's lifetime.
:func:`release_buffers` turns those into ordinary tensors at block exit, so
they don't keep the block's record and the saved-tensor interception alive.

Nothing here imports ``torch.distributed.fsdp``: a process that has not
imported it has no FSDP2 groups, so a freed storage there belongs to none.
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Iterator
from itertools import chain
from typing import TYPE_CHECKING, Any

import torch

from .._base.errors import RecomputeError, internal_error
from .._base.subclass import PLAIN, data_tensors, storage_freed
from .._base.torch_compat import current_graph_task, queue_engine_callback, storage_id
from .._record import registry as _registry
from .._record.types import BlockRecord, Var

if TYPE_CHECKING:
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

__all__ = ["regather", "release_buffers", "on_freed", "gathered"]

_FSDP_STATE_MODULE = "torch.distributed.fsdp._fully_shard._fsdp_state"

_lock = threading.RLock()
# Storage id (``_base.torch_compat.storage_id``) -> the
# group that owns it. A group's storages are allocated by its first all-gather
# and kept for its lifetime (FSDP2 resizes them, never replaces them); groups
# whose storages are all listed here are in _complete and are not scanned again.
_owners: dict[int, weakref.ref[FSDPParamGroup]] = {}
_complete: weakref.WeakSet[FSDPParamGroup] = weakref.WeakSet()


def _all_groups() -> Iterator[FSDPParamGroup]:
    """Every live FSDP2 parameter group, from torch's module -> state registry."""
    from torch.distributed._composable_state import _module_state_mapping
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    seen: set[int] = set()
    for state_ref in list(_module_state_mapping.values()):
        state = state_ref()
        if not isinstance(state, FSDPState) or id(state) in seen:
            continue
        seen.add(id(state))
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:  # torch versions with one group per state
            group = getattr(state, "_fsdp_param_group", None)
            groups = [group] if group is not None else []
        yield from groups


def _refresh() -> None:
    """List the storages of groups not scanned completely yet; forget dead groups."""
    for key in [k for k, ref in _owners.items() if ref() is None]:
        del _owners[key]
    for group in _all_groups():
        if group in _complete:
            continue
        ref = weakref.ref(group)
        complete = True
        for fsdp_param in group.fsdp_params:
            outputs = fsdp_param.all_gather_outputs
            complete = complete and bool(outputs) and hasattr(fsdp_param, "_unsharded_param")
            for t in chain(outputs, getattr(fsdp_param, "_unsharded_inner_tensors", ())):
                _owners[storage_id(t)] = ref
        if complete:
            _complete.add(group)


def _owner(key: int, refresh: bool = True) -> FSDPParamGroup | None:
    ref = _owners.get(key)
    group = ref() if ref is not None else None
    if group is None and refresh:
        _refresh()
        ref = _owners.get(key)
        group = ref() if ref is not None else None
    return group


class _Pending:
    """Groups unsharded by replays in one backward pass, to check at its end."""

    __slots__ = ("groups", "__weakref__")

    def __init__(self) -> None:
        self.groups: list[FSDPParamGroup] = []


# graph task id -> its _Pending, held strongly only by the callback queued on
# that graph task: if the pass fails before its callbacks run, the entry goes.
_pending: weakref.WeakValueDictionary[int, _Pending] = weakref.WeakValueDictionary()


def _reshard_after_pass(task: int, pending: _Pending) -> None:
    with _lock:
        if _pending.get(task) is pending:
            del _pending[task]
    for group in pending.groups:
        if group.is_unsharded and group.reshard_after_backward:
            group.reshard()


def _after_other_callbacks(task: int, pending: _Pending) -> None:
    # Queued again from inside the engine's final callbacks, so that it runs
    # after FSDP2's own end-of-backward callback (which may have been queued
    # after ours): FSDP2 reshards what it will, this reshards what is left.
    queue_engine_callback(lambda: _reshard_after_pass(task, pending))


def _unshard(group: FSDPParamGroup, task: int) -> None:
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    # On the current stream and without FSDP2's pre-backward rules (e.g.
    # unshard_in_backward=False skips gathering in PRE_BACKWARD): the replay
    # needs the values now. A pending prefetch is waited for, not repeated.
    with group.use_training_state(TrainingState.IDLE):
        group.unshard()
        group.wait_for_unshard()
    with _lock:
        pending = _pending.get(task)
        if pending is None:
            pending = _pending[task] = _Pending()
            held = pending
            queue_engine_callback(lambda: _after_other_callbacks(task, held))
        if group not in pending.groups:
            pending.groups.append(group)


def regather(t: torch.Tensor) -> bool:
    """Make the freed storage of ``t`` hold its values again, if FSDP2 owns it.

    ``t`` is a tensor a replay is about to read whose storage is freed
    (``_base.subclass.storage_freed``). Returns False when a freed storage of ``t`` belongs to no FSDP2
    parameter group (the caller raises), True once the owning groups are
    unsharded. Raises :class:`RecomputeError` when it is read outside a
    backward pass (the group could not be resharded afterwards).
    """
    if _FSDP_STATE_MODULE not in sys.modules:
        return False
    groups: list[FSDPParamGroup] = []
    with _lock:
        for d in data_tensors(t):
            if storage_freed(d):
                group = _owner(storage_id(d))
                if group is None:
                    return False
                if group not in groups:
                    groups.append(group)
    task = current_graph_task()
    if task == -1:
        raise RecomputeError(
            "gradient_scope: a tensor saved by a recompute_scope was read outside a backward "
            f"pass, and recomputing it reads a parameter of shape {list(t.shape)} ({t.dtype}) "
            f"that FSDP2 has freed ({groups[0]!r}). Parameters are gathered for a replay "
            "only during backward: read saved tensors in backward."
        )
    for group in groups:
        _unshard(group, task)
    if storage_freed(t):
        internal_error(
            f"FSDP2 did not gather the parameter of shape {list(t.shape)} ({t.dtype}) "
            f"that a replay reads ({groups[0]!r})"
        )
    return True


_FSDP_OPS: dict[int, bool] = {}  # id(op) -> whether it is one of FSDP2's (``namespace`` is a Python property)


def _is_fsdp_op(func: Any) -> bool:
    known = _FSDP_OPS.get(id(func))
    if known is None:  # op overloads live for the process: their ids stay theirs
        known = _FSDP_OPS[id(func)] = getattr(func, "namespace", None) == "fsdp"
    return known


#: Per record structure (its signature's key, held): whether it has one of FSDP2's ops.
_BY_STRUCTURE: dict[int, tuple[Any, bool]] = {}


def _has_fsdp_op(record: BlockRecord) -> bool:
    sig = record.signature
    if sig is not None:
        known = _BY_STRUCTURE.get(id(sig[0]))
        if known is not None and known[0] is sig[0]:
            return known[1]
    found = any(_is_fsdp_op(rec.func) for rec in record.ops)
    if sig is not None:
        if len(_BY_STRUCTURE) >= 256:
            _BY_STRUCTURE.clear()
        _BY_STRUCTURE[id(sig[0])] = (sig[0], found)
    return found


def release_buffers(record: BlockRecord) -> None:
    """At block exit: make the block's live tensors that are FSDP2's own buffers
    (unsharded-parameter storage, allocated by the group's first all-gather when
    that ran inside the block) ordinary tensors."""
    if _FSDP_STATE_MODULE not in sys.modules:
        return
    if not _has_fsdp_op(record):
        return
    owned: list[Var] = []
    with _lock:
        _refresh()
        for var in record.registered_vars():
            live = _registry.tensor_of(var)
            if live is not None and type(live) in PLAIN and _owner(storage_id(live), False):
                owned.append(var)
    if owned:
        _registry.forget(owned)


def on_freed(t: torch.Tensor) -> bool:
    """The adapter's freed-storage handler (registered by the package): a replay is about
    to read ``t``, whose storage FSDP2 freed; True if it was gathered back."""
    return regather(t)  # looked up at call time (tests wrap it)


def gathered(t: torch.Tensor) -> bool:
    """Whether ``t`` (an outside tensor a block read) lives in storage an FSDP2 group
    gathers: a replay that finds it freed runs FSDP2's all-gather, so the ranks must
    replay alike (``_budget.agree`` A1 [ a shared block needs one plan ])."""
    if _FSDP_STATE_MODULE not in sys.modules:
        return False
    with _lock:
        return any(_owner(storage_id(d)) is not None for d in data_tensors(t))
