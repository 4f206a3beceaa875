"""Ready-made save= policies (gradient_scope.policies): what they match, gradients equal to
the plain program, what they keep and what they free, and saved ops never replayed."""

import math
import pickle
import warnings
import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import gradient_scope
from gradient_scope import recompute_scope
from gradient_scope.policies import save_any, save_attention, save_matmuls, save_nothing

from support import grads, run_both, stat

aten = torch.ops.aten


# --------------------------------------------------------------------------------------
# a counted custom op


COUNT = {"calls": 0}


@torch.library.custom_op("gs_test::counted_mm", mutates_args=())
def counted_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    COUNT["calls"] += 1
    return a @ b


@counted_mm.register_fake
def _(a, b):
    return a.new_empty(a.shape[0], b.shape[1])


# The same op made differentiable: torch runs it through an autograd.Function.
@torch.library.custom_op("gs_test::counted_mm_ad", mutates_args=())
def counted_mm_ad(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    COUNT["calls"] += 1
    return a @ b


@counted_mm_ad.register_fake
def _(a, b):
    return a.new_empty(a.shape[0], b.shape[1])


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, g):
    a, b = ctx.saved_tensors
    return g @ b.t(), a.t() @ g


counted_mm_ad.register_autograd(_backward, setup_context=_setup)


class OpLog(TorchDispatchMode):
    """Logs (op, input shapes) of every op run while it is active."""

    def __init__(self):
        super().__init__()
        self.log = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        shapes = tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor))
        self.log.append((func, shapes))
        return func(*args, **(kwargs or {}))

    def count(self, func, shapes=None):
        return sum(1 for f, s in self.log if f == func and (shapes is None or s == shapes))


# --------------------------------------------------------------------------------------
# what the policies match


MATMULS = [
    aten.mm.default,
    aten.bmm.default,
    aten.addmm.default,
    aten.baddbmm.default,
    aten.addbmm.default,
    aten.addmv.default,
    aten.mv.default,
    aten.dot.default,
    aten.matmul.default,
    aten.linear.default,
    aten._addmm_activation.default,
    aten._int_mm.default,
    aten._scaled_mm.default,
    aten._weight_int8pack_mm.default,
]
ATTENTION = [
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
    aten._scaled_dot_product_fused_attention_overrideable.default,
    aten._flash_attention_forward.default,
    aten._efficient_attention_forward.default,
]
CONVOLUTIONS = [
    aten.convolution.default,
    aten._convolution.default,
    aten.conv2d.default,
    aten.conv1d.default,
    aten.conv_transpose2d.input,
]
CHEAP = [
    aten.gelu.default,
    aten.native_layer_norm.default,
    aten._softmax.default,
    aten.native_dropout.default,
    aten.add.Tensor,
    aten.mul.Tensor,
    aten.view.default,
    aten._unsafe_view.default,
    aten.t.default,
    aten.embedding.default,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
    aten.mm.out,  # out= / in-place overloads never match: their writes must be recorded
    aten.addmm_.default,
    aten.baddbmm_.default,
    aten.bmm.out,
]


@pytest.mark.parametrize("op", MATMULS + ATTENTION + CONVOLUTIONS, ids=str)
def test_save_matmuls_matches(op):
    assert save_matmuls(op) is True


@pytest.mark.parametrize("op", CHEAP, ids=str)
def test_save_matmuls_does_not_match(op):
    assert save_matmuls(op) is False
    assert save_attention(op) is False


@pytest.mark.parametrize("op", ATTENTION, ids=str)
def test_save_attention_matches(op):
    assert save_attention(op) is True


@pytest.mark.parametrize("op", MATMULS + CONVOLUTIONS, ids=str)
def test_save_attention_ignores_matmuls(op):
    assert save_attention(op) is False


def test_policies_ignore_other_namespaces_and_accept_packets():
    assert save_matmuls(torch.ops.gs_test.counted_mm.default) is False
    assert save_matmuls(aten.mm) is True  # a packet, if someone asks about one
    assert save_matmuls(aten.gelu) is False
    assert save_attention(aten._scaled_dot_product_efficient_attention) is True
    for op in MATMULS + ATTENTION + CHEAP:
        assert save_nothing(op) is False


