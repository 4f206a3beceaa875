"""gradient_scope.checkpoint: a drop-in for torch.utils.checkpoint.checkpoint (``docs/api.md``).

Gradients are compared with the same program without any checkpoint (same seeds,
``torch.equal``); frameworks that take a checkpoint function (torch's
``checkpoint_wrapper`` / ``apply_activation_checkpointing``) use scopes with it.
"""

import functools
import inspect
import warnings
import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.utils.checkpoint import create_selective_checkpoint_contexts, noop_context_fn

import gradient_scope
from gradient_scope import checkpoint, recompute_scope

from support import assert_interception_gone


class Block(nn.Module):
    def __init__(self, d=16, p=0.1):
        super().__init__()
        self.ln, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.drop = nn.Dropout(p)

    def forward(self, x, scale=1.0):
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln(x))))) * scale


class Net(nn.Module):
    def __init__(self, n=3, d=16):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def train_step(setup=None, call=None, seed=0, device="cpu"):
    """One forward/backward of a fresh Net from ``seed``; returns (loss, grads)."""
    torch.manual_seed(seed)
    net = Net().to(device)
    if setup is not None:
        setup(net)
    x = torch.randn(4, 5, 16, requires_grad=True, device=device)
    torch.manual_seed(seed + 1)  # dropout masks
    out = net(x) if call is None else call(net, x)
    loss = out.pow(2).sum()
    loss.backward()
    return loss.detach(), [x.grad] + [p.grad for p in net.parameters()]


def assert_same_step(a, b):
    assert torch.equal(a[0], b[0])
    assert len(a[1]) == len(b[1])
    for i, (ga, gb) in enumerate(zip(a[1], b[1])):
        if gb is None:  # a parameter the program does not use
            assert ga is None, i
            continue
        assert ga is not None, i
        assert torch.equal(ga, gb), f"grad {i}: max |diff| {(ga - gb).abs().max().item()}"


def test_public_name_and_signature():
    assert "checkpoint" in gradient_scope.__all__
    assert ">>>" in checkpoint.__doc__
    ours = inspect.signature(checkpoint).parameters
    theirs = inspect.signature(torch.utils.checkpoint.checkpoint).parameters
    # Every named argument of torch's checkpoint is accepted, with torch's default
    # (torch >= 2.15 makes ``function`` optional for a decorator form; the contract
    # keeps it required).
    for name, p in theirs.items():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        assert name in ours, name
        if p.default is not p.empty and name != "function":
            assert ours[name].default == p.default or ours[name].default is p.default, name
    assert ours["preserve_rng_state"].default is True  # torch takes it from **kwargs


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"use_reentrant": False},
        {"use_reentrant": True},
        {
            "use_reentrant": False,
            "determinism_check": "none",
            "debug": True,
            "early_stop": False,
            "respect_saved_tensors_hooks": True,
        },
        {"context_fn": noop_context_fn},
        {"preserve_rng_state": True},
    ],
    ids=["defaults", "nonreentrant", "reentrant", "all_flags", "noop_context", "rng"],
)
def test_gradients_equal_plain(options, device):
    plain = train_step(device=device)

    def call(net, x):
        for b in net.blocks:
            x = checkpoint(b, x, **options)
        return net.head(x)

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no use_reentrant warning, unlike torch's
        scoped = train_step(call=call, device=device)
    assert_same_step(scoped, plain)
    assert_interception_gone()


def test_kwargs_reach_the_function(device):
    plain = train_step(call=lambda net, x: net.head(net.blocks[0](x, scale=0.5)), device=device)
    scoped = train_step(
        call=lambda net, x: net.head(checkpoint(net.blocks[0], x, use_reentrant=False, scale=0.5)), device=device
    )
    assert_same_step(scoped, plain)


def test_runs_function_once_in_a_scope_outputs_recomputable(device):
    """The function runs once (no rerun in backward), inside a scope: its output is a
    recompute handle wherever autograd saves it, and dies when the caller drops it."""
    calls = []
    entered = []

    def fn(a, w):
        calls.append(1)
        return torch.tanh(a @ w)

    torch.manual_seed(0)
    a = torch.randn(32, 32, device=device)
    w = torch.randn(32, 32, requires_grad=True, device=device)
    c = torch.randn(32, 32, requires_grad=True, device=device)

    original_enter = recompute_scope.__enter__

    def spy(self):
        entered.append(self)
        return original_enter(self)

    recompute_scope.__enter__ = spy
    try:
        y = checkpoint(fn, a, w, use_reentrant=False)
    finally:
        recompute_scope.__enter__ = original_enter
    probe = weakref.ref(y.untyped_storage())
    z = (y * c).sum()  # mul saves y: a handle
    del y
    assert probe() is None, "the checkpointed function's output is kept for backward"
    z.backward()
    assert len(calls) == 1
    assert len(entered) == 1 and entered[0].stats.tensors_packed >= 2  # tanh and mul saves of y
    expected = torch.autograd.grad((torch.tanh(a @ w) * c).sum(), (w, c))
    assert torch.equal(w.grad, expected[0]) and torch.equal(c.grad, expected[1])
    del z
    assert_interception_gone()


