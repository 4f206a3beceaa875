"""GPT-style pre-LayerNorm transformer for the benchmarks, in plain PyTorch.

Token + position embeddings, ``n_layer`` blocks of

    x = x + attn(ln1(x))          causal self-attention, dropout on probs and output
    x = x + mlp(ln2(x))           fc1 (4x) -> GELU -> fc2 -> dropout

then a final LayerNorm and an untied LM head, with a cross-entropy loss.

Attention comes in two variants (``--attn``):

* ``explicit``: ``softmax(q k^T / sqrt(d) + causal mask)`` with dropout, written out
  (:class:`AttnProbs`), so the (B, heads, T, T) probabilities are real tensors that
  autograd saves;
* ``sdpa``: ``F.scaled_dot_product_attention(..., is_causal=True, dropout_p=...)``.

The regions a strategy may put in scopes are modules: each :class:`Block` (a layer), the
MLP activation ``gelu(fc1(x))`` (:class:`MLPAct`, on the 3-D input) and the attention
probabilities (:class:`AttnProbs`: scores, scale, mask, softmax, dropout; never
materialised with ``sdpa``). :func:`case` names them for the harness.

Run ``python -m benchmarks.gpt`` to time one fwd+bwd step of the default size.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from ._harness.suite import Case

__all__ = ["GPTConfig", "GPT", "Block", "MLPAct", "AttnProbs", "make_batch", "case", "add_size_args", "config_from"]


@dataclass
class GPTConfig:
    vocab: int = 2048
    seq: int = 256  # tokens per sequence (also the context length)
    d_model: int = 256
    n_head: int = 4
    n_layer: int = 4
    batch: int = 4
    dropout: float = 0.1
    attn: str = "explicit"  # "explicit" | "sdpa"

    def asdict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        return (
            f"GPT {self.n_layer} layers, d={self.d_model}, {self.n_head} heads, "
            f"batch {self.batch} x {self.seq} tokens, vocab {self.vocab}, "
            f"dropout {self.dropout}, attention={self.attn}"
        )


class AttnProbs(nn.Module):
    """``dropout(softmax(q k^T / sqrt(d) masked causally))``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.drop = nn.Dropout(cfg.dropout)
        self.register_buffer("causal", torch.ones(cfg.seq, cfg.seq, dtype=torch.bool).triu(1), persistent=False)

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        T = q.shape[-2]
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
        att = att.masked_fill(self.causal[:T, :T], float("-inf"))
        return self.drop(att.softmax(dim=-1))


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        assert cfg.d_model % cfg.n_head == 0
        self.cfg = cfg
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.probs = AttnProbs(cfg)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        H = self.cfg.n_head
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, H, C // H).transpose(1, 2) for t in (q, k, v))
        if self.cfg.attn == "sdpa":
            p = self.cfg.dropout if self.training else 0.0
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        else:
            y = self.probs(q, k) @ v
        y = y.transpose(1, 2).reshape(B, T, C)
        return self.resid_drop(self.proj(y))


class MLPAct(nn.Module):
    """``gelu(fc1(x))`` (x is 3-D: F.linear reshapes around addmm)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.d_model, 4 * cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.fc1(x))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.act = MLPAct(cfg)
        self.fc2 = nn.Linear(4 * cfg.d_model, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc2(self.act(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]).float(), targets.view(-1))


def make_batch(cfg: GPTConfig, device: str | torch.device = "cpu", seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic (tokens, targets), deterministic in ``seed``."""
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(cfg.vocab, (cfg.batch, cfg.seq + 1), generator=g)
    return data[:, :-1].contiguous().to(device), data[:, 1:].contiguous().to(device)


def _is_block(m: nn.Module) -> bool:
    return isinstance(m, Block)


def _is_mlp_act(m: nn.Module) -> bool:
    return isinstance(m, MLPAct)


def _is_act(m: nn.Module) -> bool:
    return isinstance(m, (MLPAct, AttnProbs))


def _is_attn_mlp(m: nn.Module) -> bool:
    return isinstance(m, (CausalSelfAttention, MLP))


def case(cfg: GPTConfig, device: str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0) -> Case:
    """The GPT (weights from ``torch.manual_seed(seed)``, ``train()`` mode) and its batch as
    a harness :class:`Case`: layers are the blocks; ``scope_mlp`` scopes the MLP activation,
    ``scope_act`` it and the attention probabilities, ``scope_attn_mlp`` the attention and
    the MLP modules."""
    torch.manual_seed(seed)
    model = GPT(cfg).to(device=device, dtype=dtype).train()
    x, y = make_batch(cfg, device, seed)
    return Case(
        "gpt",
        model,
        lambda m: m(x, y),
        _is_block,
        {"scope_mlp": _is_mlp_act, "scope_act": _is_act, "scope_attn_mlp": _is_attn_mlp},
        device,
        cfg.asdict(),
        (x, y),
    )


_FLAGS = {"layers": "n_layer", "d_model": "d_model", "heads": "n_head", "seq": "seq", "batch": "batch",
          "vocab": "vocab", "dropout": "dropout", "attn": "attn"}


def add_size_args(p: argparse.ArgumentParser) -> None:
    """The size flags (``--layers --d-model --heads --seq --batch --vocab --dropout --attn``);
    unset, they keep the job's size."""
    g = p.add_argument_group("model size (default: the job's size)")
    types = {f.name: f.type for f in fields(GPTConfig)}
    for flag, key in _FLAGS.items():
        if key == "attn":
            g.add_argument("--attn", choices=["explicit", "sdpa"],
                           help="explicit softmax or F.scaled_dot_product_attention")
        else:
            g.add_argument("--" + flag.replace("_", "-"), type=float if types[key] == "float" else int)


def config_from(base: GPTConfig, a: argparse.Namespace) -> GPTConfig:
    """``base`` with the size flags that were given."""
    return GPTConfig(**{**base.asdict(), **{k: getattr(a, f) for f, k in _FLAGS.items() if getattr(a, f) is not None}})


def _main() -> None:
    import statistics
    import time

    p = argparse.ArgumentParser(description="Time fwd+bwd steps of the benchmark GPT.")
    add_size_args(p)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--device", default="cpu")
    a = p.parse_args()
    cfg = config_from(GPTConfig(), a)
    c = case(cfg, a.device)
    times = []
    for _ in range(a.steps + 1):
        c.model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        c.loss(c.model).backward()
        if a.device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    n_params = sum(p.numel() for p in c.model.parameters())
    print(f"{cfg.describe()}; {n_params / 1e6:.2f} M parameters")
    print(f"fwd+bwd: median {1e3 * statistics.median(times[1:]):.1f} ms over {a.steps} steps "
          f"(first {1e3 * times[0]:.1f} ms)")


if __name__ == "__main__":
    _main()