def test_public_names():
    for name in ("save_nothing", "save_matmuls", "save_attention", "save_any"):
        assert name in gradient_scope.__all__
        assert name in gradient_scope.policies.__all__
        assert getattr(gradient_scope, name) is getattr(gradient_scope.policies, name)
        assert ">>>" in getattr(gradient_scope, name).__doc__


def test_save_any():
    policy = save_any(save_attention, aten.gelu, aten.mm.default)
    assert policy(aten.gelu.default) and policy(aten.gelu.out)  # the packet: every overload
    assert policy(aten.mm.default)
    assert not policy(aten.mm.out)  # the overload was named, not the packet
    assert policy(aten._scaled_dot_product_flash_attention_for_cpu.default)
    assert not policy(aten.addmm.default)
    assert not policy(aten.tanh.default)
    # nesting flattens; equality and hashing by content
    assert save_any(save_any(save_attention, aten.gelu), aten.mm.default) == policy
    assert hash(save_any(aten.mm.default, save_attention, aten.gelu)) == hash(policy)
    assert "torch.ops.aten.gelu" in repr(policy) and "save_attention" in repr(policy)
    # pickles (ops by name), including a custom op
    p2 = save_any(save_matmuls, torch.ops.gs_test.counted_mm, aten.gelu.default)
    q = pickle.loads(pickle.dumps(p2))
    assert q == p2
    assert q(torch.ops.gs_test.counted_mm.default) and q(aten.gelu.default) and q(aten.bmm.default)
    assert not q(aten.gelu.out)  # only the overload was named
    with pytest.raises(TypeError, match="save_any"):
        save_any(save_matmuls, "aten::mm")
    with pytest.raises(TypeError, match="save_any"):
        save_any(3)


def test_named_policies_pickle():
    for p in (save_nothing, save_matmuls, save_attention):
        assert pickle.loads(pickle.dumps(p)) is p


# --------------------------------------------------------------------------------------
# a small transformer-ish model; one region per block


