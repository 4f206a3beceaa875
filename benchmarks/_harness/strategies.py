"""The recompute strategies every job compares, applied to any ``nn.Module`` by module
selection, and the comparison of a strategy's tensors with plain's.

A strategy is a name; :func:`apply_strategy` makes a model (a copy, changed in place)
run it. Layer strategies take a selector of the model's layers (its repeated blocks);
region strategies (``scope_attn_mlp`` on the Hugging Face models, ``scope_mlp`` and
``scope_act`` on the benchmark GPT) take a selector of their own, given by the zoo.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

import gradient_scope
from gradient_scope import Budget

__all__ = [
    "AA",
    "Selector",
    "DESCRIPTIONS",
    "MATMUL_OPS",
    "sac_policy",
    "sac_context",
    "NopMode",
    "OpCounter",
    "wrap_forward",
    "budget_fraction",
    "selection",
    "apply_strategy",
    "plain_name",
    "PATHS",
    "compare_tensors",
]

AA = "plain_again"  # A/A control: plain timed a second time per round
Selector = Callable[[nn.Module], bool]

DESCRIPTIONS = {
    "plain": "no recomputation",
    "checkpoint": "apply_activation_checkpointing(checkpoint_wrapper, CheckpointImpl.NO_REENTRANT) per layer",
    "sac_matmul": "torch selective checkpointing per layer (checkpoint_wrapper, context_fn): MUST_SAVE "
    "matmuls and attention kernels, PREFER_RECOMPUTE the rest",
    "scope_layer": "gradient_scope.apply_recompute(model, check_fn=<layer>)",
    "scope_layer_savemm": "apply_recompute(model, check_fn=<layer>, save=gradient_scope.save_matmuls)",
    "scope_attn_mlp": "apply_recompute on each attention and MLP submodule (ResNet: each residual branch)",
    "scope_mlp": "apply_recompute on the MLP activation gelu(fc1(x)) only",
    "scope_act": "apply_recompute on the MLP activation and on the attention probabilities",
    "mode_layer": "plain, each layer's forward under a do-nothing TorchDispatchMode (the floor of any "
    "recorder that is a dispatch mode)",
    "dynamo_layer": "plain, each layer's forward run as the steady state captures it (torch.compile, "
    "fullgraph, the captured graph run eagerly; no scope): dynamo's guards and the function as dynamo "
    "traces it, the floor of the steady state",
    "budget50": "apply_recompute(model, check_fn=<layer>, budget=Budget(0.50 x plain's held after forward))",
    "budget25": "apply_recompute(model, check_fn=<layer>, budget=Budget(0.25 x plain's held after forward))",
    "scope_layer+fast": "scope_layer with GRADIENT_SCOPE_FAST=1 during the model's forward: each layer's "
    "function captured by dynamo, bound from the record of its first run (the steady state)",
    "scope_layer+recorded": "scope_layer with GRADIENT_SCOPE_FAST=0 during the model's forward: every "
    "block recorded (the default on CPU)",
    "budget50+fast": "budget50 in the steady state (GRADIENT_SCOPE_FAST=1)",
    "budget50+recorded": "budget50 with every block recorded (GRADIENT_SCOPE_FAST=0)",
    "scope_layer_savemm+recorded": "scope_layer_savemm with every block recorded (GRADIENT_SCOPE_FAST=0)",
    "budget50+offload": "budget50 with Budget(..., offload=True): keep, offload to pinned host memory, or recompute",
    "offload_all": "every tensor the model's forward saves offloaded to pinned host memory and prefetched back "
    "(the library's offload engine under a plain saved-tensor hook pair; no scope, nothing recomputed)",
    "save_on_cpu": "torch.autograd.graph.save_on_cpu(pin_memory=True) around the model's forward",
    "scope_layer_savemm+fast": "scope_layer_savemm in the steady state (GRADIENT_SCOPE_FAST=1)",
    AA: "plain on a second copy (A/A control: the noise floor of the time ratios)",
}

_aten = torch.ops.aten
MATMUL_OPS = frozenset(
    {
        _aten.mm.default,
        _aten.bmm.default,
        _aten.addmm.default,
        _aten.baddbmm.default,
        _aten.addbmm.default,
        _aten.mv.default,
        _aten.addmv.default,
        _aten.dot.default,
        _aten._scaled_dot_product_flash_attention_for_cpu.default,
        _aten._scaled_dot_product_flash_attention.default,
        _aten._scaled_dot_product_efficient_attention.default,
        _aten._scaled_dot_product_cudnn_attention.default,
    }
)


def sac_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Selective checkpointing: save matmul-like outputs, recompute everything else."""
    return CheckpointPolicy.MUST_SAVE if op in MATMUL_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def sac_context() -> Any:
    """``context_fn`` of torch's checkpoint for :func:`sac_policy`."""
    return create_selective_checkpoint_contexts(sac_policy)


