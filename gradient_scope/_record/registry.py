"""Which live tensors blocks created.

A process-wide map ``id(tensor) -> Entry`` identifies block tensors in the pack
hook. It holds no tensor strongly: each :class:`Entry` is a weak reference.
Each entry carries everything the pack hook needs (the tensor's record, its
block, the serial of the scope entry that made it, the thread ledger it counts
in), so nothing is reached through another module's objects.

An entry has no callback (that would be a Python call for each tensor that dies,
most of them inside their block): while its block is open, an entry whose tensor died
stays in the map, dead, and every reader checks ``e() is t``. When the block
closes (:func:`close_entries`) the dead ones are dropped and each one still
alive is counted and gets a tracker, a weak reference whose callback
(:func:`_died`) drops it when its tensor dies.

Invariants:

1. ``_LIVE[k] is e`` implies ``id(e()) == k`` while ``e()`` is alive; a dead
   entry stays only while its block is open (or until a tensor at the same
   address is registered). An entry is counted (``born``) when its block
   closes with its tensor alive, and its ledger's ``died`` when it is dropped
   after that (by its tracker or by :func:`forget`): exactly once each.
2. ``born`` and ``died`` are written under ``_lock``, ``died`` from whichever
   thread a tensor dies in.
3. When a ledger's live count reaches 0, every registered empty-listener is
   called once, in the thread where the last tensor died.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = [
    "Entry",
    "Ledger",
    "ledger",
    "add_empty_listener",
    "register",
    "close_entries",
    "lookup",
    "forget",
    "note_alias",
    "tensor_of",
    "value_in_memory",
]

# Reentrant: a garbage collection that runs while the lock is held (an allocation under
# it) may kill a tracked tensor in a reference cycle, and its tracker's callback then
# takes the lock in the same thread.
_lock = threading.RLock()


class Ledger:
    """Per thread: how many tensors made by its blocks are alive."""

    __slots__ = ("ident", "born", "died", "__weakref__")

    def __init__(self) -> None:
        self.ident = threading.get_ident()
        self.born = 0
        self.died = 0

    @property
    def live(self) -> int:
        return self.born - self.died


_tls = threading.local()


def ledger() -> Ledger:
    """This thread's ledger."""
    lg: Ledger | None = getattr(_tls, "ledger", None)
    if lg is None:
        lg = _tls.ledger = Ledger()
    return lg


_empty_listeners: list[Callable[[Ledger], None]] = []


def add_empty_listener(fn: Callable[[Ledger], None]) -> Callable[[], None]:
    """Call ``fn(ledger)`` whenever a ledger's live count drops to 0 (invariant 3).
    Returns a function that removes it."""
    _empty_listeners.append(fn)

    def remove() -> None:
        if fn in _empty_listeners:
            _empty_listeners.remove(fn)

    return remove


class Entry(weakref.ref):  # type: ignore[type-arg]
    """A weak reference (made without a callback) to a block tensor that knows its
    block: the recorder's ``Var`` of the tensor is one. ``frame`` (the scope that
    made the tensor) gives ``frame.owner`` (its block's replay state),
    ``frame.serial`` and ``frame.ledger``. Compared and hashed by identity, not by
    referent."""

    __slots__ = ("key", "frame", "aliases")

    __hash__ = object.__hash__
    __eq__ = object.__eq__
    __ne__ = object.__ne__

    key: int  # id() of the tensor
    frame: Any
    # Aliases that other blocks read of this tensor (same storage and version
    # counter). An entry lives while its tensor lives or a handle of it is pending,
    # so its value stays in memory exactly as long as something may ask for it.
    aliases: list[torch.Tensor] | None


_LIVE: dict[int, Entry] = {}


class _Tracker(weakref.ref):  # type: ignore[type-arg]
    """A weak reference to the tensor of a counted ``entry``: its callback is the
    tensor's death."""

    __slots__ = ("entry",)

    entry: Entry


_TRACKED: dict[int, _Tracker] = {}  # by entry key: the trackers of counted entries


def _notify(lg: Ledger) -> None:
    for fn in _empty_listeners:
        fn(lg)


def _died(tracker: _Tracker) -> None:
    """The callback of every tracker: its entry's tensor died."""
    if _lock is None:  # interpreter shutdown: module globals are gone
        return
    entry = tracker.entry
    with _lock:
        key = entry.key
        if _TRACKED.get(key) is not tracker:
            return  # forgotten already (invariant 1)
        del _TRACKED[key]
        if _LIVE.get(key) is entry:
            del _LIVE[key]
        lg = entry.frame.ledger
        lg.died += 1
        empty = lg.born == lg.died
    if empty:
        _notify(lg)


def register(entry: Entry) -> bool:
    """Record that ``entry``'s tensor is a live block tensor; False if it already is
    (an op returned an existing block tensor: the first record of it stands)."""
    key = entry.key
    old = _LIVE.get(key)
    if old is None:
        _LIVE[key] = entry
        return True
    if old() is not None:
        return False
    with _lock:  # a dead entry of an open block at the same address (invariant 1)
        old = _LIVE.get(key)
        if old is not None and old() is not None:
            return False
        _LIVE[key] = entry
    return True


def close_entries(entries: Sequence[Entry]) -> list[tuple[Entry, torch.Tensor]]:
    """At the close of the block that made ``entries`` (in its thread): drop those
    whose tensors died, count and track the others; returns them with their tensors."""
    alive: list[tuple[Entry, torch.Tensor]] = []
    with _lock:
        for e in entries:
            key = e.key
            if _LIVE.get(key) is not e:
                continue  # not registered, or forgotten
            t = e()
            if t is None:
                del _LIVE[key]
                continue
            tracker = _Tracker(t, _died)
            tracker.entry = e
            _TRACKED[key] = tracker
            e.frame.ledger.born += 1
            alive.append((e, t))
    return alive


def lookup(t: torch.Tensor) -> Entry | None:
    """The entry of a live block tensor, or None."""
    entry = _LIVE.get(id(t))
    if entry is not None and entry() is t:
        return entry
    return None


def forget(entries: Sequence[Entry]) -> None:
    """Forget the tensors of ``entries`` (an aborted block): they become ordinary tensors."""
    emptied: list[Ledger] = []
    with _lock:
        for e in entries:
            key = e.key
            if _LIVE.get(key) is not e:
                continue
            del _LIVE[key]
            tracker = _TRACKED.get(key)
            if tracker is None or tracker.entry is not e:
                continue  # not counted: its block is open
            del _TRACKED[key]
            lg = e.frame.ledger
            lg.died += 1
            if lg.born == lg.died:
                emptied.append(lg)
    for lg in emptied:
        _notify(lg)


def note_alias(entry: Entry, alias: torch.Tensor) -> None:
    """Another block read ``entry``'s tensor; ``alias`` shares its storage and version."""
    if entry.aliases is None:
        entry.aliases = [alias]
    else:
        entry.aliases.append(alias)


def tensor_of(entry: Entry) -> torch.Tensor | None:
    """The live, registered tensor ``entry`` stands for, or None."""
    return entry() if _LIVE.get(entry.key) is entry else None


def value_in_memory(entry: Entry, version: int) -> torch.Tensor | None:
    """The entry's tensor, or an alias of it another block holds, at ``version``."""
    t = entry()
    if t is not None:
        return t if t._version == version else None
    for a in entry.aliases or ():
        if a._version == version:
            return a
    return None
