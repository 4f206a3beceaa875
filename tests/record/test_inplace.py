"""In-place operations inside and after a block, BatchNorm, and their errors
(``docs/troubleshooting.md``); block buffers filled in place (by random fills, ``out=``,
``copy_``, ...) before or after autograd saved them, and kernels that save a buffer before
they fill it (``rrelu_with_noise``, fused fake-quantisation)."""

import gc
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from gradient_scope import RecomputeError, recompute_scope

from support import (
    assert_interception_gone,
    dead,
    grads,
    run_both,
    stat,
)
from support.contract import check, leaf, scribble_free_memory, weighted_sum


def test_inplace_on_block_tensors_inside_block(device):
    def program(scope):
        a = torch.randn(4, 5, requires_grad=True, device=device)
        b = torch.randn(4, 5, requires_grad=True, device=device)
        c = torch.randn(4, 5, requires_grad=True, device=device)
        k = torch.rand(5, device=device) + 0.5  # outside, no grad, only read
        with scope():
            x = a * 2
            x.add_(b)
            x[:, 0].mul_(3)  # in-place through a view
            x.relu_()  # saves its output
            u = x.sin()  # saves x
            u.mul_(k)  # saves k
            u[1:3] = u[1:3].exp()  # copy_ into a slice
            v = torch.zeros(4, 5, device=device)
            v.addcmul_(u, x)  # in-place into a block-created tensor without grad history
        y = u * c + v * c
        refs = [weakref.ref(t) for t in (x, u, v)]
        del x, u, v
        if scope.real:
            assert dead(*refs)
        y.sum().backward()
        return dict(y=y.detach(), k=k, **grads(dict(a=a, b=b, c=c)))

    run_both(program)


def test_block_tensor_modified_after_block_before_save(device):
    """Modified in place after the block, then saved: stored as usual, correct grads."""

    def program(scope):
        a = torch.randn(6, requires_grad=True, device=device)
        b = torch.randn(6, requires_grad=True, device=device)
        c = torch.randn(6, requires_grad=True, device=device)
        with scope():
            x = a + b
            w = torch.sin(a)
        x.mul_(3)
        x.add_(c)
        w[2:].zero_()
        y = x * c + w * c  # both saved after their in-place modification
        z = x.exp()
        del x, w
        (y.sum() + z.sum()).backward()
        return dict(y=y.detach(), z=z.detach(), **grads(dict(a=a, b=b, c=c)))

    run_both(program)


def test_block_tensor_modified_inplace_by_a_later_scope(device):
    def program(scope):
        a = torch.randn(6, requires_grad=True, device=device)
        c = torch.randn(6, requires_grad=True, device=device)
        with scope():
            x = a.sin()
        with scope():
            x.mul_(2)
            x.sub_(a)
            t = x.exp()
        y = t * c + x * c
        del x, t
        y.sum().backward()
        return dict(y=y.detach(), **grads(dict(a=a, c=c)))

    run_both(program)


@pytest.mark.parametrize("where", ["inside", "after"])
def test_saved_block_tensor_then_modified(where, device):
    """A block tensor saved, then modified in place.  Plain PyTorch raises; with the scope
    either the same kind of error is raised, or the gradient is the mathematically correct
    one (the value at the time of the save).  Never a silently wrong gradient."""
    a = torch.randn(6, requires_grad=True, device=device)
    c = torch.randn(6, requires_grad=True, device=device)
    with recompute_scope():
        x = a * 3
        if where == "inside":
            y = x * c
            x.add_(1)
    if where == "after":
        y = x * c
        x.add_(1)
    del x
    try:
        y.sum().backward()
    except RuntimeError:
        pass
    else:
        assert torch.equal(c.grad, a.detach() * 3)
        assert torch.equal(a.grad, c.detach() * 3)
    del y


@pytest.mark.parametrize("steps", [1, 2])
def test_batchnorm_train_in_scope(steps, device):
    def program(scope):
        lin = nn.Linear(6, 8).to(device)
        bn = nn.BatchNorm1d(8).to(device)
        bn2 = nn.BatchNorm2d(3).to(device)
        conv = nn.Conv2d(2, 3, 3, padding=1).to(device)
        head = nn.Linear(8, 3).to(device)
        snaps = []
        for _ in range(steps):
            x = torch.randn(5, 6, device=device)
            img = torch.randn(2, 2, 4, 4, device=device)
            with scope():
                h = torch.relu(bn(lin(x)))
                g = F.gelu(bn2(conv(img)))
            out = head(h).sum() + (g * g).sum()
            del h, g
            out.backward()
            snaps.append(
                [
                    bn.running_mean.clone(),
                    bn.running_var.clone(),
                    bn.num_batches_tracked.clone(),
                    bn2.running_mean.clone(),
                    bn2.running_var.clone(),
                    bn2.num_batches_tracked.clone(),
                ]
            )
        return dict(snaps=[t for s in snaps for t in s], **grads(dict(lin=lin, bn=bn, bn2=bn2, conv=conv, head=head)))

    scopes, res = run_both(program, cuda_inexact="cuDNN may choose a nondeterministic convolution backward")
    assert int(res["snaps"][-4]) == steps  # sanity: one update per forward
    assert all(stat(s, "replays") >= 1 for s in scopes.created)