class NopMode(TorchDispatchMode):
    """A dispatch mode that only runs each op: what any dispatch-mode recorder costs at least."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        return func(*args, **(kwargs or {}))


class OpCounter(TorchDispatchMode):
    """Counts the aten ops that run under it (``count``)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.count += 1
        return func(*args, **(kwargs or {}))


def _run_in(make_ctx: Callable[[], Any], forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    with make_ctx():
        return forward(*args, **kwargs)


def wrap_forward(model: nn.Module, select: Selector, make_ctx: Callable[[], Any]) -> int:
    """Run every call of the selected modules' forward inside ``make_ctx()``; returns how
    many modules were wrapped. A ``functools.partial`` instance attribute (as
    ``apply_recompute`` does): deep copies of the model stay wrapped."""
    chosen = [m for m in model.modules() if select(m)]
    for m in chosen:
        m.forward = functools.partial(_run_in, make_ctx, m.forward)  # type: ignore[method-assign]
    return len(chosen)


#: Strategy name suffixes that force the steady state on or off during the model's forward
#: (the environment variable ``GRADIENT_SCOPE_FAST``, read at each scope's entry).
PATHS = {"+fast": "1", "+recorded": "0"}


class _FastSetting:
    """``GRADIENT_SCOPE_FAST=value`` while a forward runs, restored after."""

    def __init__(self, value: str) -> None:
        self.value = value

    def __enter__(self) -> None:
        self.prior = os.environ.get("GRADIENT_SCOPE_FAST")
        os.environ["GRADIENT_SCOPE_FAST"] = self.value

    def __exit__(self, *exc: Any) -> None:
        if self.prior is None:
            os.environ.pop("GRADIENT_SCOPE_FAST", None)
        else:
            os.environ["GRADIENT_SCOPE_FAST"] = self.prior


def budget_fraction(name: str) -> float | None:
    """``budget50`` -> 0.5: a Budget at that fraction of plain's held bytes; None for others."""
    if name.startswith("budget") and name[6:].isdigit():
        return int(name[6:]) / 100
    return None


def _is_budget(name: str) -> bool:
    """``budgetNN`` (a fraction of plain's held bytes) or ``budget@N`` (N bytes)."""
    return budget_fraction(name) is not None or (name.startswith("budget@") and name[7:].isdigit())


def selection(name: str, layers: Selector, parts: Mapping[str, Selector]) -> tuple[Selector, Any] | None:
    """The modules a scope strategy puts in scopes and its ``save=`` policy (None for the
    strategies without scopes): what the ideal-memory analysis mirrors."""
    if name in ("scope_layer", "scope_layer_savemm") or _is_budget(name):
        return layers, gradient_scope.save_matmuls if name == "scope_layer_savemm" else None
    if name in parts:
        return parts[name], None
    return None


def apply_strategy(
    model: nn.Module,
    name: str,
    layers: Selector,
    parts: Mapping[str, Selector] | None = None,
    plain_held: int | None = None,
) -> Budget | None:
    """Make ``model`` (changed in place) run strategy ``name``; returns the Budget of a
    ``budget@N`` (N bytes) or ``budgetNN`` strategy (NN% of ``plain_held``, plain's bytes
    held after forward), else None."""
    parts = parts or {}
    if name.endswith("+offload") and _is_budget(name[: -len("+offload")]):
        base = name[: -len("+offload")]
        frac = budget_fraction(base)
        nbytes = int(base[7:]) if frac is None else max(1, int(frac * (plain_held or 0)))
        budget = Budget(nbytes, offload=True)
        gradient_scope.apply_recompute(model, check_fn=layers, budget=budget)
        return budget
    if name == "save_on_cpu":
        wrap_forward(model, lambda m: m is model, lambda: torch.autograd.graph.save_on_cpu(pin_memory=True))
        return None
    if name == "offload_all":
        wrap_forward(model, lambda m: m is model, _offload_all_context())
        return None
    for suffix, value in PATHS.items():
        if name.endswith(suffix):
            budget = apply_strategy(model, name[: -len(suffix)], layers, parts, plain_held)
            wrap_forward(model, lambda m: m is model, functools.partial(_FastSetting, value))
            return budget
    if name in ("plain", AA):
        return None
    if name in ("checkpoint", "sac_matmul"):
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            CheckpointImpl,
            apply_activation_checkpointing,
            checkpoint_wrapper,
        )

        kw: dict[str, Any] = {"context_fn": sac_context} if name == "sac_matmul" else {}
        wrapper = functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT, **kw)
        apply_activation_checkpointing(model, checkpoint_wrapper_fn=wrapper, check_fn=layers)
        return None
    if name == "mode_layer":
        wrap_forward(model, layers, NopMode)
        return None
    if name == "dynamo_layer":
        _captured_layers(model, layers)
        return None
    if _is_budget(name):
        frac = budget_fraction(name)
        if frac is not None and plain_held is None:
            raise ValueError(f"{name}: a budget is a fraction of plain's held bytes; run plain first")
        budget = Budget(int(name[7:]) if frac is None else max(1, int(frac * plain_held)))  # type: ignore[operator]
        gradient_scope.apply_recompute(model, check_fn=layers, budget=budget)
        return budget
    chosen = selection(name, layers, parts)
    if chosen is None:
        known = ", ".join(["plain", AA, "checkpoint", "sac_matmul", "mode_layer", "dynamo_layer", "scope_layer",
                           "scope_layer_savemm", "budgetNN", "budget@N", *parts])
        raise ValueError(f"unknown strategy {name!r}; the strategies are {known}")
    select, save = chosen
    gradient_scope.apply_recompute(model, check_fn=select, **({} if save is None else {"save": save}))
    return None