def test_preserve_rng_state_false_passes_to_the_scope(device):
    seen = []
    original_init = recompute_scope.__init__

    def spy(self, **options):
        seen.append(options)
        original_init(self, **options)

    recompute_scope.__init__ = spy
    try:
        x = torch.randn(4, requires_grad=True, device=device)
        checkpoint(torch.sin, x, preserve_rng_state=False).sum().backward()
    finally:
        recompute_scope.__init__ = original_init
    assert seen == [{"preserve_rng_state": False}]


def test_context_fn_other_than_default_raises():
    policy = functools.partial(create_selective_checkpoint_contexts, [torch.ops.aten.mm.default])
    x = torch.randn(4, 4, requires_grad=True)
    with pytest.raises(ValueError, match="context_fn is not supported.*save="):
        checkpoint(torch.sin, x, use_reentrant=False, context_fn=policy)
    assert_interception_gone()


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"determinism_check": "strict"}, ValueError, "determinism_check"),
        ({"use_reentrant": "yes"}, TypeError, "use_reentrant"),
        ({"debug": 1}, TypeError, "debug"),
        ({"early_stop": None}, TypeError, "early_stop"),
        ({"respect_saved_tensors_hooks": 1}, TypeError, "respect_saved_tensors_hooks"),
        ({"preserve_rng_state": "no"}, TypeError, "preserve_rng_state"),
    ],
)
def test_invalid_arguments_raise(kwargs, error, match):
    x = torch.randn(4, requires_grad=True)
    with pytest.raises(error, match=match):
        checkpoint(torch.sin, x, **kwargs)
    assert_interception_gone()


def test_function_not_callable():
    with pytest.raises(TypeError, match="callable"):
        checkpoint(3, torch.randn(2))


def test_function_raising_leaves_no_trace(device):
    def boom(x):
        torch.sin(x)
        raise KeyError("inside")

    with pytest.raises(KeyError, match="inside"):
        checkpoint(boom, torch.randn(4, requires_grad=True, device=device))
    assert_interception_gone()


@pytest.mark.parametrize(
    "impl", [CheckpointImpl.NO_REENTRANT, CheckpointImpl.REENTRANT], ids=["no_reentrant", "reentrant"]
)
def test_checkpoint_wrapper(impl, device):
    plain = train_step(device=device)

    def setup(net):
        for i, b in enumerate(net.blocks):
            net.blocks[i] = checkpoint_wrapper(b, checkpoint_impl=impl, checkpoint_fn=checkpoint)

    # checkpoint_wrapper passes keyword arguments to the function for NO_REENTRANT only.
    scoped = train_step(setup, device=device)
    assert_same_step(scoped, plain)
    assert_interception_gone()


def test_apply_activation_checkpointing(device):
    plain = train_step(device=device)
    used = []

    def counting_checkpoint(function, *args, **kwargs):
        used.append(function)
        return checkpoint(function, *args, **kwargs)

    wrapper = functools.partial(checkpoint_wrapper, checkpoint_fn=counting_checkpoint)
    scoped = train_step(
        lambda net: apply_activation_checkpointing(
            net, checkpoint_wrapper_fn=wrapper, check_fn=lambda m: isinstance(m, Block)
        ),
        device=device,
    )
    assert_same_step(scoped, plain)
    assert len(used) == 3  # one call per block
    assert_interception_gone()


def test_checkpoint_wrapper_memory(device):
    """Activations inside a wrapped block do not outlive forward (weakrefs, no gc)."""
    probes = []

    class Probed(Block):
        def forward(self, x, scale=1.0):
            h = F.gelu(self.fc1(self.ln(x)))
            probes.append(weakref.ref(h.untyped_storage()))
            return x + self.drop(self.fc2(h)) * scale

    torch.manual_seed(0)
    net = nn.Sequential(*(checkpoint_wrapper(Probed(), checkpoint_fn=checkpoint) for _ in range(2))).to(device)
    loss = net(torch.randn(4, 5, 16, requires_grad=True, device=device)).sum()
    assert len(probes) == 2 and all(p() is None for p in probes)
    loss.backward()
