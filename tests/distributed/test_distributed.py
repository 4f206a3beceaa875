"""Distributed training with scopes (``docs/compatibility.md``), 2 gloo processes on 127.0.0.1 (CPU).

* DistributedDataParallel with scopes inside the model trains exactly as plain DDP.
* FSDP2 (``fully_shard``): scopes per layer (``apply_recompute`` on ``fully_shard``ed layers)
  and around a ``fully_shard``ed module train exactly as plain FSDP2 -- losses, gradients and
  parameters ``torch.equal`` -- with ``reshard_after_forward`` True and False, with
  ``MixedPrecisionPolicy(param_dtype=bfloat16)``, over two optimizer steps, also when a
  replay needs a layer's parameters before FSDP2 gathers them (the layer output is saved by
  an op after the layer and dies) and in later backward passes over the same graph. FSDP2's
  all-gathers are counted (``DefaultAllGather.__call__``) and logged per group: a scoped step
  gathers exactly as often as the plain step, in the same order on both ranks, and after
  every backward pass every parameter group is sharded again with no unsharded storage.
* Tensor parallelism (``parallelize_module`` with ``ColwiseParallel``/``RowwiseParallel``,
  DTensor parameters): scoped layers train exactly as plain ones.

All of it runs in one subprocess (bounded by a timeout) that spawns the two ranks with
``torch.multiprocessing.spawn``; the ranks ``torch.save`` their results and the tests
compare them. The measured figures (all-gather counts, unsharded bytes at the backward peak)
print with ``pytest -s``.
"""

import contextlib
import os
import sys

import pytest
import torch

from gradient_scope import RecomputeError, recompute_scope

from support.tp import ranks_results

TIMEOUT = 240  # seconds for the whole subprocess (two ranks, every scenario)
WORLD = 2
STEPS = 2
# 4 ranks: reshard_after_forward=2 (an int: a smaller mesh after forward) and FSDP2 x TP
# on a 2x2 mesh. Not run by default (4 processes on a 2-core machine take about a minute).
FOUR_RANKS = os.environ.get("GS_TEST_FOUR_RANKS") == "1"
FOUR_RANK_LAYOUTS = {
    # the post-forward mesh: resharded to 2 ranks after forward, gathered from them
    "raf_int": dict(layout="flat4", raf=2, skip=True),
    # TP by parallelize_module on the "tp" dim, FSDP2 on the "dp" dim
    "fsdp_tp_plan": dict(layout="tp_plan", skip=True),
    # every parameter a Replicate DTensor on the "tp" dim: the replays read DTensor
    # parameters whose local storage FSDP2 freed
    "fsdp_dtensor_params": dict(layout="tp_replicate", skip=True),
}

FSDP_SCENARIOS = {
    # the layer output is saved by an op after the layer; reshard after forward
    "raf_true": dict(raf=True),
    "raf_false": dict(raf=False),
    "bf16": dict(raf=True, bf16=True),
    # layer 0's output is also saved at the very end: its replay runs first in backward
    "skip": dict(raf=True, skip=True),
    # a scope around a fully_shard'ed layer (FSDP2's hooks run inside the block)
    "around": dict(raf=True, around=True),
    # retain_graph, then a full second pass and a third pass no FSDP2 hook sees
    "passes": dict(raf=True, passes=True),
}
TP_SCENARIOS = ("local", "dtensor_out", "dtensor_dropout")


