"""Hugging Face transformers: one :class:`~gradient_scope.recompute_scope` per layer.

Every decoder/encoder layer of a transformers model derives from the public
``transformers.modeling_layers.GradientCheckpointingLayer``. :func:`enable`
runs every ``every_n_layers``-th of them in its own scope (with
:func:`~gradient_scope.apply_recompute`), :func:`disable` undoes it. Only public
transformers API is used: the layer class, each layer's ``gradient_checkpointing``
flag, and the model's ``activation_checkpointing_disable()`` (or, before 5.23,
``gradient_checkpointing_disable()``).

Transformers' own activation checkpointing and scopes on the same layers would
recompute each layer twice. When it is on as well -- turned on before or after
:func:`enable`, e.g. by ``Trainer`` with ``activation_checkpointing=True`` (or
``gradient_checkpointing=True``), which calls ``activation_checkpointing_enable()``
when training starts -- the next training forward (module in training mode, grad
enabled) turns transformers' checkpointing off through the model's own
``activation_checkpointing_disable()`` and warns once (``UserWarning``): **scopes
win**. It warns again only if something turns it on again.

In a training forward (module in training mode, grad enabled) :func:`enable` also does
what transformers' checkpointing does with the KV cache: the models inside it run with
``use_cache=False`` (a cache kept by the output would hold every layer's keys and values
until the output dies, in custom loops through backward), and each scoped layer gets
``use_cache=False`` and no ``cache`` / ``layer_past`` (unless its class says it only reads
the cache, ``_can_checkpoint_with_cache``), as transformers' ``GradientCheckpointingLayer``
does. When that changed something it says so once per model (a ``WARNING`` on the
``gradient_scope`` logger, as transformers logs its own). Evaluation and generation
(``eval()`` or no grad) keep the cache.
"""

from __future__ import annotations

import inspect
import weakref
from typing import Any

import torch
import torch.nn as nn

try:
    from transformers import PreTrainedModel
    from transformers.modeling_layers import GradientCheckpointingLayer
except ImportError as e:  # pragma: no cover (transformers is in the test extra)
    raise ImportError(
        "gradient_scope.integrations.transformers needs Hugging Face transformers (pip install 'transformers>=5.20')"
    ) from e

from .._api.helpers import detach_budget, scope_modules
from .._api.selection import check_every_n
from .._base.errors import check_bool
from .._base.feedback import logger, warn_user
from .._budget.budget import Budget, offload_all

__all__ = ["enable", "disable"]

_ABSENT = object()


class _Guard:
    """Forward pre-hook of the model passed to :func:`enable`: before a training
    forward, turns transformers' own checkpointing off if it is on (scopes win)."""

    def __init__(self, layers: list[nn.Module]) -> None:
        self.layers = layers  # every GradientCheckpointingLayer of the model

    def __call__(self, module: nn.Module, args: Any) -> None:
        if not module.training or not torch.is_grad_enabled():
            return  # transformers checkpoints only training forwards with grad
        if not any(layer.gradient_checkpointing for layer in self.layers):
            return
        _turn_off_hf_checkpointing(module)
        still_on = [type(layer).__name__ for layer in self.layers if layer.gradient_checkpointing]
        if still_on:
            raise RuntimeError(
                "gradient_scope.integrations.transformers: transformers' own activation checkpointing is "
                f"on for layers ({', '.join(sorted(set(still_on)))}) that no PreTrainedModel of this model "
                "can turn off, and scopes run on the same layers: each layer would be recomputed twice. "
                "Turn it off (activation_checkpointing_disable()) or call disable(model)."
            )
        warn_user(
            "gradient_scope.integrations.transformers: the model's own activation checkpointing was on "
            "as well as scopes (activation_checkpointing_enable() / gradient_checkpointing_enable(), e.g. "
            "Trainer with activation_checkpointing=True or gradient_checkpointing=True), which would "
            "recompute each layer twice. It has been turned off with activation_checkpointing_disable(): "
            "the layers run in scopes only. Leave activation_checkpointing off in the TrainingArguments, or "
            "call gradient_scope.integrations.transformers.disable(model) to use transformers' instead."
        )


def _turn_off_hf_checkpointing(model: nn.Module) -> None:
    """Call the public disable method of each outermost PreTrainedModel in ``model``
    whose layers checkpoint (it turns off its submodels' too)."""
    for m in model.modules():
        if not isinstance(m, PreTrainedModel):
            continue
        if not any(getattr(x, "gradient_checkpointing", False) is True for x in m.modules()):
            continue
        off = getattr(m, "activation_checkpointing_disable", None)  # transformers >= 5.23
        if off is None:
            off = m.gradient_checkpointing_disable
        off()


def _training(module: nn.Module) -> bool:
    """transformers' condition for checkpointing a forward (and dropping its cache)."""
    return module.training and torch.is_grad_enabled()


