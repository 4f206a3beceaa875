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
from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "Entry",
    "Ledger",
    "ledger",
    "add_empty_listener",
    "register",
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
    """A weak reference to a live block tensor, with what the pack hook needs."""

    __slots__ = ("var", "block", "serial", "ledger", "aliases")

    var: Any  # the tensor's record (a ``_record.Var``)
    block: Any  # the replay state of the block that made it
    serial: int  # of the scope entry that made it
    ledger: Ledger
    # Aliases that other blocks read of this tensor (same storage and version
    # counter). An entry lives while its tensor lives or a handle of it is pending,
    # so its value stays in memory exactly as long as something may ask for it.
    aliases: list[torch.Tensor] | None


_LIVE: dict[int, Entry] = {}


def _notify(lg: Ledger) -> None:
    for fn in _empty_listeners:
        fn(lg)


def _on_death(entry: Entry) -> None:
    if _lock is None:  # interpreter shutdown: module globals are gone
        return
    with _lock:
        key = entry.var.key
        if _LIVE.get(key) is not entry:
            return  # forgotten already (invariant 1)
        del _LIVE[key]
        lg = entry.ledger
        lg.died += 1
        empty = lg.born == lg.died
    if empty:
        _notify(lg)


def register(t: torch.Tensor, var: Any, block: Any, serial: int, lg: Ledger) -> Entry | None:
    """Record that ``t`` was made by ``block``; None if ``t`` is already registered
    (an op returned an existing block tensor: the first record of it stands)."""
    key = id(t)
    if key in _LIVE:
        return None
    entry = Entry(t, _on_death)
    entry.var = var
    entry.block = block
    entry.serial = serial
    entry.ledger = lg
    entry.aliases = None
    _LIVE[key] = entry
    lg.born += 1  # invariant 2: only the recording thread registers
    return entry


def lookup(t: torch.Tensor) -> Entry | None:
    """The entry of a live block tensor, or None."""
    entry = _LIVE.get(id(t))
    if entry is not None and entry() is t:
        return entry
    return None


def forget(vars: list[Any]) -> None:
    """Forget the tensors of ``vars`` (an aborted block): they become ordinary tensors."""
    emptied: list[Ledger] = []
    with _lock:
        for var in vars:
            entry = _LIVE.get(var.key)
            if entry is not None and entry.var is var:
                del _LIVE[var.key]
                lg = entry.ledger
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


def tensor_of(var: Any) -> torch.Tensor | None:
    """The live tensor ``var`` stands for, or None."""
    entry = _LIVE.get(var.key)
    if entry is not None and entry.var is var:
        return entry()
    return None


def value_in_memory(entry: Entry, version: int) -> torch.Tensor | None:
    """The entry's tensor, or an alias of it another block holds, at ``version``."""
    t = entry()
    if t is not None:
        return t if t._version == version else None
    for a in entry.aliases or ():
        if a._version == version:
            return a
    return None
