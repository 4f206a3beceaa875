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

``python -m benchmarks.distributed_memory --tp4`` spawns 4 gloo ranks and compares, on
3 pre-norm residual MLP blocks (``LayerNorm`` then ``d -> 4d -> d``) of a
``(batch, seq, d)`` input, in the torchtitan order (TP, then recompute, then FSDP2):

* layouts: ``TP`` (``ColwiseParallel`` fc1, ``RowwiseParallel`` fc2 on a 4-rank mesh),
  ``TP+SP`` (the same with a ``SequenceParallel`` norm: activations sharded on the sequence
  between blocks), ``FSDP2+TP`` (TP on the "tp" dim of a 2x2 mesh, ``fully_shard`` per block
  and root on "dp");
* strategies: ``plain``; ``checkpoint`` (torch's non-reentrant
  ``checkpoint_wrapper`` per block); ``scoped`` (``apply_recompute`` per block); ``budget``
  (the same with a model-level ``Budget`` of half of plain's held bytes, each rank its
  own: the plan is agreed, rank 0's);
* per row, on rank 0: held after forward and peak (the CPU probe, second of two runs;
  third of three in the ``--tp4`` table, whose budget rows agree their plan and measure
  the process groups' rates in the second),
  collectives per step (``gloo:*`` events of the profiler in one forward + backward,
  the budget's plan agreement included), and step time (forward + backward, median of 5
  unprofiled steps after 2 warm-up steps).
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


def _probe(forward: Any, runs: int = 2) -> tuple[int, int]:
    for _ in range(runs):
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


class _Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.mlp = _MLP(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp.fc2(F.gelu(self.mlp.fc1(self.norm(x))))


TP_LAYOUTS = ("TP", "TP+SP", "FSDP2+TP")
TP_STRATEGIES = ("plain", "checkpoint", "scoped", "budget")


def _tp_model(layout: str, strategy: str, d: int, budget: int) -> nn.Module:
    """The 3 blocks parallelised in the torchtitan order: TP, recompute, FSDP2."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    from gradient_scope import Budget

    torch.manual_seed(0)
    model = nn.Sequential(*[_Block(d) for _ in range(3)])
    if layout == "FSDP2+TP":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        tp, dp = mesh["tp"], mesh["dp"]
    else:
        tp, dp = init_device_mesh("cpu", (4,)), None
    for block in model:
        if layout == "TP+SP":
            plan = {
                "norm": SequenceParallel(),
                "mlp.fc1": ColwiseParallel(input_layouts=Shard(1)),
                "mlp.fc2": RowwiseParallel(output_layouts=Shard(1)),
            }
        else:
            plan = {"mlp.fc1": ColwiseParallel(), "mlp.fc2": RowwiseParallel()}
        parallelize_module(block, tp, plan)
    if strategy == "checkpoint":
        for i in range(len(model)):
            model[i] = checkpoint_wrapper(model[i])
    elif strategy == "scoped":
        apply_recompute(model, check_fn=_Block)
    elif strategy == "budget":
        apply_recompute(model, check_fn=_Block, budget=Budget(budget))
    if dp is not None:
        for block in model:
            fully_shard(block, mesh=dp)
        fully_shard(model, mesh=dp)
    return model


def _collectives(step: Any) -> int:
    """Collectives one call of ``step`` runs (the backend's ``gloo:``/``nccl:`` events)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    return sum(1 for e in prof.events() if e.name.startswith(("gloo:", "nccl:")))


def _step_time(step: Any) -> float:
    import statistics
    import time

    for _ in range(2):
        step()
    times = []
    for _ in range(5):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _tp_row(layout: str, strategy: str, batch: int, seq: int, d: int, budget: int) -> tuple[int, int, int, float]:
    model = _tp_model(layout, strategy, d, budget)
    rank = dist.get_rank()
    data = rank // 2 if layout == "FSDP2+TP" else 0  # the ranks of a TP group see the same batch
    x = torch.randn(batch, seq, d, generator=torch.Generator().manual_seed(data))
    if layout == "TP+SP":  # sequence parallel: each rank holds its part of the sequence
        x = x.chunk(4, dim=1)[rank].contiguous()

    def forward() -> torch.Tensor:
        out = model(x)
        out = out.to_local() if hasattr(out, "to_local") else out
        return out.pow(2).sum()

    def step() -> None:
        forward().backward()

    # the third step: a budget's first measures, its second agrees the plan and measures
    # the process groups' rates (an all-gather of 1 MiB per rank, once per process)
    held, peak = _probe(forward, runs=3)
    return held, peak, _collectives(step), _step_time(step)


def _tp_worker(rank: int, port: int, batch: int, seq: int, d: int) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4)
    try:
        rows = []
        for layout in TP_LAYOUTS:
            plain_held = 0
            for strategy in TP_STRATEGIES:
                row = _tp_row(layout, strategy, batch, seq, d, plain_held // 2)
                if strategy == "plain":
                    plain_held = row[0]
                rows.append((layout, strategy, *row))
        if rank == 0:
            _print_tp(rows, batch, seq, d)
    finally:
        dist.destroy_process_group()


def _print_tp(rows: list[tuple[Any, ...]], batch: int, seq: int, d: int) -> None:
    print(f"batch {batch}, seq {seq}, d {d}, hidden {4 * d}, 3 blocks, 4 ranks (gloo, CPU); bytes on rank 0\n")
    head = "| layout | strategy | held after forward | vs plain | backward peak | collectives/step | step time |"
    print(head + " vs plain |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    base: dict[str, tuple[int, float]] = {}
    for layout, strategy, held, peak, comms, secs in rows:
        if strategy == "plain":
            base[layout] = (held, secs)
        h0, t0 = base[layout]
        print(
            f"| {layout} | {strategy} | {held:,} | {held / h0:.2f}x | {peak:,} | {comms} | "
            f"{secs * 1e3:.1f} ms | {secs / t0:.2f}x |"
        )


def main(argv: list[str] | None = None) -> None:
    """Spawn the ranks and print the table (rank 0)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--d", type=int, default=256)
    parser.add_argument("--tp4", action="store_true", help="the 4-rank TP, TP+SP and FSDP2+TP table")
    parser.add_argument("--seq", type=int, default=64, help="sequence length (--tp4)")
    args = parser.parse_args(argv)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if args.tp4:
        mp.spawn(_tp_worker, args=(port, args.batch, args.seq, args.d), nprocs=4, join=True)
    else:
        mp.spawn(_worker, args=(port, args.batch, args.d), nprocs=WORLD, join=True)


if __name__ == "__main__":
    main(sys.argv[1:])