# ----------------------------------------------------------------------------------------
# worker side (runs in the spawned ranks)


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _net(scoped, skip=False, around=False, manual_scope=False, view_after=False, dim=8):
    """Three residual MLP layers, each output gated by ``x * sigmoid(x)`` after the layer
    (outside any scope: the gate saves the layer output, which nothing else holds), and a
    scoped ``tanh(head(x))``. ``manual_scope``: layers scope themselves (for DDP).
    ``skip``: layer 0's output is saved again at the end. ``around``: a scope around layer
    1's call. ``view_after``: a view of the head's output, taken after its block, is saved."""
    import torch.nn as nn
    import torch.nn.functional as F

    def scope():
        return recompute_scope() if scoped else contextlib.nullcontext()

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(dim, 2 * dim)
            self.fc2 = nn.Linear(2 * dim, dim)

        def forward(self, x):
            with scope() if manual_scope else contextlib.nullcontext():
                h = F.gelu(self.fc1(x))
                h = F.dropout(h, 0.2, self.training)
                return x + self.fc2(h)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([Layer() for _ in range(3)])
            self.head = nn.Linear(dim, 3)
            self.kept = None

        def forward(self, x):
            outs = []
            for i, layer in enumerate(self.layers):
                with scope() if around and i == 1 else contextlib.nullcontext():
                    x = layer(x)
                outs.append(x)
                gate = torch.sigmoid(x)
                x = x * gate
                if i == 0:
                    self.kept = (x, gate)  # for a backward pass over layer 0's gate only
            with scope():
                z = self.head(x).tanh()
            if skip:
                y0 = outs[0]
                z = z + (y0 * y0).mean(-1, keepdim=True)
            if view_after:
                v = z.t()
                z = (v * v).t()
            return z

    return Net()


class _Probe:
    """Instrumentation of FSDP2 in one rank: every all-gather (counted where FSDP2 calls
    the collective, and logged per group), pre-/post-backward hooks and regathers in
    order, and the unsharded parameter bytes at the peak of each backward pass."""

    def __init__(self):
        from torch.distributed.fsdp._fully_shard import _fsdp_collectives as coll
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

        import gradient_scope._adapters.fsdp as gs_fsdp

        self.groups = []
        self.events = []
        self.collectives = 0
        self.peak = 0
        self.depth = 0  # > 0 inside gradient_scope's regather
        probe = self
        unshard, wait = FSDPParamGroup.unshard, FSDPParamGroup.wait_for_unshard
        pre, post = FSDPParamGroup.pre_backward, FSDPParamGroup.post_backward
        # The collective: a DefaultAllGather object (torch >= 2.9) or a plain call of
        # dist.all_gather_into_tensor from FSDP2's collectives module (torch 2.8).
        gather_owner = getattr(coll, "DefaultAllGather", None)
        if gather_owner is None:
            gather_owner, gather_name = coll.dist, "all_gather_into_tensor"
        else:
            gather_name = "__call__"
        call, regather = getattr(gather_owner, gather_name), gs_fsdp.regather

        def is_bw():
            return torch._C._current_graph_task_id() != -1

        def unshard_(self, async_op=False):
            pending = self._all_gather_result
            unshard(self, async_op)
            if pending is None and self._all_gather_result is not None:
                probe.events.append(("gather", self._module_fqn, is_bw(), probe.depth > 0))

        def wait_(self):
            wait(self)
            if is_bw():
                probe.peak = max(probe.peak, probe.unsharded_bytes())

        def pre_(self, *args):
            probe.events.append(("pre_backward", self._module_fqn))
            return pre(self, *args)

        def post_(self, *args):
            probe.events.append(("post_backward", self._module_fqn))
            return post(self, *args)

        def call_(*args, **kwargs):
            probe.collectives += 1
            return call(*args, **kwargs)

        def regather_(t):
            probe.depth += 1
            try:
                ok = regather(t)
            finally:
                probe.depth -= 1
            probe.events.append(("regather", tuple(t.shape), ok))
            return ok

        FSDPParamGroup.unshard, FSDPParamGroup.wait_for_unshard = unshard_, wait_
        FSDPParamGroup.pre_backward, FSDPParamGroup.post_backward = pre_, post_
        setattr(gather_owner, gather_name, call_)
        gs_fsdp.regather = regather_

    def watch(self, model):
        def groups_of(state):  # a list since torch 2.9, one optional group in 2.8
            groups = getattr(state, "_fsdp_param_groups", None)
            if groups is None:
                group = state._fsdp_param_group
                groups = [] if group is None else [group]
            return groups

        self.groups = [
            g for m in model.modules() if hasattr(m, "_get_fsdp_state") for g in groups_of(m._get_fsdp_state())
        ]
        self.events, self.collectives, self.peak = [], 0, 0

    def unsharded_bytes(self):
        return sum(
            t.untyped_storage().nbytes() for g in self.groups for p in g.fsdp_params for t in p.all_gather_outputs
        )

    def left_unsharded(self):
        """Groups not sharded, or with unsharded storage still allocated (must be none)."""
        return [
            (g._module_fqn, str(g._sharded_state), self.unsharded_bytes())
            for g in self.groups
            if not g.is_sharded
            or any(t.untyped_storage().nbytes() for p in g.fsdp_params for t in p.all_gather_outputs)
        ]

    def group_bytes(self, fqn):
        (g,) = [g for g in self.groups if g._module_fqn == fqn]
        return sum(t.numel() * t.itemsize for p in g.fsdp_params for t in p.all_gather_outputs)


