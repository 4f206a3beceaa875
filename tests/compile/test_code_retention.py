"""The package's per-code caches keep no code object alive: a code object carries what
hangs on it (dynamo's cache entries and their guards, which hold a compiled model's
tensors), so keeping it would keep those tensors alive until the cache is cleared."""

import sys
import weakref
from collections.abc import Callable
from typing import Any

import torch._functorch.aot_autograd  # noqa: F401  (loads the AOT runtime the check looks for)

from gradient_scope._base import torch_compat as _torch_compat
from gradient_scope._report import where as _report_where


def _fresh_function() -> Callable[[Callable[[Any], Any]], Any]:
    """A function with its own code object, made at run time like a test's local model."""
    space: dict[str, Any] = {}
    exec("def user_fn(ask):\n    return ask(sys._getframe())\n", {"sys": sys}, space)
    fn: Callable[[Callable[[Any], Any]], Any] = space["user_fn"]
    return fn


def test_user_line_keeps_no_code_object() -> None:
    fn = _fresh_function()
    code = weakref.ref(fn.__code__)
    assert fn(_report_where.user_line) is not None  # found a line: its code was looked at
    del fn
    assert code() is None


def test_compiled_code_check_keeps_no_code_object() -> None:
    assert _torch_compat._AOT_RUNTIME in sys.modules  # the check walks the stack only then
    fn = _fresh_function()
    code = weakref.ref(fn.__code__)
    assert fn(lambda frame: _torch_compat.in_compiled_code()) is False
    del fn
    assert code() is None
