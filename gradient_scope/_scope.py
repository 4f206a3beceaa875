"""The public scope: context manager, decorator, options and stats."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterable
from typing import Any, TypeVar, cast, overload

import torch

from . import _interception, _saving  # noqa: F401  (_saving installs the hook bodies)
from ._policy import make_save_policy
from ._record import RecordingMode, Region, ScopeStats
from ._registry import thread_state

__all__ = ["recompute_scope", "recompute"]

F = TypeVar("F", bound=Callable[..., Any])

_serials = itertools.count(1)  # one per block entered, in entry order


def _check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"recompute_scope: {name} must be a bool, got {type(value).__name__} ({value!r})")
    return value


class recompute_scope:
    """Don't keep tensors created in this block for backward: recompute them.

    Every tensor created inside the block is *recomputable*: wherever autograd
    would save it for backward, inside the block or after it, a small handle is
    saved instead and the value is recomputed from the recorded ops when
    backward needs it. Gradients equal those of the same code without the scope.

    Args:
        preserve_rng_state: replay every random op with the random numbers it
            drew in forward (default True). False skips the state capture.
        save: ops whose outputs are stored rather than recomputed: an iterable
            of ops (``torch.ops.aten.mm`` or ``torch.ops.aten.mm.default``) or a
            callable ``save(op) -> bool``.
        enabled: False makes the block a plain no-op block.
        debug: compare each recomputed value with what forward computed and
            raise :class:`RecomputeError` naming the op on a mismatch.

    Used as a decorator, each call of the function is its own block.

    Example::

        >>> import torch
        >>> from gradient_scope import recompute_scope
        >>> a, b, c = (torch.randn(3, requires_grad=True) for _ in range(3))
        >>> with recompute_scope():
        ...     x = a + b          # x is not kept for backward ...
        >>> y = x * c              # ... even though mul saves it here
        >>> y.sum().backward()     # x = a + b is recomputed now
    """

    def __init__(
        self,
        *,
        preserve_rng_state: bool = True,
        save: Iterable[Any] | Callable[[Any], bool] | None = None,
        enabled: bool = True,
        debug: bool = False,
    ) -> None:
        self._options: dict[str, Any] = dict(
            preserve_rng_state=_check_bool("preserve_rng_state", preserve_rng_state),
            save=save,
            enabled=_check_bool("enabled", enabled),
            debug=_check_bool("debug", debug),
        )
        self._save = make_save_policy(save)
        self._stats = ScopeStats()
        self._region: Region | None = None
        self._active = False

    @property
    def stats(self) -> ScopeStats:
        """Counters of this scope (see :class:`ScopeStats`)."""
        return self._stats

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self._options.items())
        return f"recompute_scope({opts})"

    def __enter__(self) -> recompute_scope:
        if self._active:
            raise RuntimeError(
                "recompute_scope: this scope object is already active. Use a new "
                "recompute_scope() for each block (a decorated function does this per call)."
            )
        self._active = True
        if (
            not self._options["enabled"]
            or not torch.is_grad_enabled()
            or torch.is_inference_mode_enabled()
        ):
            self._region = None  # records nothing: a plain block
            return self
        state = thread_state()
        serial = next(_serials)
        try:
            _interception.ensure_on_top(state, serial)
        except BaseException:
            self._active = False
            raise
        if state.regions and state.regions[-1].task == torch._C._current_graph_task_id():
            # Nested in an open block of this thread: record into its region.
            region = state.regions[-1]
            region.push_frame(
                preserve_rng_state=self._options["preserve_rng_state"],
                save=self._save,
                debug=self._options["debug"],
                stats=self._stats,
                serial=serial,
            )
            self._region = region
            self._nested = True
            return self
        region = Region(
            state,
            preserve_rng_state=self._options["preserve_rng_state"],
            save=self._save,
            debug=self._options["debug"],
            stats=self._stats,
            serial=serial,
        )
        state.open_blocks += 1
        state.regions.append(region)
        if state.mode is None:
            mode = RecordingMode(state)
            mode.__enter__()
            state.mode = mode
        self._region = region
        self._nested = False
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if not self._active:
            raise RuntimeError("recompute_scope: __exit__ called on a scope that is not active.")
        region = self._region
        if region is None:
            self._active = False
            return
        state = region.state
        if self._nested:
            if region._frames and region.stats is self._stats and state.regions[-1] is region:
                region.pop_frame(aborted=exc_type is not None)
                self._region = None
                self._active = False
                return
            raise RuntimeError(
                "recompute_scope: scopes exited out of order (or in another thread). "
                "Exit the innermost recompute_scope first."
            )
        if region._frames or not state.regions or state.regions[-1] is not region:
            raise RuntimeError(
                "recompute_scope: scopes exited out of order (or in another thread). "
                "Exit the innermost recompute_scope first."
            )
        if len(state.regions) == 1:
            mode = state.mode
            from torch.utils._python_dispatch import _get_current_dispatch_mode

            if _get_current_dispatch_mode() is not mode:
                raise RuntimeError(
                    "recompute_scope: a TorchDispatchMode entered inside the block is "
                    "still active. Exit it before leaving the recompute_scope."
                )
        state.regions.pop()
        self._region = None
        self._active = False
        try:
            region.close(aborted=exc_type is not None)
        finally:
            state.open_blocks -= 1
            if not state.regions:
                mode = state.mode
                state.mode = None
                mode.__exit__(None, None, None)
            _interception.sweep()

    def __call__(self, fn: F) -> F:
        if not callable(fn):
            raise TypeError(f"recompute_scope(...) decorates a callable, got {type(fn).__name__}")
        options = self._options

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with recompute_scope(**options):
                return fn(*args, **kwargs)

        return cast(F, wrapper)


@overload
def recompute(fn: F, /) -> F: ...


@overload
def recompute(
    *,
    preserve_rng_state: bool = True,
    save: Iterable[Any] | Callable[[Any], bool] | None = None,
    enabled: bool = True,
    debug: bool = False,
) -> recompute_scope: ...


def recompute(fn: Callable[..., Any] | None = None, /, **options: Any) -> Any:
    """Decorator: each call of the function runs in its own :class:`recompute_scope`.

    Use it bare (``@recompute``) or with options (``@recompute(save=[...])``).

    Example::

        >>> import torch
        >>> from gradient_scope import recompute
        >>> @recompute
        ... def mlp(h, w1, w2):
        ...     return torch.nn.functional.gelu(h @ w1) @ w2
        >>> h = torch.randn(4, 8, requires_grad=True)
        >>> w1, w2 = torch.randn(8, 32), torch.randn(32, 8)
        >>> mlp(h, w1, w2).sum().backward()
    """
    if fn is None:
        return recompute_scope(**options)
    if options:
        raise TypeError("recompute(fn, ...): pass options as @recompute(option=...)")
    if not callable(fn):
        raise TypeError(f"recompute decorates a callable, got {type(fn).__name__}")
    return recompute_scope()(fn)
