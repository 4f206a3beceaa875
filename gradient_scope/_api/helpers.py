"""Helpers for models: scope every call of chosen submodules, or of sequential chunks.

:func:`apply_recompute` gives a module a ``forward`` instance attribute: a small
callable that runs the module's own forward inside a fresh
:class:`recompute_scope` on each call. It refers to its module through a weak
reference (no reference cycle: a model still dies as soon as it is dropped) and
pickles and deep-copies along with the module. :func:`remove_recompute` puts back
exactly what was there before: no instance attribute (the class's ``forward``
applies again) or the instance attribute the module had.

With ``budget=``, the module given (the model) also gets a forward pre-hook and a
forward hook (run also when the forward raises) that open and close the budget's model
region around each of its forwards (M6 [ a model-level budget bounds the model ] in
``_budget.budget``): the budget then bounds the model's whole activation memory, the code
outside the scopes included.
"""

from __future__ import annotations

import inspect
import logging
import operator
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.nn as nn

from .._base.errors import Site
from .._base.feedback import describe_options, describe_paths, logger, unknown_options
from .._base.options import scopes_disabled
from .._base.stats import ScopeStats, compiled_sink
from .._budget.budget import Budget
from ..policies import as_save_policy
from .scope import counting_into, recompute_scope, run_in_scope, traced_scope
from .selection import ModuleSelector, check_every_n, choose, every_module

__all__ = ["apply_recompute", "remove_recompute", "recompute_sequential", "detach_budget"]

M = TypeVar("M", bound=nn.Module)

_SCOPE_OPTIONS = frozenset(
    name
    for name, p in inspect.signature(recompute_scope.__init__).parameters.items()
    if p.kind is inspect.Parameter.KEYWORD_ONLY
)


def _scope_options(caller: str, options: dict[str, Any], own: tuple[str, ...] = ()) -> dict[str, Any]:
    """Validate ``**scope_options`` once, up front; make ``save=`` picklable. ``own``: the
    caller's other keyword options, among the names a misspelling is matched to."""
    unknown = set(options) - _SCOPE_OPTIONS
    if unknown:
        raise unknown_options(caller, unknown, _SCOPE_OPTIONS | set(own), "recompute_scope option", "options")
    options = dict(options)
    # Interpreted once; lists of ops become a policy that pickles (ops pickle by name).
    if "save" in options:
        options["save"] = as_save_policy(options["save"])
    recompute_scope(**options)  # raises TypeError/ValueError for invalid values
    return options


def _class_forward(module: nn.Module) -> Callable[..., Any]:
    """``module.forward`` as it resolves without an instance attribute."""
    cls = type(module)
    for klass in cls.__mro__:
        attr = klass.__dict__.get("forward")
        if attr is not None:
            get = getattr(type(attr), "__get__", None)
            bound: Callable[..., Any] = get(attr, module, cls) if get is not None else attr
            return bound
    raise AttributeError(f"{cls.__name__} has no forward")  # pragma: no cover (nn.Module has one)


