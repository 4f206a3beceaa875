"""gradient_scope quickstart: recompute activations instead of storing them.

A small GPT-style language model (token + position embeddings, pre-LayerNorm blocks
with explicit causal self-attention and a 4x GELU MLP) is trained for a few steps with
AdamW on random tokens, twice, from the same seed:

* ``plain``  -- ordinary PyTorch: autograd keeps every activation backward needs.
* ``scoped`` -- identical code, except that in every block the attention probabilities
  (scores, causal mask, softmax, dropout) and the MLP activation ``gelu(fc1(x))`` are
  computed inside ``with recompute_scope():``.  Tensors created in such a block are not
  kept for backward; backward recomputes them (dropout included, with the same random
  numbers) from the tensors the block read.

For each variant the script prints the memory autograd holds after the forward pass,
the peak memory of forward + backward, and the median step time (the two variants'
steps interleaved, after warm-up); then the ratio of their step times, and the largest
difference between the two variants' gradients after the first backward (0.0 on CPU:
recomputation is bitwise exact). Last, the largest rows of a ``saved_tensors_report()``
of each variant's first forward: what autograd saves, by module and op, and how much of
it the scopes turned into recompute handles.

Run:  python examples/quickstart.py [--rounds N] [--warmup N] [--device cpu|cuda]
"""

import argparse
import contextlib
import math
import os
import statistics
import sys
import time
import warnings

# torch warns at import when NumPy is absent (pytorch/pytorch#125678); nothing here uses NumPy.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

from gradient_scope import recompute_scope, saved_tensors_report  # noqa: E402

VOCAB, CONTEXT, D_MODEL, N_HEAD, N_LAYER = 512, 128, 128, 4, 3
BATCH, DROPOUT, SEED = 8, 0.1, 0
WARMUP, ROUNDS = 3, 20  # step timing: untimed warm-up rounds, then timed interleaved rounds (defaults)


def scope(recompute: bool):
    """The one line that differs between the two variants.

    (``recompute_scope(enabled=recompute)`` would do the same; the plain variant uses
    ``nullcontext`` so that the baseline does not touch the library at all.)
    """
    return recompute_scope() if recompute else contextlib.nullcontext()


# --------------------------------------------------------------------------- model


class CausalSelfAttention(nn.Module):
    def __init__(self, recompute: bool):
        super().__init__()
        self.recompute = recompute
        self.qkv = nn.Linear(D_MODEL, 3 * D_MODEL)
        self.proj = nn.Linear(D_MODEL, D_MODEL)
        self.attn_drop = nn.Dropout(DROPOUT)
        causal = torch.ones(CONTEXT, CONTEXT, dtype=torch.bool).triu(1)
        self.register_buffer("causal", causal, persistent=False)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, N_HEAD, C // N_HEAD).transpose(1, 2) for t in (q, k, v))
        # The (B, heads, T, T) tensors are the big ones.  Computing the scores inside the
        # block too means the block reads only q, k (kept for q @ k^T anyway) and the
        # mask, instead of keeping the T x T scores alive as its input.
        with scope(self.recompute):
            att = (q @ k.transpose(-2, -1)) / math.sqrt(C // N_HEAD)
            att = att.masked_fill(self.causal[:T, :T], float("-inf"))
            att = self.attn_drop(att.softmax(dim=-1))
        y = att @ v  # saves `att`: in the scoped variant, a small recompute handle
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, recompute: bool):
        super().__init__()
        self.recompute = recompute
        self.fc1 = nn.Linear(D_MODEL, 4 * D_MODEL)
        self.fc2 = nn.Linear(4 * D_MODEL, D_MODEL)
        self.drop = nn.Dropout(DROPOUT)

    def forward(self, x):
        with scope(self.recompute):
            h = F.gelu(self.fc1(x))  # 4x wider than x: recomputed, not stored
        return self.drop(self.fc2(h))


class Block(nn.Module):
    def __init__(self, recompute: bool):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(D_MODEL), CausalSelfAttention(recompute)
        self.ln2, self.mlp = nn.LayerNorm(D_MODEL), MLP(recompute)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, recompute: bool = False):
        super().__init__()
        self.tok_emb = nn.Embedding(VOCAB, D_MODEL)
        self.pos_emb = nn.Embedding(CONTEXT, D_MODEL)
        self.blocks = nn.ModuleList(Block(recompute) for _ in range(N_LAYER))
        self.ln_f = nn.LayerNorm(D_MODEL)
        self.head = nn.Linear(D_MODEL, VOCAB, bias=False)

    def forward(self, idx, targets):
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))


