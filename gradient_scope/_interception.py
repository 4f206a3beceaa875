"""The saved-tensor interception that outlives a block: one module, one job.

While a thread has an open block or a live block-created tensor, a pack/unpack
pair of ours sits on that thread's saved-tensor hook stack. PyTorch's stack is
strictly LIFO and ``saved_tensors_hooks.__exit__`` pops whatever is on top, so
a hook context entered *before* a block and exited while our pair is still
needed would pop ours instead of its own. To keep PyTorch's innermost-wins rule
exactly, this module (and only this module), while any thread has our pair
installed:

* patches ``torch._C._autograd._pop_saved_tensors_default_hooks`` (which
  ``saved_tensors_hooks.__exit__`` looks up when it runs, so this also covers
  contexts entered before our pair was pushed) so that a pop while our pair is
  on top removes the innermost *other* pair -- the one whose context is
  exiting, since those exit in LIFO order among themselves -- from under ours;
* wraps ``torch.autograd.backward`` / ``torch.autograd.grad`` so that our pair
  leaves the stack as soon as backward returns when the last block tensor died
  during backward (the autograd engine restores the thread-local hook stack
  when a backward pass ends, so it cannot be popped from inside backward).

Both are restored exactly when the last thread's pair is removed.

Each pushed pair carries, in its pack callable, the pair directly below it:
tensors that are not ours are handed on to it exactly as without the scope.
A pair pushed above another context (a block started inside it) intercepts
only tensors of blocks started from then on: by the innermost-wins rule, the
context gets block tensors of blocks that were already open when it was
entered. (This also keeps torch.utils.checkpoint's count of saved tensors the
same in forward and in its recomputation.)
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import torch

from . import _registry
from ._registry import ThreadState, thread_state

__all__ = ["ensure_on_top", "sweep", "Entry"]

_A = torch._C._autograd
_push = _A._push_saved_tensors_default_hooks
_pop = _A._pop_saved_tensors_default_hooks


def _top() -> tuple[Callable[..., Any], Callable[..., Any]] | None:
    return _A._top_saved_tensors_default_hooks(False)


def _not_ready(*args: Any) -> Any:
    raise RuntimeError("gradient_scope: _saving was not imported")


# Set by _saving: (entry, tensor) -> packed object, and packed -> tensor.
pack_impl: Callable[[Entry, torch.Tensor], Any] = _not_ready
unpack_impl: Callable[[Any], torch.Tensor] = _not_ready


class Entry:
    """Our pack hook; one per push. ``below`` is the pair under it, or None.

    With a pair below, only tensors of blocks with serial >= ``serial`` are ours.
    """

    __slots__ = ("below", "serial")

    def __init__(self, below: tuple[Callable[..., Any], Callable[..., Any]] | None, serial: int) -> None:
        self.below = below
        self.serial = serial

    def __call__(self, t: torch.Tensor) -> Any:
        return pack_impl(self, t)


def _unpack(packed: Any) -> torch.Tensor:
    return unpack_impl(packed)


def _is_ours(pair: tuple[Callable[..., Any], Callable[..., Any]] | None) -> bool:
    return pair is not None and type(pair[0]) is Entry


def _push_ours(serial: int) -> None:
    top = _top()
    below = top[0].below if _is_ours(top) else top  # type: ignore[index, union-attr]
    _push(Entry(below, serial), _unpack)


def _take_stack() -> list[tuple[Callable[..., Any], Callable[..., Any]]]:
    pairs = []
    while (top := _top()) is not None:
        pairs.append(top)
        _pop()
    pairs.reverse()
    return pairs


def _restore_stack(pairs: list[tuple[Callable[..., Any], Callable[..., Any]]]) -> None:
    for pair in pairs:
        if _is_ours(pair):
            if not _is_ours(_top()):
                # A fresh entry (what is below may have changed); of adjacent
                # entries the lowest, which intercepts the most, stands for all.
                _push_ours(pair[0].serial)  # type: ignore[attr-defined]
        else:
            _push(*pair)


# ---------------------------------------------------------------- patches

_patch_lock = threading.Lock()
_installed_threads = 0
_orig_backward = torch.autograd.backward
_orig_grad = torch.autograd.grad


def _pop_patched() -> None:
    if not _is_ours(_top()):
        _pop()
        return
    # Our pair is on top, so the context now exiting is the innermost other
    # one (they exit in LIFO order among themselves): take it from under ours.
    pairs = _take_stack()
    for i in range(len(pairs) - 1, -1, -1):
        if not _is_ours(pairs[i]):
            del pairs[i]
            break
    else:
        pairs.pop()  # an unbalanced pop: do what PyTorch would do
    _restore_stack(pairs)


@functools.wraps(_orig_backward)
def _backward_patched(*args: Any, **kwargs: Any) -> Any:
    try:
        return _orig_backward(*args, **kwargs)
    finally:
        sweep()


@functools.wraps(_orig_grad)
def _grad_patched(*args: Any, **kwargs: Any) -> Any:
    try:
        return _orig_grad(*args, **kwargs)
    finally:
        sweep()


def _install_patches() -> None:
    _A._pop_saved_tensors_default_hooks = _pop_patched
    torch.autograd.backward = _backward_patched
    torch.autograd.grad = _grad_patched


def _remove_patches() -> None:
    _A._pop_saved_tensors_default_hooks = _pop
    torch.autograd.backward = _orig_backward
    torch.autograd.grad = _orig_grad


def patches_installed() -> bool:
    return _A._pop_saved_tensors_default_hooks is _pop_patched


# ---------------------------------------------------------------- lifetime


def ensure_on_top(state: ThreadState, serial: int) -> None:
    """Make our pair the innermost one in this thread (block ``serial`` starts)."""
    global _installed_threads
    if not _A._saved_tensors_hooks_is_enabled():  # type: ignore[attr-defined]
        raise RuntimeError(
            "recompute_scope cannot run here: saved-tensor hooks are disabled "
            f"({_A._saved_tensors_hooks_get_disabled_error_message()}). This happens "
            "inside torch.func transforms and torch.autograd.graph."
            "disable_saved_tensors_hooks; use recompute_scope(enabled=False) there."
        )
    if not state.installed:
        with _patch_lock:
            if _installed_threads == 0:
                _install_patches()
            _installed_threads += 1
        state.installed = True
    if not _is_ours(_top()):
        _push_ours(serial)


def _safe_to_edit(state: ThreadState) -> bool:
    return (
        state.ident == threading.get_ident()
        and state.busy == 0
        # Inside backward the engine restores the hook stack when the pass
        # ends: edits made now would be undone. Backward's wrapper sweeps.
        and torch._C._current_graph_task_id() == -1
    )


def sweep() -> None:
    """Remove this thread's pair if nothing needs it any more (a safe point)."""
    global _installed_threads
    state = thread_state()
    if not state.installed or state.needed() or not _safe_to_edit(state):
        return
    pairs = _take_stack()
    _restore_stack([p for p in pairs if not _is_ours(p)])
    state.installed = False
    with _patch_lock:
        _installed_threads -= 1
        if _installed_threads == 0:
            _remove_patches()


def _on_unneeded(state: ThreadState) -> None:
    # A weakref callback: may run in any thread, at any point. Only act when
    # it is this thread's own stack and nothing of ours is running.
    if state.ident == threading.get_ident():
        sweep()


_registry.on_unneeded = _on_unneeded
