"""Budgets across ranks (``gradient_scope._budget.agree`` A1..A4): every rank of a process
group runs the same plan, 2 gloo processes on 127.0.0.1 (CPU).

* Ranks that disagree -- another ``Budget`` per rank, and other measured rates (rank 1's
  device rates pinned ten thousand times slower, its per-op costs from another calibration
  through the ``set_calibration`` seam) -- run rank 0's plan: the per-block decisions, the
  ops replayed and the figures are the same on both ranks, and losses, gradients and
  parameters are ``torch.equal`` to the same model without scopes, over three optimizer
  steps (the first measures, the others are planned). Under FSDP2 (its all-gathers run in
  replays) and under tensor parallelism (``parallelize_module``, DTensor blocks).
* Ranks whose scoped block structures differ (rank 1 runs another sequence length) under a
  budget whose blocks communicate: both raise the same ``RuntimeError`` at the next step,
  none waits for the other.
* A DDP-style program (no block communicates) whose ranks run other structures keeps each
  rank's own plan and trains.

One subprocess, bounded by a timeout (a hang fails the test), spawns the ranks.
"""

import contextlib
import os
import socket
import subprocess
import sys

import pytest
import torch

from support import ROOT, TESTS

TIMEOUT = 240
WORLD = 2
STEPS = 3
DIM = 8


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------------------
# worker side (runs in the spawned ranks)


def _layer_cls():
    import torch.nn as nn
    import torch.nn.functional as F

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(DIM, 4 * DIM)
            self.fc2 = nn.Linear(4 * DIM, DIM)

        def forward(self, x):
            return x + self.fc2(F.gelu(self.fc1(x)).tanh())

    return Layer


def _net():
    import torch.nn as nn

    Layer = _layer_cls()
    torch.manual_seed(0)
    return nn.Sequential(*[Layer() for _ in range(3)]), Layer


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


@contextlib.contextmanager
def _disagreeing_rates(rank):
    """Rank 1 measures other per-op costs: its calibration (the ``set_calibration`` seam)
    says a replayed op costs 0.1 s, so recompute looks dear there."""
    from gradient_scope._budget import rates

    if rank == 0:
        yield
        return
    remove = rates.set_calibration(lambda device: {"train": 1e-2, "record": 0.0, "save": 0.0, "replay": 1e-1})
    try:
        yield
    finally:
        remove()


def _plans(budget):
    run = budget._run
    return sorted(
        (str(site[1:]), occurrence, sorted(p.chosen), sorted(p.offloaded))
        for (site, occurrence), ps in run.plans.items()
        for p in ps
    )


def _train(rank, scoped, layout, seq=4, layers=3):
    """Three steps of the 3-layer MLP, ``layout``: "fsdp" (fully_shard per layer and root)
    or "tp" (fc1 colwise, fc2 rowwise). ``scoped``: a scope per layer (the first
    ``layers``) under a model-level budget that differs per rank."""
    from torch.distributed.device_mesh import init_device_mesh

    from gradient_scope import Budget, apply_recompute, model_stats

    model, Layer = _net()
    mesh = init_device_mesh("cpu", (WORLD,))
    budget = Budget(0 if rank == 0 else 10**9) if scoped else None
    if scoped:
        scoped_layers = list(model)[:layers]
        apply_recompute(model, check_fn=lambda m: any(m is x for x in scoped_layers), budget=budget)
    if layout == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        data_rank = rank
    else:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        for layer in model:
            parallelize_module(layer, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        data_rank = 0  # the ranks of a TP group see the same batch
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(100 + data_rank)
    res = {"losses": [], "grads": [], "plans": [], "replayed": []}
    with _disagreeing_rates(rank) if scoped else contextlib.nullcontext():
        for _ in range(STEPS):
            x = torch.randn(seq, DIM, generator=gen)
            opt.zero_grad()
            loss = _full(model(x)).pow(2).mean()
            loss.backward()
            res["grads"].append([_full(p.grad).clone() for p in model.parameters()])
            opt.step()
            res["losses"].append(loss.detach())
            if scoped:
                res["plans"].append(_plans(budget))
                res["replayed"].append(model_stats(model).ops_replayed)
    res["params"] = [_full(p.detach()).clone() for p in model.parameters()]
    if scoped:
        res["stored"] = [(s.op, s.how, s.why) for s in budget.stored_ops()]
        res["planned_bytes"] = budget.planned_bytes
    return res


def _mismatch(rank, layout):
    """The step structures differ: under FSDP2 rank 1 runs another sequence length; under
    TP (whose forward needs the same shapes on every rank) it scopes two layers, not three."""
    if layout == "fsdp":
        return _train(rank, True, layout, seq=4 if rank == 0 else 6)
    return _train(rank, True, layout, layers=3 if rank == 0 else 2)


def _guarded(fn, *args, **kwargs):
    import torch.distributed as dist

    try:
        out = fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001
        out = {"error": f"{type(e).__name__}: {e}"}
    dist.barrier()
    return out


def _worker(rank, port, outdir):
    import warnings

    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        results = {}
        for layout in ("fsdp", "tp"):
            results[layout] = {s: _guarded(_train, rank, s, layout) for s in (False, True)}
            results[f"{layout}_mismatch"] = _guarded(_mismatch, rank, layout)
        results["ddp_mismatch"] = _guarded(_local_mismatch, rank)
        torch.save(results, os.path.join(outdir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _local_mismatch(rank):
    """No block communicates (plain local layers, data parallel by hand): other sequence
    lengths per rank keep their own plans."""
    from gradient_scope import Budget, apply_recompute

    model, Layer = _net()
    budget = Budget(0 if rank == 0 else 10**9)
    apply_recompute(model, check_fn=Layer, budget=budget)
    for _ in range(STEPS):
        model(torch.randn(4 if rank == 0 else 6, DIM)).pow(2).mean().backward()
    return {"planned_bytes": budget.planned_bytes}


def _main(port, outdir):
    import torch.multiprocessing as mp

    mp.spawn(_worker, args=(port, outdir), nprocs=WORLD, join=True)


# ----------------------------------------------------------------------------------------
# test side


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    outdir = tmp_path_factory.mktemp("tp_budget")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(TESTS), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), str(_free_port()), str(outdir)],
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,  # a hang fails here
    )
    assert proc.returncode == 0, f"ranks failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return [torch.load(outdir / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def _ok(res, what):
    assert "error" not in res, f"{what}: {res['error']}"
    return res