# ------------------------------------------------------------------ memory probe
#
#   held = bytes allocated during the forward pass and still allocated at its end (what
#          autograd keeps for backward, plus the scalar loss; parameters existed before
#          and are not counted)
#   peak = highest level reached during forward + backward (gradients included).
#
# CUDA: the caching allocator's public counters (torch.cuda.memory_allocated,
# max_memory_allocated). CPU: torch keeps no allocator statistics, so the level at every
# moment comes from the profiler's allocation log (profile_memory=True: every allocation
# +nbytes and free -nbytes, timestamped); its public events() fold the records inside an
# op into one net sum, which loses the peak, hence the raw kineto_results (see
# benchmarks/_harness/memory.py). Forward and backward are profiled in ONE session: the
# profiler cannot report the free of a block allocated before it started. Saved-tensor
# hooks are out of the question as a probe here: gradient_scope itself is built on them.


@contextlib.contextmanager
def quiet_fd2():
    """Silence file descriptor 2 for a moment, then restore it."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def profile_cpu_memory(forward, backward):
    """CPU: run ``out = forward(); backward(out)``; return ``(out, held, peak)`` in bytes."""
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    # torch 2.13's profiler (kineto) writes a 'USDT ... profiler_start/stop' line to fd 2 at each start and stop.
    with quiet_fd2():
        prof.__enter__()
    try:
        with record_function("quickstart.forward"):
            out = forward()
        backward(out)
    finally:
        with quiet_fd2():
            prof.__exit__(None, None, None)
    events = prof.profiler.kineto_results.events()
    fwd_end = max(e.start_ns() + e.duration_ns() for e in events if e.name() == "quickstart.forward")
    deltas = sorted(
        (e.start_ns(), e.nbytes())
        for e in events
        if e.name() == "[memory]" and e.device_type().name == "CPU"
    )
    level = held = peak = 0
    for t, nbytes in deltas:
        level += nbytes
        peak = max(peak, level)
        if t <= fwd_end:
            held = level
    return out, held, peak


def cuda_memory(forward, backward, device):
    """CUDA: the same from the allocator's public counters (no profiler needed)."""
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    out = forward()
    torch.cuda.synchronize(device)
    held = torch.cuda.memory_allocated(device) - base
    backward(out)
    torch.cuda.synchronize(device)
    return out, held, torch.cuda.max_memory_allocated(device) - base


def profile_memory(forward, backward, device=None):
    """Run ``out = forward(); backward(out)`` on ``device``; return ``(out, held, peak)`` in bytes."""
    if device is not None and device.type == "cuda":
        return cuda_memory(forward, backward, device)
    return profile_cpu_memory(forward, backward)


