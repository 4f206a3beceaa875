"""Dynamo as the steady state calls it: one entry for every function, quiet, with hook guards.

Q1. [ one entry, nothing kept per function ] Every function is captured through one compiled
    trampoline (``entry``) whose own frame dynamo skips (``skip_code``): dynamo compiles the
    frame of the function it calls, with its cache on that function's code, as
    ``torch.compile(fn)`` would. Nothing here holds a function, its closure or its module: a
    model whose forward checkpoints a lambda over ``self`` dies with its last reference.
Q2. [ our captures are quiet ] While dynamo captures a function for the steady state (from the
    call until our graph runs: ``hushed``), nothing it logs (the recompile limit, graph breaks)
    and no warning it issues through ``warn_once`` (a ``functools.lru_cache`` in traced code)
    reaches the user: the user's program, run eagerly when a capture fails, says what it says.
    The records of ``torch`` loggers are dropped by a filter that lets everything through
    outside such a capture, in every thread; ``torch._dynamo.utils.warn_once`` is replaced
    only while a capture is under way in some thread. Dynamo's configuration is not touched
    but for Q3's and Q5's flags, for the time of one of our compiles.
Q3. [ hooks are guarded ] Dynamo does not guard on a module's empty hook dicts
    (``config.skip_nnmodule_hook_guards``): a hook added after a capture, or present on another
    instance than the one captured, would be skipped. Our captures build their guards with the
    flag off (set in our backend, put back when the compiled call returns or the graph first
    runs): each call checks the hook dicts of the modules it traced, and a changed one
    recaptures.
Q4. [ a recompile budget of our own ] Dynamo counts graphs per code object, and by default a
    user's ``torch.compile`` of a layer's forward shares that count with our captures of it
    (8 graphs: a model's 16 layers with a KV cache, or 9 padded lengths, used it up for both).
    Where torch has ``isolate_recompiles``, our captures keep their graphs in a region of their
    own with ``RECOMPILE_LIMIT`` graphs per function; past it a call is recorded. (With sizes
    symbolic from a function's second length on, what uses them up is a graph per layer.)
Q5. [ floats stay constants ] Dynamo (``specialize_float=False``, torch's default) turns a Python
    float that changed between two calls into a tensor input read by ``.item()``: the graph then
    runs an op the eager function does not, which the steady state rejects
    (D6 [ the graph must run the eager ops ]). Our captures trace with ``specialize_float`` on
    (set by a compile-start callback while this thread captures for us, put back by the
    compile-end one): a float is a constant of the graph, and a new value is a new graph
    (D8 [ captures must be reused ] of the steady state). Sizes and integers still become
    symbolic (one graph for every length).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["entry", "hushed", "hush", "guard_hooks", "hooks_guarded"]

_local = threading.local()
_lock = threading.Lock()
_depth = 0  # captures under way, all threads (Q2 [ our captures are quiet ])
_warn_once: list[Callable[..., None]] = []  # dynamo's own, while ours replaces it
_filtered = 0  # how many loggers existed when the filter was last put on them


def _quiet() -> bool:
    return getattr(_local, "on", False)


class _Filter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not _quiet()


_FILTER = _Filter()


def _hushed_warn_once(msg: str, stacklevel: int = 1) -> None:
    if not _quiet():
        _warn_once[0](msg, stacklevel + 1)


def _filter_loggers() -> None:
    """Q2: the filter on every ``torch`` logger (once per logger: it stays, and passes every
    record outside our captures)."""
    global _filtered
    names = logging.Logger.manager.loggerDict
    if len(names) == _filtered:
        return
    _filtered = len(names)
    for name, logger in list(names.items()):
        if (name == "torch" or name.startswith("torch.")) and isinstance(logger, logging.Logger):
            logger.addFilter(_FILTER)


def hush(on: bool) -> bool:
    """Q2: turn this thread's quiet on or off; returns what it was."""
    prior = _quiet()
    _local.on = on
    return prior


class hushed:
    """Q2 [ our captures are quiet ]: the ``with`` block calls dynamo for the steady state."""

    __slots__ = ("prior",)

    def __enter__(self) -> None:
        global _depth
        _filter_loggers()
        utils = torch._dynamo.utils
        with _lock:
            if _depth == 0:
                _warn_once[:] = [utils.warn_once]
                utils.warn_once = _hushed_warn_once
                handler = torch._dynamo.callback.callback_handler
                if _float_constants not in handler.start_callbacks:  # (torch._dynamo.reset() clears them)
                    handler.register_start_callback(_float_constants)
                    handler.register_end_callback(_floats_put_back)
            _depth += 1
        self.prior = hush(True)

    def __exit__(self, *exc: object) -> None:
        global _depth
        hush(self.prior)
        with _lock:
            _depth -= 1
            if _depth == 0:
                torch._dynamo.utils.warn_once = _warn_once.pop()
        hooks_guarded()


def _float_constants(args: Any) -> None:
    """Q5 [ floats stay constants ]: at the start of a compile, ours when this thread captures
    for the steady state."""
    if _quiet() and getattr(_local, "floats", None) is None:
        config = torch._dynamo.config
        _local.floats = config.specialize_float
        config.specialize_float = True


def _floats_put_back(args: Any) -> None:
    """Q5: dynamo's flag as it was, at the end of our compile."""
    prior = getattr(_local, "floats", None)
    if prior is not None:
        _local.floats = None
        torch._dynamo.config.specialize_float = prior


def guard_hooks() -> None:
    """Q3 [ hooks are guarded ]: called by our backend, before dynamo builds the guards of
    the graph it gives us."""
    config = torch._dynamo.config
    if getattr(_local, "hooks", None) is None:
        _local.hooks = config.skip_nnmodule_hook_guards
        config.skip_nnmodule_hook_guards = False


def hooks_guarded() -> None:
    """Q3: dynamo's flag put back (the guards of our capture are built)."""
    prior = getattr(_local, "hooks", None)
    if prior is not None:
        _local.hooks = None
        torch._dynamo.config.skip_nnmodule_hook_guards = prior


def _trampoline(f: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    return f(*args, **kwargs)


_entries: dict[Any, Callable[..., Any]] = {}


def entry(backend: Callable[..., Any]) -> Callable[..., Any]:
    """Q1 [ one entry, nothing kept per function ]: ``entry(backend)(fn, *args, **kwargs)``
    runs ``fn`` as ``torch.compile(fn, backend=backend, fullgraph=True)`` would.

    Example::

        >>> import torch
        >>> from gradient_scope._adapters.dynamo import entry
        >>> run = entry(lambda gm, example_inputs: gm.forward)
        >>> run(lambda x: x * 2, torch.ones(2))
        tensor([2., 2.])
    """
    found = _entries.get(backend)
    if found is None:
        from torch._dynamo.eval_frame import skip_code

        skip_code(_trampoline.__code__)
        found = _entries[backend] = torch.compile(
            _trampoline, backend=backend, fullgraph=True, dynamic=None, **_own_region()
        )
    return found


#: Q4 [ a recompile budget of our own ]: graphs one function may have in our captures (a
#: graph per length of padded batches, or per layer where a KV cache indexes its layer)
RECOMPILE_LIMIT = 64


def _own_region() -> dict[str, Any]:
    """Q4: the arguments that give our captures their own recompile budget, apart from the
    user's ``torch.compile`` of the same code (where this torch has them, as 2.13 does)."""
    import inspect

    params = inspect.signature(torch.compile).parameters
    if "isolate_recompiles" in params and "recompile_limit" in params:
        return {"isolate_recompiles": True, "recompile_limit": RECOMPILE_LIMIT}
    return {}
