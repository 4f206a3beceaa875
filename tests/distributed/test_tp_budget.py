"""Budgets across ranks (``gradient_scope._budget.agree`` A1..A5): every rank of a process
group runs the same plan, 2 gloo processes on 127.0.0.1 (CPU).

* Ranks that disagree -- another ``Budget`` per rank, and other measured rates (rank 1's
  device rates pinned ten thousand times slower, its per-op costs from another calibration
  through the ``set_calibration`` seam) -- run rank 0's plan: the per-block decisions, the
  ops replayed and the figures are the same on both ranks, and losses, gradients and
  parameters are ``torch.equal`` to the same model without scopes, over three optimizer
  steps (the first measures, the others are planned). Under FSDP2 (its all-gathers run in
  replays) and under tensor parallelism (``parallelize_module``, DTensor blocks).
* Ranks whose scoped block structures differ (rank 1 runs another sequence length under
  FSDP2, scopes two layers of three under TP) under a budget whose blocks communicate: both
  raise the same ``RuntimeError`` at the end of the first forward (A5), before a backward
  whose replays (TP collectives) would differ; none waits for the other.
* A budget given to ``recompute_scope`` only, ranks with other structures: both raise the
  same error when the first backward is entered (A5), before any replay.
* A DDP-style program (no block communicates) whose ranks run other structures keeps each
  rank's own plan and trains.

One subprocess, bounded by a timeout (a hang fails the test), spawns the ranks.
"""

import contextlib
import os
import socket
import sys

import pytest
import torch

from support import ROOT
from support.tp import guarded, ranks_results, sp_blocks, spawn_ranks

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


def _scopes_only(rank, layers):
    """A budget given to ``recompute_scope`` only (no model forward ends before backward),
    TP: rank 0 scopes the first ``layers[0]`` layers, rank 1 the first ``layers[1]``. The
    first step's backward is where the ranks' replays would first run collectives."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from gradient_scope import Budget, recompute_scope

    model, _ = _net()
    mesh = init_device_mesh("cpu", (WORLD,))
    for layer in model:
        parallelize_module(layer, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    budget = Budget(0)
    gen = torch.Generator().manual_seed(100)
    losses = []
    for step in range(2):
        h = torch.randn(4, DIM, generator=gen)
        for i, layer in enumerate(model):
            with recompute_scope(budget=budget) if i < layers[rank] else contextlib.nullcontext():
                h = layer(h)
        loss = _full(h).pow(2).mean()
        try:
            loss.backward()
        except RuntimeError as e:
            raise RuntimeError(f"[step {step}'s backward] {e}") from e
        losses.append(loss.detach())
    return {"losses": losses}


def _worker(rank, port, outdir):
    import warnings

    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        results = {}
        for layout in ("fsdp", "tp"):
            results[layout] = {s: guarded(_train, rank, s, layout) for s in (False, True)}
            results[f"{layout}_mismatch"] = guarded(_mismatch, rank, layout)
        results["ddp_mismatch"] = guarded(_local_mismatch, rank)
        results["scopes_only"] = guarded(_scopes_only, rank, (3, 3))
        results["scopes_only_mismatch"] = guarded(_scopes_only, rank, (3, 2))
        results["comm"] = guarded(_comm_rates, rank)
        results["recipe"] = guarded(_recipe, rank)
        results["sp_collectives"] = guarded(_sp_collectives, rank)
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


def _comm_rates(rank):
    """A new group's collectives measured (every rank together), once per process. (Not the
    world group's: the TP budgets before measured it, their blocks record collectives.)"""
    import torch.distributed as dist

    from gradient_scope._budget import rates

    name = dist.new_group(list(range(WORLD))).group_name
    assert rates.comm_rates(name) is None
    rates.measure_comm([name])
    first = rates.comm_rates(name)
    rates.measure_comm([name])  # measured already: no collective (a rank alone would hang)
    return {"rates": first, "again": rates.comm_rates(name)}


def _recipe_code():
    import re

    with open(os.path.join(ROOT, "docs", "recipes.md"), encoding="utf-8") as f:
        text = f.read()
    start = text.index("## FSDP2 + TP + compile with scopes\n")
    end = text.find("\n## ", start + 1)
    return re.search(r"```python\n(.*?)```", text[start:end], re.DOTALL).group(1)


