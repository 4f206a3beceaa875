"""A drop-in for ``torch.utils.checkpoint.checkpoint`` that runs the function in a scope."""

from __future__ import annotations

import functools
import inspect
import sys
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch._dynamo
import torch.nn as nn
from torch.utils.checkpoint import noop_context_fn
from torch.utils.weak import WeakIdKeyDictionary

from .._base.errors import check_bool
from .._base.feedback import closest, unknown_options
from .._base.stats import ScopeStats, compiled_sink
from .._budget.budget import Budget
from .scope import counting_into, recompute_scope, run_in_scope, traced_scope

__all__ = ["checkpoint", "checkpoint_stats", "checkpoint_compiled", "reset_checkpoint_stats"]

# The counters of the scopes checkpoint ran for each module (read by model_stats).
_stats: weakref.WeakKeyDictionary[nn.Module, ScopeStats] = weakref.WeakKeyDictionary()
# What the compiled graphs of checkpoint(module, ...) hold, by the module's first weight
# and its number of weights (a parent whose weights are all one child's has the same
# entry: model_stats gives it to the deepest of them), with the key compiled code passes
# to the compile adapter (``_base.stats.compiled_sink``, which holds the stats weakly).
_compiled: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensor -> {count: (stats, key)}


def _owner(function: Any) -> nn.Module | None:
    if isinstance(function, nn.Module):
        return function
    # ``isinstance`` and ``.__self__``, not ``getattr(function, "__self__", None)``: dynamo
    # traces this while it compiles, and its getattr with a default misses a method's self.
    owner = function.__self__ if isinstance(function, types.MethodType) else None
    return owner if isinstance(owner, nn.Module) else None


def _module_of(function: Any) -> nn.Module | None:
    """The module ``function`` runs: the module itself, the owner of a bound method,
    or the module a ``functools.partial`` passes first to an unbound forward
    (transformers passes ``partial(forward, layer, **kwargs)``)."""
    while isinstance(function, functools.partial):
        inner = function.func
        if not isinstance(inner, functools.partial) and _owner(inner) is None:
            first = function.args[0] if function.args else None
            return first if isinstance(first, nn.Module) else None
        function = inner
    return _owner(function)


def checkpoint_stats(module: nn.Module) -> ScopeStats | None:
    """The summed counters of the scopes :func:`checkpoint` ran for ``module``, or None."""
    return _stats.get(module)


def checkpoint_compiled(module: nn.Module) -> ScopeStats | None:
    """What the compiled graphs of :func:`checkpoint` calls of ``module`` hold (once per
    graph compiled), or None: never called in compiled code, or ``module`` has no weights."""
    weights = list(module.parameters())
    entries: dict[int, tuple[ScopeStats, int]] = _compiled.get(weights[0], {}) if weights else {}
    found = entries.get(len(weights))
    return found[0] if found is not None and found[0] != ScopeStats() else None


def _compiled_sink(first: torch.Tensor, count: int) -> int:
    """The key under which compiled scopes of the module whose first weight is ``first``
    (of ``count``) count. Dynamo runs it for real while it traces
    (``assume_constant_result``): it takes the real tensor of a graph input without a
    guard, so a graph compiled for one module serves the others as before (its figures
    are the module's that compiled it); a guard on the module itself would compile
    once per module."""
    entries: dict[int, tuple[ScopeStats, int]] = _compiled.setdefault(first, {})
    found = entries.get(count)
    if found is None:
        stats = ScopeStats()
        found = entries[count] = (stats, compiled_sink(stats))
    return found[1]


_compiled_sink = torch._dynamo.assume_constant_result(_compiled_sink)


def reset_checkpoint_stats(module: nn.Module) -> None:
    # Dropped, not zeroed: scopes still in flight keep counting into the old object.
    _stats.pop(module, None)