def _fsdp_run(rank, probe, scoped, raf=True, bf16=False, skip=False, around=False, passes=False, layout="flat2"):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import DTensor, Replicate, distribute_module
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from gradient_scope import apply_recompute

    torch.manual_seed(0)
    model = _net(scoped, skip=skip, around=around)
    if layout.startswith("flat"):
        mesh = dp = init_device_mesh("cpu", (int(layout[4:]),))
        data_rank = rank
    else:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        dp, tp = mesh["dp"], mesh["tp"]
        data_rank = rank // 2  # the ranks of a TP group see the same batch
        if layout == "tp_replicate":
            distribute_module(model.head, tp)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None)
    for i, layer in enumerate(model.layers):
        if layout == "tp_plan":
            parallelize_module(layer, tp, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        elif layout == "tp_replicate":
            distribute_module(layer, tp)
        if scoped and not (around and i == 1):
            apply_recompute(layer)  # the scope runs inside FSDP2's forward hooks
        fully_shard(layer, mesh=dp, reshard_after_forward=raf, mp_policy=mp)
    fully_shard(model, mesh=dp, mp_policy=mp)
    probe.watch(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(100 + data_rank)
    res = {"losses": [], "grads": [], "extra": [], "left": [], "peaks": [], "events": []}
    for _ in range(STEPS):
        x = torch.randn(4, 8, generator=gen).requires_grad_(passes)
        if layout == "tp_replicate":
            x = DTensor.from_local(x, tp, [Replicate()])
        torch.manual_seed(7 + data_rank)  # dropout draws
        opt.zero_grad()
        loss = _full(model(x)).float().pow(2).mean()
        probe.events.append(("backward",))
        probe.peak = 0
        loss.backward(retain_graph=passes)
        res["left"].append(probe.left_unsharded())
        res["peaks"].append(probe.peak)
        if passes:
            # a full second pass over the same graph (FSDP2 prefetches nothing now) ...
            probe.events.append(("backward",))
            res["extra"].append(torch.autograd.grad(loss, [x], retain_graph=True)[0])
            res["left"].append(probe.left_unsharded())
            # ... and one through layer 0's gate only: it reads layer 0's output (a replay
            # of layer 0, after the layer's post-backward), and no FSDP2 hook runs in it
            probe.events.append(("backward",))
            gated, gate = model.kept
            res["extra"].append(torch.autograd.grad(gated.sum(), [gate])[0])
            res["left"].append(probe.left_unsharded())
        model.kept = None
        res["grads"].append([_full(p.grad).clone() for p in model.parameters()])
        opt.step()
        res["losses"].append(loss.detach())
    res["params"] = [_full(p.detach()).clone() for p in model.parameters()]
    del loss, x
    # no block tensor left alive (FSDP2 keeps the buffers its first all-gather allocated,
    # also when that ran inside a block): the scope's saved-tensor hooks are gone
    res["hooks_left"] = torch._C._autograd._top_saved_tensors_default_hooks(False) is not None
    res["events"] = probe.events
    res["collectives"] = probe.collectives
    res["layer_bytes"] = probe.group_bytes("layers.0")
    return res


def _fsdp_errors(rank, probe):
    """Freed storage that no FSDP2 group owns, and a saved tensor read outside backward."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from gradient_scope import apply_recompute

    out = {}
    torch.manual_seed(0)
    model = _net(True)
    mesh = init_device_mesh("cpu", (WORLD,))
    for layer in model.layers:
        apply_recompute(layer)
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    probe.watch(model)
    # a plain tensor read by a block, its storage freed after the block
    x = torch.randn(4, 8)
    w = torch.randn(8, 8, requires_grad=True)
    with recompute_scope():
        h = (x @ w).sin()
    y = (h * h).sum()
    del h
    w.detach().untyped_storage().resize_(0)
    try:
        y.backward()
        out["not_fsdp"] = "no error"
    except RecomputeError as e:
        out["not_fsdp"] = str(e)
    # the gate's saved layer output, read outside backward: its replay would need the
    # layer's parameters, which FSDP2 has freed
    torch.manual_seed(0)
    z = model(torch.randn(4, 8))
    gated, _gate = model.kept
    try:
        _ = gated.grad_fn._saved_self
        out["outside_backward"] = "no error"
    except RecomputeError as e:
        out["outside_backward"] = str(e)
    out["left_after_error"] = [fqn for fqn, _, _ in probe.left_unsharded()]
    z.sum().backward()  # FSDP2 and the scope still work
    out["left_after_backward"] = probe.left_unsharded()
    return out


def _tp_run(rank, scoped, variant):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from gradient_scope import apply_recompute

    torch.manual_seed(0)
    model = _net(scoped, view_after=variant == "dtensor_out")
    mesh = init_device_mesh("cpu", (WORLD,))
    if variant == "local":  # the usual plan: local tensors in and out
        plan = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
    elif variant == "dtensor_out":
        # DTensors everywhere: the input, the layer outputs the gates save, the head's
        # output and a view of it taken after the head's block (saved by the square)
        plan = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel(use_local_output=False)}
        parallelize_module(model.head, mesh, ColwiseParallel(output_layouts=Replicate(), use_local_output=False))
    else:  # gelu and dropout (a random op on a DTensor) run on sharded DTensors
        plan = {"fc1": ColwiseParallel(use_local_output=False), "fc2": RowwiseParallel(input_layouts=Shard(-1))}
    for layer in model.layers:
        parallelize_module(layer, mesh, plan)
        if scoped:
            apply_recompute(layer)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(100)  # the same batch on both ranks (TP)
    res = {"losses": [], "grads": []}
    for _ in range(STEPS):
        x = torch.randn(4, 8, generator=gen)
        if variant == "dtensor_out":
            x = DTensor.from_local(x, mesh, [Replicate()])
        torch.manual_seed(7)
        opt.zero_grad()
        out = model(x)
        loss = _full(out).pow(2).mean()
        loss.backward()
        res["grads"].append([_full(p.grad).clone() for p in model.parameters()])
        opt.step()
        res["losses"].append(loss.detach())
    res["params"] = [_full(p.detach()).clone() for p in model.parameters()]
    res["dtensor_params"] = sum(isinstance(p, DTensor) for p in model.parameters())
    return res


def _tp_errors(rank):
    """A DTensor read by a block: its local storage freed after the block (a DTensor's
    own storage is a placeholder that keeps its size), or the DTensor modified in place."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (WORLD,))
    out = {}
    for case in ("freed", "modified"):
        torch.manual_seed(0)
        w = distribute_tensor(torch.randn(4, 6), mesh, [Shard(1)]).requires_grad_()
        x = distribute_tensor(torch.randn(3, 4), mesh, [Replicate()])
        with recompute_scope():
            h = (x @ w.cos()).sin()  # cos would read freed memory without a word
        y = (h * h).sum()
        del h
        if case == "freed":
            w.to_local().untyped_storage().resize_(0)
        else:
            with torch.no_grad():
                w.add_(1)
        try:
            y.backward()
            out[case] = "no error"
        except RecomputeError as e:
            out[case] = str(e)
    return out


def _ddp_run(rank, scoped):
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(_net(scoped, manual_scope=True))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(100 + rank)
    res = {"losses": [], "grads": []}
    for _ in range(3):
        x = torch.randn(4, 8, generator=gen)
        torch.manual_seed(7 + rank)
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        res["grads"].append([p.grad.clone() for p in model.parameters()])
        opt.step()
        res["losses"].append(loss.detach())
    res["params"] = [p.detach().clone() for p in model.parameters()]
    return res


def _guarded(fn, *args, **kwargs):
    import torch.distributed as dist

    try:
        out = fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001
        import traceback

        out = {"error": f"{type(e).__module__}.{type(e).__name__}: {e}\n{traceback.format_exc(limit=-8)}"}
    dist.barrier()  # keep the ranks in step before the next run
    return out


def _worker(rank, port, outdir):
    import warnings

    import torch.distributed as dist

    warnings.filterwarnings("ignore", message="DTensor random operators")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        results = {"ddp": {s: _guarded(_ddp_run, rank, s) for s in (False, True)}}
        probe = _Probe()
        results["fsdp"] = {
            name: {s: _guarded(_fsdp_run, rank, probe, s, **cfg) for s in (False, True)}
            for name, cfg in FSDP_SCENARIOS.items()
        }
        results["fsdp_errors"] = _guarded(_fsdp_errors, rank, probe)
        results["tp"] = {v: {s: _guarded(_tp_run, rank, s, v) for s in (False, True)} for v in TP_SCENARIOS}
        results["tp_errors"] = _guarded(_tp_errors, rank)
        torch.save(results, os.path.join(outdir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _worker4(rank, port, outdir):
    import warnings

    import torch.distributed as dist

    warnings.filterwarnings("ignore")  # DTensor's notes on CPU random ops, redistributions
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4)
    try:
        probe = _Probe()
        results = {
            name: {s: _guarded(_fsdp_run, rank, probe, s, **cfg) for s in (False, True)}
            for name, cfg in FOUR_RANK_LAYOUTS.items()
        }
        torch.save(results, os.path.join(outdir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _main(world, port, outdir):
    import torch.multiprocessing as mp

    mp.spawn(_worker if world == WORLD else _worker4, args=(port, outdir), nprocs=world, join=True)


# ----------------------------------------------------------------------------------------
# test side


def _spawn(world, outdir):
    return ranks_results(__file__, outdir, world, TIMEOUT, argv=(world,))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return _spawn(WORLD, tmp_path_factory.mktemp("ranks"))


def _ok(res, what):
    assert "error" not in res, f"{what}: {res['error']}"
    return res


def _assert_equal_lists(xs, ys, what):
    assert len(xs) == len(ys), what
    for i, (x, y) in enumerate(zip(xs, ys)):
        assert torch.equal(x, y), f"{what}[{i}] differs"


def _assert_same_training(scoped, plain, what, steps=STEPS):
    for step in range(steps):
        _assert_equal_lists(scoped["grads"][step], plain["grads"][step], f"{what} step {step} grads")
    _assert_equal_lists(scoped["losses"], plain["losses"], f"{what} losses")
    _assert_equal_lists(scoped["params"], plain["params"], f"{what} params")


def _gathers(events):
    return [e[1] for e in events if e[0] == "gather"]


def _backward_passes(events):
    """The events of each backward pass (split at the ("backward",) markers)."""
    passes, cur = [], None
    for e in events:
        if e == ("backward",):
            cur = []
            passes.append(cur)
        elif cur is not None and not (e[0] == "gather" and not e[2]):  # not forward's
            cur.append(e)
    return passes


def test_ddp_gloo_scopes_equal_plain(ranks):
    for r in range(WORLD):
        plain, scoped = (_ok(ranks[r]["ddp"][s], f"ddp rank {r} scoped={s}") for s in (False, True))
        _assert_same_training(scoped, plain, f"ddp rank {r}", steps=3)
    for step in range(3):  # all-reduced: equal across ranks
        _assert_equal_lists(
            ranks[0]["ddp"][True]["grads"][step],
            ranks[1]["ddp"][True]["grads"][step],
            f"ddp step {step} rank0 vs rank1",
        )


@pytest.mark.parametrize("name", list(FSDP_SCENARIOS))
def test_fsdp2_scoped_training_equals_plain(ranks, name):
    for r in range(WORLD):
        plain, scoped = (_ok(ranks[r]["fsdp"][name][s], f"{name} rank {r} scoped={s}") for s in (False, True))
        _assert_same_training(scoped, plain, f"{name} rank {r}")
        _assert_equal_lists(scoped["extra"], plain["extra"], f"{name} rank {r} later passes")
    # the scoped run really replayed blocks that read freed parameters
    regathers = [e for e in ranks[0]["fsdp"][name][True]["events"] if e[0] == "regather"]
    if FSDP_SCENARIOS[name]["raf"]:
        assert regathers and all(ok for _, _, ok in regathers), regathers


@pytest.mark.parametrize("name", list(FSDP_SCENARIOS))
def test_fsdp2_nothing_unsharded_after_backward_and_no_hooks_left(ranks, name):
    for r in range(WORLD):
        for s in (False, True):
            res = _ok(ranks[r]["fsdp"][name][s], f"{name} rank {r} scoped={s}")
            passes = 3 if FSDP_SCENARIOS[name].get("passes") else 1
            assert len(res["left"]) == STEPS * passes
            assert all(left == [] for left in res["left"]), f"{name} rank {r} scoped={s}: {res['left']}"
            assert not res["hooks_left"], f"{name} rank {r} scoped={s}: saved-tensor hooks left"


@pytest.mark.parametrize("name", list(FSDP_SCENARIOS))
def test_fsdp2_all_gathers(ranks, name):
    """A scoped training step all-gathers exactly as often as the plain step, group by
    group, in the same order on every rank; in a backward pass no FSDP2 hook runs in, a
    replay of layer 0 gathers layer 0 (plain FSDP2 kept the layer output instead)."""
    for r in range(WORLD):
        plain, scoped = (_ok(ranks[r]["fsdp"][name][s], f"{name} rank {r} scoped={s}") for s in (False, True))
        g_plain, g_scoped = _gathers(plain["events"]), _gathers(scoped["events"])
        assert len(g_plain) == plain["collectives"] and len(g_scoped) == scoped["collectives"]
        extra = ["layers.0"] * STEPS if FSDP_SCENARIOS[name].get("passes") else []
        assert sorted(g_scoped) == sorted(g_plain + extra), (g_plain, g_scoped)
        print(
            f"{name} rank {r}: all-gathers plain {len(g_plain)}, scoped {len(g_scoped)}; "
            f"unsharded bytes at the backward peak plain {plain['peaks']}, scoped {scoped['peaks']}"
        )
    for s in (False, True):
        assert _gathers(ranks[0]["fsdp"][name][s]["events"]) == _gathers(ranks[1]["fsdp"][name][s]["events"])


@pytest.mark.parametrize("name", ["raf_true", "bf16", "around", "passes"])
def test_fsdp2_layer_outputs_replayed_without_extra_memory(ranks, name):
    """The gate after layer k reads layer k's output before layer k's pre-backward hook;
    its replay finds layer k being prefetched by FSDP2 and waits for that gather: the
    same groups are unsharded at the backward peak as in the plain run."""
    for r in range(WORLD):
        plain, scoped = (ranks[r]["fsdp"][name][s] for s in (False, True))
        assert scoped["peaks"] == plain["peaks"], (plain["peaks"], scoped["peaks"])


def test_fsdp2_early_replay_gathers_earlier_at_one_layers_cost(ranks):
    """Layer 0's output saved at the end of forward is replayed at the start of backward:
    layer 0 is gathered then (right after the root's pre-backward) instead of when layer
    1's pre-backward prefetches it, and stays unsharded until its post-backward. The
    backward peak holds exactly one layer's unsharded parameters more than plain FSDP2."""
    for r in range(WORLD):
        plain, scoped = (ranks[r]["fsdp"]["skip"][s] for s in (False, True))
        for step in range(STEPS):
            assert scoped["peaks"][step] == plain["peaks"][step] + scoped["layer_bytes"]
        for res, hooks_before in ((plain, ["", "layers.2", "layers.1"]), (scoped, [""])):
            last = _backward_passes(res["events"])[-1]
            i = [e[:2] for e in last].index(("gather", "layers.0"))
            assert [e[1] for e in last[:i] if e[0] == "pre_backward"] == hooks_before, last
        assert ("gather", "layers.0", True, True) in scoped["events"]  # gathered by the replay
    print(
        f"skip: layer 0 ({ranks[0]['fsdp']['skip'][True]['layer_bytes']} B unsharded) gathered "
        f"2 pre-backward hooks earlier; peaks plain {ranks[0]['fsdp']['skip'][False]['peaks']}, "
        f"scoped {ranks[0]['fsdp']['skip'][True]['peaks']}"
    )


def test_fsdp2_freed_storage_of_no_group_and_outside_backward_raise(ranks):
    for r in range(WORLD):
        res = _ok(ranks[r]["fsdp_errors"], f"rank {r}")
        assert "belongs to no FSDP2 parameter group" in res["not_fsdp"], res["not_fsdp"]
        assert "storage freed" in res["not_fsdp"] and "[8, 8]" in res["not_fsdp"]
        assert "outside a backward pass" in res["outside_backward"], res["outside_backward"]
        assert "FSDP2 has freed" in res["outside_backward"]
        # after forward only the root stays unsharded (reshard_after_forward is False for
        # the root), as in plain FSDP2: the failed replay gathered nothing
        assert res["left_after_error"] == [""], res["left_after_error"]
        assert res["left_after_backward"] == []


def test_freed_storage_without_fsdp_raises():
    """In a process without FSDP2 groups, a freed storage a replay would read raises."""
    x = torch.randn(4, 8)
    w = torch.randn(8, 8, requires_grad=True)
    with recompute_scope():
        h = (x @ w).sin()
    y = (h * h).sum()
    del h
    w.detach().untyped_storage().resize_(0)
    with pytest.raises(RecomputeError, match=r"storage freed since forward.*no FSDP2 parameter group"):
        y.backward()
    del y


@pytest.mark.parametrize("variant", TP_SCENARIOS)
def test_tensor_parallel_scoped_training_equals_plain(ranks, variant):
    for r in range(WORLD):
        plain, scoped = (_ok(ranks[r]["tp"][variant][s], f"tp {variant} rank {r} scoped={s}") for s in (False, True))
        assert scoped["dtensor_params"] == plain["dtensor_params"] >= 12
        _assert_same_training(scoped, plain, f"tp {variant} rank {r}")


def test_tensor_parallel_freed_or_modified_dtensor_raises(ranks):
    for r in range(WORLD):
        res = _ok(ranks[r]["tp_errors"], f"rank {r}")
        assert "storage freed" in res["freed"], res["freed"]
        assert "modified in place" in res["modified"], res["modified"]


@pytest.mark.skipif(not FOUR_RANKS, reason="4 ranks take about a minute: set GS_TEST_FOUR_RANKS=1")
def test_fsdp2_four_ranks_int_reshard_and_tensor_parallel(tmp_path):
    """reshard_after_forward=2 on 4 ranks, and FSDP2 over TP on a 2x2 mesh (DTensor
    parameters): scoped training equals plain, with as many all-gathers, the early replay
    of layer 0 costing one layer's unsharded bytes at the peak, nothing left unsharded."""
    four = _spawn(4, tmp_path)
    for name, cfg in FOUR_RANK_LAYOUTS.items():
        for r in range(4):
            plain, scoped = (_ok(four[r][name][s], f"{name} rank {r} scoped={s}") for s in (False, True))
            _assert_same_training(scoped, plain, f"{name} rank {r}")
            assert plain["collectives"] == scoped["collectives"], name
            assert all(left == [] for left in plain["left"] + scoped["left"]), name
            regathers = [e for e in scoped["events"] if e[0] == "regather"]
            assert all(ok for _, _, ok in regathers), regathers
            if cfg["layout"] != "tp_plan":  # TP modules' outputs are not recomputed from parameters
                assert regathers
                for step in range(STEPS):
                    assert scoped["peaks"][step] == plain["peaks"][step] + scoped["layer_bytes"]
        print(
            f"{name}: all-gathers plain {four[0][name][False]['collectives']}, scoped "
            f"{four[0][name][True]['collectives']}; backward peak unsharded bytes plain "
            f"{four[0][name][False]['peaks']}, scoped {four[0][name][True]['peaks']}"
        )


if __name__ == "__main__":
    _main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
