"""Recompute strategies shared by the benchmarks: torch's selective checkpointing policy
and the strategies of the benchmark GPT (``benchmarks/gpt.py``), and the comparison of a
strategy's tensors with plain's."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from gradient_scope import recompute_scope

__all__ = [
    "AA",
    "MATMUL_OPS",
    "sac_policy",
    "sac_context",
    "apply_gpt_strategy",
    "compare_tensors",
    "grad_diff",
    "profile_against_plain",
]

AA = "plain_again"  # A/A control: plain timed a second time per round

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


# Module-level hooks (not closures): a compiled model sees the same functions every call.
def _checkpoint_layer(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return checkpoint(block, x, use_reentrant=False)


def _sac_layer(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return checkpoint(block, x, use_reentrant=False, context_fn=sac_context)


def _scope_layer(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with recompute_scope():
        return block(x)


def _scope_ctx(kind: str) -> Any:
    return recompute_scope()


def _mlp_only_ctx(kind: str) -> Any:
    return recompute_scope() if kind == "mlp_act" else contextlib.nullcontext()


def apply_gpt_strategy(model: Any, name: str, new_scope: Callable[[], Any] | None = None) -> None:
    """Point the benchmark GPT's hooks (``layer_call``, ``act_ctx``) at strategy ``name``.

    ``plain``/``plain_again``, ``checkpoint`` and ``sac_matmul`` per layer; ``scope_layer``
    and ``scope_layer_savemm`` (a scope per layer), ``scope_mlp`` (the MLP activation) and
    ``scope_act`` (the MLP activation and the attention probabilities). ``new_scope``
    makes each scope (e.g. to collect them, or another context manager in the same place,
    as the ideal-memory analysis does); without it, plain ``recompute_scope()``.
    """
    model.reset_strategy()
    if name in ("plain", AA):
        return
    if name == "checkpoint":
        model.layer_call = _checkpoint_layer
    elif name == "sac_matmul":
        model.layer_call = _sac_layer
    elif name not in ("scope_layer", "scope_layer_savemm", "scope_act", "scope_mlp"):
        raise ValueError(f"unknown strategy {name!r}")
    elif new_scope is None:
        if name == "scope_layer_savemm":
            raise ValueError("scope_layer_savemm needs new_scope (the scope with its save= policy)")
        model.layer_call, model.act_ctx = {
            "scope_layer": (_scope_layer, model.act_ctx),
            "scope_act": (model.layer_call, _scope_ctx),
            "scope_mlp": (model.layer_call, _mlp_only_ctx),
        }[name]
    elif name in ("scope_layer", "scope_layer_savemm"):

        def layer_call(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
            with new_scope():
                return block(x)

        model.layer_call = layer_call
    elif name == "scope_act":
        model.act_ctx = lambda kind: new_scope()
    else:
        model.act_ctx = lambda kind: new_scope() if kind == "mlp_act" else contextlib.nullcontext()


def compare_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Max |a - b| and bitwise equality over same-named tensors; names that differ."""
    if a.keys() != b.keys():
        missing = sorted(set(a) ^ set(b))
        return {"max_abs_diff": None, "bitwise_equal": False, "differing": missing[:5], "note": "names differ"}
    worst = 0.0
    differing = []
    for k in a:
        x, y = a[k], b[k]
        if not torch.equal(x, y):
            differing.append(k)
            worst = max(worst, (x.double() - y.double()).abs().max().item())
    return {
        "max_abs_diff": worst,
        "bitwise_equal": not differing,
        "differing": differing[:5],
        "n_differing": len(differing),
    }


def grad_diff(grads: list[torch.Tensor], ref: list[torch.Tensor]) -> dict[str, Any]:
    """``grad_max_abs_diff`` (in float32) and ``grads_bitwise_equal`` of ``grads`` vs ``ref``."""
    return {
        "grad_max_abs_diff": max((g.float() - p.float()).abs().max().item() for g, p in zip(grads, ref)),
        "grads_bitwise_equal": all(torch.equal(g, p) for g, p in zip(grads, ref)),
    }


def profile_against_plain(
    names: Iterable[str],
    profiled_step: Callable[[str], dict[str, Any]],
    compare: Callable[[list[torch.Tensor], list[torch.Tensor]], dict[str, Any]] = grad_diff,
) -> dict[str, dict[str, Any]]:
    """``profiled_step(name)`` for each name, in order; the ``"grads"`` it returns are
    replaced by ``compare(grads, plain's grads)`` once ``plain`` has run."""
    res: dict[str, dict[str, Any]] = {}
    ref = None
    for name in names:
        r = profiled_step(name)
        grads = r.pop("grads")
        if name == "plain":
            ref = grads
        if ref is not None:
            r.update(compare(grads, ref))
        res[name] = r
        del grads
    return res
