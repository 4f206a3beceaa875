"""Routing is never replayed differently (issue 37, item 6): the outputs of ops that decide
shapes or routing (top-k and sort indices, nonzero, bincount, unique, values read to the
host) are stored, never recomputed, so a MoE's dispatch and combine replay the forward's
routing, whatever happened to the router's input since."""

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import gradient_scope
from gradient_scope import Budget, RecomputeError, apply_recompute, saved_tensors_report

from support import assert_all_same, grads

aten = torch.ops.aten
D, E, K, H, T = 8, 4, 2, 16, 10


class DispatchMoE(nn.Module):
    """A router (linear, top-k on its logits, softmax of the chosen ones) and experts fed
    by a dispatch layout: tokens sorted by expert (argsort), counted per expert (bincount,
    read to the host), gathered (index_select), and combined back (index_add)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.router = nn.Linear(D, E, bias=False)
        self.w1 = nn.Parameter(torch.randn(E, H, D) / D**0.5)
        self.w2 = nn.Parameter(torch.randn(E, D, H) / H**0.5)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        top, idx = self.router(h).topk(K, dim=-1)
        weights = top.softmax(dim=-1).reshape(-1)
        flat = idx.reshape(-1)
        token = torch.arange(h.shape[0], device=h.device).repeat_interleave(K)
        order = flat.argsort(stable=True)
        counts = flat.bincount(minlength=E).tolist()
        out = torch.zeros_like(h)
        for e, chunk in enumerate(order.split(counts)):
            xs = h.index_select(0, token[chunk])
            y = F.linear(F.gelu(F.linear(xs, self.w1[e])), self.w2[e]) * weights[chunk, None]
            out = out.index_add(0, token[chunk], y)
        return h + out


class DenseMoE(nn.Module):
    """A router whose top-k picks are scattered into per-expert gates; every expert runs on
    every token and the gates combine them (no data-dependent shape: dynamo captures it
    whole, so the steady state runs it)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.router = nn.Linear(D, E, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(D, H), nn.GELU(), nn.Linear(H, D)) for _ in range(E))

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        top, idx = self.router(h).topk(K, dim=-1)
        gates = torch.zeros(h.shape[0], E, device=h.device, dtype=h.dtype).scatter(1, idx, top.softmax(dim=-1))
        return h + sum(gates[:, e, None] * expert(h) for e, expert in enumerate(self.experts))


class NormalisedMoE(DenseMoE):
    """Mixtral's router: top-k of the softmax, whose kept weights it normalises in place
    (the block writes to a tensor it did not record, then reads it again)."""

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        top, idx = self.router(h).softmax(dim=-1).topk(K, dim=-1)
        top /= top.sum(dim=-1, keepdim=True)
        gates = torch.zeros(h.shape[0], E, device=h.device, dtype=h.dtype).scatter(1, idx, top)
        return h + sum(gates[:, e, None] * expert(h) for e, expert in enumerate(self.experts))


