"""Probes for tensor-parallel tests (``tests/distributed/test_tp_memory.py``)::

    from support.tp import StorageWatch, CommCount, local_bytes, free_port
    from support.tp import guarded, spawn_ranks, ranks_results, sp_blocks

* ``StorageWatch``: a dispatch mode that notes the storage of every op's output (a wrapper's
  local tensors: DTensor's, by local bytes); ``held(exclude)`` is the bytes of those still
  alive, each storage once: what forward keeps (autograd's saves, a scope's records);
* ``CommCount``: a dispatch mode counting the collectives that run under it, also those a
  DTensor op runs for its redistributions (it lets DTensor desugar first, as PyTorch's
  ``CommDebugMode`` does) and those a replay runs;
* ``sp_blocks(mesh, dim)``: 3 pre-norm MLP blocks under TP + sequence parallelism
  (``SequenceParallel`` norm, fc1 colwise from a sequence-sharded input: an all-gather per
  block in forward, fc2 rowwise to a sequence-sharded output: a reduce-scatter);
* ``ranks_results`` runs a test file as a script in a subprocess bounded by a timeout, which
  spawns its ranks (``spawn_ranks``); each rank runs its parts under ``guarded`` (an error
  becomes a result, then a barrier) and ``torch.save``s its results.
"""

import gc
import os
import socket
import subprocess
import sys
import time

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from gradient_scope._base.subclass import data_tensors

__all__ = [
    "StorageWatch",
    "CommCount",
    "local_bytes",
    "free_port",
    "guarded",
    "spawn_ranks",
    "ranks_results",
    "sp_blocks",
]


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_bytes(t):
    """The bytes of ``t``'s local data (a DTensor's shard)."""
    return sum(d.untyped_storage().nbytes() for d in data_tensors(t))


class StorageWatch(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        # data address -> (weak storage, bytes, the op that made it); a reused address is the newest
        self.seen = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                for d in data_tensors(t):
                    s = d.untyped_storage()
                    if s.nbytes():
                        self.seen[s.data_ptr()] = (StorageWeakRef(s), s.nbytes(), str(func))
        return out

    def held(self, exclude=()):
        """Bytes of the noted storages alive now, but those of ``exclude`` (tensors)."""
        return sum(n for _, n in self.alive(exclude))

    def alive(self, exclude=()):
        """``(op, bytes)`` of each noted storage alive now, but those of ``exclude``, once no
        worker thread of the process group still holds a finished collective's tensors:
        gloo's worker drops its reference to a work a moment after the work completes (the
        waiting thread may read first), so the least of several reads 10 ms apart counts
        (until three agree, at most 20). What the program itself keeps never dies by waiting."""
        skip = {d.untyped_storage().data_ptr() for t in exclude for d in data_tensors(t)}
        reads = []
        for _ in range(20):
            gc.collect()
            seen = self.seen.items()
            reads.append(sorted((op, n) for p, (ref, n, op) in seen if not ref.expired() and p not in skip))
            if len(reads) >= 3 and reads[-1] == reads[-2] == reads[-3]:
                break
            time.sleep(0.01)
        return min(reads, key=lambda r: sum(n for _, n in r))


_COMM_NAMESPACES = ("_c10d_functional", "c10d", "c10d_functional")


class CommCount(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if any(t is DTensor for t in types):
            return NotImplemented  # DTensor runs its local ops (and collectives) under this mode
        ns = func.namespace if hasattr(func, "namespace") else ""
        if ns in _COMM_NAMESPACES and "wait" not in func.__name__ and "wrap" not in func.__name__:
            self.n += 1
            self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def sp_blocks(mesh, dim):
    """``(model, Block)``: 3 pre-norm MLP blocks of width ``dim`` (seeded: the same weights on
    every call), each parallelised with TP + sequence parallelism over ``mesh``."""
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(dim)
            self.fc1 = nn.Linear(dim, 4 * dim)
            self.fc2 = nn.Linear(4 * dim, dim)

        def forward(self, x):
            return x + self.fc2(F.gelu(self.fc1(self.norm(x))))

    torch.manual_seed(0)
    model = nn.Sequential(*[Block() for _ in range(3)])
    plan = {
        "norm": SequenceParallel(),
        "fc1": ColwiseParallel(input_layouts=Shard(1)),
        "fc2": RowwiseParallel(output_layouts=Shard(1)),
    }
    for block in model:
        parallelize_module(block, mesh, plan)
    return model, Block


def guarded(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` on a rank, or ``{"error": ...}`` with its traceback; then a
    barrier, so that a rank that raised does not leave the others waiting."""
    import traceback

    import torch.distributed as dist

    try:
        out = fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001
        out = {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=-8)}"}
    dist.barrier()
    return out


def _rank(rank, worker, port, outdir):
    """One rank: ``worker(rank, port, outdir)``, with what the imports made out of the
    collector's reach (``gc.freeze``): a full collection (``StorageWatch.alive`` runs several
    per step) then scans only what the rank made since, 0.35 s less each."""
    import torch.distributed.tensor  # noqa: F401

    import gradient_scope  # noqa: F401

    gc.freeze()
    worker(rank, port, outdir)


def spawn_ranks(worker, world):
    """``python script PORT OUTDIR``'s body: ``world`` ranks of ``worker(rank, port, outdir)``."""
    import torch.multiprocessing as mp

    mp.spawn(_rank, args=(worker, int(sys.argv[1]), sys.argv[2]), nprocs=world, join=True)


def ranks_results(script, outdir, world, timeout, argv=()):
    """Run ``script [ARGV...] PORT OUTDIR`` in a subprocess bounded by ``timeout`` seconds (a
    hang fails here); each rank's ``rank{r}.pt`` in ``outdir``."""
    from support import ROOT, TESTS

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(TESTS), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(
        [sys.executable, os.path.abspath(script), *map(str, argv), str(free_port()), str(outdir)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"ranks failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return [torch.load(outdir / f"rank{r}.pt", weights_only=False) for r in range(world)]
