"""When a function may start a capture: D8 [ captures must be reused ].

Implements D8 [ captures must be reused ] of ``run`` for it: per function code, the graphs
dynamo made for the steady state and how many of them ran again (:class:`History`), and the
setting under which a held call runs only the graphs dynamo has (``held_back``).
"""

from __future__ import annotations

import contextlib
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["History", "code_of", "history", "held_back", "CAPTURES_FREE", "CAPTURES_PER_REUSE", "HELD_MAX"]

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


def code_of(fn: Callable[..., Any]) -> types.CodeType:
    """The code what the steady state knows of ``fn`` is kept by: a bound method's function's,
    shared by the closures one ``def`` or ``lambda`` makes, as dynamo's cache is."""
    return getattr(fn, "__func__", fn).__code__


def history(fn: Callable[..., Any]) -> History:
    """The :class:`History` of ``fn``'s code (:func:`code_of`)."""
    code = code_of(fn)
    found = _histories.get(code)
    if found is None:
        found = _histories[code] = History()
    return found


def held_back() -> contextlib.AbstractContextManager[Any]:
    """D8 [ captures must be reused ]: for the time of one call, dynamo runs only graphs it
    has; a new capture is refused before it traces anything (its recompile-limit error)."""
    patched: contextlib.AbstractContextManager[Any] = torch._dynamo.config.patch(accumulated_recompile_limit=0)
    return patched