class Net(nn.Module):
    def __init__(self, moe):
        super().__init__()
        self.layers = nn.ModuleList(moe() for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _net(moe, seed=0):
    torch.manual_seed(seed)
    return Net(moe)


def _step(model, x, between=None):
    """One forward and backward; ``between(model)`` runs between them."""
    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    loss = model(x).square().sum()
    if between is not None:
        between(model)
    loss.backward()
    return {"x.grad": x.grad, **grads({"model": model})}


def _routing_rows(report, op="topk"):
    rows = [r for r in report.rows if r.op == op]
    assert rows, f"no saves by {op}: {[r.op for r in report.rows]}"
    return rows


def test_routing_ops_are_kept_always_and_dispatch_ops_are_not():
    from gradient_scope._base.ops import facts, kept_always

    x = torch.randn(T, E)
    for op, args in [
        (aten.topk.default, (x, 2)),
        (aten.sort.stable, (x,)),
        (aten.argsort.stable, (x,)),
        (aten.max.dim, (x, 1)),
        (aten.argmax.default, (x,)),
        (aten.kthvalue.default, (x, 1)),
        (aten.nonzero.default, (x,)),
        (aten.bincount.default, (x.long().abs().flatten(),)),
        (aten._unique2.default, (x,)),
        (aten.searchsorted.Tensor, (x.sort().values, x)),
        (aten._local_scalar_dense.default, (x[0, 0],)),
    ]:
        assert kept_always(facts(op), args, {}), op
    for op, args in [
        (aten.max.default, (x,)),  # a reduction: no indices
        (aten.index_select.default, (x, 0, torch.tensor([0]))),
        (aten.gather.default, (x, 1, torch.zeros(T, 1, dtype=torch.long))),
        (aten._to_copy.default, (x,)),  # host to host
    ]:
        assert not kept_always(facts(op), args, {}), op
    # A copy from a device to the host is a value read to the host; the other way is not.
    # (Fake tensors: a "cuda" tensor without a GPU.)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        dev, host = torch.empty(3, device="cuda"), torch.empty(3)
    cpu = torch.device("cpu")
    assert kept_always(facts(aten._to_copy.default), (dev,), {"device": cpu})
    assert kept_always(facts(aten.copy_.default), (host, dev), {})
    assert not kept_always(facts(aten.copy_.default), (dev, host), {})
    assert not kept_always(facts(aten._to_copy.default), (host,), {"device": "cuda"})


@pytest.mark.parametrize("moe", [DispatchMoE, DenseMoE])
def test_moe_gradients_equal_plain_and_the_routing_is_stored(moe):
    x = torch.randn(T, D)
    plain = _step(_net(moe), x)
    model = _net(moe)
    apply_recompute(model, check_fn=moe)
    with saved_tensors_report() as report:
        scoped = _step(model, x)
    assert_all_same(scoped, plain)
    # The indices top-k saved are stored by autograd; nothing of the router is replayed for them.
    for row in _routing_rows(report):
        assert row.activation_bytes > 0 and row.recomputable_bytes == 0, row
    stats = gradient_scope.model_stats(model)
    assert stats.replays > 0  # the experts are recomputed


def _perturb_router(model):
    """A write the version counters do not see: through ``.data``."""
    for layer in model.layers:
        with torch.no_grad():
            layer.router.weight.data.mul_(-1.0)


@pytest.mark.parametrize("debug", [True, False])
@pytest.mark.parametrize("moe", [DispatchMoE, DenseMoE])
def test_a_router_written_unseen_before_backward_keeps_the_forwards_routing(moe, debug):
    # The plain program stores top-k's indices: its backward routes by the forward's
    # choice. A replay of top-k would choose from the written router: other experts per
    # token, their gradients added where the forward sent nothing.
    x = torch.randn(T, D)
    plain = _step(_net(moe), x, between=_perturb_router)
    model = _net(moe)
    apply_recompute(model, check_fn=moe, debug=debug)
    try:
        scoped = _step(model, x, between=_perturb_router)
    except RecomputeError as e:  # the alternative the contract allows: it names the op
        assert "topk" in str(e), e
        return
    assert_all_same(scoped, plain)


@pytest.mark.parametrize("moe", [DispatchMoE, DenseMoE])
def test_steady_state_stores_the_routing_too(moe, fast):
    x = torch.randn(T, D)
    plain = _net(moe)
    model = _net(moe)
    apply_recompute(model, check_fn=moe)
    for step in range(4):
        xs = x + step
        expected = _step(plain, xs, between=_perturb_router)
        actual = _step(model, xs, between=_perturb_router)  # (a report would keep it recorded)
        assert_all_same(actual, expected)
    if moe is DenseMoE:
        assert fast, "the steady state never ran"


def test_steady_state_runs_a_router_that_normalises_its_kept_weights_in_place(fast):
    """The kept top-k values are written by the block (R1 copies them before the write, and
    copies the written tensor where it is read again): a steady run copies both in its graph
    (T6), so the layers run steady, with plain's gradients."""
    x = torch.randn(T, D)
    plain = _net(NormalisedMoE)
    model = _net(NormalisedMoE)
    apply_recompute(model, check_fn=NormalisedMoE)
    for step in range(4):
        before = gradient_scope.model_stats(model)
        assert_all_same(_step(model, x + step), _step(plain, x + step))
    last = gradient_scope.model_stats(model) - before
    assert (last.calls_steady, last.calls_recorded) == (2, 0), last.recorded_why
    assert gradient_scope.model_stats(model).calls_steady == len(fast)


def _mixtral(seed=0):
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.MixtralConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=12,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
    )
    return transformers.MixtralForCausalLM(cfg)


def _mixtral_step(model, ids, between=None):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    if between is not None:
        between(model)
    loss.backward()
    return {"loss": loss.detach(), **grads({"model": model})}