def _captured_layers(model: nn.Module, select: Selector) -> None:
    """Each selected module's forward called through the steady state's dynamo entry
    (the same dynamo cache entry a scope's steady run uses), outside any scope."""
    from gradient_scope._adapters.steady.run import _entry

    for m in [m for m in model.modules() if select(m)]:
        m.forward = functools.partial(_entry, m.forward)  # type: ignore[method-assign]


def _offload_all_context() -> Callable[[], Any]:
    """A context for each forward: every saved tensor offloaded by one engine (its prefetch
    order learnt from the previous step), or kept where it has nowhere to go (CPU)."""
    from gradient_scope._budget.offload import Offloaded, Offloader

    engine = Offloader(host_limit=None)

    def pack(t: torch.Tensor) -> Any:
        packed = engine.pack(t, len(engine.step))
        return packed if packed is not None else t

    def unpack(p: Any) -> torch.Tensor:
        return p.unpack() if isinstance(p, Offloaded) else p

    def make() -> Any:
        engine.new_step()
        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    return make


def plain_name(name: str) -> str:
    """A parameter or buffer name without checkpoint_wrapper's extra module level."""
    return name.replace("_checkpoint_wrapped_module.", "")


def compare_tensors(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """Max |a - b|, the largest of max |a - b| / max |b| per tensor, and bitwise equality
    over same-named tensors (``b``'s moved to ``a``'s device one at a time)."""
    if a.keys() != b.keys():
        missing = sorted(set(a) ^ set(b))
        return {"max_abs_diff": None, "bitwise_equal": False, "differing": missing[:5], "note": "names differ"}
    worst = worst_rel = 0.0
    differing = []
    for k, x in a.items():
        y = b[k].to(x.device)
        if not torch.equal(x, y):
            differing.append(k)
            wide = torch.float32 if x.element_size() < 4 else torch.float64  # exact for bf16/fp16
            d = (x.to(wide) - y.to(wide)).abs().max().item() if x.numel() else 0.0
            worst = max(worst, d)
            worst_rel = max(worst_rel, d / max(y.to(wide).abs().max().item(), 1e-30))
    return {
        "max_abs_diff": worst,
        "max_rel_diff": worst_rel,
        "bitwise_equal": not differing,
        "differing": differing[:5],
        "n_differing": len(differing),
    }
