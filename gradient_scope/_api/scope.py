"""The public scope: context manager, decorator, options and stats."""

from __future__ import annotations

import functools
import inspect
import os
import sys
import threading
from collections.abc import Callable, Generator, Iterable
from typing import Any, TypeVar, overload

import torch

from .._base import torch_compat as _torch_compat
from .._base.errors import Site, check_bool, where
from .._base.feedback import unknown_options, warn_once, warn_user
from .._base.options import ScopeOptions, scopes_disabled
from .._base.stats import ScopeStats
from .._base.torch_compat import profiler_range
from .._budget.budget import Budget
from .._record import recorder as _recorder
from .._record.entry import OpenBlock
from .._record.types import BlockRecord, Frame
from .._restore.handles import ReplayState
from .._save import interception as _interception
from ..policies import ContextPolicy, as_save_policy, is_built_in

__all__ = ["recompute_scope", "recompute", "set_traced_block", "set_steady_runner", "run_in_scope"]

F = TypeVar("F", bound=Callable[..., Any])

# True only while dynamo traces (a torch without it: never).
_dynamo_compiling: Callable[[], bool] = getattr(torch.compiler, "is_dynamo_compiling", lambda: False)


# What a scope is while dynamo traces (``_adapters.compile.graph.traced_block``), registered by the
# package (``gradient_scope/__init__``): the adapter sits above this module.
_traced_block: list[Callable[..., Any]] = []


def set_traced_block(fn: Callable[..., Any]) -> Callable[[], None]:
    """Make ``fn(*args, **options)`` build a scope while dynamo traces (None: run it
    eagerly). Returns a function that removes it."""
    _traced_block[:] = [fn]

    def remove() -> None:
        if _traced_block == [fn]:
            _traced_block.clear()

    return remove


# How a function-form scope (helpers, decorators, ``checkpoint``) runs its function:
# ``runner(options, scope, fn, args, kwargs)``, registered by the package
# (``_adapters.steady``: a block whose structure was seen before runs without the
# recorder). It reads the scope's options, typed, and only enters the scope. None: in the scope.
SteadyRunner = Callable[[ScopeOptions, Any, Callable[..., Any], tuple[Any, ...], dict[str, Any]], Any]
_steady_runner: list[SteadyRunner] = []


def set_steady_runner(fn: SteadyRunner) -> Callable[[], None]:
    """Make ``fn(options, scope, function, args, kwargs)`` run every function-form scope.
    Returns a function that removes it."""
    _steady_runner[:] = [fn]

    def remove() -> None:
        if _steady_runner == [fn]:
            _steady_runner.clear()

    return remove