def _perturb_gates(model):
    for layer in model.model.layers:
        layer.mlp.gate.weight.data.mul_(-1.0)


def test_mixtral_gradients_equal_plain_with_its_routing_stored():
    from gradient_scope.integrations.transformers import enable

    ids = torch.randint(3, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    plain = _mixtral_step(_mixtral(), ids)
    model = _mixtral()
    enable(model)
    with saved_tensors_report(model) as report:
        scoped = _mixtral_step(model, ids)
    assert_all_same(scoped, plain)
    rows = _routing_rows(report)
    assert {r.module for r in rows} == {"model.layers.0.mlp.gate", "model.layers.1.mlp.gate"}
    for row in rows:  # the router's top-k indices: stored, not replayed
        assert row.activation_bytes > 0 and row.recomputable_bytes == 0, row
    assert gradient_scope.model_stats(model).replays > 0
    # A router written unseen between forward and backward: Mixtral's experts read the
    # router's probabilities through softmax, whose saved output is replayed from the
    # written router, so with debug=True the replay of the router is refused; the
    # routing itself (which experts, which tokens) never changes.
    model = _mixtral()
    enable(model, debug=True)
    with pytest.raises(RecomputeError, match=r"replaying aten\.\w+\.\w+ gave different values"):
        _mixtral_step(model, ids, between=_perturb_gates)


def test_mixtral_runs_steady_with_plains_gradients(fast):
    """In bfloat16 (in float32 its experts branch on ``is_compiling()``: recorded, warned)."""
    from gradient_scope.integrations.transformers import enable

    ids = torch.randint(3, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    plain, model = _mixtral().to(torch.bfloat16), _mixtral().to(torch.bfloat16)
    enable(model)
    for _ in range(4):
        before = gradient_scope.model_stats(model)
        assert_all_same(_mixtral_step(model, ids), _mixtral_step(plain, ids))
    last = gradient_scope.model_stats(model) - before
    assert (last.calls_steady, last.calls_recorded) == (2, 0), last.recorded_why


@pytest.mark.parametrize("moe", [DispatchMoE, DenseMoE])
def test_a_budget_counts_the_kept_routing_as_bytes_it_cannot_recompute(moe):
    from benchmarks._harness.memory import measure

    from support import pinned_cpu_rates

    x = torch.randn(T, D, requires_grad=True)
    # What top-k returns in the two blocks (values and indices), kept whatever the plan.
    routing = 2 * T * K * (4 + 8)
    with pinned_cpu_rates():
        for budget in (0, 10**9):
            model = _net(moe)
            b = Budget(budget)
            apply_recompute(model, check_fn=moe, budget=b)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # (below the floor, on purpose)
                for _ in range(3):
                    _, held, _ = measure(lambda: model(x).square().sum(), lambda loss: loss.backward())
                floor = b.floor_bytes
            assert floor >= routing, (floor, routing)
            # What forward leaves is the plan and the loss (a float32 scalar outside the scopes).
            assert held - 4 == b.planned_bytes >= floor, (budget, held, b.planned_bytes, floor)


def test_compiled_scopes_store_the_routing_too():
    x = torch.randn(T, D)
    plain = _step(torch.compile(_net(DenseMoE), backend="aot_eager", fullgraph=True), x, between=_perturb_router)
    torch._dynamo.reset()
    model = _net(DenseMoE)
    apply_recompute(model, check_fn=DenseMoE)
    try:
        scoped = _step(torch.compile(model, backend="aot_eager", fullgraph=True), x, between=_perturb_router)
    finally:
        torch._dynamo.reset()
    assert_all_same(scoped, plain)


def test_a_compiled_budget_counts_the_stored_routing_in_its_floor():
    from support import pinned_cpu_rates

    x = torch.randn(T, D, requires_grad=True)
    routing = 2 * T * K * (4 + 8)  # top-k's values and indices in the two blocks
    model = _net(DenseMoE)
    b = Budget(0)
    apply_recompute(model, check_fn=DenseMoE, budget=b)
    try:
        with pinned_cpu_rates(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (below the floor, on purpose)
            torch.compile(model, backend="aot_eager", fullgraph=True)(x).sum().backward()
            floor = b.floor_bytes
    finally:
        torch._dynamo.reset()
    assert floor >= routing, (floor, routing)
