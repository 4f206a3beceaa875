"""What the library tells the user: the ``gradient_scope`` logger, and warnings that point
at the user's line.

The model helpers log at INFO which modules they scoped, with which options (the
``gradient_scope`` logger, silent unless the application configures logging, as
torchtitan's and torchtune's loggers). Warnings name the user's line: the innermost
frame outside torch, this package and the frameworks that call a model for the user
(a ``Trainer`` calls the model from inside transformers: the line is the user's
``trainer.train()``).
"""

from __future__ import annotations

import difflib
import logging
import os
import sys
import warnings
from collections.abc import Iterable

import torch

__all__ = [
    "logger",
    "warn_user",
    "warn_once",
    "describe_options",
    "describe_paths",
    "closest",
    "unknown_options",
]

#: The library's logger (INFO: what the helpers scoped).
logger = logging.getLogger("gradient_scope")

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
# Frameworks that run the user's model from their own code: not the user's line.
_FRAMEWORKS = ("transformers", "accelerate", "peft", "lightning", "pytorch_lightning")


def _framework_dirs() -> tuple[str, ...]:
    dirs = []
    for name in _FRAMEWORKS:
        module = sys.modules.get(name)
        path = getattr(module, "__file__", None)
        if path:
            dirs.append(os.path.dirname(os.path.abspath(path)) + os.sep)
    return tuple(dirs)


def _user_stacklevel() -> int:
    """The ``stacklevel`` that makes ``warnings.warn`` in our caller name the user's line."""
    skip = (_PACKAGE_DIR, _TORCH_DIR, *_framework_dirs())
    frame = sys._getframe(2)  # the caller of warn_user
    level = 2
    while frame.f_back is not None:
        name = frame.f_code.co_filename
        if not (name.startswith(skip) or name.startswith("<frozen ")):
            break
        frame = frame.f_back
        level += 1
    return level


def warn_user(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn(message, category)`` attributed to the user's line."""
    warnings.warn(message, category, stacklevel=_user_stacklevel())


_warned: set[object] = set()


def warn_once(key: object, message: str, category: type[Warning] = UserWarning) -> None:
    """:func:`warn_user` the first time ``key`` is seen in this process."""
    if key in _warned:
        return
    _warned.add(key)
    warnings.warn(message, category, stacklevel=_user_stacklevel())


def _name(value: object) -> str:
    name = getattr(value, "__qualname__", None)
    if isinstance(name, str) and callable(value):
        return name
    return repr(value)


def describe_options(options: dict[str, object]) -> str:
    """``save=save_matmuls, debug=True`` (policies by name); ``default options`` if none."""
    if not options:
        return "default options"
    return ", ".join(f"{k}={_name(v)}" for k, v in options.items())


def describe_paths(paths: Iterable[str], root: str = "the model") -> str:
    """Module paths in a few words: all of up to four, else the first two ... the last."""
    names = [p or root for p in paths]
    if len(names) <= 4:
        return ", ".join(names)
    return f"{names[0]}, {names[1]} ... {names[-1]}"


def closest(name: str, valid: Iterable[str], n: int = 1, cutoff: float = 0.6) -> list[str]:
    """The ``n`` names of ``valid`` that ``name`` most resembles, best first (``difflib``'s
    ratio at least ``cutoff``): the one place the library finds what a user meant.

    Example::

        >>> closest("offlod", ["budget", "offload"])
        ['offload']
    """
    return difflib.get_close_matches(name, list(valid), n=n, cutoff=cutoff)


def unknown_options(
    caller: str, unknown: Iterable[str], valid: Iterable[str], what: str = "option", listed: str = ""
) -> TypeError:
    """The ``TypeError`` for misspelled keyword options: each unknown name with the valid
    one it most resembles, then every valid name (``listed``: what to call them, default
    ``what`` + s)."""
    valid = sorted(valid)
    parts = []
    for name in sorted(unknown):
        near = closest(name, valid)
        parts.append(f"{name!r} (did you mean {near[0]!r}?)" if near else repr(name))
    s = "s" if len(parts) > 1 else ""
    return TypeError(
        f"{caller}: unknown {what}{s} {', '.join(parts)}; the {listed or what + 's'} are {', '.join(valid)}"
    )
