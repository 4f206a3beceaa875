"""Run a function in the main thread soon, from any thread.

CPython runs "pending calls" (``Py_AddPendingCall``, public C API since Python 3.0)
in the main thread, between two bytecodes, at the next check of its eval breaker
(function entries, loop back-edges): within microseconds while it runs Python code,
as soon as it returns to Python when it waits in C (a ``join``, a lock). No other
thread can be reached that way; this is the only way to act in the main thread
without its cooperation.

A pending call interrupts whatever Python code the main thread runs, at any bytecode
boundary: the function must check that its moment is safe, and may ask to be called
again (:func:`call_in_main_thread` returns whether it was queued; CPython's queue holds
32 calls).
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from collections.abc import Callable

__all__ = ["call_in_main_thread", "is_main_thread"]

_PENDING = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
_queued: list[Callable[[], None]] = []
_lock = threading.Lock()


def _run(_: int | None) -> int:
    # Called by CPython in the main thread with the GIL held; must return 0 (-1 would
    # raise a pending exception in the main thread's code).
    with _lock:
        fns = list(_queued)
        _queued.clear()
    for fn in fns:
        with contextlib.suppress(BaseException):  # the main thread's code must not see it
            fn()
    return 0


_RUN = _PENDING(_run)  # kept for the life of the process: CPython holds a bare pointer
_add_pending_call = getattr(ctypes.pythonapi, "Py_AddPendingCall", None)


def is_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def call_in_main_thread(fn: Callable[[], None]) -> bool:
    """Queue ``fn()`` to run in the main thread at its next bytecode boundary (once, for
    any number of queueings before it runs). False if it could not be queued."""
    if _add_pending_call is None:
        return False
    with _lock:
        if fn in _queued:
            return True
        _queued.append(fn)
        if len(_queued) > 1:
            return True  # a call is already pending: it runs every queued function
    if _add_pending_call(_RUN, None) != 0:
        with _lock:
            _queued.clear()
        return False
    return True
