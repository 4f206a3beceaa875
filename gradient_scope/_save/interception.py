"""The thread's saved-tensor hook pair and its lifetime: the only module that edits
PyTorch's saved-tensor hook stack or patches PyTorch.

RULES I1..I9: the hook pair's invariants.

I1. [ one pair of ours while needed ] While a thread has an open block, a live block
    tensor or an open model region (``_save.pack``
    S6 [ a region's saves go to its observer ]), exactly one pair of ours is on its hook
    stack, innermost unless a context was entered after it; when it has none of them, at
    the next safe point (I4 [ stacks edited at safe points only ]), the pair leaves and
    the stack is exactly what it would be without the scope. Blocks and regions are
    numbered in one sequence (:func:`next_serial`).
I2. [ the pair below gets the rest ] Our pack callable carries the pair directly below
    it and hands it every tensor that is not ours
    (S2 [ anything else as without the scope ] in ``_save.pack``). A pair pushed above
    another context (a block started inside it) intercepts only tensors of blocks
    started from then on (block serials): by PyTorch's innermost-wins rule the context
    gets the tensors of blocks that were already open when it was entered. (This also
    keeps torch.utils.checkpoint's count of saved tensors the same in forward and in its
    recomputation.)
I3. [ the pop patch ] ``saved_tensors_hooks.__exit__`` pops whatever is on top, and
    looks ``torch._C._autograd._pop_saved_tensors_default_hooks`` up when it runs. While
    any thread has our pair, that attribute is our pop: a pop while our pair is on top
    removes the innermost *other* pair -- the one whose context is exiting, since other
    contexts exit in LIFO order among themselves -- from under ours.
I4. [ stacks edited at safe points only ] A thread's stack is edited only by that
    thread, never inside our own pack or unpack (exiting hooks from inside a hook has
    crashed PyTorch, pytorch/pytorch#130734), and never inside a backward pass (the
    engine restores the thread's stack when the pass ends): ``torch.autograd.backward``
    and ``torch.autograd.grad`` are wrapped to sweep when they return.
I5. [ patches live with our pairs ] The patches of I3 [ the pop patch ],
    I4 [ stacks edited at safe points only ] and I6 [ hooks disabled: the refusal ] are
    installed while any thread has our pair, and removed with the last one. Removal puts
    back an attribute only if it still holds our patch; if something wrapped ours
    meanwhile, ours stays in that chain, inert (it acts only while some thread has our
    pair), and is not installed a second time.
I6. [ hooks disabled: the refusal ] ``torch.autograd.graph.disable_saved_tensors_hooks``
    (what ``torch.func``'s grad/vjp/jacrev enter) refuses while any pair is on the
    stack, with its caller's message; while this thread has our pair, the refusal also
    says that the pair is ours and how to avoid it. It looks
    ``torch._C._autograd._saved_tensors_hooks_disable`` up when it runs.
I7. [ inside backward, the engine's stack ] Inside a backward pass (a checkpoint's
    recomputation, a custom backward) a thread's stack is the engine's copy, which the
    engine drops when the node ends: a pair pushed there needs no sweep, and the thread
    counts as having our pair (I5 [ patches live with our pairs ]) until the pass ends,
    when an engine callback queued at its first push in that pass releases it (in
    whichever thread ends the pass; also when the pass raises: then the callback is
    dropped unrun, and releases as it dies). Without it, a scope whose blocks run only
    inside passes would leave the patches installed: no sweep outside a pass follows.
I8. [ the main thread's pair, removed later ] When the last tensor of the main thread's
    blocks dies in another thread (a worker ran backward), the main thread removes its
    pair at its next bytecode boundary (a pending call, ``_base.main_thread``), unless
    it is then inside a backward pass (the wrapper of
    I4 [ stacks edited at safe points only ] sweeps when it returns) or in code that
    edits the stack or enters a scope (then at the boundary after). Another thread's
    pair waits for that thread's next safe point: its next scope, backward or grad call,
    or torch.func call (I6 [ hooks disabled: the refusal ] sweeps first).
I9. [ told before backward ] Callables registered with :func:`add_before_backward` run
    when a backward pass is entered through ``torch.autograd.backward`` or ``grad``
    (``Tensor.backward`` calls the former) outside any pass, while the patches of
    I4 [ stacks edited at safe points only ] are in place, before the engine runs. A
    budget's first-step agreement runs there, before any replay (``_budget.agree``
    A5 [ the first step is checked before its backward ]). What one raises leaves the
    pass unstarted and propagates to the caller.
"""

