"""The user's source line of the op running now: the innermost frame outside torch and
this package (a model's own code, transformers' modeling files included, counts as the
user's). Shared by the saved-tensor report (``_report.where``) and a budget's plan
(``_budget.block``), which name the line an op ran at."""

from __future__ import annotations

import os
import sys
from types import CodeType, FrameType

import torch

__all__ = ["Location", "user_line", "source"]

#: (code, line) of user code; formatted as ``file.py:57`` only when shown.
Location = tuple[CodeType, int]

_LIB_DIRS = tuple(
    os.path.dirname(m.__file__) + os.sep
    for m in (torch, sys.modules[__name__.partition(".")[0]])  # torch and the whole package
    if m.__file__ is not None
)
# Code that torch generates (fx graphs) or imports itself: never the user's line.
_GENERATED = ("<eval_with_key>", "<frozen ", "<torch_package_")
# By file name, not code object: a code object kept here would keep alive what hangs on
# it (dynamo's cache entries and their guards, which hold the compiled model's tensors).
_is_lib: dict[str, bool] = {}


def user_line(frame: FrameType | None) -> Location | None:
    """The innermost frame at or above ``frame`` outside torch and this package."""
    while frame is not None:
        code = frame.f_code
        name = code.co_filename
        lib = _is_lib.get(name)
        if lib is None:
            if len(_is_lib) > 8192:
                _is_lib.clear()
            lib = _is_lib[name] = name.startswith(_GENERATED) or name.startswith(_LIB_DIRS)
        if not lib:
            return code, frame.f_lineno
        frame = frame.f_back
    return None


def source(where: Location | None) -> str:
    """``where`` as ``file.py:57`` (empty for None)."""
    if where is None:
        return ""
    code, line = where
    return f"{os.path.basename(code.co_filename)}:{line}"
