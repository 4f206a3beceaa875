"""Which tensors were created in a block, and per-thread bookkeeping.

A process-wide map ``id(tensor) -> weak reference`` identifies block-created
tensors in the pack hook. It holds no tensor strongly: each entry is a weak
reference whose callback removes it when the tensor dies and tells the owning
thread's state, which drops the saved-tensor interception once the thread has
no open block and no live block tensor left.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ._record import Node, Region

__all__ = ["ThreadState", "thread_state", "register", "lookup", "live_tensor", "unregister"]

_lock = threading.Lock()


class ThreadState:
    """What one thread has open: blocks, live block tensors, our dispatch mode."""

    __slots__ = (
        "ident",
        "regions",
        "open_blocks",
        "born",
        "died",
        "mode",
        "bypass",
        "busy",
        "installed",
        "__weakref__",
    )

    def __init__(self) -> None:
        self.ident = threading.get_ident()
        self.regions: list[Region] = []  # open blocks, innermost last
        self.open_blocks = 0
        # Block tensors registered by this thread (written by it alone) and those
        # that died since (written under the lock, from any thread).
        self.born = 0
        self.died = 0
        self.mode: Any = None  # our dispatch mode while a block is open
        self.bypass = 0  # >0: our dispatch mode passes ops through (replay, internals)
        self.busy = 0  # >0: inside our pack/unpack hook; never touch the hook stack then
        self.installed = False  # our hook pair may be on this thread's stack

    @property
    def live(self) -> int:
        return self.born - self.died

    def needed(self) -> bool:
        return self.open_blocks > 0 or self.born != self.died


_tls = threading.local()

# Called (in the owning thread, at a safe point) when a thread's need ends.
on_unneeded: Callable[[ThreadState], None] = lambda state: None


def thread_state() -> ThreadState:
    state = getattr(_tls, "state", None)
    if state is None:
        state = _tls.state = ThreadState()
    return state


class _Ref(weakref.ref[torch.Tensor]):
    """Weak reference to a block tensor, with what the pack hook needs of it."""

    __slots__ = ("node", "region")
    node: Node
    region: Region


_LIVE: dict[int, _Ref] = {}


def _on_death(ref: _Ref) -> None:
    if _lock is None:  # interpreter shutdown: module globals are gone
        return
    with _lock:
        key = ref.node.key
        if _LIVE.get(key) is ref:
            del _LIVE[key]
        owner = ref.region.state
        owner.died += 1
        unneeded = owner.born == owner.died and owner.open_blocks == 0
    if unneeded:
        on_unneeded(owner)


def register(t: torch.Tensor, node: Node, region: Region, owner: ThreadState) -> None:
    key = id(t)
    if key in _LIVE:
        # Same tensor seen again (an op returned an existing tensor): keep the
        # first record of it.
        return
    ref = _Ref(t, _on_death)
    ref.node = node
    ref.region = region
    _LIVE[key] = ref
    # Called only from the recording (owner) thread: no lock needed for born.
    owner.born += 1


def lookup(t: torch.Tensor) -> _Ref | None:
    """The registry entry (``.node``, ``.region``) of a live block tensor, or None."""
    ref = _LIVE.get(id(t))
    if ref is not None and ref() is t:
        return ref
    return None


def live_tensor(node: Node) -> torch.Tensor | None:
    """The tensor a node stands for, if it is still alive."""
    ref = _LIVE.get(node.key)
    if ref is not None and ref.node is node:
        return ref()
    return None


def unregister(nodes: list[Node]) -> None:
    """Forget nodes (an aborted block): their tensors become ordinary tensors."""
    dropped: list[ThreadState] = []
    with _lock:
        for node in nodes:
            ref = _LIVE.get(node.key)
            if ref is not None and ref.node is node:
                del _LIVE[node.key]
                ref.region.state.died += 1
                dropped.append(ref.region.state)
    for owner in dropped:
        if not owner.needed():
            on_unneeded(owner)