class Block(nn.Module):
    """Pre-LN block: attention written out (scores, mask, softmax, dropout) or SDPA, and
    a GELU MLP with dropout. Keeps storage weakrefs of some activations in ``probes``."""

    def __init__(self, d=16, heads=2, sdpa=False, p=0.1):
        super().__init__()
        self.heads, self.sdpa = heads, sdpa
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.drop = nn.Dropout(p)
        self.probes = {}

    def forward(self, x):
        B, T, D = x.shape
        H = self.heads
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        q, k, v = (t.view(B, T, H, D // H).transpose(1, 2) for t in (q, k, v))
        if self.sdpa:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            self.probes["attn"] = weakref.ref(o.untyped_storage())
        else:
            qk = q @ k.transpose(-2, -1)  # a bmm's output
            scores = qk / math.sqrt(D // H)
            mask = torch.ones(T, T, dtype=torch.bool).triu(1)
            probs = self.drop(scores.masked_fill(mask, float("-inf")).softmax(dim=-1))
            o = probs @ v
            self.probes["qk"] = weakref.ref(qk.untyped_storage())
            self.probes["probs"] = weakref.ref(probs.untyped_storage())
        x = x + self.proj(o.transpose(1, 2).reshape(B, T, D))
        h = self.fc1(self.ln2(x).view(B * T, D))  # 2-D: fc1's output is addmm's output
        a = F.gelu(h)
        self.probes["fc1"] = weakref.ref(h.untyped_storage())
        self.probes["gelu"] = weakref.ref(a.untyped_storage())
        return x + self.drop(self.fc2(a)).view(B, T, D)


class Net(nn.Module):
    def __init__(self, n=2, sdpa=False):
        super().__init__()
        self.blocks = nn.ModuleList(Block(sdpa=sdpa) for _ in range(n))
        self.head = nn.Linear(16, 7)

    def forward(self, x, scope):
        for block in self.blocks:
            with scope():
                x = block(x)
        return self.head(x)

    def alive(self):
        return [{k: r() is not None for k, r in b.probes.items()} for b in self.blocks]


def train_program(sdpa=False, steps=2, check=None):
    def program(scope):
        model = Net(sdpa=sdpa)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        out = {}
        for step in range(steps):
            x = torch.randn(2, 6, 16)
            opt.zero_grad()
            loss = model(x, scope).pow(2).mean()
            if check is not None and step == 0:
                check(scope, model)
            loss.backward()
            out[f"loss{step}"] = loss.detach()
        out.update(grads(dict(model=model)))
        out["params"] = [p.detach().clone() for p in model.parameters()]
        return out

    return program


POLICIES = {
    "none": None,
    "save_nothing": save_nothing,
    "save_matmuls": save_matmuls,
    "save_attention": save_attention,
    "save_any": save_any(save_matmuls, aten.gelu),
    "list_addmm": [aten.addmm],
    "list_overloads": [aten.addmm.default, aten.bmm.default],
}


@pytest.mark.filterwarnings("ignore:gradient_scope. save=save_attention matched no op")  # manual attention
@pytest.mark.parametrize("sdpa", [False, True], ids=["manual_attn", "sdpa"])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_gradients_equal_plain(policy, sdpa):
    run_both(train_program(sdpa=sdpa), save=POLICIES[policy])


def _check_memory(expect_alive):
    """After forward (before backward): which probed activations are alive."""

    def check(scope, model):
        alive = model.alive()
        if not scope.real:
            for block in alive:
                kept = {name for name, is_alive in block.items() if is_alive}
                assert kept >= {"probs", "attn", "fc1", "gelu"} & set(block), block
            return
        for block in alive:
            for name, is_alive in block.items():
                assert is_alive == (name in expect_alive), f"{name}: alive={is_alive}, {alive}"
        for s in scope.created:
            assert stat(s, "bytes_packed") > 0

    return check


@pytest.mark.parametrize(
    "policy,sdpa,expect_alive",
    [
        (None, False, set()),
        (save_nothing, False, set()),
        (save_matmuls, False, {"qk", "fc1"}),  # bmm and addmm outputs stored
        (save_matmuls, True, {"attn", "fc1"}),
        (save_attention, True, {"attn"}),
        (save_attention, False, set()),
        (save_any(aten.gelu), False, {"gelu"}),
    ],
    ids=[
        "none",
        "save_nothing",
        "save_matmuls",
        "save_matmuls_sdpa",
        "save_attention_sdpa",
        "save_attention_manual",
        "save_any_gelu",
    ],
)
@pytest.mark.filterwarnings("ignore:gradient_scope. save=save_attention matched no op")  # manual attention
def test_what_is_kept(policy, sdpa, expect_alive):
    run_both(train_program(sdpa=sdpa, steps=1, check=_check_memory(expect_alive)), save=policy)


def test_save_matmuls_packs_fewer_bytes():
    packed = {}
    for name, policy in (("all", None), ("matmuls", save_matmuls)):
        torch.manual_seed(0)
        model = Net()
        scopes = []

        def scope(policy=policy):
            s = recompute_scope(save=policy)
            scopes.append(s)
            return s

        loss = model(torch.randn(2, 6, 16), scope).sum()
        packed[name] = sum(s.stats.bytes_packed for s in scopes)
        loss.backward()
    assert 0 < packed["matmuls"] < packed["all"]


# --------------------------------------------------------------------------------------
# a saved op is never replayed


def _counted_program(save):
    a = torch.randn(4, 8)
    b = torch.randn(8, 16)
    x = torch.randn(4, 16, requires_grad=True)
    with recompute_scope(save=save) as s:
        m = counted_mm(a.sin(), b)  # block-created, saved by the mul below for dL/dx
        h = (x * m).tanh()
    y = (h * h).sum()
    del m, h
    before = COUNT["calls"]
    y.backward()
    return COUNT["calls"] - before, s, x.grad


@pytest.mark.parametrize(
    "save",
    [
        [torch.ops.gs_test.counted_mm],
        [torch.ops.gs_test.counted_mm.default],
        save_any(torch.ops.gs_test.counted_mm),
        lambda op: op == torch.ops.gs_test.counted_mm.default,
    ],
    ids=["packet", "overload", "save_any", "callable"],
)
def test_saved_custom_op_is_never_replayed(save):
    torch.manual_seed(0)
    replayed, s, grad_plain_policy = _counted_program(None)
    assert replayed == 1, "control: without save= the op is replayed in backward"
    assert stat(s, "replays") >= 1
    torch.manual_seed(0)
    replayed, s, grad = _counted_program(save)
    assert replayed == 0
    assert stat(s, "bytes_packed") > 0  # the rest (sin, mul) is still recomputed
    assert torch.equal(grad, grad_plain_policy)


def test_saved_differentiable_custom_op_is_never_replayed():
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(8, 16, requires_grad=True)
    with recompute_scope(save=[torch.ops.gs_test.counted_mm_ad]):
        h = counted_mm_ad(x.sin(), w).tanh()
    y = (h * h).sum()
    del h
    before = COUNT["calls"]
    y.backward()
    assert COUNT["calls"] == before


def test_differentiable_custom_op_is_replayed_without_save():
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(8, 16, requires_grad=True)
    with recompute_scope():
        h = counted_mm_ad(x.sin(), w)
    ref = weakref.ref(h.untyped_storage())
    c = torch.randn(4, 16, requires_grad=True)
    y = (h * c).sum()  # mul saves h for dL/dc
    del h
    assert ref() is None


@pytest.mark.parametrize("policy", [save_matmuls, [aten.mm]], ids=["save_matmuls", "list"])
def test_saved_matmul_is_never_replayed(policy):
    def run(save):
        torch.manual_seed(0)
        x = torch.randn(4, 8, requires_grad=True)
        w = torch.randn(8, 16, requires_grad=True)
        with recompute_scope(save=save):
            h = F.gelu(x @ w)
        y = (h * h).sum()
        del h
        with OpLog() as log:
            y.backward()
        return log.count(aten.mm.default, ((4, 8), (8, 16))), x.grad, w.grad

    n_plain, *g_plain = run(None)
    assert n_plain == 1, "control: without save= the forward mm is replayed (and seen by OpLog)"
    n, *g = run(policy)
    assert n == 0
    assert all(torch.equal(a, b) for a, b in zip(g, g_plain))


def test_saved_attention_kernel_is_never_replayed():
    op = aten._scaled_dot_product_flash_attention_for_cpu.default

    def run(save):
        torch.manual_seed(0)
        q = torch.randn(1, 2, 8, 4, requires_grad=True)
        w = torch.randn(4, 4, requires_grad=True)
        with recompute_scope(save=save):
            o = F.scaled_dot_product_attention(q.sin(), q.cos(), q, is_causal=True)
        y = (o @ w).sum()
        del o
        with OpLog() as log:
            y.backward()
        return log.count(op), q.grad, w.grad

    n_plain, *g_plain = run(None)
    if n_plain == 0:
        pytest.skip("this build does not use the CPU flash kernel for SDPA")
    for policy in (save_attention, save_matmuls):
        n, *g = run(policy)
        assert n == 0
        assert all(torch.equal(a, b) for a, b in zip(g, g_plain))


def test_save_matmuls_convolutions():
    def program(scope):
        conv1, conv2 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 4, 3)
        x = torch.randn(2, 3, 8, 8, requires_grad=True)
        with scope():
            c = conv1(x)
            a = F.gelu(c)
            y = conv2(a).tanh()
        probes = [weakref.ref(t.untyped_storage()) for t in (c, a)]
        loss = y.pow(2).sum()
        del c, a, y
        if scope.real:  # the convolution's output is stored, the GELU's is not
            assert [r() is not None for r in probes] == [True, False]
            assert stat(scope.created[0], "bytes_packed") > 0
        loss.backward()
        return dict(loss=loss.detach(), **grads(dict(conv1=conv1, conv2=conv2, x=x)))

    run_both(program, save=save_matmuls)


@pytest.mark.parametrize("policy", [save_matmuls, [aten.addmm]], ids=["save_matmuls", "list"])
def test_inplace_op_on_a_saved_output(policy):
    """nn.ReLU(inplace=True) writes to the stored output of a saved addmm."""

    def program(scope):
        m = nn.Sequential(
            nn.Linear(8, 32), nn.ReLU(inplace=True), nn.Linear(32, 32), nn.GELU(), nn.Dropout(0.2), nn.Linear(32, 8)
        )
        x = torch.randn(4, 8, requires_grad=True)
        with scope():
            y = m(x)
        loss = (y * y).sum()
        del y
        loss.backward()
        return dict(loss=loss.detach(), **grads(dict(m=m, x=x)))

    run_both(program, save=policy)


# --------------------------------------------------------------------------------------
# stats.ops_saved: what a policy matched


def test_ops_saved_counts_the_op_calls_a_policy_kept():
    def program(scope, **options):
        torch.manual_seed(0)
        mlp = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8), nn.Tanh())
        x = torch.randn(4, 8, requires_grad=True)
        with scope(**options):
            y = mlp(x)
            with scope(save=None):  # a nested scope counts its own
                z = mlp(y)
        (y * z).sum().backward()
        return grads({"x": x, "mlp": mlp})

    scopes, _ = run_both(lambda scope: program(scope, save=save_matmuls))
    outer, inner = scopes.created
    assert stat(outer, "ops_saved") == 2  # the two addmm of the first call
    assert stat(inner, "ops_saved") == 0
    scopes, _ = run_both(lambda scope: program(scope))
    assert all(stat(s, "ops_saved") == 0 for s in scopes.created)