class _ScopedForward:
    """The ``forward`` instance attribute that :func:`apply_recompute` installs.

    Calls the module's own forward (``original``, the instance attribute it
    replaced, or else the class's ``forward``) inside a fresh
    ``recompute_scope(**options)``, whose counters add into ``stats`` (read by
    ``model_stats``; ``reset_stats`` starts afresh).
    """

    __slots__ = ("_module", "original", "options", "site", "stats", "compiled", "sink")

    def __init__(
        self, module: nn.Module, original: Callable[..., Any] | None, options: dict[str, Any], site: Site
    ) -> None:
        self._module = weakref.ref(module)
        self.original = original
        self.options = options
        self.site = site  # the module path, named in errors
        self.stats = ScopeStats()  # what its scopes counted (model_stats)
        # What its scopes in compiled graphs hold, counted once per graph compiled (model_stats):
        self.compiled = ScopeStats()
        self.sink = compiled_sink(self.compiled)

    def reset_stats(self) -> None:
        # A new object: scopes still in flight keep counting into the old one.
        self.stats = ScopeStats()

    @property
    def module(self) -> nn.Module:
        module = self._module()
        if module is None:
            raise RuntimeError(
                "gradient_scope: this forward belongs to a module that no longer exists "
                "(apply_recompute's forward refers to its module weakly)."
            )
        return module

    def _forward(self) -> Callable[..., Any]:
        original = self.original
        return original if original is not None else _class_forward(self.module)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        forward = self._forward()
        scope = traced_scope(self.options, self.sink)  # (while dynamo traces, the graph's annotation)
        if scope is None:
            scope = recompute_scope(**self.options)
            if type(scope) is recompute_scope:
                scope._at(self.site)
        return run_in_scope(counting_into(scope, self.stats), forward, args, kwargs)

    @property
    def __wrapped__(self) -> Callable[..., Any]:
        # For inspect.signature(module.forward) and friends (computed on access:
        # storing the bound method would make a reference cycle).
        return self._forward()

    def __repr__(self) -> str:
        module = self._module()
        name = type(module).__name__ if module is not None else "<dead module>"
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options.items())
        return f"<{name}.forward in recompute_scope({opts})>"

    def __reduce__(self) -> Any:
        # Pickle/deepcopy with the module: the copy refers to the copied module.
        return (_rebuild_scoped_forward, (self.module, self.original, self.options, self.site))


