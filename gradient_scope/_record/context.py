"""Where an op runs, for context policies (``gradient_scope.policies.OpContext``): the path of
the innermost running module.

Read from the Python stack, only when a policy asks (``OpContext.module_path`` is lazy):
every ``nn.Module`` call runs ``Module._call_impl``, whose frame holds the module as
``self``. The innermost such frame is the running module, the outermost the root its
path is named from (``root.named_modules()``, cached per root). No module hooks: global
hooks would make dynamo break graphs at every module call, and would cost every forward
of every model, not only the ops a policy asks about.
"""

from __future__ import annotations

import sys
import weakref
from types import FrameType
from typing import Any

import torch.nn as nn

__all__ = ["running_module_path"]

_CALL_IMPL = nn.Module._call_impl.__code__

# id(root) -> (weak reference to it, {id(module): path}); rebuilt when a module is missing.
_names: dict[int, tuple[weakref.ref[nn.Module], dict[int, str]]] = {}


def _module_of(frame: FrameType) -> Any:
    return frame.f_locals.get("self")


def _paths(root: nn.Module, refresh: bool) -> dict[int, str]:
    found = _names.get(id(root))
    if found is not None and found[0]() is root and not refresh:
        return found[1]
    if len(_names) > 256:
        for key in [k for k, (ref, _) in _names.items() if ref() is None]:
            del _names[key]
    paths = {id(m): name for name, m in root.named_modules(remove_duplicate=False)}
    _names[id(root)] = (weakref.ref(root), paths)
    return paths


def running_module_path() -> str:
    """The path of the innermost module whose forward is running in this thread, from the
    outermost one (``""`` for that one itself, and outside any module)."""
    frame: FrameType | None = sys._getframe(1)
    inner = outer = None
    while frame is not None:
        if frame.f_code is _CALL_IMPL:
            if inner is None:
                inner = frame
            outer = frame
        frame = frame.f_back
    if inner is None or outer is None or inner is outer:
        return ""
    module, root = _module_of(inner), _module_of(outer)
    if not isinstance(module, nn.Module) or not isinstance(root, nn.Module):
        return ""
    path = _paths(root, False).get(id(module))
    if path is None:  # added to the model since the last look
        path = _paths(root, True).get(id(module))
    return path if path is not None else f"({type(module).__name__})"
