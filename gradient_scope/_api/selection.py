"""Which modules :func:`~gradient_scope.apply_recompute` scopes: ``check_fn`` and ``every_n_layers``.

``check_fn`` is a predicate ``module -> bool``, a module class, a class name (matched
against each module's class name, as framework configs write it:
``"LlamaDecoderLayer"``; a dotted name is matched against ``module.qualname``), or a
tuple of classes and names. Classes are matched with ``isinstance``, never called:
calling a module class with a module would run its constructor.
"""

from __future__ import annotations

import operator
import types
from collections.abc import Callable
from typing import Any

import torch.nn as nn

from .._base.feedback import closest, warn_user

__all__ = ["ModuleSelector", "every_module", "selector", "describe", "check_every_n", "choose"]

ModuleSelector = Callable[[nn.Module], bool] | type | str | tuple[type | str, ...] | types.UnionType


def every_module(module: nn.Module) -> bool:
    """The default ``check_fn``: every module (the model itself included)."""
    return True


def _class_names(cls: type) -> tuple[str, str]:
    return cls.__name__, f"{cls.__module__}.{cls.__qualname__}"


def _matches_name(name: str) -> Callable[[nn.Module], bool]:
    dotted = "." in name
    return lambda m: _class_names(type(m))[1 if dotted else 0] == name


def _instance_error(module: nn.Module, in_tuple: bool) -> TypeError:
    """A module instance passed where a class or predicate belongs (callable, it would be
    called with each module as its input, running its forward on a module)."""
    cls = type(module).__name__
    what = (
        f"check_fn holds a module instance ({cls}) where a class or class name belongs"
        if in_tuple
        else f"check_fn is a module instance ({cls}), not a class or a predicate: it would be "
        "called with each module as its input"
    )
    return TypeError(
        f"apply_recompute: {what}. Pass its class (check_fn={cls}), its class name "
        f"(check_fn={cls!r}), or, to scope this one module, check_fn=lambda m: m is module."
    )


def _item(item: Any) -> Callable[[nn.Module], bool]:
    if isinstance(item, nn.Module):
        raise _instance_error(item, True)
    if isinstance(item, str):
        return _matches_name(item)
    if isinstance(item, (type, types.UnionType)):
        return lambda m: isinstance(m, item)
    raise TypeError(
        "apply_recompute: a tuple check_fn must hold classes (matched with isinstance) or class "
        f"names (matched against each module's class name), got an item {item!r} of type {type(item).__name__}"
    )


def selector(check_fn: Any) -> Callable[[nn.Module], bool]:
    """``check_fn`` as a predicate ``module -> bool``."""
    if isinstance(check_fn, (str, type, types.UnionType)):
        return _item(check_fn)
    if isinstance(check_fn, tuple):
        tests = [_item(item) for item in check_fn]
        return lambda m: any(test(m) for test in tests)
    if isinstance(check_fn, nn.Module):
        raise _instance_error(check_fn, False)
    if not callable(check_fn):
        raise TypeError(
            "apply_recompute: check_fn must be a predicate module -> bool "
            "(e.g. lambda m: isinstance(m, Block)), a module class, a class name "
            f"(e.g. 'LlamaDecoderLayer') or a tuple of classes and names, got {type(check_fn).__name__}"
        )
    return check_fn  # type: ignore[no-any-return]


def describe(check_fn: Any) -> str:
    """``check_fn`` in a few words, for messages."""
    if isinstance(check_fn, str):
        return repr(check_fn)
    if isinstance(check_fn, tuple):
        return f"({', '.join(describe(x) for x in check_fn)})"
    return str(getattr(check_fn, "__qualname__", None) or repr(check_fn))


def check_every_n(caller: str, every_n_layers: Any) -> int:
    """``every_n_layers`` as a positive int (a NumPy integer too; not a bool)."""
    try:
        n = None if isinstance(every_n_layers, bool) else operator.index(every_n_layers)
    except TypeError:
        n = None
    if n is None or n < 1:
        raise ValueError(f"{caller}: every_n_layers must be a positive int, got {every_n_layers!r}")
    return n


def _near_names(model: nn.Module, check_fn: Any) -> str:
    """For a class name that matched nothing: the model's class names it may have meant."""
    names = [check_fn] if isinstance(check_fn, str) else [x for x in check_fn if isinstance(x, str)]
    present = sorted({type(m).__name__ for m in model.modules()})
    near = sorted({c for name in names for c in closest(name.rpartition(".")[2], present, n=3)})
    return f" Did you mean {' or '.join(map(repr, near))}?" if near else ""


def _unmatched_names(model: nn.Module, check_fn: tuple[Any, ...]) -> None:
    """Warn, as for a lone name that matched nothing, for each name of a tuple that
    matched no module while other items did, if the model has a class name near it: a
    misspelling. (A name with no near class name may be meant for another model.)"""
    for name in dict.fromkeys(x for x in check_fn if isinstance(x, str)):
        match = _matches_name(name)
        hint = _near_names(model, name)
        if hint and not any(match(m) for m in model.modules()):
            warn_user(
                f"apply_recompute: check_fn item {name!r} matched no module of {type(model).__name__}; "
                "the modules the other items matched are scoped. Pass the class name as "
                f"type(module).__name__ spells it (or the class itself).{hint}"
            )


def choose(model: nn.Module, check_fn: Any, every_n_layers: int) -> list[tuple[str, nn.Module]]:
    """The ``(path, module)`` pairs to scope, in ``model.modules()`` order; warns (at the
    user's line) when nothing matches, and when the default ``check_fn`` scopes a module
    with submodules (the root and every submodule)."""
    select = selector(check_fn)
    chosen = [(path, m) for path, m in model.named_modules(remove_duplicate=True) if select(m)]
    if not chosen:
        hint = _near_names(model, check_fn) if isinstance(check_fn, (str, tuple)) else ""
        warn_user(
            f"apply_recompute: check_fn ({describe(check_fn)}) matched no module of {type(model).__name__}; "
            "nothing was changed. Pass a predicate that is true for the modules to recompute, "
            f"their class (e.g. check_fn=Block) or its name (check_fn='Block').{hint}"
        )
        return []
    if isinstance(check_fn, tuple):
        _unmatched_names(model, check_fn)
    if check_fn is every_module and next(model.children(), None) is not None:
        name = type(model).__name__
        warn_user(
            f"apply_recompute: no check_fn: {name} and every one of its {len(chosen) - 1} submodules "
            f"run in scopes, which is one scope around {name}'s forward (nested scopes record into "
            "the outermost one). On a whole model, backward then replays the whole forward at once "
            "and the peak memory is about the plain model's: pass check_fn=YourBlock (a class, its "
            "name, or a predicate) to scope the repeated blocks. To scope just this module, pass "
            "check_fn=lambda m: m is module."
        )
    return chosen[::every_n_layers]
