"""Block-created tensors die after forward (weakrefs, no gc.collect()), and scope.stats."""

import subprocess
import sys
import weakref

import pytest
import torch

from gradient_scope import recompute_scope

from support import (
    ROOT,
    Transformer,
    assert_interception_gone,
    dead,
    grads,
    memory_allocated,
    run_both,
    stat,
    stats,
)


def test_plain_autograd_keeps_the_tensor_alive(device):
    """Sanity check of the premise of this file: without a scope, autograd keeps x."""
    a = torch.randn(5, requires_grad=True, device=device)
    c = torch.randn(5, requires_grad=True, device=device)
    x = a + 1
    ref = weakref.ref(x)
    y = x * c
    del x
    assert ref() is not None
    del y


@pytest.mark.parametrize(
    "after",
    [
        lambda x, c: x * c,
        lambda x, c: x.exp() * x * c,
        lambda x, c: x.sin().sum() * c,
        lambda x, c: x.view(-1, 1).t() * c,
        lambda x, c: torch.tanh(x).pow(2) + c,
        lambda x, c: (x[::2] * c[:3]).repeat(2).sigmoid(),
    ],
    ids=["mul", "exp_mul", "sin", "view_t", "tanh_pow", "slice_sigmoid"],
)
def test_block_tensor_dies_after_forward(after, device):
    def program(scope):
        a = torch.randn(6, requires_grad=True, device=device)
        b = torch.randn(6, requires_grad=True, device=device)
        c = torch.randn(6, requires_grad=True, device=device)
        with scope():
            x = (a + b).cos()
        ref = weakref.ref(x)
        y = after(x, c)
        del x
        if scope.real:
            assert ref() is None, "block-created tensor kept alive while the graph of y lives"
        y.sum().backward()
        return dict(y=y.detach(), **grads(dict(a=a, b=b, c=c)))

    run_both(program)


@pytest.mark.parametrize(
    "index",
    [
        lambda a, i: a[:, i],  # aten.index.Tensor: indices are a list of optional tensors
        lambda a, i: a.index_select(1, i),
        lambda a, i: a.gather(1, i.expand(4, 6)),
        lambda a, i: a[:, i.clamp(max=3)].exp(),
    ],
    ids=["index", "index_select", "gather", "index_exp"],
)
def test_block_created_index_tensor_released(index, device):
    def program(scope):
        a = torch.randn(4, 6, requires_grad=True, device=device)
        c = torch.randn(4, 6, requires_grad=True, device=device)
        with scope():
            idx = torch.arange(5, -1, -1, device=device)
            x = index(a, idx)
        refs = [weakref.ref(idx), weakref.ref(x)]
        del idx
        y = x * c[:, : x.shape[1]]
        del x
        if scope.real:
            assert dead(*refs), [r() is None for r in refs]
        y.sum().backward()
        return dict(y=y.detach(), **grads(dict(a=a, c=c)))

    run_both(program)
    assert_interception_gone()


@pytest.mark.parametrize(
    "use",
    [
        lambda a: a[:, [3, 1, 0, 2]],  # the list becomes a tensor literal inside the block
        lambda a: a[:, torch.tensor([3, 1, 0, 2], device=a.device)],
        lambda a: a * torch.tensor([0.5, 1.0, 2.0, 4.0], device=a.device),
        lambda a: a * 2 + torch.tensor(1.5, device=a.device),
    ],
    ids=["list_index", "tensor_index", "tensor_mul", "scalar_tensor"],
)
def test_tensor_literal_in_block_released(use, device):
    """torch.tensor(...) inside a block (aten.lift_fresh) is a block tensor like any other:
    once everything made in the block is gone, so is the interception."""

    def program(scope):
        a = torch.randn(4, 4, requires_grad=True, device=device)
        c = torch.randn(4, 4, requires_grad=True, device=device)
        with scope():
            x = use(a).sin()
        y = x * c
        ref = weakref.ref(x)
        del x
        if scope.real:
            assert ref() is None
        y.sum().backward()
        return dict(y=y.detach(), **grads(dict(a=a, c=c)))

    run_both(program)
    assert_interception_gone()


class _Capture(torch.autograd.Function):
    """Saves its input; backward records a weakref to the value it got back."""

    refs = []

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 2

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        _Capture.refs.append(weakref.ref(x))
        return g * 2 + x * 0


