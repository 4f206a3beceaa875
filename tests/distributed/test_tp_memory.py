"""Tensor parallelism frees activations (issue 36): 2 gloo ranks on 127.0.0.1 (CPU).

* A 3-block residual MLP, ``ColwiseParallel`` then ``RowwiseParallel`` per block, a scope per
  block (``apply_recompute``): what autograd keeps after forward, counted by local storage
  bytes (each storage once; parameters and the model input not counted), is at most 0.25x
  plain TP's; losses, gradients and parameters equal plain TP's over three SGD steps; a
  backward runs at most as many collectives as ``torch.utils.checkpoint`` per block.
* An attention + MLP layer with ``SequenceParallel`` norms (the torchtitan plan): scoped
  training equals plain, and what forward keeps is close to the layer inputs.
* Dropout on sharded DTensors in the blocks replays its forward's numbers.

One subprocess (bounded by a timeout) spawns the ranks; they ``torch.save`` results.
``pytest -s`` prints the measured figures.
"""

import os

import pytest
import torch

from support.tp import CommCount, StorageWatch, guarded, local_bytes, ranks_results, spawn_ranks

TIMEOUT = 300
WORLD = 2
STEPS = 3
MODES = ("plain", "scoped", "checkpoint")
B, S, D, HEADS = 4, 16, 32, 4


# ----------------------------------------------------------------------------------------
# worker side


def _mlp_model(d, dropout):
    import torch.nn as nn
    import torch.nn.functional as F

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(d, 4 * d)
            self.fc2 = nn.Linear(4 * d, d)

        def forward(self, x):
            h = F.gelu(self.fc1(x))
            if dropout:
                h = F.dropout(h, 0.3, self.training)
            return self.fc2(h)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([Block() for _ in range(3)])
            self.checkpointed = False

        def forward(self, x):
            from torch.utils.checkpoint import checkpoint

            for b in self.blocks:
                x = x + (checkpoint(b, x, use_reentrant=False) if self.checkpointed else b(x))
            return x

    return Net()


