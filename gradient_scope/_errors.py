"""The library's exception type, and the errors and checks shared by several modules."""

from __future__ import annotations

from typing import Any, NoReturn

__all__ = ["RecomputeError", "internal_error", "inplace_error", "check_bool"]


class RecomputeError(RuntimeError):
    """Raised when a value saved for backward cannot be recomputed faithfully.

    The message names the recorded operation and the tensor shape involved and
    says what to do. Gradients are never silently wrong for writes PyTorch can
    see (its version counter, storage swaps): when replay cannot reproduce what
    forward computed, this error is raised instead. Writes that bypass the
    version counter (``.data``, NumPy, ``untyped_storage()``) are seen only with
    ``recompute_scope(debug=True)``.

    Example::

        >>> import torch
        >>> from gradient_scope import recompute_scope, RecomputeError
        >>> w = torch.ones(3, requires_grad=True)
        >>> with recompute_scope():
        ...     h = w.sin()
        >>> y = (h * h).sum()
        >>> del h
        >>> with torch.no_grad():
        ...     _ = w.add_(1)   # the block's input changed after the block
        >>> try:
        ...     y.backward()
        ... except RecomputeError as e:
        ...     print("caught")
        caught
    """


def internal_error(what: str) -> NoReturn:
    """Raise the error for a broken invariant of the library itself (never the
    user's doing): ``what`` says which."""
    raise RecomputeError(f"gradient_scope: internal error: {what}. Please report this.")


def inplace_error(what: str, saved: int, now: int) -> RuntimeError:
    """PyTorch's error for a saved tensor modified in place (hooks switch its own check off)."""
    return RuntimeError(
        "one of the variables needed for gradient computation has been modified by an "
        f"inplace operation: [{what}] is at version {now}; expected version {saved} instead. "
        "(Checked by gradient_scope, which stands in for PyTorch's own check while its "
        "saved-tensor hooks are active.)"
    )


def check_bool(where: str, name: str, value: Any) -> bool:
    """``value``, if it is a bool; else a TypeError naming option ``name`` of ``where``."""
    if not isinstance(value, bool):
        raise TypeError(f"{where}: {name} must be a bool, got {type(value).__name__} ({value!r})")
    return value
