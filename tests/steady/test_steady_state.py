"""The steady state of function-form scopes (docs/internals.md, ``_adapters/steady``):
dynamo captures the function, its first run is recorded, and later runs are bound from
that record without the recorder. Every run must give the plain program's gradients
bitwise, keep what the recorded scope keeps, and fall back to recording wherever the
template cannot be trusted. ``GRADIENT_SCOPE_FAST=1`` turns it on for CPU tensors."""

from __future__ import annotations

import gc
import threading
import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import gradient_scope
from gradient_scope import Budget, RecomputeError, apply_recompute, checkpoint, recompute, recompute_scope
from gradient_scope._adapters.steady import run as steady

from support import assert_stacks_clean, dead, pinned_cpu_rates, steady_graphs


class Block(nn.Module):
    def __init__(self, d=16, p=0.1):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)
        self.drop = nn.Dropout(p)

    def forward(self, x):
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln(x)))))


def _model(layers=3, p=0.1):
    torch.manual_seed(0)
    return nn.Sequential(*(Block(p=p) for _ in range(layers)))


def _step(model, x, seed):
    torch.manual_seed(seed)
    loss = model(x).square().mean()
    loss.backward()
    out = (loss.detach(), [p.grad.clone() for p in model.parameters()])
    model.zero_grad(set_to_none=True)
    return out


def _counts(stats):
    """A model's counters but how its calls ran (steady or recorded), per module too."""
    keep = ("ops_recorded", "ops_saved", "tensors_packed", "bytes_packed", "replays", "ops_replayed")

    def of(s):
        return (*(getattr(s, k) for k in keep), s.calls_steady + s.calls_recorded)

    return of(stats), {k: of(v) for k, v in stats.modules.items()}


def _same(a, b):
    (la, ga), (lb, gb) = a, b
    return torch.equal(la, lb) and all(torch.equal(x, y) for x, y in zip(ga, gb))


