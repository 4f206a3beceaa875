"""The saved-tensor report under tensor parallelism (issue 36 item 5): DTensor saves count
by their local bytes, DTensor parameters count as parameters, and the report names the
collectives the scopes' replays run.

One subprocess (bounded by a timeout) spawns 2 gloo ranks; they ``torch.save`` results.
"""

import os

import pytest
import torch

from support.tp import StorageWatch, local_bytes, ranks_results, spawn_ranks

TIMEOUT = 120
WORLD = 2
D = 32


# ----------------------------------------------------------------------------------------
# worker side


def _model():
    import torch.nn as nn
    import torch.nn.functional as F

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(D, 4 * D)
            self.fc2 = nn.Linear(4 * D, D)

        def forward(self, x):
            return self.fc2(F.gelu(self.fc1(x)))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([Block() for _ in range(3)])

        def forward(self, x):
            for b in self.blocks:
                x = x + b(x)
            return x

    return Net()


def _run(mode):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from gradient_scope import apply_recompute, saved_tensors_report

    torch.manual_seed(0)
    model = _model()
    mesh = init_device_mesh("cpu", (WORLD,))
    for b in model.blocks:
        parallelize_module(b, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        if mode == "scoped":
            apply_recompute(b, check_fn=lambda m, b=b: m is b)
    x = torch.randn(32, D, generator=torch.Generator().manual_seed(100))
    watch = StorageWatch()
    with saved_tensors_report(model) as report, watch:
        out = model(x)
    weights = [m.weight for b in model.blocks for m in (b.fc1, b.fc2) if m is not model.blocks[0].fc1]
    res = {
        "held": watch.held(exclude=[out, x, *model.parameters()]),
        "activation": report.activation_bytes,
        "held_by_scopes": report.held_by_scopes_bytes,
        "param": report.param_bytes,
        "recomputable": report.recomputable_bytes,
        "saved_weights": sum(local_bytes(w) for w in weights),
        "input": local_bytes(x),
        "collectives": getattr(report, "replayed_collectives", None),
        "table": report.table(),
    }
    out.sum().backward()
    return res


def _worker(rank, port, outdir):
    import warnings

    import torch.distributed as dist

    warnings.filterwarnings("ignore", message="DTensor random operators")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        results = {}
        for mode in ("plain", "scoped"):
            try:
                results[mode] = _run(mode)
            except Exception as e:  # noqa: BLE001
                import traceback

                results[mode] = {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=-8)}"}
            dist.barrier()
        torch.save(results, os.path.join(outdir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------------------
# test side


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    outdir = tmp_path_factory.mktemp("tp_report_ranks")
    results = ranks_results(__file__, outdir, WORLD, TIMEOUT)
    for r, res in enumerate(results):
        for mode, got in res.items():
            assert "error" not in got, f"rank {r} {mode}: {got['error']}"
    return results


def test_tp_report_counts_local_bytes(ranks):
    """The report's bytes are local: what forward leaves (activations + held by scopes)
    equals the local storages a dispatch mode sees alive after forward, plain and scoped;
    DTensor weights count as parameters by their local shard."""
    for r in range(WORLD):
        for mode in ("plain", "scoped"):
            got = ranks[r][mode]
            left = got["activation"] + got["held_by_scopes"]
            assert left == got["held"], (r, mode, left, got["held"], got["table"])
            # Saved weights: all but blocks.0.fc1's (its input needs no grad), and the input x.
            assert got["param"] == got["saved_weights"] + got["input"], (r, mode, got["table"])
        plain, scoped = ranks[r]["plain"], ranks[r]["scoped"]
        assert scoped["activation"] < plain["activation"]
        assert scoped["recomputable"] == plain["activation"] - scoped["activation"], (r, scoped["table"])


def test_tp_report_names_replayed_collectives(ranks):
    """Each scoped Colwise -> Rowwise block replays its RowwiseParallel all_reduce."""
    for r in range(WORLD):
        plain, scoped = ranks[r]["plain"], ranks[r]["scoped"]
        assert scoped["collectives"] == {"_c10d_functional::all_reduce": 3}, (r, scoped["collectives"])
        assert plain["collectives"] == {}
        assert "collectives replayed in backward: _c10d_functional::all_reduce x3" in scoped["table"]
        assert "collectives replayed" not in plain["table"]


if __name__ == "__main__":
    spawn_ranks(_worker, WORLD)