@pytest.mark.parametrize(
    "dropout,attention_saved,matmuls_saved",
    [(0.0, 1, 1), (0.1, 0, 2)],
    ids=["fused_kernel", "math_path"],
)
def test_sdpa_on_cpu_fused_kernel_or_math_path(dropout, attention_saved, matmuls_saved):
    """On CPU, SDPA with dropout takes the math path: the scope sees bmm/softmax/dropout
    ops, no attention kernel, and save_attention matches nothing (ops_saved says so)."""

    def program(scope, policy):
        torch.manual_seed(0)
        q = torch.randn(2, 4, 16, 8, requires_grad=True)
        with scope(save=policy):
            y = F.scaled_dot_product_attention(q.sin(), q.cos(), q, dropout_p=dropout, is_causal=True)
        y.pow(2).sum().backward()
        return {"q.grad": q.grad}

    for policy, saved in ((save_attention, attention_saved), (save_matmuls, matmuls_saved)):
        scopes, _ = run_both(lambda scope: program(scope, policy))
        assert stat(scopes.created[0], "ops_saved") == saved


def test_a_built_in_policy_that_matches_nothing_warns_once(monkeypatch):
    import gradient_scope._base.feedback as feedback

    monkeypatch.setattr(feedback, "_warned", set())
    model = Net(sdpa=False)  # attention written out: no SDPA kernel for save_attention

    def run():
        x = torch.randn(2, 5, 16)
        model(x, lambda: recompute_scope(save=save_attention)).sum().backward()

    with pytest.warns(UserWarning, match=r"save=save_attention matched no op of a block of \d+ recorded ops") as w:
        run()
    assert len(w) == 1 and w[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run()  # once per policy per process
        model_sdpa = Net(sdpa=True)
        model_sdpa(torch.randn(2, 5, 16), lambda: recompute_scope(save=save_matmuls)).sum().backward()


def test_an_unhashable_policy_object_works():
    class Policy:  # __eq__ without __hash__: instances do not hash
        def __eq__(self, other):
            return isinstance(other, Policy)

        def __call__(self, op):
            return op is aten.mm.default

    w = torch.randn(4, 4, requires_grad=True)
    with recompute_scope(save=Policy()) as scope:
        h = (w @ w).relu()
    h.sum().backward()
    assert scope.stats.ops_saved == 1