def test_outside_tensor_modified_inside_block_not_repeated(device):
    """The block writes into a tensor from outside; replay must not write it again.  The
    scope may refuse (RecomputeError) but must never repeat the side effect or compute a
    wrong gradient."""
    a = torch.randn(4, requires_grad=True, device=device)
    c = torch.randn(4, requires_grad=True, device=device)
    counter = torch.zeros(4, device=device)
    with recompute_scope():
        x = a.sin()
        counter.add_(1)
        y = x * counter
        z = y.exp()
    out = (z * c).sum()
    del x, y, z
    try:
        out.backward()
    except RecomputeError:
        pass
    else:
        a2 = a.detach().clone().requires_grad_()
        c2 = c.detach().clone().requires_grad_()
        cnt2 = torch.ones(4, device=device)
        ((a2.sin() * cnt2).exp() * c2).sum().backward()
        assert torch.equal(a.grad, a2.grad) and torch.equal(c.grad, c2.grad)
    assert torch.equal(counter, torch.ones(4, device=device)), "replay repeated an in-place write to an outside tensor"


@pytest.mark.parametrize(
    "opname,make",
    [
        ("add", lambda a, w: a + w),
        ("exp", lambda a, w: a.exp() * w),
        ("sin", lambda a, w: (w + 1) * a.sin()),
    ],
)
def test_outside_input_modified_after_block_raises(opname, make, device):
    """A tensor the block read from outside, modified after the block and before backward:
    the value cannot be replayed faithfully -> RecomputeError naming the op."""
    a = torch.randn(3, 7, device=device)  # outside, no grad: can be modified in place
    w = torch.randn(3, 7, requires_grad=True, device=device)
    c = torch.randn(3, 7, requires_grad=True, device=device)
    with recompute_scope():
        x = make(a, w)
    y = x * c
    del x
    a.add_(1.0)
    with pytest.raises(RecomputeError) as info:
        y.sum().backward()
    assert isinstance(info.value, RuntimeError)
    assert opname in str(info.value), str(info.value)
    del info, y
    gc.collect()
    assert_interception_gone()


def test_outside_input_modified_but_block_tensor_alive_is_fine(device):
    """If the block tensor is still alive it is used as it is: no replay, no error."""
    a = torch.randn(3, 7, device=device)
    w = torch.randn(3, 7, requires_grad=True, device=device)
    c = torch.randn(3, 7, requires_grad=True, device=device)
    s = recompute_scope()
    with s:
        x = a + w
    y = x * c
    a.add_(1.0)
    y.sum().backward()
    assert torch.equal(c.grad, x.detach())
    assert stat(s, "ops_replayed") == 0
    del x, y


def test_outside_input_modified_read_by_inner_op_raises(device):
    """The modified outside tensor is read by an op in the middle of the block (and
    also saved by autograd there): replaying the block tensor needed first must raise."""
    a = torch.randn(5, device=device)
    w = torch.randn(5, requires_grad=True, device=device)
    c = torch.randn(5, requires_grad=True, device=device)
    with recompute_scope():
        x = torch.tanh(a * w)
    y = x * c
    del x
    a.mul_(2)
    with pytest.raises(RecomputeError):
        y.sum().backward()
    del y


def test_pass_through_tensor_modified_after_save_raises(device):
    """A tensor not created in the block, saved while the scope's interception is active,
    then modified in place: PyTorch's usual error (hooks would otherwise hide it)."""
    p = torch.randn(5, requires_grad=True, device=device)
    a = torch.randn(5, requires_grad=True, device=device)
    with recompute_scope():
        keep = a.exp()  # keeps the interception on
    q = p * 2  # not block-created
    y = q.sin()  # saves q through the active interception
    q.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
    z = (keep * q).sum()
    z.backward()  # the scope itself still works
    del keep, y, z, q
    gc.collect()  # the error's traceback may hold cycles
    assert_interception_gone()


