"""The library's exception type."""

from __future__ import annotations

__all__ = ["RecomputeError"]


class RecomputeError(RuntimeError):
    """Raised when a value saved for backward cannot be recomputed faithfully.

    The message names the recorded operation and the tensor shape involved and
    says what to do. Gradients are never silently wrong: when replay cannot
    reproduce what forward computed, this error is raised instead.

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
