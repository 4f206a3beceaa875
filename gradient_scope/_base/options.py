"""Option values and the process-wide switch that turns every scope off.

:class:`ScopeOptions` is what a scope tells the stages that run its function without
the scope object itself (``_adapters.steady``): typed and read-only.

The switch is read when a scope is entered (``recompute_scope.__enter__``, and
while ``torch.compile`` traces a scope): a scope entered while it is on records
nothing, exactly like ``recompute_scope(enabled=False)``. Blocks entered before
it was turned on keep recomputing their tensors.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from typing import Any, NamedTuple

from .stats import ScopeStats

__all__ = ["disabled", "scopes_disabled", "switch", "ENV_VAR", "FAST_VAR", "ScopeOptions"]

#: The environment variable that turns every scope off (``1``, ``true``, ``yes``, ``on``).
ENV_VAR = "GRADIENT_SCOPE_DISABLE"
_ON = frozenset({"1", "true", "yes", "on"})
_OFF = frozenset({"", "0", "false", "no", "off"})


class ScopeOptions(NamedTuple):
    """The options of one function-form scope, as the steady-state runner reads them:
    typed and read-only (a named tuple: made at every call of a function-form scope, where
    a frozen dataclass costs about twice the host time to make).

    Example::

        >>> from gradient_scope._base.options import ScopeOptions
        >>> from gradient_scope._base.stats import ScopeStats
        >>> opts = ScopeOptions(save=None, contextual=False, preserve_rng_state=True, debug=False, stats=ScopeStats())
        >>> opts.debug
        False
    """

    #: The ``save=`` option as given (templates are kept per option: its identity names it).
    save: Any
    #: Whether the save policy is a context policy (it reads the running module of each op).
    contextual: bool
    preserve_rng_state: bool
    debug: bool
    #: The scope's counters: a block whose outermost frame counts into them is the scope's.
    stats: ScopeStats


_lock = threading.Lock()
_depth = 0  # open ``disabled()`` contexts, all threads together


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Turn every scope into a no-op while the ``with`` block runs, in all threads.

    Scopes entered inside (``with recompute_scope()``, ``@recompute``, the scopes
    of :func:`apply_recompute` and :func:`checkpoint`, compiled code traced
    inside) record nothing, as with ``enabled=False``: their tensors are stored
    as without the library. Blocks entered before keep recomputing their
    tensors. Without touching code, the environment variable
    ``GRADIENT_SCOPE_DISABLE=1`` does the same for the whole process (read
    each time a scope is entered).

    For A/B runs (the same script with and without scopes), debugging (is a
    problem caused by the scopes?) and ``torch.func`` (``grad``, ``vjp``,
    ``jacrev`` refuse to run while a scope's saved-tensor hooks are on the
    stack). Usable as a decorator too. Nests; process-wide, not per thread.
    A graph that ``torch.compile`` traced while scopes were on keeps its
    scopes when called inside (dynamo does not recompile for the switch).

    Example::

        >>> import torch
        >>> import gradient_scope
        >>> from gradient_scope import recompute_scope
        >>> def loss_fn(w, x):
        ...     with recompute_scope():
        ...         h = (x @ w).tanh()
        ...     return (h * h).sum()
        >>> w, x = torch.randn(4, 4), torch.randn(2, 4)
        >>> with gradient_scope.disabled():
        ...     g = torch.func.grad(loss_fn)(w, x)
        >>> g.shape
        torch.Size([4, 4])
    """
    global _depth
    with _lock:
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1


def scopes_disabled() -> bool:
    """Whether a scope entered now records nothing (:func:`disabled` or the environment)."""
    if _depth:
        return True
    return switch(ENV_VAR, "turn every recompute_scope off") is True


#: The environment variable that chooses the steady state of function-form scopes: on,
#: off, or unset (on where an argument is a CUDA tensor).
FAST_VAR = "GRADIENT_SCOPE_FAST"


def switch(name: str, what: str) -> bool | None:
    """The value of the on/off environment variable ``name`` (whose ``1`` does ``what``):
    True for ``1``/``true``/``yes``/``on``, False for ``0``/``false``/``no``/``off`` (any case,
    spaces stripped), None when unset or empty; a ValueError for any other word.

    Example::

        >>> import os
        >>> from gradient_scope._base.options import switch
        >>> os.environ["GS_EXAMPLE_SWITCH"] = " On "
        >>> switch("GS_EXAMPLE_SWITCH", "do it")
        True
        >>> del os.environ["GS_EXAMPLE_SWITCH"]
    """
    value = os.environ.get(name)
    if value is None:
        return None
    v = value.strip().lower()
    if v in _ON:
        return True
    if v in _OFF:
        return None if v == "" else False
    raise ValueError(
        f"gradient_scope: the environment variable {name}={value!r} is neither on "
        f"({', '.join(sorted(_ON))}) nor off ({', '.join(repr(x) for x in sorted(_OFF))}). "
        f"Set {name}=1 to {what}, {name}=0 for the opposite, or unset it."
    )