def check_memory_probe():
    """Validate the probe on a known pattern before trusting it with the model."""
    MiB = 2**20

    def forward():  # allocate three 1 MiB tensors, keep two
        a, b, c = (torch.empty(MiB, dtype=torch.uint8) for _ in range(3))
        return [a, b]

    def backward(kept):  # free the two (allocated *before* this call), then allocate 1.5 MiB
        kept.clear()
        torch.empty(MiB + MiB // 2, dtype=torch.uint8)

    _, held, peak = profile_memory(forward, backward)
    assert (held, peak) == (2 * MiB, 3 * MiB), f"memory probe is off: held={held} peak={peak}"


# ------------------------------------------------------------------------ training
#
# Both variants train side by side from the same seed: the same weights, the same data and,
# because the RNG is reseeded before every step, the same dropout masks. Step 0 of each is
# profiled (memory, what autograd saves, first gradients) and not timed. Step times come
# from interleaved rounds: each round runs one step of each variant, each round starting
# with another one, so that load from other processes and CPU frequency changes hit all alike. The first
# warm-up rounds are not timed (allocator and first-call costs).


class Run:
    """One variant: its model, optimizer and what its steps measured."""

    def __init__(self, make_model, device: torch.device):
        torch.manual_seed(SEED)  # same weights in every variant
        self.device = device
        self.model = make_model().to(device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-4)
        self.times: list[float] = []
        self.losses: list[float] = []

    def step(self, step: int, x, y) -> float:
        """One training step (forward, backward, AdamW); returns its wall time in seconds."""
        torch.manual_seed(SEED + step)  # same dropout masks in both variants
        self.opt.zero_grad(set_to_none=True)
        self.sync()
        t0 = time.perf_counter()
        loss = self.model(x, y)
        loss.backward()
        self.opt.step()
        self.sync()
        elapsed = time.perf_counter() - t0
        self.losses.append(loss.item())
        return elapsed

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def profiled_step(self, x, y) -> None:
        torch.manual_seed(SEED)
        self.opt.zero_grad(set_to_none=True)

        def forward():
            # The report only observes (it holds no tensors): same held/peak without it.
            with saved_tensors_report() as self.report:
                return self.model(x, y)

        loss, self.held, self.peak = profile_memory(forward, lambda loss: loss.backward(), self.device)
        self.grads = [p.grad.clone() for p in self.model.parameters()]
        self.opt.step()
        self.losses.append(loss.item())


def train(makers: dict, warmup: int = WARMUP, rounds: int = ROUNDS, device: str = "cpu") -> dict:
    """Train one model per ``name -> make_model`` side by side; returns ``name -> Run``."""
    torch.manual_seed(SEED)
    tokens = torch.randint(VOCAB, (1 + warmup + rounds, BATCH, CONTEXT + 1))  # synthetic data
    batches = [(t[:, :-1].contiguous().to(device), t[:, 1:].contiguous().to(device)) for t in tokens]
    runs = {name: Run(make, torch.device(device)) for name, make in makers.items()}
    for run in runs.values():
        run.profiled_step(*batches[0])
    variants = list(runs.values())
    for step in range(1, 1 + warmup + rounds):
        # Each round starts with another variant (a rotation), so none always runs first.
        order = variants[step % len(variants) :] + variants[: step % len(variants)]
        for run in order:
            elapsed = run.step(step, *batches[step])
            if step > warmup:
                run.times.append(elapsed)
    return runs


def quartiles(values: list[float]) -> tuple[float, float, float]:
    # "inclusive": within the values' range (the default extrapolates beyond it with few rounds).
    q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, median, q3


def main():
    parser = argparse.ArgumentParser(description="Train a small GPT with and without recompute_scope.")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="timed interleaved rounds (at least 2)")
    parser.add_argument("--warmup", type=int, default=WARMUP, help="untimed warm-up rounds")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = parser.parse_args()
    if args.rounds < 2 or args.warmup < 0:
        parser.error("--rounds must be at least 2 (the step-time quartiles need two) and --warmup at least 0")
    check_memory_probe()
    makers = {"plain": lambda: GPT(recompute=False), "scoped": lambda: GPT(recompute=True)}
    runs = train(makers, args.warmup, args.rounds, args.device)
    plain, scoped = runs["plain"], runs["scoped"]

    MiB = 2**20
    print(f"GPT: {N_LAYER} layers, d={D_MODEL}, {N_HEAD} heads, batch {BATCH} x {CONTEXT} tokens")
    print(f"{'variant':<8} {'held after forward':>20} {'peak fwd+bwd':>14} {'median step':>13}")
    for name, r in runs.items():
        step_ms = 1e3 * statistics.median(r.times)
        print(f"{name:<8} {r.held / MiB:>16.2f} MiB {r.peak / MiB:>10.2f} MiB {step_ms:>10.1f} ms")
    print(f"activation memory saved by recompute_scope: {1 - scoped.held / plain.held:.0%}")
    q1, ratio, q3 = quartiles([s / p for p, s in zip(plain.times, scoped.times)])
    print(
        f"step time scoped / plain: {ratio:.2f}x (median of {args.rounds} interleaved rounds after "
        f"{args.warmup} warm-up rounds; quartiles {q1:.2f}x-{q3:.2f}x)"
    )
    if q3 - q1 > 0.2 * ratio:
        print("  (the quartiles are far apart: other processes loaded this machine; rerun on an idle one)")

    grad_diff = max((gp - gs).abs().max().item() for gp, gs in zip(plain.grads, scoped.grads))
    print(f"max |grad difference| after the first backward: {grad_diff}")
    print(f"losses identical in all {len(plain.losses)} steps: {plain.losses == scoped.losses}")
    print(f"losses  plain: {[round(v, 4) for v in plain.losses[:5]]} ...")
    print(f"losses scoped: {[round(v, 4) for v in scoped.losses[:5]]} ...")

    # What autograd saves in the first forward, largest (module, op) rows first. Stored
    # bytes count each storage once (parameters that ops save included); recomputable
    # bytes are what the scopes replaced with handles.
    for name, r in runs.items():
        report = r.report
        print(
            f"\n{name}: autograd stores {report.stored_bytes / MiB:.2f} MiB; "
            f"recompute handles stand for {report.recomputable_bytes / MiB:.2f} MiB"
        )
        print(report.table(top=10))


if __name__ == "__main__":
    main()
