"""Model helpers: apply_recompute / remove_recompute / recompute_sequential."""

import copy
import dataclasses
import functools
import gc
import inspect
import logging
import math
import pickle
import warnings
import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import gradient_scope
import gradient_scope._api.helpers as helpers_module
from gradient_scope import (
    apply_recompute,
    recompute_scope,
    recompute_sequential,
    remove_recompute,
    save_matmuls,
)

from support import assert_interception_gone, global_state

# The tests that compute run on both devices (the ``device`` fixture); those that check
# only how modules are wrapped, selected or validated compute nothing device-specific.

aten = torch.ops.aten
D = 16


# --------------------------------------------------------------------------------------
# a small transformer-ish model


class Attention(nn.Module):
    def __init__(self, d=D, heads=2, p=0.1):
        super().__init__()
        self.heads = heads
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.drop = nn.Dropout(p)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(C // self.heads)
        att = att.masked_fill(torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
        probs = self.drop(att.softmax(dim=-1))
        self.probe = weakref.ref(probs.untyped_storage())
        return self.proj((probs @ v).transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, d=D, p=0.1):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(d), Attention(d, p=p)
        self.ln2 = nn.LayerNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.drop = nn.Dropout(p)
        self.probes = {}

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        B, T, C = x.shape
        h = self.fc1(self.ln2(x).view(B * T, C))  # addmm's output
        a = F.gelu(h)
        self.probes = {
            "probs": self.attn.probe,
            "fc1": weakref.ref(h.untyped_storage()),
            "gelu": weakref.ref(a.untyped_storage()),
        }
        return x + self.drop(self.fc2(a)).view(B, T, C)


class GPT(nn.Module):
    def __init__(self, n_layer=2, vocab=11):
        super().__init__()
        self.emb = nn.Embedding(vocab, D)
        self.blocks = nn.ModuleList(Block() for _ in range(n_layer))
        self.ln_f, self.head = nn.LayerNorm(D), nn.Linear(D, vocab)

    def forward(self, idx):
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def alive(self):
        return [{k: r() is not None for k, r in b.probes.items()} for b in self.blocks]


def is_block(m):
    return isinstance(m, Block)


def tokens(seed=1, shape=(2, 6), device="cpu"):
    g = torch.Generator().manual_seed(seed)  # (drawn on the CPU: the same tokens on every device)
    return torch.randint(11, shape, generator=g).to(device)


def train(setup=None, steps=2, seed=0, after_forward=None, device="cpu"):
    """Train a fresh GPT a few steps; return losses, grads of the last step, params."""
    torch.manual_seed(seed)
    model = GPT().to(device)
    if setup is not None:
        setup(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        idx = tokens(step, device=device)
        opt.zero_grad()
        logits = model(idx)
        loss = F.cross_entropy(logits.view(-1, 11), idx.view(-1))
        del logits
        if after_forward is not None:
            after_forward(model, step)
        loss.backward()
        losses.append(loss.detach())
        grads = [p.grad.clone() for p in model.parameters()]
        opt.step()
    return dict(losses=losses, grads=grads, params=[p.detach().clone() for p in model.parameters()])


def assert_same_run(a, b):
    for key in ("losses", "grads", "params"):
        assert len(a[key]) == len(b[key])
        for i, (x, y) in enumerate(zip(a[key], b[key])):
            assert torch.equal(x, y), f"{key}[{i}] differs: max |diff| {(x - y).abs().max().item()}"


@pytest.fixture
def entered_scopes(monkeypatch):
    """Every recompute_scope that the helpers enter, in order."""
    entered = []

    class Recording(recompute_scope):
        def __enter__(self):
            entered.append(self)
            return super().__enter__()

    monkeypatch.setattr(helpers_module, "recompute_scope", Recording)
    return entered


# --------------------------------------------------------------------------------------
# apply_recompute: gradients and memory


def test_public_names():
    for name in ("apply_recompute", "remove_recompute", "recompute_sequential"):
        assert name in gradient_scope.__all__
        assert ">>>" in getattr(gradient_scope, name).__doc__


@pytest.mark.parametrize(
    "options",
    [{}, {"save": save_matmuls}, {"save": [aten.addmm, aten.bmm]}, {"preserve_rng_state": True}],
    ids=["all", "save_matmuls", "save_list", "rng"],
)
def test_apply_recompute_gradients_equal_plain(options, device):
    plain = train(device=device)
    scoped = train(lambda m: apply_recompute(m, check_fn=is_block, **options), device=device)
    assert_same_run(scoped, plain)


def _no_dropout(model):
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0


def test_apply_recompute_debug_option(device):
    # Without dropout: debug=True flags CPU dropout's empty_like as a mismatch (core issue).
    plain = train(_no_dropout, device=device)
    scoped = train(lambda m: (_no_dropout(m), apply_recompute(m, check_fn=is_block, debug=True)), device=device)
    assert_same_run(scoped, plain)


@pytest.mark.parametrize(
    "options,expect_alive",
    [({}, set()), ({"save": save_matmuls}, {"fc1"}), ({"enabled": False}, {"probs", "fc1", "gelu"})],
    ids=["all", "save_matmuls", "disabled"],
)
def test_apply_recompute_memory(entered_scopes, options, expect_alive, device):
    """Held after forward: block activations die (storage weakrefs, no gc.collect()),
    autograd keeps handles instead (bytes_packed > 0); matmul outputs stay with
    save_matmuls."""
    seen = {}

    def after_forward(model, step):
        if step == 0:
            seen["alive"] = model.alive()
            seen["scopes"] = list(entered_scopes)

    train(steps=1, after_forward=after_forward, device=device)  # control: plain keeps all of them
    assert all(all(b.values()) for b in seen["alive"]), seen["alive"]
    entered_scopes.clear()
    train(
        lambda m: apply_recompute(m, check_fn=is_block, **options), steps=1, after_forward=after_forward, device=device
    )
    for block in seen["alive"]:
        assert {k for k, alive in block.items() if alive} == expect_alive, seen["alive"]
    assert len(seen["scopes"]) == 2  # one per block call
    if options.get("enabled", True):
        assert all(s.stats.bytes_packed > 0 for s in seen["scopes"])


def test_apply_recompute_each_call_its_own_scope(entered_scopes, device):
    torch.manual_seed(0)
    block = Block().to(device)
    apply_recompute(block, check_fn=lambda m: m is block, save=save_matmuls)  # the root
    x = torch.randn(2, 4, D, device=device)
    y = block(block(x))  # twice: two independent scopes
    assert len(entered_scopes) == 2 and entered_scopes[0] is not entered_scopes[1]
    assert all("save_matmuls" in repr(s) for s in entered_scopes)
    y.sum().backward()


# --------------------------------------------------------------------------------------
# apply / remove round trip


def _snapshot(model):
    return {name: (dict(vars(m)), type(m), type(m).__dict__.get("forward")) for name, m in model.named_modules()}


def test_remove_recompute_round_trip(device):
    torch.manual_seed(0)
    model = GPT().to(device)
    # one module with a forward instance attribute of its own
    own = functools.partial(Block.forward, model.blocks[1])
    model.blocks[1].forward = own
    before = _snapshot(model)
    class_forward = Block.forward
    sd_keys = list(model.state_dict())
    names = [n for n, _ in model.named_modules()]
    params = list(model.parameters())

    apply_recompute(model, check_fn=is_block)
    for name, m in model.named_modules():
        assert ("forward" in vars(m)) == (isinstance(m, Block)), name
        assert type(m) is before[name][1]
    assert Block.forward is class_forward
    assert list(model.state_dict()) == sd_keys
    assert [n for n, _ in model.named_modules()] == names
    assert all(a is b for a, b in zip(model.parameters(), params))
    assert model.blocks[0].forward is not own

    assert remove_recompute(model) is model
    after = _snapshot(model)
    assert after.keys() == before.keys()
    for name in before:
        d_before, cls, fwd = before[name]
        d_after, cls_after, fwd_after = after[name]
        assert d_after.keys() == d_before.keys(), f"{name}: attributes changed"
        assert all(d_after[k] is d_before[k] for k in d_before), name
        assert cls_after is cls and fwd_after is fwd
    assert "forward" not in vars(model.blocks[0])
    assert model.blocks[1].forward is own  # the module's own instance attribute, as it was
    assert Block.forward is class_forward
    # behaviour: still the same computation
    idx = tokens(device=device)
    torch.manual_seed(3)
    out = model(idx)
    torch.manual_seed(3)
    apply_recompute(model, check_fn=is_block)
    torch.manual_seed(3)
    out2 = model(idx)
    assert torch.equal(out, out2)
    remove_recompute(model)
    assert remove_recompute(model) is model  # idempotent


def test_remove_then_plain_forward_stores_activations(device):
    torch.manual_seed(0)
    model = GPT().to(device)
    apply_recompute(model, check_fn=is_block)
    remove_recompute(model)
    loss = model(tokens(device=device)).sum()
    assert all(all(b.values()) for b in model.alive())
    loss.backward()


def test_apply_twice_does_not_double_wrap(entered_scopes, device):
    torch.manual_seed(0)
    model = GPT().to(device)
    apply_recompute(model, check_fn=is_block)
    wrappers = [vars(b)["forward"] for b in model.blocks]
    apply_recompute(model, check_fn=is_block, save=save_matmuls)
    assert [vars(b)["forward"] for b in model.blocks] == wrappers  # same objects
    assert all(w.original is None for w in wrappers)
    loss = model(tokens(device=device)).sum()
    assert len(entered_scopes) == 2  # one scope per block call, not two
    assert all("save_matmuls" in repr(s) for s in entered_scopes)  # latest options
    loss.backward()
    remove_recompute(model)
    assert all("forward" not in vars(b) for b in model.blocks)


def test_twice_then_gradients_equal_plain(device):
    def setup(m):
        apply_recompute(m, check_fn=is_block)
        apply_recompute(m, check_fn=lambda x: isinstance(x, (Block, Attention)))

    assert_same_run(train(setup, device=device), train(device=device))


def test_check_fn_selects_modules():
    model = GPT()
    apply_recompute(model, check_fn=lambda m: isinstance(m, nn.LayerNorm))
    wrapped = {n for n, m in model.named_modules() if "forward" in vars(m)}
    assert wrapped == {"blocks.0.ln1", "blocks.0.ln2", "blocks.1.ln1", "blocks.1.ln2", "ln_f"}
    remove_recompute(model)
    with pytest.warns(UserWarning, match=r"no check_fn: GPT and every one of its \d+ submodules run in scopes") as w:
        apply_recompute(model)  # default: every module, the root included
    assert w[0].filename == __file__  # the warning names the user's line
    assert all("forward" in vars(m) for m in model.modules())
    remove_recompute(model)
    assert not any("forward" in vars(m) for m in model.modules())


class Exploding(nn.Module):
    """A module class whose constructor must never be called by apply_recompute."""

    def __init__(self, *args):
        raise AssertionError("apply_recompute called the class given as check_fn")


@pytest.mark.parametrize(
    "check_fn,expected",
    [
        (Block, {"blocks.0", "blocks.1"}),
        ((Block,), {"blocks.0", "blocks.1"}),
        (
            (Attention, nn.LayerNorm),
            {"blocks.0.attn", "blocks.1.attn", "blocks.0.ln1", "blocks.0.ln2", "blocks.1.ln1", "blocks.1.ln2", "ln_f"},
        ),
        (Attention | Block, {"blocks.0", "blocks.1", "blocks.0.attn", "blocks.1.attn"}),
        ((Exploding, Block), {"blocks.0", "blocks.1"}),
    ],
    ids=["class", "tuple1", "tuple2", "union", "never_called"],
)
def test_check_fn_classes_match_with_isinstance(check_fn, expected):
    model = GPT()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        apply_recompute(model, check_fn=check_fn)
    wrapped = {n for n, m in model.named_modules() if "forward" in vars(m)}
    assert wrapped == expected


@pytest.mark.parametrize(
    "check_fn",
    [lambda m: False, Exploding, (nn.Conv2d, nn.BatchNorm1d), ()],
    ids=["predicate", "class", "tuple", "empty_tuple"],
)
def test_check_fn_matching_nothing_warns_and_changes_nothing(check_fn):
    model = GPT()
    apply_recompute(model.blocks[0], check_fn=Attention)  # what is there stays as it is
    before = _snapshot(model)
    with pytest.warns(UserWarning, match="matched no module of GPT; nothing was changed") as caught:
        assert apply_recompute(model, check_fn=check_fn, save=save_matmuls) is model
    assert len(caught) == 1 and caught[0].filename == __file__  # points at the caller
    assert _snapshot(model) == before
    assert vars(model.blocks[0].attn)["forward"].options == {}  # not updated to save=


@pytest.mark.filterwarnings("ignore:apply_recompute. no check_fn")  # the default, on purpose
def test_every_module_gradients_equal_plain(device):
    assert_same_run(train(apply_recompute, device=device), train(device=device))


def test_hooks_run_once_and_see_the_forward(device):
    torch.manual_seed(0)
    model = GPT().to(device)
    calls = []
    model.blocks[0].register_forward_pre_hook(lambda m, args: calls.append("pre"))
    model.blocks[0].register_forward_hook(lambda m, args, out: calls.append("post") or out * 1)
    torch.manual_seed(1)
    plain = model(tokens(device=device))
    apply_recompute(model, check_fn=is_block)
    calls.clear()
    torch.manual_seed(1)
    scoped = model(tokens(device=device))
    assert calls == ["pre", "post"]
    assert torch.equal(scoped, plain)
    scoped.sum().backward()
    assert calls == ["pre", "post"]  # replay does not rerun Python code


def test_no_reference_cycle():
    model = GPT()
    apply_recompute(model, check_fn=is_block)
    ref = weakref.ref(model.blocks[0])
    fwd = vars(model.blocks[0])["forward"]
    gc.disable()
    try:
        del model
        assert ref() is None, "apply_recompute made a reference cycle"
    finally:
        gc.enable()
    with pytest.raises(RuntimeError, match="no longer exists"):
        fwd(torch.randn(1, 2, D))


def test_signature_and_repr():
    block = Block()
    apply_recompute(block, check_fn=Block, save=save_matmuls)
    assert list(inspect.signature(block.forward).parameters) == ["x"]
    assert "recompute_scope" in repr(block.forward) and "save_matmuls" in repr(block.forward)


def test_exception_in_forward_exits_scope(device):
    class Boom(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x, fail=False):
            h = self.fc(x).relu()
            if fail:
                raise ValueError("boom")
            return h

    m = Boom().to(device)
    apply_recompute(m, check_fn=Boom)
    before = global_state()
    x = torch.randn(2, 4, requires_grad=True, device=device)
    with pytest.raises(ValueError, match="boom"):
        m(x, fail=True)
    assert_interception_gone(before)
    y = m(x)
    y.sum().backward()


# --------------------------------------------------------------------------------------
# keyword arguments and nested outputs


@dataclasses.dataclass
class Out:
    hidden: torch.Tensor
    extras: dict


class Fancy(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)
        self.drop = nn.Dropout(0.2)

    def forward(self, x, scale=1.0, *, mask=None, kind="tuple"):
        h = self.drop(F.gelu(self.fc1(x))) * scale
        if mask is not None:
            h = h.masked_fill(mask, 0.0)
        y = self.fc2(h)
        self.probe = weakref.ref(h.untyped_storage())
        if kind == "tuple":
            return y, (h.sum(-1), [y.tanh()])
        if kind == "dict":
            return {"y": y, "aux": {"h": h, "n": 3}}
        return Out(hidden=y, extras={"pair": (h, y.sin())})


def _flatten(out):
    if isinstance(out, torch.Tensor):
        return [out]
    if dataclasses.is_dataclass(out):
        return _flatten([getattr(out, f.name) for f in dataclasses.fields(out)])
    if isinstance(out, dict):
        return [t for v in out.values() for t in _flatten(v)]
    if isinstance(out, (list, tuple)):
        return [t for v in out for t in _flatten(v)]
    return []


@pytest.mark.parametrize("kind", ["tuple", "dict", "dataclass"])
def test_kwargs_and_nested_outputs(kind, device):
    def run(apply):
        torch.manual_seed(0)
        m = Fancy().to(device)
        if apply:
            apply_recompute(m, check_fn=lambda x: True)  # every module (the default, without its warning)
        x = torch.randn(3, 5, D, requires_grad=True, device=device)
        mask = torch.rand(3, 5, 2 * D, device=device) > 0.7
        out = m(x, 0.5, mask=mask, kind=kind)
        assert type(out) is {"tuple": tuple, "dict": dict, "dataclass": Out}[kind]
        tensors = _flatten(out)
        if kind == "dict":
            assert out["aux"]["n"] == 3
        loss = sum((t * (i + 1)).sum() for i, t in enumerate(tensors))
        values = [t.detach().clone() for t in tensors]
        del out, tensors
        alive = m.probe() is not None
        loss.backward()
        return values, [p.grad for p in m.parameters()] + [x.grad], alive

    v_plain, g_plain, alive_plain = run(False)
    v, g, alive = run(True)
    assert alive_plain and not alive  # h is recomputed although the output held it
    for a, b in zip(v + g, v_plain + g_plain):
        assert torch.equal(a, b)


# --------------------------------------------------------------------------------------
# pickling and copying


@pytest.mark.parametrize(
    "options",
    [{}, {"save": save_matmuls}, {"save": [aten.addmm, aten.bmm.default]}, {"save": aten.mm}],
    ids=["plain", "save_matmuls", "op_list", "single_op"],
)
@pytest.mark.parametrize("how", ["pickle", "deepcopy"])
def test_pickle_and_deepcopy(options, how, device):
    torch.manual_seed(0)
    model = GPT().to(device)
    apply_recompute(model, check_fn=is_block, **options)
    clone = pickle.loads(pickle.dumps(model)) if how == "pickle" else copy.deepcopy(model)
    for c in clone.blocks:
        fwd = vars(c)["forward"]
        assert fwd.module is c, "the copy's forward must run the copy"
        assert fwd.original is None
    assert list(clone.state_dict()) == list(model.state_dict())
    # the copy trains the copy, with the same numbers
    idx = tokens(device=device)
    torch.manual_seed(5)
    model(idx).sum().backward()
    torch.manual_seed(5)
    clone(idx).sum().backward()
    for p, q in zip(model.parameters(), clone.parameters()):
        assert p is not q and torch.equal(p.grad, q.grad)
    # and the copy keeps its activations out of memory too
    loss = clone(idx).sum()
    assert not any(b.probes["gelu"]() for b in clone.blocks)
    loss.backward()
    remove_recompute(clone)
    assert not any("forward" in vars(m) for m in clone.modules())
    assert all("forward" in vars(b) for b in model.blocks)


def test_shallow_copy_reapply_rebinds():
    block = Block()
    apply_recompute(block, check_fn=Block)
    twin = copy.copy(block)
    assert vars(twin)["forward"].module is block  # documented caveat
    apply_recompute(twin, check_fn=Block)
    assert vars(twin)["forward"].module is twin
    assert vars(block)["forward"].module is block
    remove_recompute(twin)
    assert "forward" not in vars(twin)


# --------------------------------------------------------------------------------------
# validation


def test_apply_recompute_validation():
    model = GPT()
    with pytest.raises(TypeError, match="nn.Module"):
        apply_recompute(lambda x: x)
    with pytest.raises(TypeError, match="nn.Module"):
        remove_recompute([model])
    with pytest.raises(TypeError, match="check_fn must be a predicate"):
        apply_recompute(model, check_fn=True)
    with pytest.raises(TypeError, match="tuple check_fn must hold classes"):
        apply_recompute(model, check_fn=(Block, is_block))
    with pytest.raises(TypeError, match="unknown recompute_scope option"):
        apply_recompute(model, check_fn=is_block, preserve_rng=False)
    with pytest.raises(TypeError):
        apply_recompute(model, check_fn=is_block, enabled="yes")
    with pytest.raises(TypeError):
        apply_recompute(model, check_fn=is_block, save=["aten::mm"])
    remove_recompute(model)
    assert not any("forward" in vars(m) for m in model.modules())


# --------------------------------------------------------------------------------------
# recompute_sequential


def make_seq(n=6, p=0.1):
    layers = []
    for _ in range(n):
        layers.append(
            nn.Sequential(nn.LayerNorm(D), nn.Linear(D, 2 * D), nn.GELU(), nn.Dropout(p), nn.Linear(2 * D, D))
        )
    return nn.Sequential(*layers)


class Probe(nn.Module):
    """Identity that records a storage weakref of an intermediate it makes."""

    def __init__(self, store):
        super().__init__()
        self.store = store

    def forward(self, x):
        y = x.sin()
        self.store.append(weakref.ref(y.untyped_storage()))
        return y * y  # saves y


def _seq_run(fn, seg, device, as_list=False, **options):
    torch.manual_seed(0)
    seq = make_seq().to(device)
    x = torch.randn(4, D, requires_grad=True, device=device)
    functions = list(seq) if as_list else seq
    out = fn(functions, seg, x, **options)
    out.pow(2).sum().backward()
    return [out.detach()] + [p.grad for p in seq.parameters()] + [x.grad]


@pytest.mark.parametrize("segments", [1, 2, 3, 4, 6])
def test_recompute_sequential_gradients_equal_plain(segments, entered_scopes, device):
    plain = _seq_run(lambda f, s, x: f(x), segments, device)
    got = _seq_run(recompute_sequential, segments, device)
    assert all(torch.equal(a, b) for a, b in zip(got, plain))
    assert len(entered_scopes) == segments - 1
    entered_scopes.clear()
    got = _seq_run(recompute_sequential, segments, device, as_list=True, save=save_matmuls)
    assert all(torch.equal(a, b) for a, b in zip(got, plain))
    assert len(entered_scopes) == segments - 1


def test_recompute_sequential_matches_checkpoint_sequential_chunks(device):
    """Chunks as in checkpoint_sequential: 7 functions, 3 segments -> 2, 2, 3 (last plain)."""

    def run(fn):
        store = []
        probes = [Probe(store) for _ in range(7)]
        x = torch.linspace(-2, 2, 5, requires_grad=True, device=device)
        out = fn(probes, x)
        alive = [r() is not None for r in store]
        out.sum().backward()
        return alive, out.detach(), x.grad

    alive, out, grad = run(lambda fns, x: recompute_sequential(fns, 3, x))
    alive_plain, out_plain, grad_plain = run(lambda fns, x: nn.Sequential(*fns)(x))
    assert alive_plain == [True] * 7
    assert alive == [False, False, False, False, True, True, True]
    assert torch.equal(out, out_plain) and torch.equal(grad, grad_plain)


def test_recompute_sequential_plain_functions_and_tuple_outputs(device):
    w = torch.randn(D, D, requires_grad=True, device=device)
    fns = [lambda x: (x @ w, x), lambda t: t[0].tanh() + t[1], torch.sigmoid, lambda x: x * 3]

    def run(fn):
        w.grad = None
        x = torch.randn(5, D, generator=torch.Generator().manual_seed(0)).to(device)
        out = fn(x)
        out.sum().backward()
        return out.detach(), w.grad.clone()

    def plain(x):
        for f in fns:
            x = f(x)
        return x

    ref = run(plain)
    for seg in (1, 2, 3, 4):
        got = run(lambda x: recompute_sequential(fns, seg, x))
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    got = run(lambda x: recompute_sequential(functions=tuple(fns), segments=2, input=x, preserve_rng_state=False))
    assert torch.equal(got[1], ref[1])


@pytest.mark.parametrize("segments", [0, -1, 5, 2.0, 2.5, True, "2", None])
def test_recompute_sequential_bad_segments(segments):
    fns = [torch.sin, torch.cos, torch.tanh, torch.exp]
    with pytest.raises(ValueError, match="segments"):
        recompute_sequential(fns, segments, torch.randn(3))


def test_recompute_sequential_validation():
    with pytest.raises(TypeError, match="functions"):
        recompute_sequential(torch.sin, 1, torch.randn(3))
    with pytest.raises(TypeError, match=r"functions\[1\]"):
        recompute_sequential([torch.sin, 3], 1, torch.randn(3))
    with pytest.raises(ValueError, match="segments"):
        recompute_sequential([], 1, torch.randn(3))
    with pytest.raises(TypeError, match="unknown recompute_scope option"):
        recompute_sequential([torch.sin], 1, torch.randn(3), save_ops=[])
    out = recompute_sequential(nn.ModuleList([nn.Linear(3, 3), nn.ReLU()]), 2, torch.randn(2, 3))
    assert out.shape == (2, 3)


# --------------------------------------------------------------------------------------
# selection: check_fn as names and tuples, every_n_layers; feedback: warnings and the log


def _scoped(model):
    return [n for n, m in model.named_modules() if "forward" in vars(m)]


def test_check_fn_as_class_names_and_tuples():
    model = GPT()
    apply_recompute(model, check_fn="Block")
    assert _scoped(model) == ["blocks.0", "blocks.1"]
    remove_recompute(model)
    apply_recompute(model, check_fn=f"{Block.__module__}.{Block.__qualname__}")  # a dotted name
    assert _scoped(model) == ["blocks.0", "blocks.1"]
    remove_recompute(model)
    apply_recompute(model, check_fn=("Attention", nn.LayerNorm))  # names and classes mixed
    assert _scoped(model) == [f"blocks.{i}.{m}" for i in (0, 1) for m in ("ln1", "attn", "ln2")] + ["ln_f"]
    remove_recompute(model)
    with pytest.warns(UserWarning, match="matched no module of GPT; nothing was changed.*Did you mean 'Block'") as w:
        apply_recompute(model, check_fn="Blocks")
    assert w[0].filename == __file__ and _scoped(model) == []
    with pytest.raises(TypeError, match="a tuple check_fn must hold classes .* or class names"):
        apply_recompute(model, check_fn=(Block, 3))


def test_every_n_layers_scopes_matches_0_n_2n():
    class Deep(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(5))

    model = Deep()
    apply_recompute(model, check_fn=Block, every_n_layers=2)
    assert _scoped(model) == ["blocks.0", "blocks.2", "blocks.4"]
    remove_recompute(model)
    apply_recompute(model, check_fn=Block, every_n_layers=np_int(3))
    assert _scoped(model) == ["blocks.0", "blocks.3"]
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="every_n_layers must be a positive int"):
            apply_recompute(model, check_fn=Block, every_n_layers=bad)


def np_int(n):
    import numpy as np

    return np.int64(n)


def test_helpers_log_what_they_scoped(caplog):
    model = GPT()
    with caplog.at_level(logging.INFO, logger="gradient_scope"):
        apply_recompute(model, check_fn=Block, save=save_matmuls, preserve_rng_state=False)
        apply_recompute(model, check_fn=nn.Linear)
        seq = nn.Sequential(*(nn.Linear(4, 4) for _ in range(5)))
        for _ in range(3):  # logged once per layout and options: it runs every forward
            recompute_sequential(seq, segments=2, input=torch.randn(2, 4, requires_grad=True))
    lines = [r.getMessage() for r in caplog.records if r.name == "gradient_scope"]
    assert lines == [
        "apply_recompute: scoped 2 modules (blocks.0, blocks.1) of GPT with save=save_matmuls, "
        "preserve_rng_state=False",
        "apply_recompute: scoped 9 modules (blocks.0.attn.qkv, blocks.0.attn.proj ... head) of GPT "
        "with default options",
        "recompute_sequential: 5 functions in 2 segments: functions 0-1 in 1 scopes of 2, the last 3 plain, "
        "with default options",
    ]
