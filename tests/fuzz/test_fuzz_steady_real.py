"""Differential fuzzing of the steady state in settings of real training (issue 35): module hooks,
several models of one layer class in one process, budgets, varying lengths and key/value caches.

Every example draws a model of ``_Layer`` layers (a layer class of this file: dynamo captures it)
and a setting, and runs it for several steps with ``GRADIENT_SCOPE_FAST=1`` against the same
program without scopes (same seeds, same hooks): losses and gradients bitwise equal at every step.

- Hooks (forward, pre, full backward) on a submodule of some layers only (instances differ), with
  values that differ by layer, present from the start or added after the layers were captured.
- Two models of one layer class in one process: one scoped per layer or under a budget, the other
  under a ``Budget``, run alternately.
- Lengths: one, alternating, or new ones every step.
- A key/value cache: each layer appends its keys and values to an object outside the block (held in a
  reference cycle, as Hugging Face's ``DynamicCache``) that dies with the step's output.
- A tiny Hugging Face Llama with ``use_cache=True`` through ``apply_recompute`` on its layers, at
  varying lengths.

Size: GS_STEADY_REAL_EXAMPLES examples (default 3; each pays dynamo's captures, a few seconds); the
draws are fixed unless GS_DIFF_RANDOM=1.
"""

from __future__ import annotations

import gc
import os
import random
import warnings
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from gradient_scope import Budget, apply_recompute

from support import older_objects_out_of_sight
from support.hf_models import VOCAB, make_model

N_EXAMPLES = int(os.environ.get("GS_STEADY_REAL_EXAMPLES", "3"))
RANDOM = os.environ.get("GS_DIFF_RANDOM", "") not in ("", "0")
D = 8


class _Cache:
    """Keys and values the layers write, held in a reference cycle."""

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.me = self


class _Layer(nn.Module):
    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.q, self.k, self.v = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)
        self.mlp = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))
        self.dropout = dropout

    def forward(self, x: torch.Tensor, cache: _Cache | None = None) -> torch.Tensor:
        h = self.norm(x)
        q, k, v = self.q(h), self.k(h), self.v(h)
        if cache is not None:
            cache.keys.append(k)
            cache.values.append(v)
        x = x + F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + F.dropout(self.mlp(x), self.dropout, training=self.training)


class _Model(nn.Module):
    def __init__(self, layers: int, dropout: float, cached: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Layer(dropout) for _ in range(layers))
        self.cached = cached

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cache = _Cache() if self.cached else None
        for layer in self.layers:
            x = layer(x, cache) if cache is not None else layer(x)
        return x


def _hook(kind: str, scale: float) -> tuple[str, Any]:
    if kind == "forward":
        return "register_forward_hook", lambda m, args, out: out * scale
    if kind == "pre":
        return "register_forward_pre_hook", lambda m, args: (args[0] * scale, *args[1:])
    return "register_full_backward_hook", lambda m, gin, gout: tuple(None if g is None else g * scale for g in gin)


def _draw(rng: random.Random) -> dict[str, Any]:
    lengths = rng.choice(("one", "alternating", "new"))
    steps = 5
    seqs = {"one": [6] * steps, "alternating": [6, 4] * 3, "new": [3 + i for i in range(steps)]}[lengths][:steps]
    hooks = []
    for _ in range(rng.randint(0, 2)):
        hooks.append(
            (
                rng.choice(("forward", "pre", "backward")),
                rng.choice(("q", "mlp", "norm", "mlp.0")),  # submodules (mlp.0 inside a Sequential)
                rng.randrange(3),  # which layer
                rng.choice((0, 0, 2, 3)),  # added before this step (0: from the start)
                rng.choice((0.5, 1.5, 2.0)),
            )
        )
    first, two = rng.choice(("per layer", "budget")), rng.random() < 0.6  # two models of one layer class
    return {
        "layers": 3,
        "dropout": rng.choice((0.0, 0.2)),
        "cached": rng.random() < 0.5,
        "seqs": seqs,
        "hooks": hooks,
        "scopes": [first, "budget"] if two else [first],
        "budgets": [rng.choice((0, 2_000, 6_000, 10**9)) for _ in range(2)],
    }


def _models(ex: dict[str, Any], scoped: bool) -> list[_Model]:
    models = []
    for n, how in enumerate(ex["scopes"]):
        torch.manual_seed(1000 + n)
        m = _Model(ex["layers"], ex["dropout"], ex["cached"])
        if scoped:
            budget = Budget(ex["budgets"][n]) if how == "budget" else None
            apply_recompute(m, check_fn=lambda mod: isinstance(mod, _Layer), budget=budget)
        models.append(m)
    return models


def _run(ex: dict[str, Any], scoped: bool) -> list[torch.Tensor]:
    models = _models(ex, scoped)
    out: list[torch.Tensor] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a budget below its floor says so
        for step, seq in enumerate(ex["seqs"]):
            for layer_n, (kind, sub, which, at, scale) in enumerate(ex["hooks"]):
                if at == step:
                    for n, m in enumerate(models):
                        method, fn = _hook(kind, scale + 0.25 * n + 0.125 * layer_n)
                        getattr(m.layers[which].get_submodule(sub), method)(fn)
            for n, m in enumerate(models):
                torch.manual_seed(100 * step + n)
                x = torch.randn(2, seq, D, requires_grad=True)
                y = m(x)
                g = torch.Generator().manual_seed(step)
                loss = (y * torch.randn(y.shape, generator=g)).sum()
                del y
                gc.collect()  # a cache's cycle goes before backward
                loss.backward()
                out += [loss.detach(), x.grad, *(p.grad.clone() for p in m.parameters())]
                m.zero_grad()
    return out


# a full collection per step (a cache's cycle goes before backward)
_older = pytest.fixture(autouse=True, scope="module")(older_objects_out_of_sight)


@pytest.mark.parametrize("n", range(N_EXAMPLES))
def test_steady_real_settings_equal_plain(n, fast):
    rng = random.Random(None if RANDOM else 7717 * n + 3)
    ex = _draw(rng)
    plain = _run(ex, scoped=False)
    scoped = _run(ex, scoped=True)
    assert len(plain) == len(scoped)
    for i, (p, s) in enumerate(zip(plain, scoped)):
        assert torch.equal(p, s), f"example {n}: value {i} differs\n{ex}"
    if len(set(ex["seqs"])) < len(ex["seqs"]):  # a length seen again (a new one's first graph run is recorded)
        assert fast, f"example {n}: no step ran steady\n{ex}"


def _llama(scoped: bool) -> list[torch.Tensor]:
    model = make_model("llama", 2, seed=0)
    if scoped:
        apply_recompute(model, check_fn=lambda m: type(m).__name__ == "LlamaDecoderLayer")
    out = []
    for step, seq in enumerate((8, 8, 6, 8, 5)):
        torch.manual_seed(step)
        ids = torch.randint(3, VOCAB, (2, seq))
        result = model(input_ids=ids, use_cache=True)  # attention dropout 0.1 (the model's config)
        loss = result.logits.float().pow(2).mean()
        del result
        gc.collect()
        loss.backward()
        out += [loss.detach(), *(p.grad.clone() for p in model.parameters())]
        model.zero_grad()
    return out


def test_hugging_face_llama_with_its_cache_equals_plain(fast):
    plain = _llama(scoped=False)
    scoped = _llama(scoped=True)
    assert all(torch.equal(p, s) for p, s in zip(plain, scoped, strict=True))
