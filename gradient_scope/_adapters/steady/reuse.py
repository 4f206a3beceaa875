"""D8 [ captures must be reused ]: a function's captures are paid for by the graphs' reuse.

A capture costs dynamo's trace (0.2-2 s on CPU for a transformer layer); a graph pays it back
only when later calls run it. A function that changes at every call (a Python constant, a
global, an object it guards on by identity) would pay a capture per call, up to the recompile
limit. So per function code, the graphs dynamo made for the steady state and how many of them
ran again are counted (:class:`History`): a function may have ``CAPTURES_FREE`` graphs before
any is reused, and ``CAPTURES_PER_REUSE`` more per graph reused (a model with a KV cache has a
graph per layer, each reused at the next step). Past that, a call still runs a graph dynamo
already has, but no new capture is started for it: dynamo's accumulated recompile limit is set
to 0 for the time of that call (``held_back``), so dynamo refuses at once, before tracing, and
the call is recorded (``recorded_why``: ``"captures not reused"``). After ``HELD_MAX`` such
calls with no graph reused at all, the function is recorded from then on, said once at INFO.
"""

from __future__ import annotations

import contextlib
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["History", "history", "held_back", "CAPTURES_FREE", "CAPTURES_PER_REUSE", "HELD_MAX"]

#: graphs a function may have before any of them is reused
CAPTURES_FREE = 8
#: more graphs allowed per graph of the function that ran again
CAPTURES_PER_REUSE = 8
#: calls held back with no graph reused, after which the function is recorded for good
HELD_MAX = 32


class History:
    """A function code's captures: ``graphs`` made, ``reused`` (graphs that ran again),
    ``held`` (calls that could not start a capture)."""

    __slots__ = ("graphs", "reused", "held", "__weakref__")

    def __init__(self) -> None:
        self.graphs = 0
        self.reused = 0
        self.held = 0

    def may_capture(self) -> bool:
        """Whether a call may start a new capture."""
        return self.graphs < CAPTURES_FREE + CAPTURES_PER_REUSE * self.reused

    def hopeless(self) -> bool:
        """Whether to record the function from now on: many calls held, no graph ever reused."""
        return self.reused == 0 and self.held >= HELD_MAX


_histories: weakref.WeakKeyDictionary[types.CodeType, History] = weakref.WeakKeyDictionary()


def history(fn: Callable[..., Any]) -> History:
    """The :class:`History` of ``fn``'s code (a bound method's function's; shared by the closures
    one ``def`` or ``lambda`` makes, as dynamo's cache is)."""
    code = getattr(fn, "__func__", fn).__code__
    found = _histories.get(code)
    if found is None:
        found = _histories[code] = History()
    return found


def held_back() -> contextlib.AbstractContextManager[Any]:
    """D8 [ captures must be reused ]: for the time of one call, dynamo runs only graphs it
    has; a new capture is refused before it traces anything (its recompile-limit error)."""
    return torch._dynamo.config.patch(accumulated_recompile_limit=0)
