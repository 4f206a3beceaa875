"""The autograd entry points with scopes (``docs/compatibility.md``):
``torch.autograd.grad`` with ``inputs=``, ``retain_graph=True`` and repeated backward,
``create_graph=True`` (double backward), ``gradgradcheck``, ``autograd.grad`` inside the
block, and partial replay (only the ops a backward needs are replayed).  Ground truth:
the plain program, ``torch.equal``."""

import pytest
import torch
import torch.nn.functional as F

from gradient_scope import recompute_scope

from support import assert_stacks_clean, grads, stat
from support.interop import run_both_clean


def leaves(*shapes, dtype=torch.float32, device="cpu"):
    return [torch.randn(*s, dtype=dtype, requires_grad=True, device=device) for s in shapes]


# ----------------------------------------------------------------------------------------
# autograd.grad with inputs=


@pytest.mark.parametrize("subset", ["a", "b", "c", "ab", "bc"])
def test_grad_inputs_subset(subset, device):
    def program(scope):
        a, b, c = leaves((4, 6), (6, 5), (4, 5), device=device)
        with scope():
            h = (a @ b).tanh()
            k = torch.dropout(h, 0.25, True) * h
        y = (k * c).exp() + h.sin()
        del h, k
        named = dict(a=a, b=b, c=c)
        gs = torch.autograd.grad(y.sum(), inputs=[named[n] for n in subset])
        return dict(y=y.detach(), g=list(gs))

    run_both_clean(program)
    assert_stacks_clean()


def test_backward_inputs_subset(device):
    def program(scope):
        a, b, c = leaves((4, 6), (6, 5), (4, 5), device=device)
        with scope():
            h = F.gelu(a @ b)
        (h * c).sum().backward(inputs=[b, c])
        assert a.grad is None
        return grads(dict(b=b, c=c))

    run_both_clean(program)
    assert_stacks_clean()


# ----------------------------------------------------------------------------------------
# retain_graph and repeated backward


def test_retain_graph_repeated_backward(device):
    def program(scope):
        a, b, c = leaves((5, 4), (4, 4), (5, 4), device=device)
        with scope():
            h = (a @ b).sigmoid()
            d = torch.dropout(h, 0.5, True)
        y = (d * c).tanh() + d.exp() * h
        del h, d
        loss = y.sum()
        out = {}
        for i in range(3):
            loss.backward(retain_graph=i < 2)
            out[f"pass{i}"] = [a.grad.clone(), b.grad.clone(), c.grad.clone()]
        return out

    scopes, _ = run_both_clean(program)
    (s,) = scopes.created
    # each pass replays again (a later pass after retain_graph=True replays again)
    assert stat(s, "replays") >= 3
    del scopes, s
    assert_stacks_clean()


def test_retain_graph_grad_then_backward(device):
    def program(scope):
        a, b = leaves((3, 7), (3, 7), device=device)
        with scope():
            h = a.exp() * b
        y = h.cos() * h
        del h
        g1 = torch.autograd.grad(y.sum(), [a], retain_graph=True)[0]
        g2 = torch.autograd.grad(y.sum(), [b], retain_graph=True)[0]
        y.sum().backward()
        return dict(g1=g1, g2=g2, **grads(dict(a=a, b=b)))

    run_both_clean(program)
    assert_stacks_clean()


# ----------------------------------------------------------------------------------------
# create_graph / higher order


def test_create_graph_double_backward(device):
    def program(scope):
        a, b, c = leaves((4, 5), (5, 3), (4, 3), device=device)
        with scope():
            h = (a @ b).tanh()
            k = h.exp() * h
        y = (k * c).sin()
        del h, k
        ga, gb = torch.autograd.grad(y.sum(), [a, b], create_graph=True)
        assert ga.requires_grad and gb.requires_grad
        (ga.pow(2).sum() + (gb * gb.cos()).sum()).backward()
        return dict(ga=ga.detach(), gb=gb.detach(), **grads(dict(a=a, b=b, c=c)))

    run_both_clean(program)
    assert_stacks_clean()


def test_create_graph_third_order(device):
    def program(scope):
        (x,) = leaves((6,), device=device)
        with scope():
            h = x.sin() * x.exp()
        y = (h * h).sum()
        del h
        (g1,) = torch.autograd.grad(y, x, create_graph=True)
        (g2,) = torch.autograd.grad(g1.sum(), x, create_graph=True)
        (g3,) = torch.autograd.grad(g2.sum(), x)
        return dict(g1=g1.detach(), g2=g2.detach(), g3=g3)

    run_both_clean(program)
    assert_stacks_clean()