@pytest.mark.parametrize("retain_graph", [False, True])
def test_recomputed_value_released_after_backward(retain_graph, device):
    _Capture.refs.clear()
    a = torch.randn(1000, requires_grad=True, device=device)
    s = recompute_scope()
    with s:
        x = torch.tanh(a) * 3
    y = _Capture.apply(x)
    del x
    y.sum().backward(retain_graph=retain_graph)
    assert stat(s, "replays") >= 1
    assert len(_Capture.refs) == 1
    assert _Capture.refs[0]() is None, "recomputed value kept after backward consumed it"
    if retain_graph:
        y.sum().backward()  # a later pass recomputes again
        assert stat(s, "replays") >= 2
        assert _Capture.refs[1]() is None
    del y
    assert_interception_gone()


def test_block_intermediates_die_at_block_exit(device):
    a = torch.randn(8, requires_grad=True, device=device)
    refs = []
    with recompute_scope():
        h1 = a.exp()  # exp saves its output
        h2 = torch.tanh(h1)  # saves its output
        h3 = h2 * h1  # saves both
        out = h3.sigmoid()
        refs = [weakref.ref(t) for t in (h1, h2, h3)]
        del h1, h2, h3
    assert dead(*refs)
    out.sum().backward()
    assert a.grad is not None
    del out
    assert_interception_gone()


def test_product_of_two_scoped_factors(device):
    """f1() * f2(): each factor made in its own scope; neither is kept alive."""

    def program(scope):
        a = torch.randn(7, requires_grad=True, device=device)
        b = torch.randn(7, requires_grad=True, device=device)
        refs = []

        def f1():
            with scope():
                t = a.sin() * 2
            refs.append(weakref.ref(t))
            return t

        def f2():
            with scope():
                t = b.exp() - a
            refs.append(weakref.ref(t))
            return t

        y = f1() * f2()
        if scope.real:
            assert len(refs) == 2 and dead(*refs), "a scoped factor is kept alive by mul"
        y.sum().backward()
        return dict(y=y.detach(), **grads(dict(a=a, b=b)))

    scopes, _ = run_both(program)
    s1, s2 = scopes.created
    assert stat(s1, "tensors_packed") >= 1 and stat(s2, "tensors_packed") >= 1
    assert stat(s1, "replays") >= 1 and stat(s2, "replays") >= 1


def test_nested_scopes(device):
    def program(scope):
        a = torch.randn(5, requires_grad=True, device=device)
        b = torch.randn(5, requires_grad=True, device=device)
        c = torch.randn(5, requires_grad=True, device=device)
        with scope():
            u = a.sin() * 2
            with scope():
                v = b.cos() * 3
                vv = v.exp()
            w = u * vv
        y = w * c
        refs = [weakref.ref(t) for t in (u, v, vv, w)]
        del u, v, vv, w
        if scope.real:
            assert dead(*refs)
        y.sum().backward()
        return dict(y=y.detach(), **grads(dict(a=a, b=b, c=c)))

    scopes, _ = run_both(program)
    outer, inner = scopes.created
    assert stat(outer, "tensors_packed") >= 1
    assert stat(inner, "tensors_packed") >= 1


def test_nested_inner_reads_outer_tensor(device):
    def program(scope):
        a = torch.randn(5, requires_grad=True, device=device)
        c = torch.randn(5, requires_grad=True, device=device)
        with scope():
            u = a.sin() * 2
            with scope():
                v = (u * a).exp()
            w = torch.tanh(v + u)
        y = w * c
        refs = [weakref.ref(t) for t in (v, w)]
        del u, v, w
        if scope.real:
            assert dead(*refs)
        y.sum().backward()
        return dict(y=y.detach(), **grads(dict(a=a, c=c)))

    run_both(program)


def test_exp_of_block_tensor_after_block_no_leak(device):
    """z = w.exp() after the block saves z (not block-created) while interception is on:
    z and w must both die on del, with y's graph alive, without gc."""

    def program(scope):
        a = torch.randn(9, requires_grad=True, device=device)
        with scope():
            w = a.sin() * 2
        z = w.exp()
        loss = z.sum()
        refs = [weakref.ref(z), weakref.ref(w)]
        del z, w
        if scope.real:
            assert dead(*refs), "exp's saved output (or the block tensor) leaked"
        loss.backward()
        return dict(loss=loss.detach(), **grads(dict(a=a)))

    run_both(program)
    assert_interception_gone()


