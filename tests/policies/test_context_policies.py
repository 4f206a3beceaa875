"""Context policies (``gradient_scope.policies.context_policy``): a save= policy that sees
where and what the op is -- the module path, shapes, a region name -- in eager code and
under torch.compile; gradients equal to the plain program; what is kept."""

import copy
import pickle
import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import gradient_scope
from gradient_scope import apply_recompute, model_stats, recompute_scope, remove_recompute
from gradient_scope.policies import (
    ContextPolicy,
    OpContext,
    context_policy,
    name_region,
    save_any,
    save_attention,
    save_matmuls,
)

aten = torch.ops.aten
D, HEADS = 16, 2


class Layer(nn.Module):
    """SDPA attention and a 4x MLP, with the attention output in a named region."""

    def __init__(self):
        super().__init__()
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.fc1, self.fc2 = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = (t.view(B, T, HEADS, D // HEADS).transpose(1, 2) for t in self.qkv(x).split(D, dim=2))
        with name_region("attn_out"):
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(B, T, D))
        return x + self.drop(self.fc2(F.gelu(self.fc1(x))))


class Model(nn.Module):
    def __init__(self, n=4):
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(n))
        self.head = nn.Linear(D, 5)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


@context_policy
def attention_of_layers_0_1(ctx: OpContext) -> bool:
    """The recipe: save the attention output of the first two layers."""
    return save_attention(ctx.op) and ctx.layer is not None and ctx.layer < 2


@context_policy
def big_matmuls(ctx: OpContext) -> bool:
    """The recipe: save matmul outputs over 8 KiB."""
    return save_matmuls(ctx.op) and ctx.out_bytes > 8 * 1024


@context_policy
def named_attention(ctx: OpContext) -> bool:
    return ctx.name == "attn_out"


def _train(policy, steps=2):
    """Losses and gradients of `steps` steps; scoped per layer with `policy` unless None."""
    torch.manual_seed(0)
    model = Model()
    if policy is not None:
        apply_recompute(model, check_fn=Layer, save=policy)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for step in range(steps):
        torch.manual_seed(100 + step)
        x = torch.randn(2, 8, D, requires_grad=True)
        loss = model(x).square().mean()
        loss.backward()
        out.append((loss.detach(), [p.grad.clone() for p in model.parameters()], x.grad.clone()))
        opt.step()
        opt.zero_grad()
    return model, out


def _assert_same(a, b):
    for (la, ga, xa), (lb, gb, xb) in zip(a, b):
        assert torch.equal(la, lb) and torch.equal(xa, xb)
        assert all(torch.equal(p, q) for p, q in zip(ga, gb))


@pytest.mark.parametrize("policy", [attention_of_layers_0_1, big_matmuls, named_attention])
def test_gradients_equal_plain(policy):
    _, plain = _train(None)
    _, scoped = _train(policy)
    _assert_same(plain, scoped)


def test_save_the_attention_output_of_layers_0_1():
    model, _ = _train(attention_of_layers_0_1, steps=1)
    saved = {path: stats.ops_saved for path, stats in model_stats(model).modules.items()}
    assert saved == {"layers.0": 1, "layers.1": 1, "layers.2": 0, "layers.3": 0}


def test_save_matmuls_over_a_size():
    seen = []

    @context_policy
    def log(ctx):
        seen.append((ctx.op, ctx.module_path, ctx.out_shapes, ctx.out_bytes))
        return big_matmuls(ctx)

    torch.manual_seed(0)
    m = Model(n=1)
    apply_recompute(m, check_fn=Layer, save=log)
    m(torch.randn(8, 8, D)).sum().backward()
    mm = [(path, bytes_) for op, path, _, bytes_ in seen if save_matmuls(op)]
    # qkv, proj, fc1, fc2 (+ SDPA): only fc1 (8 x 8 x 64 floats = 16 KiB) is over 8 KiB.
    assert ("layers.0.fc1", 8 * 8 * 4 * D * 4) in mm
    assert model_stats(m).modules["layers.0"].ops_saved == sum(b > 8 * 1024 for _, b in mm)


def test_what_the_policy_sees():
    seen = []

    @context_policy
    def log(ctx):
        where = (ctx.op, ctx.module_path, ctx.layer, ctx.name)
        seen.append((*where, ctx.arg_shapes, ctx.arg_dtypes, ctx.out_shapes, ctx.out_dtypes))
        return False

    torch.manual_seed(0)
    model = Model(n=2).eval()  # no dropout: no op of the blocks writes to an argument
    apply_recompute(model, check_fn=Layer, save=log)
    model(torch.randn(2, 8, D)).sum().backward()
    addmm = [s for s in seen if s[0] is aten.addmm.default]
    assert [s[1] for s in addmm] == [f"layers.{i}.{m}" for i in (0, 1) for m in ("qkv", "proj", "fc1", "fc2")]
    assert [s[2] for s in addmm] == [0] * 4 + [1] * 4
    fc1 = addmm[2]
    assert fc1[4] == (torch.Size([4 * D]), torch.Size([16, D]), torch.Size([D, 4 * D]))
    assert fc1[5] == (torch.float32,) * 3
    assert fc1[6] == (torch.Size([16, 4 * D]),) and fc1[7] == (torch.float32,)
    sdpa = [s for s in seen if save_attention(s[0])]
    assert [s[3] for s in sdpa] == ["attn_out", "attn_out"] and {s[3] for s in addmm} == {None}
    # Asked at every op call (none writes here): no op of the blocks is missing.
    assert len(seen) == sum(stats.ops_recorded + stats.ops_saved for stats in model_stats(model).modules.values())


