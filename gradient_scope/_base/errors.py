"""The library's exception type, and the pieces its messages share.

A :class:`RecomputeError` message says what could not be recomputed (op,
shape), where the block was entered (:func:`where`) and the likely cause with
its fix. In-place errors keep PyTorch's own wording and hint
(:func:`inplace_error`): with saved-tensor hooks on, PyTorch skips its version
check and the library makes it in its place.
"""

from __future__ import annotations

import threading
from typing import Any, NoReturn

import torch

__all__ = [
    "RecomputeError",
    "internal_error",
    "check_bool",
    "Site",
    "where",
    "with_site",
    "inplace_error",
    "WEIGHT_UPDATE",
    "INPUT_WRITTEN",
    "HOOKS_ON_STACK",
]

#: Where a block was entered: ``(file, line, what)``. ``what`` names the block
#: for helpers (the module path for ``apply_recompute``); file is None when
#: ``what`` says it all.
Site = tuple[str | None, int, str | None]

WEIGHT_UPDATE = (
    "Likely cause: an optimizer step or another weight update (optimizer.step(), "
    "load_state_dict(), `with torch.no_grad(): w.add_(...)`) between forward and backward. "
    "Fix: call optimizer.step() after backward (forward, backward, step, in that order)."
)
INPUT_WRITTEN = (
    "Likely cause: a tensor the block read was written in place after the block "
    "(`x += 1`, `x.copy_(...)`, `x[i] = ...`). Fix: write it before the block, or pass "
    "a clone into the block (`x.clone()`)."
)
HOOKS_ON_STACK = (
    "gradient_scope's saved-tensor hooks were on the stack (they stay while a tensor made in "
    "a recompute_scope is alive), so gradient_scope made PyTorch's in-place check in its place."
)


class RecomputeError(RuntimeError):
    """Raised when a value saved for backward cannot be recomputed faithfully.

    The message names the recorded operation and the tensor shape involved,
    where the block was entered (``file.py:line`` of the ``with`` or of the
    decorated call; the module path for :func:`apply_recompute` blocks, the
    function for :func:`checkpoint` blocks), and the likely cause with its
    fix. Gradients are never silently wrong for every write PyTorch can see --
    its version counter and storage swaps (``tensor.data = ...``, ``set_()``):
    when replay cannot reproduce what forward computed, the tensor is stored
    instead, or this error is raised. Writes that bypass both are seen only
    with ``recompute_scope(debug=True)``, which compares every recomputed value
    with forward's: writes through ``.data``, a NumPy array (``.numpy()``,
    ``torch.from_numpy``) or ``untyped_storage()``; fused optimizer steps
    (``Adam``/``AdamW``/``SGD(fused=True)``, which on CPU do not bump the
    version) between forward and backward; a storage ``resize_`` round trip;
    and, with ``preserve_rng_state=False``, random ops, which then replay with
    the current random state.

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
        ...     print("optimizer.step() after backward" in str(e))
        True
    """


def internal_error(what: str) -> NoReturn:
    """Raise the error for a broken invariant of the library itself (never the
    user's doing): ``what`` says which."""
    raise RecomputeError(f"gradient_scope: internal error: {what}. Please report this.")


def check_bool(where: str, name: str, value: Any) -> bool:
    """``value`` as a bool: a ``bool`` or a NumPy bool; anything else is a TypeError
    naming option ``name`` of ``where``. Ints and tensors are refused: ``enabled=0``
    is more often a mistake than a choice, and a tensor's truth value would
    synchronise with its device."""
    if type(value) is bool:
        return value
    cls = type(value)
    if cls.__module__ == "numpy" and cls.__name__ in ("bool", "bool_"):
        return bool(value)
    raise TypeError(
        f"{where}: {name} must be a bool (True or False; a numpy.bool_ is accepted too), got {cls.__name__} ({value!r})"
    )


def where(site: Site | None) -> str:
    """``site`` in words, e.g. ``the recompute_scope entered at train.py:57``."""
    if site is None:
        return "The block: entered at an unknown place."
    file, line, what = site
    if file is None:
        return f"The block: {what}."
    if what is None:
        return f"The block: the recompute_scope entered at {file}:{line}."
    return f"The block: {what}, called at {file}:{line}."


def with_site(e: RecomputeError, site: Site | None) -> RecomputeError:
    """``e`` with where its block was entered appended to its message (once)."""
    if e.args and isinstance(e.args[0], str) and "\nThe block: " not in e.args[0]:
        e.args = (f"{e.args[0]}\n{where(site)}", *e.args[1:])
    return e


def inplace_error(what: str, saved: int, now: int) -> RuntimeError:
    """PyTorch's error for a saved tensor modified in place, with PyTorch's hint,
    and a sentence saying that our hooks made the check (hooks switch PyTorch's off)."""
    return RuntimeError(
        "one of the variables needed for gradient computation has been modified by an "
        f"inplace operation: [{what}] is at version {now}; expected version {saved} instead. "
        f"{_pytorch_hint()} ({HOOKS_ON_STACK})"
    )


_ANOMALY_HINT = (
    "Hint: the backtrace further above shows the operation that failed to compute its "
    "gradient. The variable in question was changed in there or anywhere later. Good luck!"
)
_hint: list[str] = []  # PyTorch's hint outside anomaly mode, read once from PyTorch itself


def _pytorch_hint() -> str:
    if torch.is_anomaly_enabled():
        return _ANOMALY_HINT
    if not _hint:
        # PyTorch words the hint by version (2.13 adds `check_nan=False`): ask it. A
        # fresh thread has an empty saved-tensor hook stack, so PyTorch checks itself.
        box: list[str] = []
        probe = threading.Thread(target=_probe, args=(box,), daemon=True)
        probe.start()
        probe.join()
        _hint.append(box[0] if box else "")
    return _hint[0]


def _probe(box: list[Any]) -> None:
    try:
        a = torch.ones(1, requires_grad=True)
        b = a.exp()
        c = b * 1
        with torch.no_grad():
            b.add_(1)
        c.backward()
    except RuntimeError as e:
        msg = str(e)
        if not torch.is_anomaly_enabled() and "Hint:" in msg:
            box.append(msg[msg.index("Hint:") :].strip())
            return
    box.append(
        "Hint: enable anomaly detection to find the operation that failed to compute its "
        "gradient, with torch.autograd.set_detect_anomaly(True)."
    )
