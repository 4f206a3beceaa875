"""Which live tensors blocks created.

A process-wide map ``id(tensor) -> Entry`` identifies block tensors in the pack
hook. It holds no tensor strongly: each :class:`Entry` is a weak reference whose
callback removes it when the tensor dies. Each entry carries everything the
pack hook needs (the tensor's record, its block, the serial of the scope entry
that made it, the thread ledger it counts in), so nothing is reached through
another module's objects.

Invariants:

1. ``_LIVE[k] is e`` implies ``id(e()) == k`` while ``e()`` is alive; a dead
   entry is removed by its callback (or by :func:`forget`) exactly once, and
   only then is its ledger's ``died`` counted.
2. A ledger's ``born`` is written by its own thread only (the recording
   thread); ``died`` under ``_lock``, from whichever thread a tensor dies in.
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
    "on_death",
    "lookup",
    "forget",
    "note_alias",
    "tensor_of",
    "value_in_memory",
]

_lock = threading.Lock()


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


def add_empty_listener(fn: Callable[[Ledger], None]) -> None:
    """Call ``fn(ledger)`` whenever a ledger's live count drops to 0 (invariant 3)."""
    _empty_listeners.append(fn)


class Entry(weakref.ref):  # type: ignore[type-arg]
    """A weak reference to a block tensor that knows its block: the recorder's
    ``Var`` of the tensor is one. ``frame`` (the scope that made the tensor) gives
    ``frame.owner`` (its block's replay state), ``frame.serial`` and
    ``frame.ledger``. Compared and hashed by identity, not by referent."""

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


def _notify(lg: Ledger) -> None:
    for fn in _empty_listeners:
        fn(lg)


def on_death(entry: Entry) -> None:
    """The callback of every Entry (pass it when creating one)."""
    if _lock is None:  # interpreter shutdown: module globals are gone
        return
    with _lock:
        key = entry.key
        if _LIVE.get(key) is not entry:
            return  # forgotten already (invariant 1)
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
    if key in _LIVE:
        return False
    _LIVE[key] = entry
    entry.frame.ledger.born += 1  # invariant 2: only the recording thread registers
    return True


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
            key, lg = e.key, e.frame.ledger
            if _LIVE.get(key) is not e:
                continue
            del _LIVE[key]
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
