"""A block tensor held by an outside object during the block (a KV cache, as Hugging Face's
``DynamicCache``) that dies in a reference cycle while backward runs.

A replay's plan does not rebuild a value still in memory (P3 [ values in memory are used ]); the
cycle may be collected by any allocation between that plan and the load of the value (the
collection is forced there below, as the collector may run it). The value is held from the plan
until the replay has run: gradients are the plain program's, in both modes
(``GRADIENT_SCOPE_FAST`` unset or 1).
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from gradient_scope import apply_recompute
from gradient_scope._record.types import Var
from gradient_scope._restore import replay as _replay

from support.hf_models import SEQ, VOCAB, make_model


@pytest.fixture
def collect_at_load(monkeypatch):
    """A full collection before each block value a replay loads instead of rebuilding (in the
    interpreter and in compiled replay code)."""
    real = _replay._load

    def load(r, func, cache):
        if type(r) is Var:
            gc.collect()
        return real(r, func, cache)

    monkeypatch.setattr(_replay, "_load", load)
    monkeypatch.setitem(_replay._RUNTIME, "load", load)


class _Cache:
    """Keys and values written by the layers, held in a reference cycle (as a cache whose
    layers refer back to it)."""

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.me = self


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, cache: _Cache) -> torch.Tensor:
        q, k, v = self.q(x), self.k(x), self.v(x)
        cache.keys.append(k)
        cache.values.append(v)
        return x + F.scaled_dot_product_attention(q, k, v)


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Attention() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cache = _Cache()
        for layer in self.layers:
            x = layer(x, cache)
        return x


def _steps(model: nn.Module, scoped: bool) -> list[torch.Tensor]:
    if scoped:
        apply_recompute(model, check_fn=lambda m: isinstance(m, _Attention))
    out = []
    for step in range(3):
        torch.manual_seed(step)
        x = torch.randn(2, 4, 8, requires_grad=True)
        loss = model(x).pow(2).sum()
        loss.backward()
        out += [loss.detach(), x.grad, *(p.grad.clone() for p in model.parameters())]
        model.zero_grad()
    return out


def _model() -> _Model:
    torch.manual_seed(0)
    return _Model()


def test_a_cache_in_a_cycle_collected_during_replay(collect_at_load):
    plain = _steps(_model(), scoped=False)
    scoped = _steps(_model(), scoped=True)
    assert all(torch.equal(p, s) for p, s in zip(plain, scoped, strict=True))


def _llama_steps(scoped: bool) -> list[torch.Tensor]:
    model = make_model("llama", 2, seed=0)
    model.config.attention_dropout = 0.0
    if scoped:
        apply_recompute(model, check_fn=lambda m: type(m).__name__ == "LlamaDecoderLayer")
    out = []
    for step in range(2):
        torch.manual_seed(step)
        ids = torch.randint(3, VOCAB, (2, SEQ))
        result = model(input_ids=ids, use_cache=True)
        loss = result.logits.float().pow(2).mean()
        del result  # the DynamicCache goes with it, or with the next collection
        loss.backward()
        out += [loss.detach(), *(p.grad.clone() for p in model.parameters())]
        model.zero_grad()
    return out


def test_hugging_face_kv_cache_collected_during_replay(collect_at_load):
    plain = _llama_steps(scoped=False)
    scoped = _llama_steps(scoped=True)
    assert all(torch.equal(p, s) for p, s in zip(plain, scoped, strict=True))