def _attn_model(d, heads):
    import torch.nn as nn
    import torch.nn.functional as F

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.wq, self.wk, self.wv = (nn.Linear(d, d, bias=False) for _ in range(3))
            self.wo = nn.Linear(d, d, bias=False)

        def forward(self, x):
            b, s, _ = x.shape
            q, k, v = (w(x).view(b, s, -1, d // heads).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.wo(o.transpose(1, 2).reshape(b, s, -1))

    class FeedForward(nn.Module):
        def __init__(self):
            super().__init__()
            self.w1 = nn.Linear(d, 4 * d)
            self.w2 = nn.Linear(4 * d, d)

        def forward(self, x):
            return self.w2(F.silu(self.w1(x)))

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.attn, self.ffn = Attention(), FeedForward()

        def forward(self, x):
            h = x + self.attn(self.norm1(x))
            return h + self.ffn(self.norm2(h))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([Layer() for _ in range(2)])
            self.checkpointed = False

        def forward(self, x):
            from torch.utils.checkpoint import checkpoint

            for layer in self.layers:
                x = checkpoint(layer, x, use_reentrant=False) if self.checkpointed else layer(x)
            return x

    return Net()


def _parallelize(model, kind, mesh):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    if kind == "mlp":
        for b in model.blocks:
            parallelize_module(b, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        return model.blocks
    if kind == "mlp_dropout":  # gelu and dropout on sharded DTensors
        plan = {"fc1": ColwiseParallel(use_local_output=False), "fc2": RowwiseParallel(input_layouts=Shard(-1))}
        for b in model.blocks:
            parallelize_module(b, mesh, plan)
        return model.blocks
    plan = {  # torchtitan's plan for a transformer layer, sequence parallel norms
        "norm1": SequenceParallel(),
        "attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "attn.wq": ColwiseParallel(),
        "attn.wk": ColwiseParallel(),
        "attn.wv": ColwiseParallel(),
        "attn.wo": RowwiseParallel(output_layouts=Shard(1)),
        "norm2": SequenceParallel(),
        "ffn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "ffn.w1": ColwiseParallel(),
        "ffn.w2": RowwiseParallel(output_layouts=Shard(1)),
    }
    for layer in model.layers:
        parallelize_module(layer, mesh, plan)
    return model.layers


def _run(rank, kind, mode):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from gradient_scope import apply_recompute

    torch.manual_seed(0)
    model = _attn_model(D, HEADS) if kind == "attn_sp" else _mlp_model(D, kind == "mlp_dropout")
    mesh = init_device_mesh("cpu", (WORLD,))
    blocks = _parallelize(model, kind, mesh)
    if mode == "scoped":
        for b in blocks:
            apply_recompute(b, check_fn=lambda m, b=b: m is b)
    model.checkpointed = mode == "checkpoint"
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.1)
    gen = torch.Generator().manual_seed(100)  # the same batch on every rank (TP)
    res = {"losses": [], "grads": [], "held": [], "collectives": []}
    for _ in range(STEPS):
        if kind == "attn_sp":  # this rank's sequence shard (torchtitan's residual stream)
            x = torch.randn(B, S, D, generator=gen).chunk(WORLD, dim=1)[rank].clone()
        else:
            x = torch.randn(32, D, generator=gen)
        torch.manual_seed(7)
        opt.zero_grad()
        watch = StorageWatch()
        with watch:
            out = model(x)
            loss = (out.full_tensor() if isinstance(out, DTensor) else out).pow(2).mean()
        alive = watch.alive(exclude=[loss, x, *params])
        res["held"].append(sum(n for _, n in alive))
        res.setdefault("alive", []).append(alive)  # what a failure names
        res["input_bytes"] = local_bytes(x)
        with CommCount() as count:
            loss.backward()
        res["collectives"].append(count.n)
        res["grads"].append([p.grad.full_tensor().clone() for p in params])
        opt.step()
        res["losses"].append(loss.detach())
    res["params"] = [p.detach().full_tensor().clone() for p in params]
    return res


def _worker(rank, port, outdir):
    import warnings

    import torch.distributed as dist

    warnings.filterwarnings("ignore", message="DTensor random operators")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        results = {
            kind: {mode: guarded(_run, rank, kind, mode) for mode in MODES}
            for kind in ("attn_sp", "mlp", "mlp_dropout")
        }
        torch.save(results, os.path.join(outdir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------------------
# test side


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    outdir = tmp_path_factory.mktemp("tp_ranks")
    return ranks_results(__file__, outdir, WORLD, TIMEOUT)


def _ok(res, what):
    assert "error" not in res, f"{what}: {res['error']}"
    return res


def _assert_same_training(a, b, what):
    for step in range(STEPS):
        for i, (x, y) in enumerate(zip(a["grads"][step], b["grads"][step], strict=True)):
            assert torch.equal(x, y), f"{what}: step {step} gradient {i} differs"
    for name in ("losses", "params"):
        for i, (x, y) in enumerate(zip(a[name], b[name], strict=True)):
            assert torch.equal(x, y), f"{what}: {name}[{i}] differs"


@pytest.mark.parametrize("kind", ["mlp", "mlp_dropout", "attn_sp"])
def test_tp_scoped_training_equals_plain(ranks, kind):
    for r in range(WORLD):
        plain, scoped = (_ok(ranks[r][kind][m], f"{kind} rank {r} {m}") for m in ("plain", "scoped"))
        _assert_same_training(scoped, plain, f"{kind} rank {r}")


@pytest.mark.parametrize("kind", ["mlp", "mlp_dropout"])
def test_tp_scope_per_block_keeps_a_quarter_of_plain(ranks, kind):
    """Colwise -> Rowwise blocks: the scoped forward keeps the block inputs only (what
    checkpoint keeps), at most 0.25x plain TP's local bytes, on every rank and step."""
    for r in range(WORLD):
        res = {m: _ok(ranks[r][kind][m], f"{kind} rank {r} {m}") for m in MODES}
        print(f"{kind} rank {r}: held after forward " + ", ".join(f"{m} {res[m]['held']}" for m in MODES))
        for step in range(STEPS):
            plain, scoped, ckpt = (res[m]["held"][step] for m in MODES)
            assert scoped <= 0.25 * plain, (kind, r, step, scoped, plain, res["scoped"]["alive"][step])
            assert scoped <= ckpt, (kind, r, step, scoped, ckpt)


def test_tp_sequence_parallel_layer_keeps_about_its_inputs(ranks):
    """Attention + MLP layers with SequenceParallel norms: the scoped forward keeps about the
    layers' inputs (sequence shards), as checkpoint does, a small part of plain's."""
    for r in range(WORLD):
        res = {m: _ok(ranks[r]["attn_sp"][m], f"attn_sp rank {r} {m}") for m in MODES}
        print(f"attn_sp rank {r}: held after forward " + ", ".join(f"{m} {res[m]['held']}" for m in MODES))
        inputs = 2 * res["plain"]["input_bytes"]  # two layers, each input one sequence shard
        for step in range(STEPS):
            plain, scoped, ckpt = (res[m]["held"][step] for m in MODES)
            assert scoped <= ckpt, (r, step, scoped, ckpt)
            assert scoped <= 1.25 * inputs, (r, step, scoped, inputs)
            assert scoped <= 0.25 * plain, (r, step, scoped, plain)


@pytest.mark.parametrize("kind", ["mlp", "attn_sp"])
def test_tp_backward_collectives_at_most_checkpoints(ranks, kind):
    """A scoped backward replays the blocks' collectives: no more than checkpoint's rerun."""
    for r in range(WORLD):
        res = {m: _ok(ranks[r][kind][m], f"{kind} rank {r} {m}") for m in MODES}
        print(f"{kind} rank {r}: collectives per backward " + ", ".join(f"{m} {res[m]['collectives']}" for m in MODES))
        for step in range(STEPS):
            assert res["plain"]["collectives"][step] <= res["scoped"]["collectives"][step]
            assert res["scoped"]["collectives"][step] <= res["checkpoint"]["collectives"][step], (r, step)


if __name__ == "__main__":
    spawn_ranks(_worker, WORLD)