def test_outside_tensor_saved_inside_block_then_modified_raises(device):
    p = torch.randn(5, requires_grad=True, device=device)
    q = p * 2  # outside the block
    with recompute_scope():
        y = q.sin()  # saves q (not block-created)
        keep = y * 1
    q.add_(1)
    with pytest.raises(RuntimeError):
        y.sum().backward()
    del y, keep, q
    gc.collect()  # the error's traceback may hold cycles
    assert_interception_gone()


def test_pass_through_output_saved_after_block_modified_raises(device):
    """exp saves its own output; modifying that output (not a block tensor) must raise."""
    a = torch.randn(5, requires_grad=True, device=device)
    with recompute_scope():
        keep = a * 3
    z = keep.exp()  # saves z
    z.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.sum().backward()
    del keep, z


def test_view_of_outside_tensor_made_in_block_then_base_modified(device):
    """v = a[...] is made in the block but shares storage with a (outside).  a modified
    in place after v was saved: plain PyTorch raises, so must the scope (never replay the
    view from the modified base)."""
    p = torch.randn(4, 5, requires_grad=True, device=device)
    a = p * 1  # outside, non-leaf
    c = torch.randn(3, 5, requires_grad=True, device=device)
    with recompute_scope():
        v = a[1:]
    y = v * c
    del v
    a.add_(1)
    with pytest.raises(RuntimeError):
        y.sum().backward()
    del y
    gc.collect()
    assert_interception_gone()


def test_view_of_outside_tensor_made_in_block_base_modified_before_save(device):
    def program(scope):
        p = torch.randn(4, 5, requires_grad=True, device=device)
        a = p * 1
        c = torch.randn(3, 5, requires_grad=True, device=device)
        with scope():
            v = a[1:]
        a.mul_(2)  # v sees it too: saved afterwards, so stored as usual
        y = v * c
        del v
        y.sum().backward()
        return dict(y=y.detach(), **grads(dict(p=p, c=c)))

    run_both(program)


def test_outside_tensor_modified_inside_block_after_being_read(device):
    """x = a * 2 reads a; then the block itself modifies a.  Replaying x from the new a
    would be wrong: the scope must store x, replay faithfully, or raise RecomputeError."""
    p = torch.randn(5, requires_grad=True, device=device)
    c = torch.randn(5, requires_grad=True, device=device)
    a = p * 1
    with recompute_scope():
        x = a * 2
        a.add_(10)
    y = x * c
    del x
    try:
        y.sum().backward()
    except RecomputeError:
        return
    p2 = p.detach().clone().requires_grad_()
    c2 = c.detach().clone().requires_grad_()
    a2 = p2 * 1
    x2 = a2 * 2
    a2.add_(10)
    (x2 * c2).sum().backward()
    assert torch.equal(c.grad, c2.grad), "replayed x from the modified outside tensor"
    assert torch.equal(p.grad, p2.grad)


# --------------------------------------------------------------------------------------
# buffers saved before they are filled; block buffers filled in place


@pytest.mark.parametrize("debug", [False, True], ids=["default", "debug"])
@pytest.mark.parametrize("saved", ["inside", "after"])
def test_rrelu_module_train(debug, saved, device):
    """nn.RReLU in training mode: rrelu_with_noise saves its noise buffer (an empty_like
    output) before it writes the noise into it."""

    def program(scope):
        m = nn.RReLU(0.1, 0.3).train()
        x = leaf(6, 5, device=device)
        with scope():
            h = m(x * 1.5)
            if saved == "inside":
                y = h * h
        if saved == "after":
            y = h.tanh() * h
        del h
        scribble_free_memory(device=device)
        weighted_sum(y).backward()
        return [x.grad]

    check(program, debug=debug)


@pytest.mark.parametrize("debug", [False, True], ids=["default", "debug"])
def test_rrelu_functional_inplace(debug, device):
    """rrelu_with_noise_ (F.rrelu(inplace=True)) on a block tensor: the noise and the
    written tensor are both saved around the write."""

    def program(scope):
        x = leaf(6, 5, device=device)
        with scope():
            h = x * 2
            F.rrelu(h, 0.1, 0.4, training=True, inplace=True)
            g = h.exp()
        del h
        scribble_free_memory(device=device)
        weighted_sum(g).backward()
        return [x.grad]

    check(program, debug=debug)


@pytest.mark.parametrize("debug", [False, True], ids=["default", "debug"])
def test_rrelu_with_noise_explicit_generator(debug, device):
    def program(scope):
        gen = torch.Generator(device=device).manual_seed(11)
        x = leaf(4, 6, device=device)
        with scope():
            h = x * 2
            y = torch.ops.aten.rrelu_with_noise(h, torch.empty_like(h), 0.1, 0.3, True, gen)
        scribble_free_memory(device=device)
        weighted_sum(y * y).backward()
        return [x.grad]

    check(program, debug=debug)