def _use_cache_position(model: nn.Module) -> int | None:
    """Where ``use_cache`` sits among ``model.forward``'s positional parameters; -1 when it
    is keyword-only; None when the forward takes no ``use_cache``."""
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):  # no signature to read: leave the model alone
        return None
    for i, p in enumerate(params):
        if p.name == "use_cache":
            return i if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD else -1
    return None


class _CacheOff:
    """The forward pre-hooks (with kwargs) that keep a training forward from building a KV
    cache, as transformers' checkpointing does: ``model`` on each transformers model with a
    ``use_cache`` parameter (``merge_with_config_defaults``'s rule: an explicit value, else
    the config's), ``layer`` on each scoped layer (``GradientCheckpointingLayer``'s rule, on
    keyword arguments). Says so once, the first time it changes something."""

    def __init__(self, positions: dict[nn.Module, int]) -> None:
        self.positions = positions  # model -> position of use_cache (-1: keyword-only)
        self.said = False

    def _say(self, where: str, what: str) -> None:
        if not self.said:
            self.said = True
            logger.warning(
                "gradient_scope: enable(): training forwards of %s run with %s, as with transformers' own "
                "activation checkpointing: a KV cache would hold every layer's keys and values as long as "
                "the output lives (through backward where the loop keeps the output). Evaluation and "
                "generation (eval() or torch.no_grad()) keep the cache.",
                where,
                what,
            )

    def model(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not _training(module):
            return None
        at = self.positions.get(module, -1)
        positional = 0 <= at < len(args)
        value = args[at] if positional else kwargs.get("use_cache")
        if value is None:
            value = getattr(getattr(module, "config", None), "use_cache", None)
        if not value:
            return None
        if positional:
            args = (*args[:at], False, *args[at + 1 :])
        else:
            kwargs = {**kwargs, "use_cache": False}
        self._say(type(module).__name__, "use_cache=False")
        return args, kwargs

    def layer(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not _training(module):
            return None
        changed: dict[str, bool | None] = {}
        if kwargs.get("use_cache"):
            changed["use_cache"] = False
        if not getattr(module, "_can_checkpoint_with_cache", False):
            # (different names for the same thing in different layers, as transformers says)
            changed.update({k: None for k in ("cache", "layer_past") if kwargs.get(k) is not None})
        if not changed:
            return None
        self._say(type(module).__name__, ", ".join(f"{k}={v}" for k, v in changed.items()))
        return args, {**kwargs, **changed}


def _cache_hooks(model: nn.Module, chosen: list[nn.Module]) -> list[Any]:
    """Put :class:`_CacheOff`'s hooks on the transformers models that hold a chosen layer
    and on the chosen layers; their handles."""
    ids = {id(m) for m in chosen}
    positions: dict[nn.Module, int] = {}
    for m in model.modules():
        if isinstance(m, PreTrainedModel) and any(id(x) in ids for x in m.modules()):
            at = _use_cache_position(m)
            if at is not None:
                positions[m] = at
    off = _CacheOff(positions)
    handles = [m.register_forward_pre_hook(off.model, with_kwargs=True) for m in positions]
    return handles + [m.register_forward_pre_hook(off.layer, with_kwargs=True) for m in chosen]


class _Enabled:
    """What :func:`enable` changed on one model, for :func:`disable`."""

    __slots__ = ("before", "handles")

    def __init__(self, before: list[tuple[nn.Module, Any]], handles: list[Any]) -> None:
        self.before = before  # (layer, its ``forward`` instance attribute or _ABSENT)
        self.handles = handles  # the guard's hook and the cache hooks


_ENABLED: weakref.WeakKeyDictionary[nn.Module, _Enabled] = weakref.WeakKeyDictionary()


def enable(model: nn.Module, every_n_layers: int = 1, offload: bool = False, **scope_options: Any) -> nn.Module:
    """Run every ``every_n_layers``-th transformers layer of ``model`` in its own scope.

    The layers are the model's ``GradientCheckpointingLayer`` instances (every
    decoder/encoder layer of a transformers model), counted in
    ``model.modules()`` order as transformers' ``every_n_layers`` counts them:
    layers 0, n, 2n, ... Each call of such a layer's forward runs in a fresh
    ``recompute_scope(**scope_options)``: its activations are recomputed in
    backward instead of stored, with the gradients of the plain model.
    ``model`` may be a transformers model or any module holding one (a PEFT
    ``PeftModel``, a wrapper). Calling it again replaces the options.

    If transformers' own activation checkpointing is on too (before or after
    this call; ``Trainer(activation_checkpointing=True)`` turns it on when
    training starts), the next training forward turns it off through the
    model's ``activation_checkpointing_disable()`` and warns once: scopes win.
    The warning names the user's line (the model's call, or ``trainer.train()``).

    Logs one line at INFO on the ``gradient_scope`` logger: the layers scoped
    (their paths) and the options.

    ``every_n_layers`` and ``offload`` are transformers' own
    ``activation_checkpointing_enable`` arguments, with their meaning: a port
    from it changes the method's name only.

    Args:
        model: the model, changed in place.
        every_n_layers: scope layers 0, n, 2n, ... (1: every layer).
        offload: as transformers' ``offload=True``, keep what the layers save in
            pinned host memory rather than on the accelerator: the scopes get
            ``budget=Budget(0, offload=True)`` (``gradient_scope._budget.budget.offload_all``):
            the device keeps as little as recompute and offload can make it, each
            saved tensor recomputed or offloaded as the plan predicts faster, and
            the floor that neither can move does not warn. With ``budget=`` given
            as bytes, that budget offloads (``Budget(budget, offload=True)``). On a
            CPU there is nowhere to offload to: it changes nothing and says so once.
        **scope_options: options of each scope (``save=``, ``preserve_rng_state=``,
            ``debug=``, ``budget=``, ...), passed on to :func:`~gradient_scope.apply_recompute`.

    Returns:
        ``model``.

    Raises:
        ValueError: ``model`` has no ``GradientCheckpointingLayer``, or
            ``every_n_layers`` is not a positive int, or ``offload=True`` with a
            ``Budget`` that does not offload.
        TypeError: an unknown option (the message names the one meant).

    Example::

        >>> import torch, transformers
        >>> import gradient_scope.integrations.transformers as gs_hf
        >>> cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        ...     num_attention_heads=2, num_key_value_heads=1, vocab_size=64)
        >>> model = transformers.LlamaForCausalLM(cfg).train()
        >>> _ = gs_hf.enable(model)
        >>> ids = torch.randint(0, 64, (2, 8))
        >>> model(input_ids=ids, labels=ids).loss.backward()   # layers recomputed in backward
        >>> _ = gs_hf.disable(model)                              # back to plain layers
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"enable: model must be a torch.nn.Module, got {type(model).__name__}")
    every_n_layers = check_every_n("enable", every_n_layers)
    shown = {"every_n_layers": every_n_layers, **({"offload": True} if offload else {}), **scope_options}
    if check_bool("enable", "offload", offload):
        scope_options = {**scope_options, "budget": _offloading(scope_options.get("budget"))}
    layers: list[nn.Module] = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if not layers:
        raise ValueError(
            f"enable: {type(model).__name__} has no transformers GradientCheckpointingLayer (the base "
            "class of transformers' decoder/encoder layers). For other models use "
            "gradient_scope.apply_recompute(model, check_fn=YourBlock)."
        )
    if model in _ENABLED:
        disable(model)
    chosen = layers[::every_n_layers]
    ids = {id(m) for m in chosen}
    before = [(m, m.__dict__.get("forward", _ABSENT)) for m in chosen]
    # Validates the options (unknown or invalid ones raise) before changing anything.
    what = f"of {len(layers)} layers"
    own = ("every_n_layers", "offload")
    scope_modules(model, lambda m: id(m) in ids, 1, scope_options, "enable", what, shown, own)
    handles = [model.register_forward_pre_hook(_Guard(layers)), *_cache_hooks(model, chosen)]
    _ENABLED[model] = _Enabled(before, handles)
    return model


def _offloading(budget: Any) -> Budget:
    """``enable(offload=True)``'s budget, given the ``budget=`` option (see :func:`enable`)."""
    if budget is None:
        return offload_all()
    if not isinstance(budget, Budget):
        return Budget(budget, offload=True)
    if budget.offload is None:
        raise ValueError(
            f"enable: offload=True with budget={budget!r}, which does not offload. Pass "
            f"budget=Budget({budget.bytes}, offload=True) instead (or offload= the host bytes it may fill, "
            "e.g. '64GiB')."
        )
    return budget


def disable(model: nn.Module) -> nn.Module:
    """Undo :func:`enable` on ``model``: each layer's forward is as it was before.

    Scopes applied separately (``apply_recompute``) stay. transformers'
    checkpointing, if :func:`enable` turned it off, stays off (turn it on again
    with ``model.activation_checkpointing_enable()``).

    Returns:
        ``model``.

    Raises:
        ValueError: :func:`enable` was not called on ``model`` (or it was disabled).
    """
    state = _ENABLED.pop(model, None)
    if state is None:
        raise ValueError(
            f"disable: gradient_scope.integrations.transformers.enable() was not called on this "
            f"{type(model).__name__} (or disable() already was)."
        )
    for handle in state.handles:
        handle.remove()
    detach_budget(model)
    for layer, forward in state.before:
        if forward is _ABSENT:
            layer.__dict__.pop("forward", None)
        else:
            layer.__dict__["forward"] = forward
    return model