def test_everything_released_without_gc(device):
    """After a step the graph is gone: block tensors, outputs and the inputs the scope
    needed for replay are all freed by refcounting alone, and interception is gone."""

    def step():
        a = torch.randn(16, requires_grad=True, device=device)
        c = torch.randn(16, requires_grad=True, device=device)
        with recompute_scope():
            x = torch.tanh(a * 3)
            e = x.exp()
        y = e * c + x
        refs = [weakref.ref(t) for t in (a, c, x, e, y)]
        del x, e
        y.sum().backward()
        return refs

    if device == "cuda":
        step()  # warm-up: CUDA's lazy initialisation allocates once
    before = memory_allocated(device)
    refs = step()
    assert dead(*refs), [r() is None for r in refs]
    assert memory_allocated(device) == before, "device memory still allocated after the step"
    assert_interception_gone()


def test_graph_dropped_without_backward(device):
    a = torch.randn(16, requires_grad=True, device=device)
    before = memory_allocated(device)
    with recompute_scope():
        x = a.exp()
    y = x * a
    refs = [weakref.ref(x), weakref.ref(y)]
    del x, y
    assert dead(*refs)
    assert memory_allocated(device) == before, "device memory of the dropped graph still allocated"
    assert_interception_gone()


@pytest.mark.parametrize("mode", ["inner", "outer", "both"])
def test_train_step_three_times(mode, device):
    held = {True: [], False: []}  # device bytes allocated after each forward (CUDA), scoped / plain

    def program(scope):
        model = Transformer(mode=mode).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        losses = []
        for step in range(3):
            x = torch.randn(2, 6, 16, device=device)
            opt.zero_grad(set_to_none=True)
            out = model(x, scope)
            probes = model.probes()
            assert len(probes) == 4
            if scope.real:
                assert dead(*probes), f"step {step}: block tensors alive after forward"
            held[scope.real].append(memory_allocated(device))
            loss = out.pow(2).mean()
            del out
            loss.backward()
            losses.append(loss.detach())
            del loss
            if scope.real:
                assert_interception_gone()
            opt.step()
        return dict(losses=losses, params=[p.detach().clone() for p in model.parameters()])

    run_both(program)
    if device == "cuda":
        assert all(s < p for s, p in zip(held[True], held[False])), f"scoped {held[True]} vs plain {held[False]} bytes"


def test_stats_simple(device):
    s = recompute_scope()
    a = torch.randn(100, requires_grad=True, device=device)
    b = torch.randn(100, requires_grad=True, device=device)
    c = torch.randn(100, requires_grad=True, device=device)
    with s:
        x = a + b
    nbytes = x.numel() * x.element_size()
    y = x * c
    del x
    st = stats(s)
    assert st["ops_recorded"] >= 1
    assert st["tensors_packed"] >= 1
    assert st["bytes_packed"] >= nbytes
    assert st["replays"] == 0 and st["ops_replayed"] == 0, "nothing replayed before backward"
    y.sum().backward(retain_graph=True)
    st1 = stats(s)
    assert st1["replays"] >= 1
    assert 1 <= st1["ops_replayed"] <= st1["ops_recorded"]
    y.sum().backward()
    st2 = stats(s)
    assert st2["replays"] > st1["replays"]
    assert st1["ops_replayed"] < st2["ops_replayed"] <= 2 * st2["ops_recorded"]
    assert st2["ops_recorded"] == st["ops_recorded"]
    assert torch.equal(c.grad, 2 * (a + b).detach())


def test_stats_bytes_scale_with_size(device):
    def packed(n):
        s = recompute_scope()
        a = torch.randn(n, requires_grad=True, device=device)
        with s:
            x = a.sin()
        y = x * a
        del x, y
        return stat(s, "bytes_packed")

    small, large = packed(10), packed(10_000)
    assert small >= 40 and large >= 40_000
    assert large > small