def test_apply_recompute_runs_bound_from_the_template_bitwise(fast):
    plain, scoped = _model(), _model()
    apply_recompute(scoped, check_fn=Block)
    x = torch.randn(4, 8, 16, requires_grad=True)
    for seed in range(4):  # dropout: each step draws new masks, replayed in backward
        assert _same(_step(plain, x, seed), _step(scoped, x, seed)), f"step {seed}"
    # D6: layer 0 of step 0 runs eagerly, layer 1's run of the graph is recorded (its
    # structure is the eager run's): its template serves every other run
    assert len(fast) == 10
    stats = gradient_scope.model_stats(scoped)
    assert stats.ops_recorded == 4 * 3 * (stats.ops_recorded // 12)
    assert stats.tensors_packed > 0 and stats.replays > 0


def test_steady_runs_count_as_recorded_ones(fast, monkeypatch):
    """The same stats, whichever path ran the block."""
    x = torch.randn(4, 8, 16, requires_grad=True)
    seen = {}
    for setting in ("0", "1"):
        monkeypatch.setenv("GRADIENT_SCOPE_FAST", setting)
        model = _model()
        apply_recompute(model, check_fn=Block)
        for seed in range(3):
            _step(model, x, seed)
        seen[setting] = _counts(gradient_scope.model_stats(model))
    assert seen["0"] == seen["1"]  # the same counts but how the calls ran
    assert len(fast) == 7


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_hugging_face_layers_bitwise(fast, kind):
    from transformers.modeling_layers import GradientCheckpointingLayer

    from support.hf_models import SEQ, VOCAB, make_model

    plain = make_model(kind, 3, seed=0)
    scoped = make_model(kind, 3, seed=0)
    plain.train()
    scoped.train()
    apply_recompute(scoped, check_fn=GradientCheckpointingLayer)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    for seed in range(3):
        outs = []
        for m in (plain, scoped):
            torch.manual_seed(seed)
            loss = m(ids, labels=ids, use_cache=False).loss
            loss.backward()
            outs.append((loss.detach(), [p.grad.clone() for p in m.parameters()]))
            m.zero_grad(set_to_none=True)
        assert _same(*outs), f"{kind} step {seed}"
    assert len(fast) == 7


def test_decorator_and_checkpoint_forms(fast):
    w = torch.randn(8, 8, requires_grad=True)

    @recompute
    def mlp(h):
        return torch.tanh(h @ w).sigmoid() * 2

    def body(h):
        return F.gelu(h @ w.t()).exp()

    x = torch.randn(5, 8, requires_grad=True)
    for _ in range(3):
        (mlp(x) * checkpoint(body, x)).sum().backward()
    expected_w, expected_x = w.grad.clone(), x.grad.clone()
    w.grad = x.grad = None
    for _ in range(3):
        ((torch.tanh(x @ w).sigmoid() * 2) * F.gelu(x @ w.t()).exp()).sum().backward()
    assert torch.equal(w.grad, expected_w) and torch.equal(x.grad, expected_x)
    assert len(fast) == 2  # each function: run 1 eager, run 2 the graph recorded (D6), run 3 steady


def test_an_output_saved_inside_the_block_is_a_handle_and_dies_with_its_user(fast):
    w = torch.randn(6, 6, requires_grad=True)

    @recompute
    def block(h):
        y = (h @ w).exp()  # exp saves its output y: a block tensor that is also returned
        return y, y * 3

    x = torch.randn(4, 6, requires_grad=True)
    for _ in range(3):
        y, z = block(x)
        ref = weakref.ref(y)
        loss = (z * 2).sum()
        del y, z
        assert dead(ref), "the saved output was kept by autograd"
        loss.backward()
    assert len(fast) == 1
    del loss
    assert_stacks_clean()


def test_a_live_output_is_used_as_it_is(fast):
    w = torch.randn(6, 6, requires_grad=True)
    scope_stats = []

    def run():
        scope = recompute_scope()
        scope_stats.append(scope.stats)
        return gradient_scope._api.scope.run_in_scope(scope, lambda h: (h @ w).exp(), (x,), {})

    x = torch.randn(4, 6, requires_grad=True)
    for _ in range(3):
        y = run()
        (y * 2).sum().backward()
        del y
    assert len(fast) == 1
    assert all(s.replays == 0 for s in scope_stats), "y was alive: no replay needed"


def test_budget_applies_to_steady_runs(fast):
    plain, scoped = _model(4), _model(4)
    budget = Budget("64KiB")
    apply_recompute(scoped, check_fn=Block, budget=budget)
    x = torch.randn(4, 8, 16, requires_grad=True)
    for seed in range(4):
        assert _same(_step(plain, x, seed), _step(scoped, x, seed)), f"step {seed}"
    assert budget.planned_bytes is not None and budget.planned_bytes <= budget.bytes
    assert any(op.nbytes > 0 for op in budget.stored_ops())
    assert len(fast) == 14


def test_a_run_that_saves_otherwise_raises_and_retires_the_template(fast):
    model = _model(1)
    apply_recompute(model, check_fn=Block)
    x = torch.randn(4, 8, 16, requires_grad=True)
    _step(model, x, 0)  # eager (D6)
    _step(model, x, 0)  # the graph's run, recorded: its template
    graphs = [g for g in gc.get_objects() if type(g) is steady._Graph and g.templates]
    tpl = next(t for g in graphs for _, t in g.templates.values() if isinstance(t, steady.Template))
    first = tpl.saves[0]
    tpl.saves[0] = first._replace(shape=torch.Size([3, 3]))  # as if the run saved something else
    with pytest.raises(RecomputeError, match="did not save what that run saved"):
        _step(model, x, 1)
    plain = _model(1)
    assert _same(_step(plain, x, 2), _step(model, x, 2))  # recorded again, correct
    assert len(fast) == 1


def test_functions_dynamo_cannot_capture_are_recorded(fast, capsys):
    w = torch.randn(6, 6, requires_grad=True)

    @recompute
    def noisy(h):
        print("side effect")  # a graph break: fullgraph capture fails
        return (h @ w).tanh()

    x = torch.randn(4, 6, requires_grad=True)
    for _ in range(3):
        noisy(x).sum().backward()
    assert capsys.readouterr().out.count("side effect") == 3  # once per call, never replayed
    expected = w.grad.clone()
    w.grad = None
    for _ in range(3):
        (x @ w).tanh().sum().backward()
    assert torch.equal(w.grad, expected)
    assert not fast
    assert noisy.__wrapped__.__code__ in steady._failed  # tried twice, then recorded without a capture


def test_giving_up_holds_for_the_code_a_new_model_shares(fast, monkeypatch):
    """A layer class made anew per model (a class defined in a function, as ``fully_shard``
    makes one per module): what gave up on the first model's layer (a higher-order op in its
    graph, or two failed captures) holds for the second's, whose forward is another function of
    the same code: it is
    recorded without a capture (dynamo's failed recaptures kept block tensors alive)."""
    made = steady_graphs(monkeypatch)

    def model():
        class Layer(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = torch.nn.Linear(6, 6)

            def forward(self, h):
                return torch.utils.checkpoint.checkpoint(self.lin, h, use_reentrant=False).tanh()

        torch.manual_seed(0)
        layers = [Layer() for _ in range(3)]
        return gradient_scope.apply_recompute(torch.nn.Sequential(*layers), check_fn=Layer)

    x = torch.randn(4, 6, requires_grad=True)
    first, second = model(), model()
    assert type(first[0]).forward is not type(second[0]).forward
    first(x).sum().backward()
    assert type(first[0]).forward.__code__ in steady._failed, gradient_scope.model_stats(first).recorded_why
    graphs = len(made)
    second(x).sum().backward()
    assert len(made) == graphs and not fast
    assert gradient_scope.model_stats(second).recorded_why["given up"] == 3


class PassThrough(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("why", ["debug", "env_off", "function_mode", "nested", "no_grad"])
def test_where_the_steady_state_does_not_apply(fast, monkeypatch, why):
    w = torch.randn(6, 6, requires_grad=True)
    options = {"debug": True} if why == "debug" else {}

    @recompute(**options)
    def block(h):
        return (h @ w).sigmoid()

    if why == "env_off":
        monkeypatch.setenv("GRADIENT_SCOPE_FAST", "0")
    x = torch.randn(4, 6, requires_grad=True)
    for _ in range(3):
        if why == "function_mode":
            with PassThrough():
                block(x).sum().backward()
        elif why == "nested":
            with recompute_scope():
                y = block(x)
            y.sum().backward()
        elif why == "no_grad":
            with torch.no_grad():
                block(x)
        else:
            block(x).sum().backward()
    assert not fast


def test_two_random_draws_between_saves_keep_the_block_recorded(fast):
    """T3: the state of the second draw cannot be observed in a run: no template."""
    w = torch.randn(6, 6, requires_grad=True)

    @recompute
    def block(h):
        noise = torch.rand_like(h) * torch.rand_like(h)  # two draws, then the saves of mul
        return F.dropout(h @ w + noise, 0.5)

    x = torch.randn(4, 6, requires_grad=True)
    grads = []
    for seed in range(3):
        torch.manual_seed(seed)
        block(x).sum().backward()
        grads.append(w.grad.clone())
        w.grad = None
    for seed in range(3):
        torch.manual_seed(seed)
        noise = torch.rand_like(x) * torch.rand_like(x)
        F.dropout(x @ w + noise, 0.5).sum().backward()
        assert torch.equal(w.grad, grads[seed])
        w.grad = None
    assert not fast


def test_outputs_a_save_policy_keeps_are_taken_from_the_graph(fast, monkeypatch):
    """T6: matmul outputs save= keeps are no graph arguments; later runs take them from
    the graph's values (F.linear on 3-D input returns a view of the kept addmm/mm)."""
    x = torch.randn(4, 8, 16, requires_grad=True)
    seen = {}
    for setting in ("0", "1"):
        monkeypatch.setenv("GRADIENT_SCOPE_FAST", setting)
        plain, scoped = _model(3), _model(3)
        apply_recompute(scoped, check_fn=Block, save=gradient_scope.save_matmuls)
        for seed in range(4):
            assert _same(_step(plain, x, seed), _step(scoped, x, seed)), (setting, seed)
        seen[setting] = _counts(gradient_scope.model_stats(scoped))
    assert seen["0"] == seen["1"] and seen["1"][0][1] > 0
    assert len(fast) == 9  # run 1 eager (D6), run 2 records the template, run 3 finds the kept values' nodes


def test_a_kept_output_no_node_holds_keeps_the_block_recorded(fast):
    """T6: SDPA's math path (CPU, dropout) keeps its inner bmm out of every node's value."""
    w = torch.randn(8, 8, requires_grad=True)

    @recompute(save=gradient_scope.save_matmuls)
    def attention(h):
        q = (h @ w).view(2, 2, 4, 8)
        return F.scaled_dot_product_attention(q, q, q, dropout_p=0.5)

    x = torch.randn(4, 4, 8, requires_grad=True)
    for seed in range(3):
        torch.manual_seed(seed)
        attention(x).sum().backward()
        got = w.grad.clone()
        w.grad = None
        torch.manual_seed(seed)
        q = (x @ w).view(2, 2, 4, 8)
        F.scaled_dot_product_attention(q, q, q, dropout_p=0.5).sum().backward()
        assert torch.equal(w.grad, got)
        w.grad = None
    assert not fast


def test_a_save_policy_keeping_a_random_op_is_checked(fast):
    """An op a save= policy keeps is not recorded; its draw shifts the generator state
    between observations (T3): the template is refused and the block stays correct."""
    model_plain, model = _model(2, p=0.5), _model(2, p=0.5)
    apply_recompute(model, check_fn=Block, save=[torch.ops.aten.native_dropout])
    x = torch.randn(4, 8, 16, requires_grad=True)
    for seed in range(3):
        assert _same(_step(model_plain, x, seed), _step(model, x, seed))


def test_exceptions_leave_nothing_behind(fast):
    w = torch.randn(6, 6, requires_grad=True)

    @recompute
    def block(h, fail):
        y = (h @ w).tanh()
        return y[fail]  # an index error at run time, after saves

    x = torch.randn(4, 6, requires_grad=True)
    for _ in range(2):
        block(x, 1).sum().backward()
    with pytest.raises(IndexError):
        block(x, torch.tensor(99))
    block(x, 2).sum().backward()
    gc.collect()
    assert_stacks_clean()


def test_backward_in_another_thread(fast):
    plain, scoped = _model(), _model()
    apply_recompute(scoped, check_fn=Block)
    x = torch.randn(4, 8, 16, requires_grad=True)
    for seed in range(3):
        torch.manual_seed(seed)
        loss = scoped(x).square().mean()
        t = threading.Thread(target=loss.backward)
        t.start()
        t.join()
        got = [p.grad.clone() for p in scoped.parameters()]
        scoped.zero_grad(set_to_none=True)
        _, want = _step(plain, x, seed)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert len(fast) == 7


def test_a_weight_written_before_backward_raises_as_when_recorded(fast):
    model = _model(1, p=0.0)
    apply_recompute(model, check_fn=Block)
    x = torch.randn(4, 8, 16, requires_grad=True)
    _step(model, x, 0)  # eager (D6)
    _step(model, x, 0)  # the graph's run, recorded: its template
    loss = model(x).square().mean()
    with torch.no_grad():
        model[0].fc2.weight.add_(1)  # an optimizer step between forward and backward
    with pytest.raises(RecomputeError, match="modified in place"):
        loss.backward()
    assert len(fast) == 1


def test_a_template_belongs_to_its_save_option_not_to_its_id(fast, monkeypatch):
    """Options made and dropped in turn may reuse one address: each still gets its own
    template (the save= option is held by its template's entry)."""
    x = torch.randn(4, 8, 16, requires_grad=True)
    for i in range(4):
        policy = [torch.ops.aten.addmm, torch.ops.aten.mm] if i % 2 == 0 else []
        counted = {}
        for setting in ("0", "1"):
            monkeypatch.setenv("GRADIENT_SCOPE_FAST", setting)
            model = _model(2)
            apply_recompute(model, check_fn=Block, save=policy)
            for seed in range(3):
                _step(model, x, seed)
            counted[setting] = _counts(gradient_scope.model_stats(model))
        assert counted["0"] == counted["1"], (i, policy)
        del policy, model


class _ViewBlock(nn.Module):
    """Saves a view of its input (``mul`` saves ``x[..., :8]``): autograd keeps that
    input too, which a budget counts (N2)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        return self.fc(x) + (x[..., :8] * 2.0).repeat(1, 1, 2) * x[..., 8:].sigmoid().repeat(1, 1, 2)


def test_a_budget_measured_in_steady_runs_plans_what_a_recorded_run_plans(fast, monkeypatch):
    x = torch.randn(4, 8, 16, requires_grad=True)

    def planned(budget_bytes):
        torch.manual_seed(0)
        model = nn.Sequential(*(_ViewBlock() for _ in range(3)))
        budget = Budget(budget_bytes)
        apply_recompute(model, check_fn=_ViewBlock, budget=budget)
        for seed in range(3):
            _step(model, x, seed)
        return budget.floor_bytes, budget.planned_bytes

    planned("1GiB")  # the layer's template is made here: the next model runs bound from it
    steady_runs = len(fast)
    in_steady = planned("1GiB"), planned(6000)
    assert len(fast) > steady_runs
    monkeypatch.setenv("GRADIENT_SCOPE_FAST", "0")
    assert in_steady == (planned("1GiB"), planned(6000))


def test_a_context_policy_keeps_the_block_recorded(fast):
    """A context policy reads the running module of each op call, which a captured
    graph does not have (D1): its blocks are recorded, and it sees the model's paths."""
    from gradient_scope.policies import context_policy

    seen = set()

    @context_policy
    def look(ctx):
        seen.add(ctx.module_path)
        return False

    plain, scoped = _model(2), _model(2)
    apply_recompute(scoped, check_fn=Block, save=look)
    x = torch.randn(4, 8, 16, requires_grad=True)
    for seed in range(3):
        assert _same(_step(plain, x, seed), _step(scoped, x, seed)), f"step {seed}"
    assert len(fast) == 0
    assert {"0.fc1", "1.fc2"} <= seen and not any("GraphModule" in p for p in seen)


def test_a_budget_that_offloads_applies_to_steady_runs(fast):
    """The CUDA default path: steady runs whose budget offloads (the host-copy stand-in
    plays the device on CPU) give plain's gradients and offload what the plan says."""
    from gradient_scope._budget.streams import host_copy_stand_in

    plain, scoped = _model(4), _model(4)
    x = torch.randn(4, 8, 16, requires_grad=True)
    with pinned_cpu_rates(), host_copy_stand_in() as backend:
        budget = Budget("32KiB", offload=True)  # above the floor (about 20 KB): keeps, offloads, recomputes
        apply_recompute(scoped, check_fn=Block, budget=budget)
        for seed in range(4):
            assert _same(_step(plain, x, seed), _step(scoped, x, seed)), f"step {seed}"
        assert budget.offloaded_bytes and budget.planned_bytes <= budget.bytes
        assert {op.how for op in budget.stored_ops()} == {"kept", "offloaded", "recomputed"}
        assert backend.copies > 0 and backend.pending() == 0
    assert len(fast) > 0


def test_a_budget_decides_on_a_saved_view_of_an_output_in_steady_runs(fast):
    """A view made in a steady run names the template's Var of its base as its root, while
    the run's own Var of that base (an output) replaced it in its op (D4): the budget still
    finds the view's storage group."""

    def f(x, w):
        a = x + x  # an output
        b = a.reshape(-1).reshape(a.shape)  # a view of it, made in the run
        m = w @ a  # saves a: the run's own Var of it replaces the template's in its op
        n = F.layer_norm(b, (b.shape[-1],))  # then saves b, whose root is the template's Var
        return a, n + m.sum()

    for nbytes in (0, 600, 2000, 10**9):
        torch._dynamo.reset()
        scoped = recompute_scope(budget=Budget(nbytes))(f)
        for seed in range(3):
            torch.manual_seed(seed)
            x, w = torch.randn(6, 6, requires_grad=True), torch.randn(6, 6, requires_grad=True)
            outs = [f(x, w), scoped(x, w)]
            grads = [torch.autograd.grad(sum(o.sum() for o in out), (x, w)) for out in outs]
            assert all(torch.equal(p, s) for p, s in zip(*grads)), (nbytes, seed)
    assert len(fast) > 0


def test_a_function_dynamo_traces_down_another_branch_is_recorded_eagerly(fast):
    """D6: a graph stands for a function only where it runs the ops the function runs
    eagerly. Here dynamo takes the ``is_compiling()`` branch: the graph's first run (call 2)
    computes that branch, as ``torch.compile`` would; the next call that reaches the graph
    runs eagerly instead, its structure differs, and from then on the function is recorded
    eagerly, with one warning."""
    w = torch.randn(6, 6, requires_grad=True)
    x = torch.randn(4, 6, requires_grad=True)

    def body(h):
        y = h @ w
        if torch.compiler.is_compiling():
            return torch.sin(y)
        return torch.cos(y)

    def grads(f):
        w.grad = x.grad = None
        f(x).sum().backward()
        return w.grad.clone(), x.grad.clone()

    same = []
    with pytest.warns(UserWarning, match="runs other ops when dynamo traces it") as caught:
        for _ in range(5):
            got = grads(lambda h: checkpoint(body, h))
            want = grads(lambda h: torch.cos(h @ w))
            same.append(all(torch.equal(a, b) for a, b in zip(got, want)))
    assert same == [True, False, True, True, True]  # call 2: the graph's first run
    assert len([c for c in caught if "dynamo traces it" in str(c.message)]) == 1
    assert len(fast) == 0


class _Branching(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        y = self.fc(h)
        return torch.sin(y) if torch.compiler.is_compiling() else torch.cos(y)


def test_a_call_that_runs_eagerly_instead_of_its_graph_leaves_nothing_behind(fast):
    """D6 with layers that take each other's outputs: the call that runs eagerly instead of
    the graph (its frame saw the exception that said so) keeps no block tensor alive, so
    the hook pair leaves with the step's last tensor (checked without gc)."""
    model = nn.Sequential(*[_Branching() for _ in range(3)])
    apply_recompute(model, check_fn=_Branching)
    x = torch.randn(4, 8, requires_grad=True)
    with pytest.warns(UserWarning, match="runs other ops when dynamo traces it"):
        for _ in range(3):
            model(x).sum().backward()
            assert_stacks_clean()
    assert len(fast) == 0