def run_in_scope(scope: Any, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``fn(*args, **kwargs)`` in ``scope``: the steady-state runner for a
    :class:`recompute_scope`, else plainly (``scope`` is the compiled graph's
    annotation while dynamo traces)."""
    if _steady_runner and type(scope) is recompute_scope:
        opts = scope._options
        options = ScopeOptions(
            save=opts["save"],
            contextual=isinstance(scope._save, ContextPolicy),
            preserve_rng_state=opts["preserve_rng_state"],
            debug=opts["debug"],
            stats=scope._stats,
        )
        return _steady_runner[0](options, scope, fn, args, kwargs)
    with scope:
        return fn(*args, **kwargs)


# The package's root folder: a frame in any of its rooms is the library's, not the user's.
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
# a scope's entry pushes the pair, then opens its block
# (I8 [ the main thread's pair, removed later ])
_interception.add_unsafe_file(__file__)


def _caller_site() -> Site:
    """File and line of the code that entered the scope: the innermost frame
    outside this package (a decorated function's wrapper, a helper's scope).
    Two attribute reads per frame; the frame itself is not kept (it would keep
    the caller's locals alive)."""
    f = sys._getframe(2)
    while f.f_back is not None and f.f_code.co_filename.startswith(_PACKAGE_DIR):
        f = f.f_back
    return (f.f_code.co_filename, f.f_lineno, None)


class recompute_scope:
    """Don't keep tensors created in this block for backward: recompute them.

    Every tensor created inside the block is *recomputable*: wherever autograd
    would save it for backward, inside the block or after it, a small handle is
    saved instead and the value is recomputed from the recorded ops when
    backward needs it. Gradients equal those of the same code without the scope,
    or :class:`RecomputeError` is raised; writes that bypass PyTorch's version
    counter are seen only with ``debug=True`` (see :class:`RecomputeError`).

    Args:
        preserve_rng_state: replay every random op with the random numbers it
            drew in forward (default True). False skips the state capture.
        save: ops whose outputs are stored rather than recomputed: an iterable
            of ops (``torch.ops.aten.mm`` or ``torch.ops.aten.mm.default``) or a
            callable ``save(op) -> bool``. Whatever it says (and whatever a
            budget plans), the outputs of ops that decide shapes or routing are
            always stored: top-k and sort indices, ``argmax``, ``nonzero``,
            ``bincount``, ``unique``, ``searchsorted``, values read to the host,
            collectives (a MoE's router is never replayed differently).
        enabled: False makes the block a plain no-op block.
        debug: compare each recomputed value with what forward computed and
            raise :class:`RecomputeError` naming the op on a mismatch. Without
            it, recomputation is never silently wrong for the writes PyTorch can
            see (version counter, storage swaps); ``debug=True`` also catches the
            writes that bypass them: ``.data``, NumPy, ``untyped_storage()``,
            fused optimizer steps, a storage ``resize_`` round trip, and random
            ops with ``preserve_rng_state=False`` (see :class:`RecomputeError`).
            On CUDA values are compared within float tolerance. It costs memory:
            the scope keeps a copy of every tensor the block creates until
            backward has run -- on the quickstart's GPT, memory held after
            forward is 2.7x the plain model's with the quickstart's scopes and
            4.1x with a scope per block (``python -m benchmarks.caveats``).
            For tracking down a suspected mismatch, not for training.
        budget: a :class:`Budget` shared by several scopes: the library decides
            what the blocks store to stay within it (not with ``save=``; ignored
            in a scope nested in another one and inside compiled code).

    Used as a decorator (``@recompute_scope()``, or bare ``@recompute_scope``
    as with ``@torch.no_grad``), each call of the function is its own block
    (each resumption, for a generator function or an ``async def`` function).

    Bools accept ``numpy.bool_`` too. ``gradient_scope.disabled()`` and the
    environment variable ``GRADIENT_SCOPE_DISABLE=1`` turn every scope into a
    no-op (read when the scope is entered).

    Inside code that ``torch.compile`` traces, the block is part of the compiled
    graph: the compiled backward recomputes its tensors (nothing is recorded in
    Python there; see ``gradient_scope._compile``).

    Example::

        >>> import torch
        >>> from gradient_scope import recompute_scope
        >>> a, b, c = (torch.randn(3, requires_grad=True) for _ in range(3))
        >>> with recompute_scope():
        ...     x = a + b          # x is not kept for backward ...
        >>> y = x * c              # ... even though mul saves it here
        >>> y.sum().backward()     # x = a + b is recomputed now
    """

    def __new__(cls, *args: Any, **options: Any) -> Any:
        for name in options:
            if name not in _OPTION_NAMES:
                raise unknown_options("recompute_scope", set(options) - _OPTION_NAMES, _OPTION_NAMES)
        if args:  # the bare decorator, ``@recompute_scope`` (as ``@torch.no_grad``)
            if len(args) > 1 or options or not callable(args[0]):
                raise TypeError(
                    "recompute_scope() takes keyword options only, e.g. recompute_scope(save=...); "
                    "as a decorator use @recompute_scope or @recompute_scope(option=...)"
                )
            return _decorate(args[0], {})
        # While dynamo traces, a scope is an annotation of the compiled graph
        # (gradient_scope._compile); None there means "run it eagerly".
        if _dynamo_compiling() and _traced_block:
            block = traced(options)
            if block is not None:
                return block
        return super().__new__(cls)

    def __init__(
        self,
        *,
        preserve_rng_state: bool = True,
        save: Iterable[Any] | Callable[[Any], bool] | None = None,
        enabled: bool = True,
        debug: bool = False,
        budget: Budget | None = None,
    ) -> None:
        self._options: dict[str, Any] = dict(
            preserve_rng_state=check_bool("recompute_scope", "preserve_rng_state", preserve_rng_state),
            save=save,
            enabled=check_bool("recompute_scope", "enabled", enabled),
            debug=check_bool("recompute_scope", "debug", debug),
        )
        if budget is not None:
            self._options["budget"] = _check_budget(budget, save)
        self._budget_block: Any = None
        self._save = as_save_policy(save)
        self._stats = ScopeStats()
        self._block: OpenBlock | None = None
        self._frame: Frame | None = None
        self._nested = False
        self._active = False
        self._range: Any = None  # the profiler range of the recorded region
        self._site: Site | None = None  # set by helpers that know the module path
        self._dynamo_callback: tuple[int, Any] = (0, None)

    def _at(self, site: Site) -> recompute_scope:
        """This scope, reporting ``site`` as where its block was entered (in errors)."""
        self._site = site
        return self

    @property
    def stats(self) -> ScopeStats:
        """Counters of this scope (see :class:`ScopeStats`)."""
        return self._stats

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self._options.items())
        return f"recompute_scope({opts})"

    def __reduce__(self) -> Any:
        # Copies (copy.copy, copy.deepcopy, pickle) are fresh scopes with the same options.
        return (_rebuild_scope, (self._options,))

    def __enter__(self) -> recompute_scope:
        if self._active:
            raise RuntimeError(
                "recompute_scope: this scope object is already active. Use a new "
                "recompute_scope() for each block (a decorated function does this per call)."
            )
        self._active = True
        # Entered eagerly while dynamo compiles the frames this thread enters: the
        # frame with the block fell back to eager (a graph break in a compiled
        # scope). Frames called from the open block run eagerly too, so that their
        # ops are recorded as an eager scope's (functions the user wrapped with
        # torch.compile still compile, R7 [ compiled code is not recorded ]); so does the
        # library's own code here.
        self._dynamo_callback = (threading.get_ident(), _torch_compat.suspend_dynamo_compile())
        try:
            self._open()
        except BaseException:
            _undo_open(self)  # the object can be entered again once the cause is fixed
            raise
        if self._block is None:  # a plain block: nothing to keep eager
            _resume_dynamo(self)
        return self

    def _open(self) -> None:
        opts = self._options
        if not opts["enabled"] or not torch.is_grad_enabled() or torch.is_inference_mode_enabled() or scopes_disabled():
            self._block = None  # records nothing: a plain block
            return
        site = self._site if self._site is not None else _caller_site()
        serial = _interception.next_serial()
        _interception.ensure_on_top(serial)
        outer = _recorder.innermost()
        budget = opts.get("budget")
        record = state = None
        if outer is None:
            record = BlockRecord()
            state = ReplayState(record)
            if budget is not None:
                self._budget_block = budget._open_block(site, record, state)
        elif budget is not None:
            _warn_budget_nested()
        frame = self._frame = Frame(
            opts["preserve_rng_state"], self._save, opts["debug"], self._stats, serial, self._budget_block
        )
        frame.site = site
        if outer is not None:  # nested in an open block of this thread: record into it
            outer.push(frame)
            self._block, self._nested = outer, True
        else:
            self._block, self._nested = _recorder.open_block(record, state, frame), False  # type: ignore[arg-type]
        rng = profiler_range("gradient_scope.record")
        rng.__enter__()
        self._range = rng

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if not self._active:
            raise RuntimeError("recompute_scope: __exit__ called on a scope that is not active.")
        block = self._block
        if block is None:
            self._active = False
            return
        try:
            self._close(block, exc_type)
        finally:
            # Dynamo compiles called frames again only now: the library's own code
            # above must not be traced (another thread: _close raised).
            _resume_dynamo(self)

    def _close(self, block: OpenBlock, exc_type: Any) -> None:
        if (
            _recorder.innermost() is not block
            or block.frame is not self._frame
            or (not self._nested and len(block.frames) != 1)
        ):
            raise RuntimeError(
                "recompute_scope: scopes exited out of order (or in another thread). "
                "Exit the innermost recompute_scope first."
            )
        self._block = self._frame = None
        self._active = False
        rng, self._range = self._range, None
        rng.__exit__(None, None, None)
        aborted = exc_type is not None
        if self._nested:
            block.pop(aborted)
            return
        try:
            clean = _recorder.close_block(block, aborted)
        finally:
            _interception.sweep()
        _check_matched(block.frame, len(block.record.ops), aborted)
        if self._budget_block is not None:
            plan, self._budget_block = self._budget_block, None
            plan.close(aborted)
        if not clean and not aborted:
            raise RuntimeError(
                "recompute_scope: a TorchDispatchMode entered inside the block was still "
                "active when the block ended; the scope has been closed under it. Exit modes "
                "entered inside a recompute_scope before leaving it."
            )

    def __call__(self, fn: F) -> F:
        return _decorate(fn, self._options)  # type: ignore[return-value]


# The real options for help(), inspect.signature and IDEs (``__new__`` takes
# ``*args`` for the bare decorator form).
_init_signature = inspect.signature(recompute_scope.__init__)
recompute_scope.__signature__ = _init_signature.replace(  # type: ignore[attr-defined]
    parameters=list(_init_signature.parameters.values())[1:], return_annotation=inspect.Signature.empty
)
_OPTION_NAMES = frozenset(list(_init_signature.parameters)[1:])


def _undo_open(scope: recompute_scope) -> None:
    """Put everything back after ``scope._open`` raised: nothing of it stays open."""
    scope._active = False
    block, scope._block, scope._frame = scope._block, None, None
    plan, scope._budget_block = scope._budget_block, None
    try:
        if block is not None:
            if scope._nested:
                block.pop(True)
            else:
                _recorder.close_block(block, True)
        if plan is not None:
            plan.close(True)
    finally:
        _resume_dynamo(scope)
        _interception.sweep()


def _resume_dynamo(scope: recompute_scope) -> None:
    """Undo the suspension of dynamo's compiling that ``scope``'s entry made (in another
    thread than the entry's: nothing)."""
    thread, callback = scope._dynamo_callback
    scope._dynamo_callback = (0, None)
    if thread == threading.get_ident():
        _torch_compat.resume_dynamo_compile(callback)


def traced(options: dict[str, Any], sink: int = 0) -> Any:
    """The scope of ``options`` while dynamo traces (the compile adapter's annotation), or
    None: run it eagerly. ``sink``: the key of the stats (``_base.stats.compiled_sink``)
    the compiled scope counts into."""
    options = dict(options)
    budget = options.pop("budget", None)
    if budget is not None:
        options["budget_given"] = getattr(budget, "key", True)  # the graph applies its plan
    if sink:
        options["sink"] = sink
    return _traced_block[0](**options) if _traced_block else None


def traced_scope(options: dict[str, Any], sink: int) -> Any:
    """While dynamo traces, a model helper's scope of ``options`` as the compiled graph's
    annotation, its figures going to the stats of key ``sink``; else None (a scope)."""
    return traced(options, sink) if _dynamo_compiling() and _traced_block else None


def counting_into(scope: Any, stats: ScopeStats) -> Any:
    """``scope``, its counters adding into ``stats`` (shared by the scopes a model
    helper runs for one module). Inside dynamo tracing the scope is part of the
    graph and counts nothing."""
    if isinstance(scope, recompute_scope):
        scope._stats = stats
    return scope


def _check_budget(budget: Any, save: Any) -> Budget:
    if not isinstance(budget, Budget):
        raise TypeError(
            "recompute_scope: budget must be a gradient_scope.Budget shared by the scopes it "
            f"bounds (e.g. budget = Budget('2GiB'), created once), got {type(budget).__name__}"
        )
    if save is not None:
        raise ValueError(
            "recompute_scope: pass either save= or budget=, not both: with a budget, the library decides what to store."
        )
    return budget


_warned: set[str] = set()


def _check_matched(frame: Frame, recorded: int, aborted: bool) -> None:
    """A built-in policy (``save_matmuls``, ``save_attention``) that kept no op of a block
    that recorded some warns, once per policy per process: the model does not run the
    ops it names (e.g. its attention is no SDPA kernel), so everything is recomputed."""
    policy = frame.save
    if not is_built_in(policy) or frame.kept_any or aborted or not recorded:
        return
    name = getattr(policy, "__name__", repr(policy))
    warn_once(
        ("policy matched nothing", name),
        f"gradient_scope: save={name} matched no op of a block of {recorded} recorded ops: nothing is "
        f"stored, everything is recomputed. The model may not run the ops {name} names (e.g. attention "
        "that is not an F.scaled_dot_product_attention kernel). Check the ops with saved_tensors_report(), "
        "then name them (save=[torch.ops.aten.bmm]) or use a context policy "
        f"(gradient_scope.policies.context_policy). Warned once per policy. {where(frame.site)}",
    )


def _warn_budget_nested() -> None:
    if "nested" not in _warned:
        _warned.add("nested")
        warn_user(
            "gradient_scope: a recompute_scope with budget= nested in another scope records into "
            "the outer block, which follows its own options: the budget is not applied there. "
            "Give budget= to the outermost scopes."
        )


def _rebuild_scope(options: dict[str, Any]) -> recompute_scope:
    return recompute_scope(**options)


def _decorate(fn: Callable[..., Any], options: dict[str, Any]) -> Callable[..., Any]:
    """``fn`` with each call (each resumption of a generator or coroutine) in a scope."""
    if inspect.isclass(fn):
        raise TypeError(
            f"recompute_scope(...) cannot decorate a class ({fn.__name__}); decorate its "
            "forward method, or use apply_recompute(model, check_fn=...) on instances."
        )
    if not callable(fn):
        raise TypeError(f"recompute_scope(...) decorates a callable, got {type(fn).__name__}")
    if inspect.isasyncgenfunction(fn):
        raise TypeError(
            f"recompute_scope(...) cannot decorate the async generator function {fn.__name__}; "
            "use `with recompute_scope():` inside it around the tensor code."
        )
    if inspect.isgeneratorfunction(fn):

        @functools.wraps(fn)
        def generator(*args: Any, **kwargs: Any) -> Any:
            return (yield from _each_step_scoped(fn(*args, **kwargs), options))

        return generator
    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def coroutine(*args: Any, **kwargs: Any) -> Any:
            return await _ScopedAwaitable(fn(*args, **kwargs), options)

        return coroutine

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return run_in_scope(recompute_scope(**options), fn, args, kwargs)

    return wrapper


def _each_step_scoped(gen: Any, options: dict[str, Any]) -> Generator[Any, Any, Any]:
    """Drive a generator or coroutine, each resumption in its own scope."""
    send: Any = None
    throw: BaseException | None = None
    while True:
        finished, result, out = False, None, None
        with recompute_scope(**options):
            try:
                out = gen.throw(throw) if throw is not None else gen.send(send)
            except StopIteration as stop:
                # Keep the value, not the exception: its traceback holds this frame
                # (a reference cycle that would keep the yielded tensors alive).
                finished, result = True, stop.value
        if finished:
            return result
        send, throw = None, None
        try:
            send = yield out
        except GeneratorExit:
            gen.close()
            raise
        except BaseException as e:  # noqa: BLE001  (thrown into us: the inner one gets it)
            throw = e
        finally:
            out = None


class _ScopedAwaitable:
    __slots__ = ("coro", "options")

    def __init__(self, coro: Any, options: dict[str, Any]) -> None:
        self.coro, self.options = coro, options

    def __await__(self) -> Generator[Any, Any, Any]:
        return _each_step_scoped(self.coro, self.options)


@overload
def recompute(fn: F, /) -> F: ...


@overload
def recompute(
    *,
    preserve_rng_state: bool = True,
    save: Iterable[Any] | Callable[[Any], bool] | None = None,
    enabled: bool = True,
    debug: bool = False,
    budget: Budget | None = None,
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
    return recompute_scope()(fn)