class _ModelBudget:
    """The hooks of a model-level budget on the model
    (M6 [ a model-level budget bounds the model ]): each forward of the model is a
    region of the budget. Inert where a scope records nothing: while dynamo traces (a
    compiled model's budget applies in its graph), without grad, and while scopes are
    disabled (``gradient_scope.disabled()``, ``GRADIENT_SCOPE_DISABLE``: nothing is
    counted or planned, so the budget's figures stay those of its last enabled step)."""

    def __init__(self, budget: Budget) -> None:
        self.budget = budget
        self.open: list[Any] = []
        self.handles: list[Any] = []

    def pre(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if not torch.compiler.is_compiling() and torch.is_grad_enabled() and not scopes_disabled():
            self.open.append(self.budget._open_region(module, (args, kwargs)))
        else:
            self.open.append(None)

    def post(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        region = self.open.pop() if self.open else None
        if region is not None:
            self.budget._close_region(region, output)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


_MODEL_BUDGETS: weakref.WeakKeyDictionary[nn.Module, _ModelBudget] = weakref.WeakKeyDictionary()


def _attach_budget(model: nn.Module, budget: Budget) -> None:
    detach_budget(model)
    hooks = _ModelBudget(budget)
    hooks.handles = [
        model.register_forward_pre_hook(hooks.pre, with_kwargs=True),
        model.register_forward_hook(hooks.post, with_kwargs=True, always_call=True),
    ]
    _MODEL_BUDGETS[model] = hooks


def detach_budget(model: nn.Module) -> None:
    """Remove the model-level budget hooks :func:`apply_recompute` put on ``model``."""
    hooks = _MODEL_BUDGETS.pop(model, None)
    if hooks is not None:
        hooks.remove()


def scoped_forward_stats(module: nn.Module) -> ScopeStats | None:
    """The counters of the scopes ``apply_recompute`` runs for ``module``, or None."""
    current = module.__dict__.get("forward")
    if isinstance(current, _ScopedForward) and current._module() is module:
        return current.stats
    return None


def scoped_forward_compiled(module: nn.Module) -> ScopeStats | None:
    """What the compiled graphs of ``module``'s scoped forward hold (``_ScopedForward.compiled``),
    or None: not scoped by ``apply_recompute``, or never compiled."""
    current = module.__dict__.get("forward")
    if isinstance(current, _ScopedForward) and current._module() is module and current.compiled != ScopeStats():
        return current.compiled
    return None


def reset_scoped_forward_stats(module: nn.Module) -> None:
    current = module.__dict__.get("forward")
    if isinstance(current, _ScopedForward) and current._module() is module:
        current.reset_stats()


def _rebuild_scoped_forward(
    module: nn.Module, original: Callable[..., Any] | None, options: dict[str, Any], site: Site
) -> _ScopedForward:
    return _ScopedForward(module, original, options, site)


def _module_site(path: str, module: nn.Module) -> Site:
    return (None, 0, f"{path or 'the model'} ({type(module).__name__}), scoped by apply_recompute")


def apply_recompute(
    model: M,
    check_fn: ModuleSelector = every_module,
    *,
    every_n_layers: int = 1,
    **scope_options: Any,
) -> M:
    """Run every call of chosen submodules in its own :class:`recompute_scope`.

    For each module in ``model.modules()`` (``model`` itself included) for
    which ``check_fn(module)`` is true, each call of the module's forward from
    now on runs in a fresh ``recompute_scope(**scope_options)``: tensors the
    forward creates are recomputed in backward instead of stored. This is the
    ``recompute_scope`` counterpart of torch's ``apply_activation_checkpointing``.

    The change is made in place, without wrapper modules: the module gets a
    ``forward`` instance attribute, and ``state_dict()``, ``named_modules()``,
    ``parameters()``, ``type(module)`` and the module's hooks are unchanged (the
    hooks run outside the scope, around it). The model still pickles and
    deep-copies. Forwards with keyword arguments and with any output (tensors,
    tuples, dicts, dataclasses, ...) work as they are.

    Applying again does not wrap twice: a module that already runs in a scope
    keeps one scope, with the options of the latest call. Undo with
    :func:`remove_recompute`.

    Wrap the modules that repeat and hold most activations (transformer
    blocks, residual stages). Apply it after wrappers that replace modules. A
    shallow copy of a module (``copy.copy``, a ``DataParallel`` replica)
    shares the original's forward attribute: apply recompute to the copy
    again.

    ``check_fn``'s default wraps every module, which is the same as one scope
    around ``model`` (nested scopes record into the outermost one): memory held
    after forward is small, but the first op of backward needs values that
    depend on the whole forward, so backward replays the whole forward at once
    and the peak memory is about that of the plain model. On a model with
    submodules it warns so. Pick the repeated blocks instead, so each block's
    activations are recomputed only while backward goes through that block.

    Each call logs one line at INFO on the ``gradient_scope`` logger: how many
    modules got scopes, their paths and the options (``logging.basicConfig(level=
    logging.INFO)`` shows it).

    Hugging Face transformers models: every decoder/encoder layer derives from
    ``transformers.modeling_layers.GradientCheckpointingLayer``, so
    ``apply_recompute(model, check_fn=GradientCheckpointingLayer)`` gives a
    scope per layer (``gradient_scope.integrations.transformers.enable(model)``
    does it too, and guards against transformers' own checkpointing).

    Args:
        model: the module to modify, in place.
        check_fn: picks the modules to wrap: a predicate
            ``check_fn(module) -> bool``, a module class, or a tuple of
            classes (matched with ``isinstance``, as FSDP's wrap policies
            take them), or a class name string (matched against each
            module's class name, as framework configs write it:
            ``"LlamaDecoderLayer"``; a dotted name against
            ``module.qualname``; a tuple may mix names and classes). When
            it matches no module, a ``UserWarning`` says so and nothing is
            changed; a name in a tuple that matches nothing while the model
            has a class name near it warns too (a misspelling). A module
            instance (not its class) raises ``TypeError`` before any module
            runs.
        every_n_layers: scope the matches 0, n, 2n, ... in ``model.modules()``
            order (1, the default: every match).
        **scope_options: options of each scope (``save=``,
            ``preserve_rng_state=``, ``enabled=``, ``debug=``, ``budget=``); see
            :class:`recompute_scope`. ``budget`` may be an int number of bytes
            or a string such as ``"2GiB"`` (one :class:`Budget` for all the
            chosen modules) or a :class:`Budget`, which then shows its plan.
            It bounds ``model``'s activation memory after each of its
            forwards, the code outside the chosen modules included.

    Returns:
        ``model``.

    Example::

        >>> import torch
        >>> import torch.nn as nn
        >>> from gradient_scope import apply_recompute, remove_recompute, save_matmuls
        >>> class Block(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.ln, self.fc1, self.fc2 = nn.LayerNorm(16), nn.Linear(16, 64), nn.Linear(64, 16)
        ...     def forward(self, x):
        ...         return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln(x))))
        >>> model = nn.Sequential(Block(), Block(), nn.Linear(16, 4))
        >>> _ = apply_recompute(model, check_fn=Block, save=save_matmuls)   # or a predicate
        >>> model(torch.randn(8, 16)).sum().backward()   # block activations recomputed
        >>> _ = remove_recompute(model)                   # back to plain forwards
        >>> _ = apply_recompute(model, check_fn="Block", every_n_layers=2)   # by class name: model[0] only
        >>> "forward" in vars(model[0]), "forward" in vars(model[1])
        (True, False)
        >>> _ = remove_recompute(model)
        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     _ = apply_recompute(model, check_fn=nn.Conv2d)
        >>> print(caught[0].message)   # doctest: +ELLIPSIS
        apply_recompute: check_fn (Conv2d) matched no module of Sequential; nothing was changed. ...
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"apply_recompute: model must be a torch.nn.Module, got {type(model).__name__}")
    n = check_every_n("apply_recompute", every_n_layers)
    scope_modules(model, check_fn, n, scope_options, "apply_recompute")
    return model


def scope_modules(
    model: nn.Module,
    check_fn: Any,
    every_n_layers: int,
    scope_options: dict[str, Any],
    caller: str,
    what: str = "",
    shown: dict[str, Any] | None = None,
    own: tuple[str, ...] = ("check_fn", "every_n_layers"),
) -> list[str]:
    """``apply_recompute``'s work, for the helpers built on it: validate the options, choose
    the modules, give each a scoped forward, log one line (``caller``; ``what`` the modules
    are; ``shown``: the options to name, default ``scope_options`` and ``every_n_layers``;
    ``own``: the caller's keyword options besides the scope's). Returns the paths scoped."""
    if shown is None:
        shown = {**({"every_n_layers": every_n_layers} if every_n_layers != 1 else {}), **scope_options}
    budget = scope_options.get("budget")
    if budget is not None and not isinstance(budget, Budget):
        scope_options = {**scope_options, "budget": Budget(budget)}
    options = _scope_options(caller, scope_options, own)
    chosen = choose(model, check_fn, every_n_layers)
    for path, module in chosen:
        _install(path, module, options)
    if chosen:
        # M6 [ a model-level budget bounds the model ]: the budget bounds the whole model
        if options.get("budget") is not None:
            _attach_budget(model, options["budget"])
        else:
            detach_budget(model)
        paths = [p for p, _ in chosen]
        logger.info(
            "%s: scoped %d %s (%s) of %s with %s",
            caller,
            len(paths),
            what or ("module" if len(paths) == 1 else "modules"),
            describe_paths(paths),
            type(model).__name__,
            describe_options(shown),
        )
    return [p for p, _ in chosen]


def _install(path: str, module: nn.Module, options: dict[str, Any]) -> None:
    """Give ``module`` a scoped forward with ``options`` (a fresh copy of them)."""
    current = module.__dict__.get("forward")
    site = _module_site(path, module)
    if isinstance(current, _ScopedForward):
        if current._module() is module:
            current.options, current.site = dict(options), site
            current.reset_stats()
            return
        original = current.original  # shared by a shallow copy of another module
    else:
        original = current
    module.__dict__["forward"] = _ScopedForward(module, original, dict(options), site)


def remove_recompute(model: M) -> M:
    """Undo :func:`apply_recompute` on ``model`` and all its submodules.

    Each module's ``forward`` is exactly as before ``apply_recompute``: the
    instance attribute it installed is removed (or, where the module had a
    ``forward`` instance attribute of its own, that one is put back). Modules
    without recompute applied are left alone.

    Returns:
        ``model``.

    Example::

        >>> import torch.nn as nn
        >>> from gradient_scope import apply_recompute, remove_recompute
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.GELU())
        >>> _ = apply_recompute(model, check_fn=lambda m: isinstance(m, nn.Linear))
        >>> "forward" in vars(model[0])
        True
        >>> _ = remove_recompute(model)
        >>> "forward" in vars(model[0])
        False
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"remove_recompute: model must be a torch.nn.Module, got {type(model).__name__}")
    for module in model.modules():
        detach_budget(module)
        current = module.__dict__.get("forward")
        if isinstance(current, _ScopedForward):
            if current.original is None:
                del module.__dict__["forward"]
            else:
                module.__dict__["forward"] = current.original
    return model