def test_stats_transformer_replays_bounded(device):
    model = Transformer(mode="outer").to(device)
    scopes = []

    def scope():
        scopes.append(recompute_scope())
        return scopes[-1]

    x = torch.randn(2, 5, 16, requires_grad=True, device=device)
    loss = model(x, scope).pow(2).mean()
    before = [stats(s) for s in scopes]
    loss.backward()
    for s, b in zip(scopes, before):
        st = stats(s)
        assert b["replays"] == 0
        assert st["ops_recorded"] > 10 and st["tensors_packed"] >= 2
        assert st["replays"] >= 1
        assert 1 <= st["ops_replayed"] <= st["ops_recorded"], st


def test_no_grad_records_nothing(device):
    a = torch.randn(5, requires_grad=True, device=device)
    c = torch.randn(5, requires_grad=True, device=device)
    s = recompute_scope()
    with torch.no_grad():
        with s:
            x = a.sin() * 2
    assert stat(s, "ops_recorded") == 0
    assert_interception_gone()  # even though x is alive
    y = x * c  # saved as usual
    y.sum().backward()
    assert stat(s, "tensors_packed") == 0
    assert torch.equal(c.grad, (a.detach().sin() * 2))


def test_inference_mode_records_nothing(device):
    a = torch.randn(5, device=device)
    s = recompute_scope()
    with torch.inference_mode():
        with s:
            x = a.sin() * 2
            y = torch.tanh(x)
        assert stat(s, "ops_recorded") == 0
    assert y.is_inference()
    assert torch.equal(y, torch.tanh(a.sin() * 2))
    assert_interception_gone()


# ----------------------------------------------------------------------------------------
# memory at scale: nothing the scope keeps outlives what backward needs


