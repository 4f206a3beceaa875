"""Dropout on sharded DTensors under DTensor's RNG tracker (issue 36 item 4), on CUDA.

DTensor draws random numbers for a sharded tensor through its ``OffsetBasedRNGTracker``
(``torch.distributed.tensor._random``), which torch 2.13 creates on CUDA-like meshes only
(it raises on a CPU mesh; on CPU DTensor uses the default generator, tested by
``test_tp_memory.py``'s ``mlp_dropout``). A scope replays the dropout in backward: the
replay must draw the forward's numbers, and leave the tracker where plain training leaves
it, so that later steps draw as plain ones do. One process, a 1-rank NCCL mesh (the
tracker is the same object for any mesh size); losses, gradients and parameters
``torch.equal`` to plain TP over three SGD steps. Skipped without CUDA and NCCL.

Never run yet: the machine this was written on had no GPU.
"""

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or not dist.is_available() or not dist.is_nccl_available(),
    reason="DTensor's RNG tracker runs on CUDA meshes only (torch 2.13 refuses a CPU mesh); needs NCCL",
)

D, STEPS = 32, 3


def _train(scoped, mesh):
    import torch.nn as nn
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor import _random as dtensor_random
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from gradient_scope import apply_recompute

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)
            self.drop = nn.Dropout(0.5)

        def forward(self, x):
            return x + self.fc2(self.drop(torch.nn.functional.gelu(self.fc1(x))))

    torch.manual_seed(0)
    model = nn.Sequential(*[Block() for _ in range(2)]).cuda()
    for b in model:  # dropout on the sharded DTensor fc1 returns
        plan = {"fc1": ColwiseParallel(use_local_output=False), "fc2": RowwiseParallel(input_layouts=Shard(-1))}
        parallelize_module(b, mesh, plan)
    if scoped:
        apply_recompute(model, check_fn=Block)
    dtensor_random._rng_tracker = None  # made again from the CUDA generator seeded below
    torch.manual_seed(7)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(100)
    out = {"losses": [], "grads": []}
    for _ in range(STEPS):
        x = torch.randn(16, D, generator=gen).cuda()
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        out["grads"].append([p.grad.full_tensor().clone() for p in model.parameters()])
        opt.step()
        out["losses"].append(loss.detach())
    out["tracker"] = type(dtensor_random._rng_tracker).__name__
    out["params"] = [p.detach().full_tensor().clone() for p in model.parameters()]
    return out


def test_dropout_on_sharded_dtensors_replays_its_numbers_under_the_rng_tracker(tmp_path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import _random as dtensor_random

    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    before = dtensor_random._rng_tracker
    try:
        mesh = init_device_mesh("cuda", (1,))
        plain, scoped = _train(False, mesh), _train(True, mesh)
    finally:
        dtensor_random._rng_tracker = before
        dist.destroy_process_group()
    assert plain["tracker"] == scoped["tracker"] == "OffsetBasedRNGTracker"
    for step in range(STEPS):
        for i, (a, b) in enumerate(zip(scoped["grads"][step], plain["grads"][step], strict=True)):
            assert torch.equal(a, b), f"step {step} gradient {i} differs"
    for name in ("losses", "params"):
        for i, (a, b) in enumerate(zip(scoped[name], plain[name], strict=True)):
            assert torch.equal(a, b), f"{name}[{i}] differs"