def _function_name(fn: Any) -> str:
    """``fn`` named for errors: a module's class, ``Class.method``, a function's qualname."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    if isinstance(fn, nn.Module):
        return type(fn).__name__
    owner = getattr(fn, "__self__", None)
    if isinstance(owner, nn.Module):
        return f"{type(owner).__name__}.{getattr(fn, '__name__', '?')}"
    return str(getattr(fn, "__qualname__", type(fn).__name__))


_near_option: dict[str, bool] = {}  # keyword -> whether it resembles an option of checkpoint


def _check_keywords(function: Any, kwargs: dict[str, Any]) -> None:
    """A keyword that resembles an option of checkpoint (``presrve_rng_state``) and that
    ``function`` does not take is a misspelled option: raise, naming the options."""
    suspicious = []
    for key in kwargs:
        near = _near_option.get(key)
        if near is None:
            near = bool(closest(key, _OPTIONS, cutoff=0.8))
            if len(_near_option) < 4096:
                _near_option[key] = near
        if near:
            suspicious.append(key)
    if not suspicious:
        return
    try:
        params = inspect.signature(function.forward if isinstance(function, nn.Module) else function).parameters
    except (TypeError, ValueError):  # no signature to read (some builtins): the function decides
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    unknown = [k for k in suspicious if k not in params or params[k].kind is inspect.Parameter.POSITIONAL_ONLY]
    if unknown:
        error = unknown_options("gradient_scope.checkpoint", unknown, _OPTIONS)
        raise TypeError(
            f"{error} (other keyword arguments are passed to the function, "
            f"which takes no {', '.join(map(repr, unknown))})"
        )


def checkpoint(
    function: Callable[..., Any],
    *args: Any,
    use_reentrant: bool | None = None,
    preserve_rng_state: bool = True,
    context_fn: Callable[[], Any] = noop_context_fn,
    determinism_check: str = "default",
    debug: bool = False,
    early_stop: bool = True,
    respect_saved_tensors_hooks: bool | None = None,
    budget: Budget | None = None,
    **kwargs: Any,
) -> Any:
    """Drop-in for ``torch.utils.checkpoint.checkpoint``: run ``function`` in a scope.

    Returns ``function(*args, **kwargs)``, computed inside a
    ``recompute_scope(preserve_rng_state=preserve_rng_state)``: everything the
    function creates, its outputs included, is recomputable (saved for backward
    as a handle and recomputed from the recorded ops when backward needs it).
    Unlike ``torch.utils.checkpoint``, the function's Python code runs once:
    backward replays only the recorded ops it needs.

    It takes every argument ``torch.utils.checkpoint.checkpoint`` takes, so any
    framework that accepts a checkpoint function uses scopes with it:

    * ``checkpoint_wrapper(module, checkpoint_fn=gradient_scope.checkpoint)``
      (``torch.distributed.algorithms._checkpoint.checkpoint_wrapper``), also
      through ``apply_activation_checkpointing(model,
      checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper,
      checkpoint_fn=gradient_scope.checkpoint), check_fn=...)``;
    * Hugging Face transformers models: prefer
      ``gradient_scope.integrations.transformers.enable(model)`` (public
      transformers API, guarded against transformers' own checkpointing).
      Through transformers' switch it takes a private method:
      ``model._set_gradient_checkpointing(True, gradient_checkpointing_func=gradient_scope.checkpoint)``
      (``activation_checkpointing_enable()`` always passes torch's checkpoint).

    Args:
        function: the function to run (a module, a ``functools.partial``, ...).
        *args: its positional arguments.
        use_reentrant: accepted and ignored (a scope has no reentrant variant);
            no warning when left out.
        preserve_rng_state: replay random ops with the random numbers they drew
            in forward (see :class:`recompute_scope`).
        context_fn: only torch's default (``noop_context_fn``) is accepted:
            selective checkpointing contexts do not apply to a scope; use
            ``recompute_scope(save=...)`` for selective recompute.
        determinism_check: ``"default"`` or ``"none"``, accepted and ignored
            (a replay always checks shape, dtype and device).
        debug: accepted and ignored (``recompute_scope(debug=True)`` is the
            scope's value check).
        early_stop: accepted and ignored (a replay runs only the ops it needs).
        respect_saved_tensors_hooks: accepted and ignored (torch >= 2.15 takes it for
            what selective checkpointing saves; what a scope keeps always goes
            through the ``saved_tensors_hooks`` around it).
        budget: a :class:`Budget` shared by the calls it bounds (create it once):
            the library decides what each call stores to stay within it.
        **kwargs: keyword arguments of ``function``.

    Raises:
        ValueError: ``context_fn`` is not torch's default, or
            ``determinism_check`` is neither ``"default"`` nor ``"none"``.
        TypeError: ``function`` is not callable or a flag is not a bool.

    Example::

        >>> import torch
        >>> import torch.nn as nn
        >>> import gradient_scope
        >>> mlp = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))
        >>> x = torch.randn(4, 8, requires_grad=True)
        >>> y = gradient_scope.checkpoint(mlp, x, use_reentrant=False)
        >>> y.sum().backward()       # the GELU input and output are recomputed
        >>> from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
        >>> wrapped = checkpoint_wrapper(mlp, checkpoint_fn=gradient_scope.checkpoint)
        >>> wrapped(x).sum().backward()
    """
    if not callable(function):
        raise TypeError(f"gradient_scope.checkpoint: function must be callable, got {type(function).__name__}")
    if kwargs:
        _check_keywords(function, kwargs)
    if context_fn is not noop_context_fn:
        raise ValueError(
            "gradient_scope.checkpoint: context_fn is not supported (selective checkpointing "
            "contexts apply to torch.utils.checkpoint only). For selective recompute use "
            "recompute_scope(save=...), e.g. save=gradient_scope.save_matmuls."
        )
    if determinism_check not in ("default", "none"):
        raise ValueError(
            "gradient_scope.checkpoint: determinism_check must be 'default' or 'none' "
            f"(as for torch.utils.checkpoint), got {determinism_check!r}"
        )
    if use_reentrant is not None:
        check_bool("gradient_scope.checkpoint", "use_reentrant", use_reentrant)
    check_bool("gradient_scope.checkpoint", "debug", debug)
    check_bool("gradient_scope.checkpoint", "early_stop", early_stop)
    if respect_saved_tensors_hooks is not None:
        check_bool("gradient_scope.checkpoint", "respect_saved_tensors_hooks", respect_saved_tensors_hooks)
    options: dict[str, Any] = {"preserve_rng_state": preserve_rng_state}
    if budget is not None:
        options["budget"] = budget
    scope = None
    if torch.compiler.is_compiling():  # the compiled graph's annotation, counting for the module
        module = _module_of(function)
        weights = list(module.parameters()) if module is not None else []
        scope = traced_scope(options, _compiled_sink(weights[0], len(weights))) if weights else None
    if scope is None:
        scope = recompute_scope(**options)
    if type(scope) is recompute_scope:
        caller = sys._getframe(1)
        scope._at(
            (caller.f_code.co_filename, caller.f_lineno, f"gradient_scope.checkpoint({_function_name(function)})")
        )
        del caller  # the frame holds the caller's locals
        module = _module_of(function)
        if module is not None and not torch.compiler.is_compiling():
            stats = _stats.get(module)
            if stats is None:
                stats = _stats[module] = ScopeStats()
            counting_into(scope, stats)
    return run_in_scope(scope, function, args, kwargs)


# checkpoint's own options (every keyword parameter; the rest of **kwargs goes to the function).
_OPTIONS = tuple(
    name for name, p in inspect.signature(checkpoint).parameters.items() if p.kind is inspect.Parameter.KEYWORD_ONLY
)