class _ResidualMLP(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln = torch.nn.LayerNorm(d)
        self.fc1 = torch.nn.Linear(d, 4 * d)
        self.fc2 = torch.nn.Linear(4 * d, d)

    def forward(self, x):
        return x + torch.nn.functional.dropout(self.fc2(torch.nn.functional.gelu(self.fc1(self.ln(x)))), 0.1)


def test_scoped_training_step_makes_no_reference_cycles(device):
    """A scoped step (per-block scopes, save= policy, in-place write, views) leaves nothing
    for the garbage collector: every record, cache and replayed value is freed by
    reference counting as soon as it is unused."""
    import gc

    from gradient_scope import apply_recompute, save_matmuls

    blocks = torch.nn.Sequential(*[_ResidualMLP(16) for _ in range(3)]).to(device)
    apply_recompute(blocks, check_fn=lambda m: isinstance(m, _ResidualMLP))
    x = torch.randn(4, 16, requires_grad=True, device=device)
    blocks(x).sum().backward()  # warm-up: lazy imports and caches
    gc.collect()
    gc.disable()
    try:
        blocks(x).sum().backward()
        with recompute_scope(save=save_matmuls):
            y = (x @ x.t()).sin()
            y2 = y.t()
            y.mul_(2)
        (y2 * y).sum().backward()
        del y, y2
        found = gc.collect()
    finally:
        gc.enable()
    assert found == 0, f"{found} objects were only freed by the garbage collector"


@pytest.mark.parametrize("layers", [2, 8])
def test_backward_peak_not_above_checkpoint_at_depth(layers, device):
    """A scope per block peaks no higher than torch.utils.checkpoint per block, at any
    depth: a block's record, cache and input alias are freed once its backward is done
    (measured with the validated CPU probe of benchmarks/_harness/memory.py)."""

    from torch.utils.checkpoint import checkpoint

    from benchmarks._harness.memory import measure
    from gradient_scope import apply_recompute

    x = torch.randn(64, 256, requires_grad=True, device=device)  # a block input is 64 KiB

    def peak(strategy):
        torch.manual_seed(0)
        blocks = torch.nn.ModuleList([_ResidualMLP(256) for _ in range(layers)]).to(device)
        if strategy == "scope":
            apply_recompute(blocks, check_fn=lambda m: isinstance(m, _ResidualMLP))

        def forward():
            h = x
            for b in blocks:
                h = checkpoint(b, h, use_reentrant=False) if strategy == "checkpoint" else b(h)
            return h.pow(2).mean()

        forward().backward()  # warm-up
        return measure(forward, lambda loss: loss.backward(), device)[2]

    scope, ckpt = peak("scope"), peak("checkpoint")
    # Per random op the scope keeps one generator state (CPU: 5056 bytes; CUDA: 16 host
    # bytes); checkpoint keeps one per block. Here each block has one dropout: no difference.
    assert scope <= ckpt, f"{layers} blocks: scope peak {scope} > checkpoint peak {ckpt} bytes"


class _FailsInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        raise RuntimeError("backward failed on purpose")


def test_a_failed_backward_releases_the_block_at_the_next_backward():
    # CPU only: on CUDA the ready nodes wait in the device thread's queue, which that
    # thread drains on its own schedule (no moment at which to check).
    # PyTorch keeps the nodes a failed backward had made ready (here: sin's, which
    # saved a handle of h) in its thread-local ready queue until the next backward on
    # the thread; that backward drops them, and with them the block. (A debug handle
    # holds its tensor for the comparison, so h, its registry entry and the hooks
    # live as long as that node.)
    a = torch.randn(16, requires_grad=True)
    with recompute_scope(debug=True):
        h = a.exp()
    probes = [weakref.ref(h), weakref.ref(h.untyped_storage())]
    s = h.sin()
    y = (s * _FailsInBackward.apply(a)).sum()  # its node runs before sin's
    del h, s
    with pytest.raises(RuntimeError, match="on purpose"):
        y.backward()
    del y
    torch.ones((), requires_grad=True).backward()
    assert all(p() is None for p in probes)  # without gc.collect()
    assert_interception_gone()


def test_a_pytorch_reference_cycle_through_a_block_tensor_is_broken_by_its_handle(device):
    # `u.copy_(u.cos())`: u's new node (CopyBackwards) reaches CosBackward, which saved
    # u itself, so plain PyTorch keeps u for ever (a C++ cycle gc cannot see). In a
    # scope the save is a handle, which holds u weakly: u dies, and the hooks go.
    a = torch.randn(4, requires_grad=True, device=device)
    u = a.clone()
    u.copy_(u.cos())
    plain = weakref.ref(u)
    del u
    assert plain() is not None, "PyTorch no longer leaks this cycle: update docs/limitations.md"

    with recompute_scope():
        u = a.clone()
        u.copy_(u.cos())
    probe = weakref.ref(u)
    del u
    assert probe() is None  # without gc.collect()
    assert_interception_gone()


def test_debug_keeps_a_block_tensor_in_a_pytorch_reference_cycle_as_plain_pytorch_does(device):
    # debug=True keeps a saved input as autograd does (to see a later `.data = ...`), so
    # the cycle above keeps the tensor, its record and the hook pair, exactly as plain
    # PyTorch keeps the tensor (docs/limitations.md). Breaking the cycle by hand frees it.
    a = torch.randn(4, requires_grad=True, device=device)
    with recompute_scope(debug=True):
        u = a.clone()
        u.copy_(u.cos())
    probe = weakref.ref(u)
    del u
    assert probe() is not None
    probe().detach_()  # drops u's grad_fn: the cycle is gone
    assert probe() is None
    assert_interception_gone()


_FIRST_SCOPE = """
import gc, weakref
gc.disable()
import torch
from gradient_scope import Budget, checkpoint, recompute_scope, saved_tensors_report

def step(budget):
    x = torch.randn(8, 8, requires_grad=True)
    with recompute_scope(budget=budget):
        y = x.exp()
    z = checkpoint(torch.sin, y, use_reentrant=False)
    with saved_tensors_report():
        loss = (z * y).sum()
    loss.backward()
    return weakref.ref(x), weakref.ref(y)

budget = Budget("1MiB")
for i in range(3):
    refs = step(budget)
    print(i, [r() is None for r in refs])
"""


def test_the_first_scope_of_a_process_does_not_keep_its_callers_frame():
    """The first scope of a process imports what it needs lazily (seconds of imports);
    the cycles such an import may leave hold its frames, and a frame holds its callers':
    the caller's tensors must still die at once, without gc (a fresh interpreter)."""
    out = subprocess.run(
        [sys.executable, "-c", _FIRST_SCOPE], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:3] == ["0 [True, True]", "1 [True, True]", "2 [True, True]"], out.stdout
