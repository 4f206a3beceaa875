"""Distributed training with scopes (API.md section 4): DistributedDataParallel (gloo, 2
processes on 127.0.0.1) with scopes inside the model's forward trains exactly as the plain
DDP run; FSDP2 (``fully_shard`` on CPU/gloo) with scopes inside gives the plain gradients
or a clear ``RecomputeError`` (never silently wrong gradients).

Each test runs this file as a script in a subprocess (bounded by a timeout), which spawns
two ranks with ``torch.multiprocessing.spawn``; ranks write their results with
``torch.save`` and the test compares them.
"""

import contextlib
import os
import socket
import subprocess
import sys

import pytest
import torch

TIMEOUT = 90  # seconds for the whole subprocess (two ranks, two runs each)
WORLD = 2


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------------------
# worker side (runs in the spawned ranks)


def _model(scoped, outside):
    import torch.nn as nn
    import torch.nn.functional as F

    from gradient_scope import recompute_scope

    def scope():
        return recompute_scope() if scoped else contextlib.nullcontext()

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(8, 16)
            self.fc2 = nn.Linear(16, 8)

        def forward(self, x):
            with scope():
                h = F.gelu(self.fc1(x))
                h = F.dropout(h, 0.2, self.training)
                y = x + self.fc2(h)
            return y

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([Layer() for _ in range(2)])
            self.head = nn.Linear(8, 3)

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
                if outside:
                    # the layer's output (a block tensor) is saved here, outside the
                    # layer, and dies: its replay runs in backward before the layer's own
                    # backward (for FSDP2: before its parameters are gathered again)
                    x = x * torch.sigmoid(x)
            with scope():
                z = self.head(x).tanh()
            return z

    return Net()


def _train(model, rank, steps=3):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(100 + rank)
    out = {"losses": [], "grads": []}
    for _ in range(steps):
        x = torch.randn(4, 8, generator=gen)
        t = torch.randn(4, 3, generator=gen)
        torch.manual_seed(7 + rank)  # dropout draws
        opt.zero_grad()
        loss = (model(x) - t).pow(2).mean()
        loss.backward()
        out["grads"].append([_full(p.grad).clone() for p in model.parameters()])
        opt.step()
        out["losses"].append(loss.detach())
    out["params"] = [_full(p.detach()).clone() for p in model.parameters()]
    return out


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _worker(rank, mode, port, outdir):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD
    )
    try:
        results = {}
        for scoped in (False, True):
            torch.manual_seed(0)
            model = _model(scoped, outside=mode != "fsdp2")
            try:
                if mode == "ddp":
                    from torch.nn.parallel import DistributedDataParallel as DDP

                    model = DDP(model)
                else:
                    from torch.distributed.device_mesh import init_device_mesh
                    from torch.distributed.fsdp import fully_shard

                    mesh = init_device_mesh("cpu", (WORLD,))
                    for layer in model.layers:
                        fully_shard(layer, mesh=mesh)
                    fully_shard(model, mesh=mesh)
                results[scoped] = _train(model, rank)
            except Exception as e:  # noqa: BLE001
                results[scoped] = {"error": f"{type(e).__module__}.{type(e).__name__}: {e}"}
                # keep the ranks in step before the next run / shutdown
            dist.barrier()
        torch.save(results, os.path.join(outdir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _main(mode, port, outdir):
    import torch.multiprocessing as mp

    mp.spawn(_worker, args=(mode, port, outdir), nprocs=WORLD, join=True)


# ----------------------------------------------------------------------------------------
# test side


def run_ranks(mode, tmp_path):
    env = dict(os.environ)
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(here)
    env["PYTHONPATH"] = os.pathsep.join([root, here, env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), mode, str(free_port()), str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=TIMEOUT,
    )
    assert proc.returncode == 0, f"ranks failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def _assert_equal_lists(xs, ys, what):
    assert len(xs) == len(ys), what
    for i, (x, y) in enumerate(zip(xs, ys)):
        assert torch.equal(x, y), f"{what}[{i}] differs"


def test_ddp_gloo_scopes_equal_plain(tmp_path):
    ranks = run_ranks("ddp", tmp_path)
    for r, res in enumerate(ranks):
        for scoped in (False, True):
            assert "error" not in res[scoped], f"rank {r} scoped={scoped}: {res[scoped]['error']}"
    for step in range(3):
        # gradients equal across ranks (all-reduced) ...
        _assert_equal_lists(ranks[0][True]["grads"][step], ranks[1][True]["grads"][step],
                            f"step {step} grads rank0 vs rank1")
        # ... and equal to the plain DDP run
        for r in range(WORLD):
            _assert_equal_lists(ranks[r][True]["grads"][step], ranks[r][False]["grads"][step],
                                f"rank {r} step {step} scoped vs plain grads")
    for r in range(WORLD):
        _assert_equal_lists(ranks[r][True]["losses"], ranks[r][False]["losses"], "losses")
        _assert_equal_lists(ranks[r][True]["params"], ranks[r][False]["params"], "params")


@pytest.mark.parametrize("mode", ["fsdp2", "fsdp2_outside"])
def test_fsdp2_gloo_scopes_correct_or_clear_error(mode, tmp_path):
    """FSDP2 frees unsharded parameters after forward; a replay that would read them must
    either be made correct or raise RecomputeError -- never produce wrong gradients.
    fsdp2: block tensors are only saved inside their layer (or kept alive by the next
    layer's scope); fsdp2_outside: a layer's output is saved after the layer and dies."""
    ranks = run_ranks(mode, tmp_path)
    for r, res in enumerate(ranks):
        assert "error" not in res[False], f"plain FSDP2 run failed on rank {r}: {res[False]}"
    outcomes = []
    for r, res in enumerate(ranks):
        if "error" in res[True]:
            msg = res[True]["error"]
            outcomes.append(("error", msg))
            assert "RecomputeError" in msg, f"rank {r}: unclear error: {msg}"
            assert "shape" in msg or "storage" in msg or "FSDP" in msg, msg
        else:
            outcomes.append(("ok", None))
            for step in range(3):
                _assert_equal_lists(res[True]["grads"][step], res[False]["grads"][step],
                                    f"rank {r} step {step} scoped vs plain grads")
            _assert_equal_lists(res[True]["params"], res[False]["params"], "params")
    print("FSDP2 outcome per rank:", outcomes)


if __name__ == "__main__":
    _main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