def recompute_sequential(functions: Any, segments: int, input: Any, **scope_options: Any) -> Any:
    """Run a sequence of modules/functions in chunks, each but the last in a scope.

    The counterpart of ``torch.utils.checkpoint.checkpoint_sequential``:
    ``functions`` (an ``nn.Sequential`` or a list of modules/functions) is split
    into ``segments`` consecutive chunks of ``len(functions) // segments``
    functions (the last chunk takes the rest). Each function is called with the
    previous one's output, starting from ``input``. Every chunk but the last
    runs inside its own ``recompute_scope(**scope_options)``; the last runs
    plainly, since backward starts with it and would recompute it at once.

    Args:
        functions: ``nn.Sequential``, ``nn.ModuleList``, or list/tuple of callables.
        segments: number of chunks, ``1 <= segments <= len(functions)``.
        input: the input of the first function.
        **scope_options: options of each scope; see :class:`recompute_scope`.

    Returns:
        The output of the last function.

    Raises:
        ValueError: ``segments`` is not an int between 1 and ``len(functions)``.

    Example::

        >>> import torch
        >>> import torch.nn as nn
        >>> from gradient_scope import recompute_sequential
        >>> model = nn.Sequential(*(nn.Sequential(nn.Linear(32, 32), nn.GELU()) for _ in range(8)))
        >>> x = torch.randn(16, 32, requires_grad=True)
        >>> out = recompute_sequential(model, segments=4, input=x)   # 3 scopes, 2 layers each
        >>> out.sum().backward()
    """
    if isinstance(functions, (nn.Sequential, nn.ModuleList, list, tuple)):
        funcs = list(functions)
    else:
        raise TypeError(
            "recompute_sequential: functions must be an nn.Sequential, an nn.ModuleList or a "
            f"list of modules/functions, got {type(functions).__name__}"
        )
    for i, f in enumerate(funcs):
        if not callable(f):
            raise TypeError(f"recompute_sequential: functions[{i}] is not callable ({type(f).__name__})")
    n = len(funcs)
    try:
        count = None if isinstance(segments, bool) else operator.index(segments)
    except TypeError:
        count = None
    if count is None or not 1 <= count <= n:
        raise ValueError(
            f"recompute_sequential: segments must be an int between 1 and the number of "
            f"functions ({n}), got {segments!r}"
        )
    segments = count
    options = _scope_options("recompute_sequential", scope_options, ("segments", "input"))
    size = n // segments
    _log_sequential(n, segments, size, scope_options)
    x = input
    end = 0
    for s in range(segments - 1):
        start, end = s * size, (s + 1) * size
        with recompute_scope(**options):
            for f in funcs[start:end]:
                x = f(x)
    for f in funcs[end:]:
        x = f(x)
    return x


_logged_sequential: set[tuple[int, int, str]] = set()


def _log_sequential(n: int, segments: int, size: int, options: dict[str, Any]) -> None:
    """One INFO line per distinct layout and options (it runs every forward: not every call)."""
    if not logger.isEnabledFor(logging.INFO):
        return
    described = describe_options(options)
    key = (n, segments, described)
    if key in _logged_sequential:
        return
    if len(_logged_sequential) < 1024:
        _logged_sequential.add(key)
    scoped = size * (segments - 1)
    layout = f"functions 0-{scoped - 1} in {segments - 1} scopes of {size}, " if scoped else ""
    logger.info(
        "recompute_sequential: %d functions in %d segments: %sthe last %d plain, with %s",
        n,
        segments,
        layout,
        n - scoped,
        described,
    )
