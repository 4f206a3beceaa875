"""Memory with FSDP2 and tensor parallelism: bytes held after forward and peak, plain vs scoped.

``python -m benchmarks.distributed_memory`` spawns 2 gloo ranks on 127.0.0.1 (CPU) and
measures, with the CPU probe of :mod:`benchmarks._harness.memory` on rank 0 (each run measured
twice, the second one reported, so that one-time allocations are not counted):

* FSDP2: 3 residual MLP layers (``d -> 4d -> d``), each ``fully_shard``ed, each output
  gated by ``x * sigmoid(x)`` after the layer; ``scoped`` applies ``apply_recompute`` to
  every layer;
* TP: one residual MLP with ``ColwiseParallel`` / ``RowwiseParallel`` followed by the same
  gate, and the same MLP without TP for reference; ``scoped`` wraps the MLP in a
  ``recompute_scope``.

Held bytes include whatever FSDP2 keeps after forward (the root's unsharded parameters),
the same with and without scopes.
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import sys
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

from gradient_scope import apply_recompute, recompute_scope

from ._harness.memory import profile_cpu_memory

WORLD = 2


class _MLP(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(x)))


class _Net(nn.Module):
    def __init__(self, d: int, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_MLP(d) for _ in range(layers)])
        self.head = nn.Linear(d, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
            x = x * torch.sigmoid(x)
        return self.head(x)


def _probe(forward: Any) -> tuple[int, int]:
    for _ in range(2):
        _, held, peak = profile_cpu_memory(forward, lambda out: out.backward())
    return held, peak


def _fsdp(scoped: bool, batch: int, d: int) -> tuple[int, int]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = _Net(d, 3)
    mesh = init_device_mesh("cpu", (WORLD,))
    for layer in model.layers:
        if scoped:
            apply_recompute(layer)
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    x = torch.randn(batch, d)
    return _probe(lambda: model(x).pow(2).sum())


def _tp(tp: bool, scoped: bool, batch: int, d: int) -> tuple[int, int]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    mlp = _MLP(d)
    if tp:
        mesh = init_device_mesh("cpu", (WORLD,))
        parallelize_module(mlp, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    x = torch.randn(batch, d, requires_grad=True)

    def forward() -> torch.Tensor:
        with recompute_scope() if scoped else contextlib.nullcontext():
            y = mlp(x)
        return (y * torch.sigmoid(y)).sum()

    return _probe(forward)


def _worker(rank: int, port: int, batch: int, d: int) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        rows = []
        for scoped in (False, True):
            rows.append((f"FSDP2, 3 layers, {'scoped' if scoped else 'plain'}", *_fsdp(scoped, batch, d)))
        for tp in (False, True):
            for scoped in (False, True):
                name = f"{'TP' if tp else 'no TP'} MLP, {'scoped' if scoped else 'plain'}"
                rows.append((name, *_tp(tp, scoped, batch, d)))
        if rank == 0:
            print(f"batch {batch}, d {d}, hidden {4 * d}, {WORLD} ranks (gloo, CPU); bytes on rank 0\n")
            print("| run | held after forward | peak |\n| --- | --- | --- |")
            for name, held, peak in rows:
                print(f"| {name} | {held:,} | {peak:,} |")
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    """Spawn the ranks and print the table (rank 0)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--d", type=int, default=256)
    args = parser.parse_args(argv)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(port, args.batch, args.d), nprocs=WORLD, join=True)


if __name__ == "__main__":
    main(sys.argv[1:])
