"""The oldest torch release this library runs on, checked when the package is imported.

The saved-tensor interception reads the thread's innermost hook pair with
``torch._C._autograd._top_saved_tensors_default_hooks``, which torch has from 2.8 on.
Without this check an older torch would fail with an ``AttributeError`` at the first
block; this turns it into an ``ImportError`` that says which torch to install.
"""

from __future__ import annotations

import re

import torch

__all__ = ["REQUIRED_API", "TORCH_FLOOR", "check_torch"]

# The oldest torch (major, minor) the test suite has run on. pyproject.toml declares the
# same floor in its dependencies; tests/package/test_package.py checks that the two agree.
TORCH_FLOOR = (2, 8)

# The private torch API that sets the floor.
REQUIRED_API = "_top_saved_tensors_default_hooks"


def _major_minor(version: str) -> tuple[int, int] | None:
    """``(2, 8)`` for ``"2.8.0"``, ``"2.8.0+cu128"``, ``"2.8.0a0+git1234"``; None if unparsable."""
    m = re.match(r"\s*(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else None


def check_torch(version: str | None = None, autograd: object | None = None) -> None:
    """Raise ``ImportError`` naming the floor when the installed torch is older than it.

    ``version`` and ``autograd`` stand in for ``torch.__version__`` and
    ``torch._C._autograd`` (tests pass others). A version string that cannot be parsed
    is judged by the API alone.
    """
    installed = str(getattr(torch, "__version__", "unknown")) if version is None else version
    if autograd is None:
        autograd = torch._C._autograd
    floor = "{}.{}".format(*TORCH_FLOOR)
    parsed = _major_minor(installed)
    if parsed is not None and parsed < TORCH_FLOOR:
        raise ImportError(
            f"gradient_scope requires torch>={floor}, but torch {installed} is installed. "
            f"Upgrade it, e.g. pip install --upgrade 'torch>={floor}'."
        )
    if not hasattr(autograd, REQUIRED_API):
        raise ImportError(
            f"gradient_scope requires torch>={floor}: the installed torch {installed} lacks "
            f"torch._C._autograd.{REQUIRED_API}, which gradient_scope uses. "
            f"Install a torch release >= {floor}, e.g. pip install --upgrade 'torch>={floor}'."
        )


check_torch()