from __future__ import annotations

import functools
import itertools
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch

from .._base.main_thread import call_in_main_thread
from .._base.torch_compat import (
    HookPair,
    current_graph_task,
    pop_attribute_owner,
    pop_saved_hooks,
    push_saved_hooks,
    queue_engine_callback,
    saved_hooks_disabled_message,
    saved_hooks_enabled,
    skip_dynamo,
    top_saved_hooks,
)
from .._record import recorder as _recorder
from .._record import registry as _registry
from . import pack as _pack

__all__ = ["ensure_on_top", "sweep", "next_serial", "add_unsafe_file", "on_empty", "add_before_backward"]

_serials = itertools.count(1)


def next_serial() -> int:
    """The serial of a block or region about to start (entry order,
    I1 [ one pair of ours while needed ], I2 [ the pair below gets the rest ])."""
    return next(_serials)


class _Thread:
    """This module's per-thread state."""

    __slots__ = ("ident", "outside", "passes", "busy")

    def __init__(self) -> None:
        self.ident = threading.get_ident()
        self.outside = False  # our pair may be on this thread's own stack
        # backward passes that pushed our pair here (I7 [ inside backward, the engine's stack ])
        self.passes: set[int] = set()
        self.busy = 0  # > 0: inside our pack/unpack (I4 [ stacks edited at safe points only ])

    @property
    def installed(self) -> bool:
        """Whether this thread counts as having our pair (I5 [ patches live with our pairs ])."""
        return self.outside or bool(self.passes)


_tls = threading.local()


def _thread() -> _Thread:
    st: _Thread | None = getattr(_tls, "st", None)
    if st is None:
        st = _tls.st = _Thread()
    return st


class _Pack:
    """Our pack hook; one per push. ``below`` is the pair under it
    (I2 [ the pair below gets the rest ])."""

    __slots__ = ("below", "serial")

    def __init__(self, below: HookPair | None, serial: int) -> None:
        self.below = below
        self.serial = serial

    def __call__(self, t: torch.Tensor) -> Any:
        st = _thread()
        st.busy += 1
        try:
            return _pack.pack(self.below, self.serial, t)
        finally:
            st.busy -= 1


def _unpack(packed: Any) -> torch.Tensor:
    if type(packed) is _pack.Stored:  # most unpacks: a tensor stored as autograd stores it
        t = packed.t
        if t._version == packed.version:
            # I4 [ stacks edited at safe points only ] holds: this path allocates nothing a garbage
            # collection could follow
            return t
    st = _thread()
    st.busy += 1
    try:
        return _pack.unpack(packed)
    finally:
        st.busy -= 1


def _is_ours(pair: HookPair | None) -> bool:
    return pair is not None and type(pair[0]) is _Pack


def _push_ours(serial: int) -> None:
    top = top_saved_hooks()
    below = top[0].below if top is not None and type(top[0]) is _Pack else top
    push_saved_hooks(_Pack(below, serial), _unpack)


def _take_stack() -> list[HookPair]:
    pairs = []
    while (top := top_saved_hooks()) is not None:
        pairs.append(top)
        pop_saved_hooks()
    pairs.reverse()
    return pairs


def _restore_stack(pairs: list[HookPair]) -> None:
    for pair in pairs:
        if _is_ours(pair):
            if not _is_ours(top_saved_hooks()):
                # A fresh pack hook (what is below may have changed); of adjacent
                # ones the lowest, which intercepts the most, stands for all.
                _push_ours(pair[0].serial)  # type: ignore[attr-defined]
        else:
            push_saved_hooks(*pair)


# ---------------------------------------------------------------- patches
# (I3 [ the pop patch ], I5 [ patches live with our pairs ], I6 [ hooks disabled: the refusal ])

_patch_lock = threading.Lock()
_threads_installed = 0  # threads with our pair; the patches act while > 0


def _popping(inner: Callable[[], None]) -> Callable[[], None]:
    @functools.wraps(inner)
    def pop() -> None:
        if _threads_installed == 0 or not _is_ours(top_saved_hooks()):
            inner()
        else:
            _pop_from_under_ours()

    return pop


def _pop_from_under_ours() -> None:
    # I3 [ the pop patch ]: the context now exiting is the innermost other one: take it from
    # under ours.
    pairs = _take_stack()
    for i in range(len(pairs) - 1, -1, -1):
        if not _is_ours(pairs[i]):
            del pairs[i]
            break
    else:
        pairs.pop()  # an unbalanced pop: do what PyTorch would do
    _restore_stack(pairs)