def test_kept_outputs_stay_the_rest_dies():
    probes = {}

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

        def forward(self, x):
            with name_region("keep"):
                h = self.fc1(x)
            g = F.gelu(h)
            probes["h"], probes["g"] = weakref.ref(h), weakref.ref(g)
            return self.fc2(g)

    @context_policy
    def keep(ctx):
        return ctx.name == "keep" and ctx.op is aten.addmm.default

    block = Block()
    apply_recompute(block, check_fn=Block, save=keep)
    y = block(torch.randn(4, D, requires_grad=True))
    assert probes["h"]() is not None  # stored (gelu saves it)
    assert probes["g"]() is None  # recomputed (fc2 saves it: a handle)
    y.sum().backward()


def test_regions_nest_and_need_a_str():
    names = []

    @context_policy
    def log(ctx):
        names.append(ctx.name)
        return False

    x = torch.randn(3, requires_grad=True)
    with recompute_scope(save=log):
        a = x.sin()
        with name_region("outer"):
            b = a.cos()
            with name_region("inner"):
                c = b.exp()
            d = c.tanh()
        e = d.sigmoid()
    e.sum().backward()
    assert names == [None, "outer", "inner", "outer", None]
    with pytest.raises(TypeError, match="name_region: name must be a str"), name_region(3):
        pass


def test_ctx_is_released_after_the_call():
    kept = []

    @context_policy
    def hold(ctx):
        kept.append(ctx)
        return False

    x = torch.randn(64, requires_grad=True)
    with recompute_scope(save=hold):
        y = x.sin()
    ref = weakref.ref(y)
    del y
    assert ref() is None  # the stored context does not keep the op's output alive
    assert kept[0].out_shapes == () and kept[0].arg_shapes == ()


def test_context_policies_combine_pickle_and_copy():
    policy = save_any(big_matmuls, aten.gelu)
    assert isinstance(policy, ContextPolicy)
    _, plain = _train(None, steps=1)
    _, scoped = _train(policy, steps=1)
    _assert_same(plain, scoped)
    again = pickle.loads(pickle.dumps(attention_of_layers_0_1))
    assert again == attention_of_layers_0_1 and context_policy(again) is again
    model = Model(n=1)
    apply_recompute(model, check_fn=Layer, save=named_attention)
    twin = copy.deepcopy(model)
    twin(torch.randn(1, 4, D)).sum().backward()
    assert model_stats(twin).ops_saved == 1
    remove_recompute(model)


def test_one_argument_policies_are_asked_once_per_op():
    asked = []

    def policy(op):
        asked.append(op)
        return False

    x = torch.randn(3, requires_grad=True)
    with recompute_scope(save=policy):
        y = x.sin().sin().sin()
    y.sum().backward()
    assert asked == [aten.sin.default]


@pytest.mark.parametrize("dynamic", [False, True])
def test_under_compile_the_policy_sees_what_eager_sees(dynamic):
    def log_into(seen):
        @context_policy
        def log(ctx):
            if ctx.op in (aten.addmm.default, aten.mm.default) or save_attention(ctx.op):
                seen.append((ctx.module_path, ctx.name, ctx.out_bytes))
            return ctx.name == "attn_out"

        return log

    eager, compiled = [], []
    torch.manual_seed(0)
    model = Model(n=2).eval()  # no dropout: compiled and eager draw random numbers differently
    x = torch.randn(2, 8, D, requires_grad=True)
    apply_recompute(model, check_fn=Layer, save=log_into(eager))
    model(x).sum().backward()
    g_eager = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    apply_recompute(model, check_fn=Layer, save=log_into(compiled))
    torch._dynamo.reset()
    try:
        cm = torch.compile(model, backend="aot_eager", dynamic=dynamic)
        cm(x).sum().backward()
    finally:
        torch._dynamo.reset()
    # The compiled graph may order and decompose differently: compare what was seen.
    assert {(p, n) for p, n, _ in compiled} >= {(p, n) for p, n, _ in eager if n is None}
    assert ("layers.1.fc1", None, 2 * 8 * 4 * D * 4) in compiled
    assert any(n == "attn_out" and p == "layers.0" for p, n, _ in compiled)
    for g, p in zip(g_eager, model.parameters()):
        torch.testing.assert_close(p.grad, g)


def test_public_names():
    for name in ("context_policy", "OpContext", "name_region"):
        assert getattr(gradient_scope, name) is getattr(gradient_scope.policies, name)
        assert name in gradient_scope.__all__
