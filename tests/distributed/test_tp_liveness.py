"""Replays that communicate do not depend on what one rank still holds (``_restore.handles``
P11 [ a replay that communicates reads no liveness ]): 2 gloo ranks on 127.0.0.1 (CPU).

Under tensor parallelism with sequence parallelism, a block's replay runs collectives (the
all-gather before ``fc1``, the reduce-scatter after ``fc2``). Which values are still in
memory differs by rank -- here a forward pre-hook keeps ``fc1``'s all-gathered input of one
block alive on rank 0 only, as a reference cycle that rank 0's garbage collector has not freed yet does in
real programs. Were a value in memory used on rank 0 (``P3``), rank 0 would skip the
all-gather that rank 1 replays, and the two ranks would wait on each other (gloo pairs
collectives by order). Both ranks must replay the same collectives and train as plain TP.

One subprocess (bounded by a timeout) spawns the ranks; the process group's own timeout
turns a hang into an error the test reports.
"""

import datetime
import os

import pytest
import torch

from support.tp import CommCount, guarded, ranks_results, sp_blocks, spawn_ranks

TIMEOUT = 240
WORLD = 2
STEPS = 2
DIM = 8

# ----------------------------------------------------------------------------------------
# worker side


def _model(mesh, scoped):
    from gradient_scope import apply_recompute

    model, Block = sp_blocks(mesh, DIM)
    if scoped:
        apply_recompute(model, check_fn=Block)
    return model


def _train(rank, scoped):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (WORLD,))
    model = _model(mesh, scoped)
    held = []
    if rank == 0:  # rank 0 only: fc1's all-gathered input of the middle block stays in memory
        model[1].fc1.register_forward_pre_hook(lambda m, args: held.append(args[0]))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(0)
    res = {"losses": [], "grads": [], "collectives": []}
    for _ in range(STEPS):
        x = torch.randn(2, 8, DIM, generator=gen).chunk(WORLD, dim=1)[rank].contiguous()
        opt.zero_grad()
        loss = model(x).pow(2).sum()
        with CommCount() as count:
            loss.backward()
        held.clear()
        res["collectives"].append(count.names)
        res["grads"].append([p.grad.full_tensor().clone() for p in model.parameters()])
        opt.step()
        res["losses"].append(loss.detach())
    return res


def _worker(rank, port, outdir):
    import warnings

    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    # a collective one rank waits for in vain raises after this long
    timeout = datetime.timedelta(seconds=60)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD, timeout=timeout)
    try:
        results = {"plain": guarded(_train, rank, False)}
        results["scoped"] = guarded(_train, rank, True)
        torch.save(results, os.path.join(outdir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------------------
# test side


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    outdir = tmp_path_factory.mktemp("tp_liveness")
    return ranks_results(__file__, outdir, WORLD, TIMEOUT)


def test_ranks_holding_different_values_replay_the_same_collectives(ranks):
    """Rank 0 still holds a value its scope would replay, rank 1 does not: both replay the
    same collectives in backward, and the step completes."""
    for r in range(WORLD):
        assert "error" not in ranks[r]["scoped"], f"rank {r}: {ranks[r]['scoped']['error']}"
    for step in range(STEPS):
        ops = [ranks[r]["scoped"]["collectives"][step] for r in range(WORLD)]
        assert ops[0] == ops[1], f"step {step}: rank 0 ran {ops[0]}, rank 1 ran {ops[1]}"
        assert any("all_gather" in name for name in ops[0])  # the replayed all-gathers


def test_ranks_holding_different_values_train_as_plain(ranks):
    """Losses and gradients equal plain TP's (no scope) on both ranks, bitwise."""
    for r in range(WORLD):
        plain, scoped = ranks[r]["plain"], ranks[r]["scoped"]
        assert "error" not in plain and "error" not in scoped
        for step in range(STEPS):
            assert torch.equal(plain["losses"][step], scoped["losses"][step]), f"rank {r} step {step}: loss"
            for i, (a, b) in enumerate(zip(plain["grads"][step], scoped["grads"][step], strict=True)):
                assert torch.equal(a, b), f"rank {r} step {step}: gradient {i}"


if __name__ == "__main__":
    spawn_ranks(_worker, WORLD)