TORCH_FUNC_HINT = (
    "gradient_scope: its saved-tensor hooks are on this thread's stack, and stay there while "
    "a tensor made in a recompute_scope is alive. Fix: let the block's tensors die first "
    "(finish backward, `del` them), or run the scoped code with scopes turned off: "
    "`with gradient_scope.disabled(): ...` (or GRADIENT_SCOPE_DISABLE=1)."
)


def _explaining_refusal(inner: Callable[[str], None]) -> Callable[[str], None]:
    @functools.wraps(inner)
    def disable(message: str) -> None:
        sweep()  # a pair that nothing needs any more (I8 [ the main thread's pair, removed later ]) leaves first
        try:
            inner(message)
        except RuntimeError as e:
            st: _Thread | None = getattr(_tls, "st", None)
            if _threads_installed == 0 or st is None or not st.installed:
                raise
            raise RuntimeError(f"{e}\n{TORCH_FUNC_HINT}") from None  # I6 [ hooks disabled: the refusal ]

    return disable


# I9 [ told before backward ]
_before_backward: list[Callable[[], None]] = []


def add_before_backward(fn: Callable[[], None]) -> Callable[[], None]:
    """Run ``fn()`` when the next backward pass is entered (I9 [ told before backward ]),
    and at every one after until the returned remover is called."""
    _before_backward.append(fn)

    def remove() -> None:
        if fn in _before_backward:
            _before_backward.remove(fn)

    return remove