def _assert_equal_lists(xs, ys, what):
    assert len(xs) == len(ys), what
    for i, (x, y) in enumerate(zip(xs, ys)):
        assert torch.equal(x, y), f"{what}[{i}] differs"


@pytest.mark.parametrize("layout", ["fsdp", "tp"])
def test_disagreeing_ranks_run_rank0s_plan_and_train_as_plain(ranks, layout):
    for rank, res in enumerate(ranks):
        plain, scoped = _ok(res[layout][False], f"rank {rank} plain"), _ok(res[layout][True], f"rank {rank} scoped")
        for step in range(STEPS):
            _assert_equal_lists(scoped["grads"][step], plain["grads"][step], f"rank {rank} step {step} grads")
        _assert_equal_lists(scoped["losses"], plain["losses"], f"rank {rank} losses")
        _assert_equal_lists(scoped["params"], plain["params"], f"rank {rank} params")
    r0, r1 = ranks[0][layout][True], ranks[1][layout][True]
    # rank 0's budget (0 bytes) keeps what is in memory anyway; rank 1's would keep everything
    assert r0["plans"][-1] == r1["plans"][-1], "the ranks run different plans"
    assert r0["plans"][-1], "no plan was made"
    assert r0["replayed"] == r1["replayed"], "the ranks replayed different ops"
    assert r0["replayed"][-1] > r0["replayed"][0] > 0, "the planned steps replay (they keep nothing)"
    assert r0["stored"] == r1["stored"] and r0["planned_bytes"] == r1["planned_bytes"], "figures are rank 0's"


@pytest.mark.parametrize("layout", ["fsdp", "tp"])
def test_ranks_with_other_structures_raise_instead_of_hanging(ranks, layout):
    for rank, res in enumerate(ranks):
        err = res[f"{layout}_mismatch"].get("error", "")
        assert err.startswith("RuntimeError"), f"rank {rank}: {res[f'{layout}_mismatch']}"
        assert "different scoped block structures" in err and "rank 1: " in err, err
        assert "same sequence length" in err, err
    if layout == "tp":
        assert "rank 0: 3 blocks" in ranks[0]["tp_mismatch"]["error"]
        assert "rank 1: 2 blocks" in ranks[0]["tp_mismatch"]["error"]


def test_ranks_whose_blocks_do_not_communicate_keep_their_own_plans(ranks):
    b0, b1 = (_ok(r["ddp_mismatch"], f"rank {i}") for i, r in enumerate(ranks))
    assert b0["planned_bytes"] < b1["planned_bytes"]  # each its own budget's plan


if __name__ == "__main__":
    _main(int(sys.argv[1]), sys.argv[2])
