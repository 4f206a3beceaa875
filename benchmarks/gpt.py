"""GPT-style pre-LayerNorm transformer for the benchmarks, in plain PyTorch.

Token + position embeddings, ``n_layer`` blocks of

    x = x + attn(ln1(x))          causal self-attention, dropout on probs and output
    x = x + mlp(ln2(x))           fc1 (4x) -> GELU -> fc2 -> dropout

then a final LayerNorm and an untied LM head, with a cross-entropy loss.

Attention comes in two variants (``--attn``):

* ``explicit``: ``softmax(q k^T / sqrt(d) + causal mask)`` with dropout, written out,
  so the (B, heads, T, T) probabilities are real tensors that autograd saves;
* ``sdpa``: ``F.scaled_dot_product_attention(..., is_causal=True, dropout_p=...)``.

Recompute strategies are not baked into the model: the model asks two hooks, which a
strategy sets (``benchmarks/_harness/strategies.py``):

* ``model.layer_call(block, x)`` runs one block (default: ``block(x)``); layer-level
  strategies wrap it (``torch.utils.checkpoint``, ``recompute_scope``, ...);
* ``model.act_ctx(kind)`` returns a context manager entered around the attention
  probabilities (``kind="attn_probs"``: scores, scale, mask, softmax, dropout) and around
  the MLP activation (``kind="mlp_act"``: ``gelu(fc1(x))`` on the 3-D input);
  default: ``contextlib.nullcontext()``. With ``sdpa`` attention the probabilities are
  never materialised, so only ``mlp_act`` is asked for.

Run ``python -m benchmarks.gpt`` to time one fwd+bwd step of the default size.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import weakref
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["GPTConfig", "GPT", "add_model_args", "config_from_args", "make_batch"]


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

    def asdict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        return (
            f"GPT {self.n_layer} layers, d={self.d_model}, {self.n_head} heads, "
            f"batch {self.batch} x {self.seq} tokens, vocab {self.vocab}, "
            f"dropout {self.dropout}, attention={self.attn}"
        )


def _no_ctx(kind: str):
    return contextlib.nullcontext()


def _call(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return block(x)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig, owner: GPT):
        super().__init__()
        assert cfg.d_model % cfg.n_head == 0
        self.cfg = cfg
        self._owner = weakref.ref(owner)  # not a submodule, and no reference cycle
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.attn_drop = nn.Dropout(cfg.dropout)
        self.resid_drop = nn.Dropout(cfg.dropout)
        causal = torch.ones(cfg.seq, cfg.seq, dtype=torch.bool).triu(1)
        self.register_buffer("causal", causal, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        H = self.cfg.n_head
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, H, C // H).transpose(1, 2) for t in (q, k, v))
        if self.cfg.attn == "sdpa":
            p = self.cfg.dropout if self.training else 0.0
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        else:
            with self._owner().act_ctx("attn_probs"):
                att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(C // H))
                att = att.masked_fill(self.causal[:T, :T], float("-inf"))
                att = self.attn_drop(att.softmax(dim=-1))
            y = att @ v
        y = y.transpose(1, 2).reshape(B, T, C)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig, owner: GPT):
        super().__init__()
        self._owner = weakref.ref(owner)
        self.fc1 = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.fc2 = nn.Linear(4 * cfg.d_model, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self._owner().act_ctx("mlp_act"):
            h = F.gelu(self.fc1(x))  # x is 3-D: F.linear reshapes around addmm
        return self.drop(self.fc2(h))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, owner: GPT):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg, owner)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg, owner)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        # Strategy hooks (plain attributes, not modules).
        self.layer_call = _call
        self.act_ctx = _no_ctx
        self.tok_emb = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg, self) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)

    def reset_strategy(self) -> None:
        self.layer_call = _call
        self.act_ctx = _no_ctx

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        call = self.layer_call
        for block in self.blocks:
            x = call(block, x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]).float(), targets.view(-1))


def make_batch(cfg: GPTConfig, device: str | torch.device = "cpu", seed: int = 0):
    """Synthetic (tokens, targets), deterministic in ``seed``."""
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(cfg.vocab, (cfg.batch, cfg.seq + 1), generator=g)
    return data[:, :-1].contiguous().to(device), data[:, 1:].contiguous().to(device)


# ---------------------------------------------------------------------------- flags


def add_model_args(p: argparse.ArgumentParser) -> None:
    d = GPTConfig()
    g = p.add_argument_group("model size")
    g.add_argument("--layers", type=int, default=d.n_layer, help=f"transformer blocks (default {d.n_layer})")
    g.add_argument("--d-model", type=int, default=d.d_model, help=f"model width (default {d.d_model})")
    g.add_argument("--heads", type=int, default=d.n_head, help=f"attention heads (default {d.n_head})")
    g.add_argument("--seq", type=int, default=d.seq, help=f"sequence length (default {d.seq})")
    g.add_argument("--batch", type=int, default=d.batch, help=f"batch size (default {d.batch})")
    g.add_argument("--vocab", type=int, default=d.vocab, help=f"vocabulary size (default {d.vocab})")
    g.add_argument("--dropout", type=float, default=d.dropout, help=f"dropout (default {d.dropout})")
    g.add_argument(
        "--attn",
        choices=["explicit", "sdpa"],
        default=d.attn,
        help="attention: explicit softmax (default) or F.scaled_dot_product_attention",
    )


def config_from_args(a: argparse.Namespace) -> GPTConfig:
    return GPTConfig(
        vocab=a.vocab,
        seq=a.seq,
        d_model=a.d_model,
        n_head=a.heads,
        n_layer=a.layers,
        batch=a.batch,
        dropout=a.dropout,
        attn=a.attn,
    )


def _main() -> None:
    import statistics
    import time

    p = argparse.ArgumentParser(description="Time fwd+bwd steps of the benchmark GPT.")
    add_model_args(p)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--device", default="cpu")
    a = p.parse_args()
    cfg = config_from_args(a)
    torch.manual_seed(0)
    model = GPT(cfg).to(a.device)
    x, y = make_batch(cfg, a.device)
    n_params = sum(p.numel() for p in model.parameters())
    times = []
    for _ in range(a.steps + 1):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        model(x, y).backward()
        if a.device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    print(f"{cfg.describe()}; {n_params / 1e6:.2f} M parameters")
    print(f"fwd+bwd: median {1e3 * statistics.median(times[1:]):.1f} ms over {a.steps} steps "
          f"(first {1e3 * times[0]:.1f} ms)")


if __name__ == "__main__":
    _main()