def _sweeping(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if _before_backward and _threads_installed and current_graph_task() == -1:
            for before in list(_before_backward):  # I9 [ told before backward ]
                before()
        try:
            return fn(*args, **kwargs)
        finally:
            if _threads_installed:
                sweep()  # I4 [ stacks edited at safe points only ]

    return wrapper


class _Patch:
    """One attribute we replace while any thread has our pair
    (I5 [ patches live with our pairs ])."""

    def __init__(self, owner: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        self.owner, self.name, self.make = owner, name, make
        self.ours: Callable[..., Any] | None = None  # our patch, while it is in place
        self.inner: Callable[..., Any] | None = None  # what it replaced
        # The last (function, our wrapper of it): the pair comes and goes every step, the
        # function it wraps rarely changes.
        self.made: tuple[Callable[..., Any], Callable[..., Any]] | None = None

    def install(self) -> None:
        current = getattr(self.owner, self.name)
        if self.ours is not None and _in_chain(current, self.ours):
            return  # still in place, possibly wrapped by someone else: inert until now
        if self.made is None or self.made[0] is not current:
            self.made = (current, self.make(current))
        self.inner, self.ours = self.made
        setattr(self.owner, self.name, self.ours)

    def remove(self) -> None:
        if self.ours is not None and getattr(self.owner, self.name) is self.ours:
            setattr(self.owner, self.name, self.inner)
            self.ours = self.inner = None


def _in_chain(fn: Any, target: Any) -> bool:
    """Whether ``target`` is ``fn`` or is wrapped by it (``functools.wraps`` chains)."""
    seen = 0
    while fn is not None and seen < 64:
        if fn is target:
            return True
        fn = getattr(fn, "__wrapped__", None)
        seen += 1
    return False


_PATCHES = (
    _Patch(pop_attribute_owner(), "_pop_saved_tensors_default_hooks", _popping),
    _Patch(torch.autograd, "backward", _sweeping),
    _Patch(torch.autograd, "grad", _sweeping),
    _Patch(pop_attribute_owner(), "_saved_tensors_hooks_disable", _explaining_refusal),
)


# ---------------------------------------------------------------- lifetime
# (I1 [ one pair of ours while needed ], I4 [ stacks edited at safe points only ])


def _hold(st: _Thread, task: int) -> None:
    """``st``'s thread has our pair outside any backward pass (``task`` -1) or in
    backward pass ``task``; the patches are in place while some thread has it
    (I5 [ patches live with our pairs ])."""
    global _threads_installed
    with _patch_lock:
        if not st.installed:
            if _threads_installed == 0:
                for p in _PATCHES:
                    p.install()
            _threads_installed += 1
        if task == -1:
            st.outside = True
        else:
            st.passes.add(task)


def _release(st: _Thread, task: int) -> None:
    """The opposite of ``_hold(st, task)``; may run in another thread than ``st``'s
    (I7 [ inside backward, the engine's stack ])."""
    global _threads_installed
    with _patch_lock:
        was = st.installed
        if task == -1:
            st.outside = False
        else:
            st.passes.discard(task)
        if was and not st.installed:
            _threads_installed -= 1
            if _threads_installed == 0:
                for p in _PATCHES:
                    p.remove()


class _PassEnd:
    """Releases a thread's hold for backward pass ``task``
    (I7 [ inside backward, the engine's stack ]): called by the engine when the pass ends, and
    dropped with the pass, also when the pass raises (the engine then skips its callbacks)."""

    __slots__ = ("st", "task")

    def __init__(self, st: _Thread, task: int) -> None:
        self.st, self.task = st, task

    def __call__(self) -> None:
        _release(self.st, self.task)

    def __del__(self) -> None:
        _release(self.st, self.task)


_dynamo_told = False


def _skip_dynamo() -> None:
    """Tell dynamo never to trace our hooks, nor what they call (replays): a compiled
    function's saves call them while dynamo compiles the frames it enters."""
    global _dynamo_told
    _dynamo_told = True
    skip_dynamo(_Pack.__call__.__code__)
    skip_dynamo(_unpack.__code__)


def ensure_on_top(serial: int) -> None:
    """Make our pair the innermost one in this thread: block ``serial`` starts."""
    if not _dynamo_told:
        _skip_dynamo()
    if not saved_hooks_enabled():
        raise RuntimeError(
            "recompute_scope cannot run here: saved-tensor hooks are disabled "
            f"({saved_hooks_disabled_message()}). This happens inside torch.func transforms "
            "and torch.autograd.graph.disable_saved_tensors_hooks. Fix: turn scopes off around "
            "the call, `with gradient_scope.disabled(): ...`, or use recompute_scope(enabled=False) "
            "there."
        )
    st = _thread()
    task = current_graph_task()
    if task == -1:
        if not st.outside:
            _hold(st, -1)
    elif task not in st.passes:
        _hold(st, task)
        queue_engine_callback(_PassEnd(st, task))  # (if it raises, _PassEnd dies: released)
    if not _is_ours(top_saved_hooks()):
        _push_ours(serial)


def _needed() -> bool:
    return _recorder.has_open_block() or _registry.ledger().live > 0 or _pack.regions_open()


def sweep() -> None:
    """Remove this thread's pair if nothing needs it any more and it is safe
    (I1 [ one pair of ours while needed ], I4 [ stacks edited at safe points only ])."""
    st: _Thread | None = getattr(_tls, "st", None)
    if st is None or not st.outside or st.busy or current_graph_task() != -1 or _needed():
        return
    _restore_stack([p for p in _take_stack() if not _is_ours(p)])
    _release(st, -1)


_MAIN = threading.main_thread().ident
# Files whose code edits the stack, or runs between a push of our pair and the opening
# of its block (a scope's entry): I8 [ the main thread's pair, removed later ] waits until the
# main thread is out of them.
_unsafe_files = {__file__}


def add_unsafe_file(path: str) -> None:
    """Tell I8 [ the main thread's pair, removed later ] that code in ``path`` may run between a
    push of our pair and the opening of its block (a scope's entry)."""
    _unsafe_files.add(path)


def on_empty(lg: _registry.Ledger) -> None:
    """The registry's empty-ledger listener (registered by the package): the last block
    tensor of ``lg`` died, so our pair may leave the stack
    (I4 [ stacks edited at safe points only ], I8 [ the main thread's pair, removed later ])."""
    # Called where the last tensor died: any thread, any point
    # (I4 [ stacks edited at safe points only ]). Died in another
    # thread than the ledger's: the main thread sweeps at its next bytecode boundary
    # (I8 [ the main thread's pair, removed later ]).
    if lg.ident == threading.get_ident():
        sweep()
    elif lg.ident == _MAIN:
        call_in_main_thread(_sweep_main)


def _sweep_main() -> None:
    """I8 [ the main thread's pair, removed later ]: in the main thread, between two of its
    bytecodes."""
    st: _Thread | None = getattr(_tls, "st", None)
    if st is None or not st.outside or current_graph_task() != -1 or _needed():
        return  # nothing to do, or later: a backward's end sweeps, a block's last tensor calls again
    f: Any = sys._getframe(1)
    while f is not None and f.f_code.co_filename not in _unsafe_files:
        f = f.f_back
    if f is not None or st.busy:  # editing the stack, or entering a scope: at the next boundary
        call_in_main_thread(_sweep_main)
        return
    sweep()