def test_gradgradcheck_scope_inside(device):
    def fn(a, b):
        with recompute_scope():
            h = (a @ b).tanh()
            k = h * a.sum(dim=1, keepdim=True)
        return (k.exp() * h).sin()

    torch.manual_seed(0)
    a = torch.randn(3, 4, dtype=torch.float64, requires_grad=True, device=device)
    b = torch.randn(4, 2, dtype=torch.float64, requires_grad=True, device=device)
    assert torch.autograd.gradcheck(fn, (a, b))
    assert torch.autograd.gradgradcheck(fn, (a, b))
    del a, b
    assert_stacks_clean()


# ----------------------------------------------------------------------------------------
# autograd.grad inside the block


@pytest.mark.parametrize("create_graph", [False, True])
def test_grad_called_inside_block(create_graph, device):
    def program(scope):
        a, b = leaves((4, 5), (4, 5), device=device)
        with scope():
            h = (a * b).exp()
            (ga,) = torch.autograd.grad(h.sum(), a, create_graph=create_graph, retain_graph=True)
            k = h.sin() * ga
        y = k * h
        del h, k, ga
        y.sum().backward()
        return dict(y=y.detach(), **grads(dict(a=a, b=b)))

    run_both_clean(program)
    assert_stacks_clean()


def test_backward_of_earlier_graph_inside_block(device):
    """A full backward (of an earlier scope's tensors) runs while another block is open."""

    def program(scope):
        a, b = leaves((4, 5), (4, 5), device=device)
        with scope():
            h = (a * b).exp()
        loss1 = (h * h).sum()
        del h
        with scope():
            m = (a - b).tanh()
            loss1.backward()  # replays the first scope's tensors inside the second block
            k = m * m
        (k.sum()).backward()
        return grads(dict(a=a, b=b))

    run_both_clean(program)
    assert_stacks_clean()


# ----------------------------------------------------------------------------------------
# partial replay


def test_partial_grad_replays_only_needed_ops(device):
    def program(scope):
        a, b, c, d = leaves((4, 4), (4, 4), (4, 4), (4, 4), device=device)
        with scope():
            h1 = a.sin().exp()  # 2 ops
            h2 = b.cos().tanh().exp()  # 3 ops
        y = (h1 * c).sum() + (h2 * d).sum()
        del h1, h2
        (gc,) = torch.autograd.grad(y, inputs=[c])  # needs h1 only
        return dict(gc=gc)

    scopes, _ = run_both_clean(program)
    (s,) = scopes.created
    recorded, replayed = stat(s, "ops_recorded"), stat(s, "ops_replayed")
    assert recorded >= 5
    assert 0 < replayed < recorded, (replayed, recorded)
    assert replayed <= 2, f"replayed {replayed} ops where h1 needs 2"
    del scopes, s
    assert_stacks_clean()


def test_second_pass_replays_the_rest(device):
    """grad for c (needs h1) then, after retain_graph, for d (needs h2): each pass replays
    only its part, and each recorded op at most once per pass."""

    def program(scope):
        a, b, c, d = leaves((4, 4), (4, 4), (4, 4), (4, 4), device=device)
        with scope():
            h1 = a.sin().exp()
            h2 = b.cos().tanh().exp()
        y = (h1 * c).sum() + (h2 * d).sum() + (h1 * h2).sum()
        del h1, h2
        (gc,) = torch.autograd.grad(y, inputs=[c], retain_graph=True)
        replayed_after_first[scope.real] = stat(scope.created[0], "ops_replayed") if scope.real else None
        (ga, gb) = torch.autograd.grad(y, inputs=[a, b])
        return dict(gc=gc, ga=ga, gb=gb)

    replayed_after_first = {}
    scopes, _ = run_both_clean(program)
    (s,) = scopes.created
    recorded = stat(s, "ops_recorded")
    first = replayed_after_first[True]
    total = stat(s, "ops_replayed")
    # first pass: h1 (via (h1*c)) and h2 (via (h1*h2)) -> at most all 5 ops, once each
    assert first <= recorded
    # second pass needs everything, once each
    assert total - first <= recorded
    del scopes, s
    assert_stacks_clean()


def test_each_op_replayed_at_most_once_per_pass(device):
    """``docs/concepts.md``: within one backward pass each recorded op is replayed at most once; a
    replayed value other still-packed handles depend on is kept until they are served.
    Here exp saves its output h and mul saves h again: two handles of one tensor."""
    a, c = leaves((4,), (4,), device=device)
    s = recompute_scope()
    with s:
        h = a.sin().exp()
    y = (h * c).sum()
    del h
    y.backward()
    assert stat(s, "ops_recorded") == 2
    assert stat(s, "ops_replayed") <= 2, (
        f"one backward pass replayed {stat(s, 'ops_replayed')} ops of a 2-op record ({s.stats})"
    )
    ga = a.grad.clone()
    a.grad = None
    (a.sin().exp() * c).sum().backward()
    assert torch.equal(ga, a.grad)
    del s, y
    assert_stacks_clean()