def _recipe(rank):
    """The docs' recipe as written: dp=1, tp=2, compiled with aot_eager; plain, scoped,
    and scoped under a budget (each rank its own)."""
    import types

    from gradient_scope import Budget

    module = sys.modules["gs_tp_recipe"] = types.ModuleType("gs_tp_recipe")  # (dynamo imports it)
    exec(compile(_recipe_code(), "docs/recipes.md", "exec"), module.__dict__)
    ns = module.__dict__
    out = {}
    for name in ("plain", "scoped", "budget"):
        torch._dynamo.reset()
        budget = Budget(0 if rank == 0 else 10**9) if name == "budget" else None
        model = ns["build"](1, 2, scoped=name != "plain", budget=budget, backend="aot_eager")
        out[name] = ns["train"](model, dp_rank=0)
    return out


def _sp_collectives(rank):
    """Collectives per forward and per backward (the backend's ``gloo:`` profiler events) of
    ``sp_blocks`` (an all-gather per block in forward), plain, under torch's checkpoint per
    block, and with a scope per block."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.device_mesh import init_device_mesh
    from torch.profiler import ProfilerActivity, profile

    from gradient_scope import apply_recompute

    def count(fn):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            out = fn()
        names = [e.name for e in prof.events() if e.name.startswith("gloo:")]
        return out, (names.count("gloo:all_gather"), len(names) - names.count("gloo:all_gather"))

    mesh = init_device_mesh("cpu", (WORLD,))
    out = {}
    for strategy in ("plain", "checkpoint", "scoped"):
        model, Block = sp_blocks(mesh, DIM)
        if strategy == "checkpoint":
            for i in range(len(model)):
                model[i] = checkpoint_wrapper(model[i])
        elif strategy == "scoped":
            apply_recompute(model, check_fn=Block)
        x = torch.randn(2, 8, DIM, generator=torch.Generator().manual_seed(0)).chunk(WORLD, dim=1)[rank]
        loss, forward = count(lambda: model(x.contiguous()).pow(2).sum())
        _, backward = count(loss.backward)
        out[strategy] = (forward, backward, [_full(p.grad).clone() for p in model.parameters()])
    return out


# ----------------------------------------------------------------------------------------
# test side


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    outdir = tmp_path_factory.mktemp("tp_budget")
    return ranks_results(__file__, outdir, WORLD, TIMEOUT)


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


def test_a_budget_on_scopes_only_checks_the_first_step_at_its_backward(ranks):
    """No model forward ends before the first backward: the ranks' structures are
    exchanged when it is entered (A5), before any replay runs a collective."""
    for rank, res in enumerate(ranks):
        _ok(res["scopes_only"], f"rank {rank} (same structures)")
        err = res["scopes_only_mismatch"].get("error", "")
        # (before, the first step's replays ran unmatched collectives; the next step raised)
        assert err.startswith("RuntimeError: [step 0's backward] "), f"rank {rank}: {res['scopes_only_mismatch']}"
        assert "different scoped block structures" in err, err
        assert "rank 0: 3 blocks" in err and "rank 1: 2 blocks" in err, err
    _assert_equal_lists(ranks[0]["scopes_only"]["losses"], ranks[1]["scopes_only"]["losses"], "losses by rank")


def test_ranks_whose_blocks_do_not_communicate_keep_their_own_plans(ranks):
    b0, b1 = (_ok(r["ddp_mismatch"], f"rank {i}") for i, r in enumerate(ranks))
    assert b0["planned_bytes"] < b1["planned_bytes"]  # each its own budget's plan


def test_the_fsdp2_tp_compile_recipe_trains_as_plain(ranks):
    for rank, res in enumerate(ranks):
        got = _ok(res["recipe"], f"rank {rank}")
        for name in ("scoped", "budget"):
            _assert_equal_lists(got[name], got["plain"], f"rank {rank} {name} losses")


def test_tp_sp_backward_replays_one_all_gather_per_block(ranks):
    """A scope per block replays what backward needs, each recorded op at most once per
    pass: the all-gather of a block's sequence-sharded input (``ColwiseParallel`` from
    ``Shard(1)``) is replayed once and reused where the weight gradient needs the same
    gathered value, so a backward runs one all-gather per block more than plain TP, as
    torch's checkpoint (which reruns each block's forward up to its last save). Other
    collectives: plain's, as checkpoint -- a block output saved after its block (the next
    block's input, the loss's) is kept where its replay would run a collective
    (``_save.pack`` S1 [ block tensors become handles ])."""
    for rank, res in enumerate(ranks):
        got = _ok(res["sp_collectives"], f"rank {rank}")
        (pf, pb, pg), (cf, cb, _), (sf, sb, sg) = got["plain"], got["checkpoint"], got["scoped"]
        print(f"rank {rank}: (all-gathers, others) fwd/bwd plain {pf}/{pb}, checkpoint {cf}/{cb}, scoped {sf}/{sb}")
        assert sf == pf == cf, (pf, cf, sf)
        assert cb[0] == pb[0] + 3 and cb[1] == pb[1], "checkpoint reruns each block's all-gather"
        assert sb[0] == cb[0], (pb, sb, cb)  # one replayed all-gather per block, not two
        assert sb[1] == cb[1] == pb[1], (pb, sb, cb)  # no output's reduce-scatter replayed
        _assert_equal_lists(sg, pg, f"rank {rank} scoped grads")


def test_process_group_collectives_are_measured_once(ranks):
    for rank, res in enumerate(ranks):
        got = _ok(res["comm"], f"rank {rank}")
        r = got["rates"]
        assert got["again"] is r
        assert 0 < r.latency < 1 and 1e6 < r.bandwidth < 1e13, r


def _collective_record(nbytes_in, group="7"):
    """A closed record by hand: ``all_gather_into_tensor`` of a local shard of ``nbytes_in``
    bytes over 2 ranks of group ``group``, then ``mul``: what a TP block records."""
    from gradient_scope._record.types import Input, OpRecord, Var
    from gradient_scope._record.wrappers import collective

    shard = torch.ones(nbytes_in // 4)
    inp = Input(shard)
    full = torch.ones(2 * shard.numel())  # (a Var refers to its tensor weakly: kept here)
    gathered, doubled = Var(full), Var(full)
    for op, v in enumerate((gathered, doubled)):
        v.op, v.size, v.dtype, v.base, v.writes = op, full.shape, full.dtype, None, ()
    _collective_record.keep = full
    ag = collective(torch.ops._c10d_functional.all_gather_into_tensor.default)  # as a block records it
    return [
        OpRecord(ag, [inp, 2, group], {}, None, (gathered,)),
        OpRecord(torch.ops.aten.mul.Tensor, [gathered, 2.0], {}, None, (doubled,)),
    ]


def test_a_collective_is_priced_by_its_groups_measured_rates_and_local_bytes():
    import torch.distributed  # noqa: F401  (registers the functional collectives)

    from gradient_scope._budget import measure as M
    from gradient_scope._budget import rates

    ops = _collective_record(4096)
    assert M._group(ops[0]) == "7" and M._comm_bytes(ops[0]) == 8192  # the gathered output, local
    m = M.Measured()
    for rec in ops:
        flops, moved = M.op_work(rec)
        m.flops.append(flops)
        m.moved.append(moved)
        m.groups.append(M._group(rec) if M.is_collective(rec.func) else None)
        m.comm.append(M._comm_bytes(rec) if m.groups[-1] is not None else 0)
    assert m.groups == ["7", None]
    device = rates.Rates(flops=1e12, memory=1e11, overhead=1e-6, to_host=1e10, to_device=1e10, replay=1e-5)
    before = M.costs(m, device)  # unmeasured group: priced as any op moving its bytes
    assert before[0] == pytest.approx(rates.seconds(m.flops[0], m.moved[0], device) + 1e-5)
    slow = rates.CommRates(latency=2e-3, bandwidth=1e6)
    with rates.pinned_comm_rates("7", slow):
        priced = M.costs(m, device)
    assert priced[0] == pytest.approx(2e-3 + 8192 / 1e6 + 1e-5)
    assert priced[1] == before[1]  # other ops as before
    assert rates.comm_rates("7") is None  # pinned only inside the block


if __name__ == "__main__":
    spawn_ranks(_worker, WORLD)