@pytest.mark.parametrize("arrangement", ["nested", "later_scope_reads", "save_policy", "view_input"])
def test_rrelu_in_scope_arrangements(arrangement, device):
    def program(scope):
        m = nn.RReLU().train()
        x = leaf(4, 6, device=device)
        w = leaf(6, 6, device=device)
        if arrangement == "nested":
            with scope():
                h = x @ w
                with scope():
                    r = m(h)
                z = r.sin()
        elif arrangement == "later_scope_reads":
            with scope():
                r = m(x @ w)
            with scope():
                z = r * r
        elif arrangement == "save_policy":
            with scope(save=[torch.ops.aten.mm]):
                r = m(x @ w)
                z = r.sigmoid()
        else:
            with scope():
                h = x @ w
                r = m(h.t()[1:])
                z = r * 3
        del r
        scribble_free_memory(device=device)
        weighted_sum(z * z).backward()
        return [x.grad, w.grad]

    check(program)


FILLS: dict[str, Callable[[torch.Tensor, torch.Tensor], Any]] = {
    "bernoulli_": lambda buf, src: buf.bernoulli_(0.6),
    "uniform_": lambda buf, src: buf.uniform_(-1.0, 1.0),
    "normal_": lambda buf, src: buf.normal_(0.5, 2.0),
    "exponential_": lambda buf, src: buf.exponential_(),
    "geometric_": lambda buf, src: buf.geometric_(0.3),
    "cauchy_": lambda buf, src: buf.cauchy_(),
    "log_normal_": lambda buf, src: buf.log_normal_(),
    "random_": lambda buf, src: buf.random_(0, 7),
    "fill_": lambda buf, src: buf.fill_(1.5),
    "copy_": lambda buf, src: buf.copy_(src.sin()),
    "index_fill_": lambda buf, src: buf.zero_().index_fill_(1, torch.tensor([0, 2], device=buf.device), -2.0),
    "masked_fill_": lambda buf, src: buf.copy_(src).masked_fill_(src > 0, 0.25),
    "scatter_": lambda buf, src: buf.zero_().scatter_(1, torch.tensor([[1], [0], [3], [2]], device=buf.device), 3.0),
    "setitem": lambda buf, src: (buf.zero_(), buf.__setitem__((slice(None), 1), src[:, 2])),
    "out=": lambda buf, src: torch.mul(src, 2.0, out=buf),
    "rand_out=": lambda buf, src: torch.rand(4, 4, out=buf),
}


@pytest.mark.parametrize("fill_at", ["inside", "after"])
@pytest.mark.parametrize("fill", list(FILLS))
def test_block_buffer_filled_in_place_then_saved(fill, fill_at, device):
    """An uninitialised block buffer (empty_like / new_empty / empty) filled in place --
    inside the block, or after it (then it must be stored) -- and then saved."""

    def program(scope):
        a = leaf(4, 4, device=device)
        src = torch.randn(4, 4, device=device)  # no grad: fills and out= are legal on it
        with scope():
            h = a.sin()
            buf = torch.empty_like(h, requires_grad=False)
            if fill_at == "inside":
                FILLS[fill](buf, src)
                y = h * buf
        if fill_at == "after":
            FILLS[fill](buf, src)
            y = h * buf
        z = buf * a  # buf saved again after the block
        del h, buf
        scribble_free_memory(device=device)
        weighted_sum(y + z).backward()
        return [a.grad]

    check(program)


@pytest.mark.parametrize("debug", [False, True], ids=["default", "debug"])
def test_fused_fake_quant_buffers(debug, device):
    """fused_moving_avg_obs_fake_quant writes running_min/max, scale and zero_point
    (block tensors here) and saves its mask."""

    def program(scope):
        x = leaf(4, 6, device=device)
        on = torch.ones(1, dtype=torch.long, device=device)
        with scope():
            rmin = torch.full((1,), float("inf"), device=device) * 1
            rmax = torch.full((1,), float("-inf"), device=device) * 1
            scale = torch.ones(1, device=device) * 1
            zp = torch.zeros(1, dtype=torch.int32, device=device) + 0
            y = torch.fused_moving_avg_obs_fake_quant(x * 1.5, on, on, rmin, rmax, scale, zp, 0.01, 0, 255, -1)
            y = y * scale
        scribble_free_memory(device=device)
        weighted_sum(y * y).backward()
        return [x.grad]

    check(program, debug=debug)
