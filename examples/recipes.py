"""gradient_scope recipes: three ways to recompute a GPT's activations.

The same small GPT-style model as in ``quickstart.py`` (copied here so that this file
stands alone) is trained for a few steps from the same seed, once plainly and once per
recipe:

* ``attn-probs``  -- recompute only the attention probabilities: the (B, heads, T, T)
  scores, causal mask, softmax and dropout run inside ``with recompute_scope():``.
* ``block+save``  -- one scope per transformer block, with the matmuls' outputs stored
  (``save=save_matmuls``): LayerNorm, GELU, softmax, dropout and the residual adds are
  recomputed from them, the matmuls are not.
* ``apply``       -- ``apply_recompute(model, check_fn=lambda m: isinstance(m, Block))``:
  every call of a ``Block`` runs in its own scope, without touching the model's code.
  Everything a block creates is recomputed (its input is kept, as in checkpointing).

For each variant the script prints the memory autograd holds after the forward pass, the
peak memory of forward + backward, the median step time (the recipes' steps interleaved,
after warm-up) and its ratio to plain's, and the largest difference
between its gradients and the plain run's after the first backward (0.0 on CPU:
recomputation is bitwise exact).

Run:  python examples/recipes.py
"""

import contextlib
import math
import statistics

import torch
import torch.nn as nn
import torch.nn.functional as F

from gradient_scope import apply_recompute, recompute_scope, save_matmuls

VOCAB, CONTEXT, D_MODEL, N_HEAD, N_LAYER = 512, 128, 128, 4, 3
BATCH, DROPOUT, SEED = 8, 0.1, 0


# --------------------------------------------------------------------------- model
#
# quickstart.py's model, with the scopes as options: ``scoped_attention`` puts the
# attention probabilities in a scope (recipe a), ``block_scope`` is a factory of the
# context manager each block runs in (recipe b). Recipe c leaves the code alone.


class CausalSelfAttention(nn.Module):
    def __init__(self, scoped_attention: bool = False):
        super().__init__()
        self.scoped_attention = scoped_attention
        self.qkv = nn.Linear(D_MODEL, 3 * D_MODEL)
        self.proj = nn.Linear(D_MODEL, D_MODEL)
        self.attn_drop = nn.Dropout(DROPOUT)
        causal = torch.ones(CONTEXT, CONTEXT, dtype=torch.bool).triu(1)
        self.register_buffer("causal", causal, persistent=False)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, N_HEAD, C // N_HEAD).transpose(1, 2) for t in (q, k, v))
        # Recipe (a): the T x T tensors are made in the scope and recomputed in backward.
        # (The other variants use a nullcontext: they do not touch the library here.)
        with recompute_scope() if self.scoped_attention else contextlib.nullcontext():
            att = (q @ k.transpose(-2, -1)) / math.sqrt(C // N_HEAD)
            att = att.masked_fill(self.causal[:T, :T], float("-inf"))
            att = self.attn_drop(att.softmax(dim=-1))
        y = att @ v  # saves `att`: with the scope, a small recompute handle
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(D_MODEL, 4 * D_MODEL)
        self.fc2 = nn.Linear(4 * D_MODEL, D_MODEL)
        self.drop = nn.Dropout(DROPOUT)

    def forward(self, x):
        return self.drop(self.fc2(F.gelu(self.fc1(x))))


class Block(nn.Module):
    def __init__(self, scoped_attention: bool = False):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(D_MODEL), CausalSelfAttention(scoped_attention)
        self.ln2, self.mlp = nn.LayerNorm(D_MODEL), MLP()

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, scoped_attention: bool = False, block_scope=None):
        super().__init__()
        self.block_scope = block_scope
        self.tok_emb = nn.Embedding(VOCAB, D_MODEL)
        self.pos_emb = nn.Embedding(CONTEXT, D_MODEL)
        self.blocks = nn.ModuleList(Block(scoped_attention) for _ in range(N_LAYER))
        self.ln_f = nn.LayerNorm(D_MODEL)
        self.head = nn.Linear(D_MODEL, VOCAB, bias=False)

    def forward(self, idx, targets):
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(idx.shape[1]))
        for block in self.blocks:
            if self.block_scope is None:
                x = block(x)
            else:  # Recipe (b): one scope per block
                with self.block_scope():
                    x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))


# --------------------------------------------------------------------------- recipes


def plain():
    return GPT()


def attention_probs():  # (a)
    return GPT(scoped_attention=True)


def block_scope_saving_matmuls():  # (b)
    return GPT(block_scope=lambda: recompute_scope(save=save_matmuls))


def apply_to_blocks():  # (c)
    model = GPT()
    apply_recompute(model, check_fn=lambda m: isinstance(m, Block))
    return model


RECIPES = {
    "plain": plain,
    "attn-probs": attention_probs,
    "block+save": block_scope_saving_matmuls,
    "apply": apply_to_blocks,
}


# The memory probe (CPU profiler, validated on a known allocation pattern) is the
# quickstart's: run this file from the repository root or from examples/.
from quickstart import ROUNDS, WARMUP, check_memory_probe, quartiles, train  # noqa: E402

# ------------------------------------------------------------------------ training


def main():
    check_memory_probe()
    runs = train(RECIPES)  # the recipes' steps interleaved, round by round

    MiB = 2**20
    base = runs["plain"]
    print(f"GPT: {N_LAYER} layers, d={D_MODEL}, {N_HEAD} heads, batch {BATCH} x {CONTEXT} tokens")
    print(
        f"{'recipe':<11} {'held after fwd':>15} {'vs plain':>9} {'peak fwd+bwd':>13} "
        f"{'median step':>12} {'vs plain':>9} {'max |grad diff|':>16}"
    )
    for name, r in runs.items():
        step_ms = 1e3 * statistics.median(r.times)
        _, ratio, _ = quartiles([t / b for b, t in zip(base.times, r.times)])
        diff = max((gp - g).abs().max().item() for gp, g in zip(base.grads, r.grads))
        print(
            f"{name:<11} {r.held / MiB:>11.2f} MiB {r.held / base.held:>8.0%} "
            f"{r.peak / MiB:>9.2f} MiB {step_ms:>9.1f} ms {ratio:>8.2f}x {diff:>16}"
        )
    print(
        f"step times: medians of {ROUNDS} interleaved rounds after {WARMUP} warm-up rounds; "
        "vs plain: the median of the per-round ratios"
    )
    for name, r in runs.items():
        same = r.losses == base.losses
        print(f"losses {name:<11} {[round(v, 4) for v in r.losses[:5]]} ... identical to plain in all steps: {same}")


if __name__ == "__main__":
    main()
