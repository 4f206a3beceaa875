"""Interop with torch.utils.checkpoint (``docs/compatibility.md``).

Every combination of a recompute_scope and torch.utils.checkpoint gives the gradients of
the plain program (same code, no scope, same seed; ``torch.equal``, on CPU and CUDA): a scope inside
a checkpointed function, a checkpoint inside a scope, a scope's tensor flowing into a
checkpointed function, a checkpoint's output read by a later scope; reentrant and
non-reentrant checkpoint; selective checkpointing (``context_fn``); early stop on and off,
including checkpoint aborting its recomputation (``_StopRecomputationError`` raised from
its pack hook) while a scope is open inside the recomputed function.

After each test, once all tensors are dropped, the saved-tensor hook stack and the
dispatch mode stack are what they were before (checked without ``gc.collect()``).
"""

import contextlib
import functools

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
    set_checkpoint_early_stop,
)

from support import assert_stacks_clean, grads, stat
from support.interop import run_both_clean

REENTRANT = [pytest.param(True, id="reentrant"), pytest.param(False, id="nonreentrant")]
EARLY_STOP = [pytest.param(True, id="early_stop"), pytest.param(False, id="no_early_stop")]


def early_stop_ctx(enabled):
    return contextlib.nullcontext() if enabled else set_checkpoint_early_stop(False)


def ckpt(fn, *args, reentrant, **kw):
    return checkpoint(fn, *args, use_reentrant=reentrant, **kw)


def params(*shapes, device="cpu"):
    return [torch.randn(*s, requires_grad=True, device=device) for s in shapes]


# ----------------------------------------------------------------------------------------
# a scope inside a checkpointed function


@pytest.mark.parametrize("early_stop", EARLY_STOP)
@pytest.mark.parametrize("reentrant", REENTRANT)
def test_scope_inside_checkpoint(reentrant, early_stop, device):
    def program(scope):
        x, w1, w2, c = params((6, 8), (8, 10), (10, 4), (6, 4), device=device)

        def fn(inp):
            h = inp @ w1
            with scope():
                a = F.gelu(h)
                b = a * h.sin()  # saves a (block) and h.sin() (block), sin saves h (outside)
                d = torch.dropout(b, 0.3, True)
            e = d @ w2  # block tensor saved after the block, inside the checkpointed fn
            return e * a.sum(dim=1, keepdim=True)

        with early_stop_ctx(early_stop):
            out = ckpt(fn, x, reentrant=reentrant)
        loss = (out * c).tanh().sum()
        loss.backward()
        return dict(loss=loss.detach(), **grads(dict(x=x, w1=w1, w2=w2, c=c)))

    run_both_clean(program)
    assert_stacks_clean()


@pytest.mark.parametrize("early_stop", EARLY_STOP)
@pytest.mark.parametrize("reentrant", REENTRANT)
def test_whole_checkpointed_function_in_scope(reentrant, early_stop, device):
    """The checkpointed function's whole body is a scope; its output leaves the block."""

    def program(scope):
        x, w1, w2 = params((5, 7), (7, 9), (9, 3), device=device)

        def fn(inp):
            with scope():
                h = torch.tanh(inp @ w1)
                return torch.sigmoid(h @ w2) * h[:, :3]

        with early_stop_ctx(early_stop):
            y = ckpt(fn, x, reentrant=reentrant)
        z = y.exp() * y  # checkpoint output (a block tensor in the scoped run) saved after
        z.sum().backward()
        return dict(z=z.detach(), **grads(dict(x=x, w1=w1, w2=w2)))

    run_both_clean(program)
    assert_stacks_clean()


# ----------------------------------------------------------------------------------------
# a checkpoint inside a scope


@pytest.mark.parametrize("early_stop", EARLY_STOP)
@pytest.mark.parametrize("reentrant", REENTRANT)
def test_checkpoint_inside_scope(reentrant, early_stop, device):
    def program(scope):
        x, w1, w2, c = params((6, 8), (8, 8), (8, 5), (6, 5), device=device)

        def fn(h):
            return torch.sigmoid(h @ w2) * h.sum(dim=1, keepdim=True)

        with scope():
            h = torch.relu(x @ w1)
            with early_stop_ctx(early_stop):
                y = ckpt(fn, h, reentrant=reentrant)
            z = y * y.cos()
        out = (z * c).sum() + (h * h).sum()
        del h, y
        out.backward()
        return dict(out=out.detach(), **grads(dict(x=x, w1=w1, w2=w2, c=c)))

    run_both_clean(program)
    assert_stacks_clean()


@pytest.mark.parametrize("reentrant", REENTRANT)
def test_nested_scope_checkpoint_scope(reentrant, device):
    """scope > checkpoint > scope."""

    def program(scope):
        x, w1, w2 = params((4, 6), (6, 6), (6, 6), device=device)

        def fn(h):
            with scope():
                g = (h @ w2).tanh()
            return g * h

        with scope():
            h = (x @ w1).sin()
            y = ckpt(fn, h, reentrant=reentrant)
        (y.exp() * h).sum().backward()
        return grads(dict(x=x, w1=w1, w2=w2))

    run_both_clean(program)
    assert_stacks_clean()


# ----------------------------------------------------------------------------------------
# tensors flowing between scopes and checkpointed functions


@pytest.mark.parametrize("early_stop", EARLY_STOP)
@pytest.mark.parametrize("reentrant", REENTRANT)
def test_scope_tensor_into_checkpoint(reentrant, early_stop, device):
    def program(scope):
        x, w1, w2, c = params((6, 8), (8, 8), (8, 5), (6, 5), device=device)
        with scope():
            h = F.gelu(x @ w1)
            v = h.t()  # a view of a block tensor, passed in too

        def fn(a, at):
            return (a @ w2).tanh() * (at.t() * a).sum(dim=1, keepdim=True)

        with early_stop_ctx(early_stop):
            y = ckpt(fn, h, v, reentrant=reentrant)
        del h, v  # only the checkpoint (and its saved inputs) refer to them now
        (y * c).sum().backward()
        return dict(y=y.detach(), **grads(dict(x=x, w1=w1, w2=w2, c=c)))

    run_both_clean(program)
    assert_stacks_clean()


@pytest.mark.parametrize("early_stop", EARLY_STOP)
@pytest.mark.parametrize("reentrant", REENTRANT)
def test_checkpoint_output_read_by_later_scope(reentrant, early_stop, device):
    def program(scope):
        x, w1, w2, c = params((6, 8), (8, 8), (8, 5), (6, 5), device=device)

        def fn(a):
            return torch.sigmoid(a @ w1) * a

        with early_stop_ctx(early_stop):
            y = ckpt(fn, x, reentrant=reentrant)
        with scope():
            z = (y @ w2).exp()
            u = z * y.sum(dim=1, keepdim=True)
        out = (u * c).sum() + (z * u).sum()
        del z, u
        out.backward()
        return dict(out=out.detach(), **grads(dict(x=x, w1=w1, w2=w2, c=c)))

    run_both_clean(program)
    assert_stacks_clean()


@pytest.mark.parametrize("reentrant", REENTRANT)
def test_scope_checkpoint_scope_chain(reentrant, device):
    """scope -> checkpoint -> scope, tensors flowing along and all dropped before backward."""

    def program(scope):
        x, w1, w2, w3 = params((5, 6), (6, 6), (6, 6), (6, 2), device=device)
        with scope():
            a = (x @ w1).tanh()
        b = ckpt(lambda t: (t @ w2).sigmoid() * t, a, reentrant=reentrant)
        with scope():
            d = torch.dropout(b @ w3, 0.2, True).exp()
        loss = (d * b[:, :2]).sum()
        del a, b, d
        loss.backward()
        return dict(loss=loss.detach(), **grads(dict(x=x, w1=w1, w2=w2, w3=w3)))

    run_both_clean(program)
    assert_stacks_clean()


# ----------------------------------------------------------------------------------------
# selective checkpointing


def _policy(ctx, op, *args, **kwargs):
    if op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


@pytest.mark.parametrize("early_stop", EARLY_STOP)
def test_scope_inside_selective_checkpoint(early_stop, device):
    def program(scope):
        x, w1, w2, c = params((6, 8), (8, 8), (8, 5), (6, 5), device=device)

        def fn(a):
            h = a @ w1
            with scope():
                g = F.gelu(h) * h.cos()
                k = g @ w2  # mm inside the scope, must-save for SAC
            return k.tanh() * g[:, :5]

        with early_stop_ctx(early_stop):
            y = checkpoint(
                fn,
                x,
                use_reentrant=False,
                context_fn=functools.partial(create_selective_checkpoint_contexts, _policy),
            )
        (y * c).sum().backward()
        return dict(y=y.detach(), **grads(dict(x=x, w1=w1, w2=w2, c=c)))

    run_both_clean(program)
    assert_stacks_clean()


@pytest.mark.parametrize("early_stop", EARLY_STOP)
def test_selective_checkpoint_inside_scope(early_stop, device):
    def program(scope):
        x, w1, w2, c = params((6, 8), (8, 8), (8, 5), (6, 5), device=device)

        def fn(a):
            return (a @ w2).sigmoid() * (a @ w2).sin()

        with scope():
            h = (x @ w1).relu()
            with early_stop_ctx(early_stop):
                y = checkpoint(
                    fn,
                    h,
                    use_reentrant=False,
                    context_fn=functools.partial(create_selective_checkpoint_contexts, _policy),
                )
            z = y.exp()
        out = (z * c).sum() + h.pow(2).sum()
        del h, y, z
        out.backward()
        return dict(out=out.detach(), **grads(dict(x=x, w1=w1, w2=w2, c=c)))

    run_both_clean(program)
    assert_stacks_clean()


def test_selective_checkpoint_with_scope_save_option(device):
    """Both a save= policy on the scope and a SAC policy on the checkpoint."""

    def program(scope):
        x, w1, w2 = params((6, 8), (8, 8), (8, 8), device=device)

        def fn(a):
            with scope(save=[torch.ops.aten.mm]):
                h = (a @ w1).tanh()
                k = (h @ w2).sigmoid()
            return k * h

        y = checkpoint(
            fn,
            x,
            use_reentrant=False,
            context_fn=functools.partial(create_selective_checkpoint_contexts, _policy),
        )
        (y * y).sum().backward()
        return grads(dict(x=x, w1=w1, w2=w2))

    run_both_clean(program)
    assert_stacks_clean()


# ----------------------------------------------------------------------------------------
# early stop: checkpoint aborts its recomputation from inside a pack hook while a scope
# is open inside the recomputed function


@pytest.mark.parametrize("early_stop", EARLY_STOP)
def test_early_stop_abort_inside_open_scope(early_stop, device):
    after_stop = []  # Python side effect after the last tensor checkpoint counts

    def program(scope):
        after_stop.clear()
        x, w, v = params((5, 6), (6, 6), (6, 6), device=device)

        def fn(a):
            with scope():
                s = a.sin()  # saves a (outside the scope): checkpoint counts it
                m = s @ w  # saves s (block: a handle) and w (outside): counted
                # With early stop, recomputation raises _StopRecomputationError from the
                # pack hook above, right here, with the scope still open.
                after_stop.append(1)
                t = m.tanh()  # saves its output (block tensor): a handle, not counted
                r = t * 2.0
            return r + m

        with early_stop_ctx(early_stop):
            y = checkpoint(fn, x, use_reentrant=False)
        (y @ v).sum().backward()
        runs[scope.real] = len(after_stop)
        return dict(y=y.detach(), **grads(dict(x=x, w=w, v=v)))

    runs = {}
    scopes, actual = run_both_clean(program)
    # In the scoped run the last tensor checkpoint counts is w (s and t are recompute
    # handles), so with early stop the recomputation stops inside the open scope, before
    # the side effect; without early stop fn runs to its end again.
    assert runs[True] == (1 if early_stop else 2)
    # the recomputation's scope was created too (aborted by the stop, or closed normally)
    assert len(scopes.created) == 2
    assert stat(scopes.created[0], "ops_recorded") >= 4
    del scopes, actual
    assert_stacks_clean()


@pytest.mark.parametrize("early_stop", EARLY_STOP)
def test_early_stop_abort_nested_scopes_open(early_stop, device):
    """Two nested scopes open when the recomputation is aborted; training continues."""

    def program(scope):
        x, w = params((4, 5), (5, 5), device=device)
        outs = []
        for _ in range(2):  # a second step after the aborted recomputation

            def fn(a):
                with scope():
                    h = a.cos()
                    with scope():
                        k = h @ w  # last counted save (w) -> stop here
                        k2 = k.exp()
                    return k2 * h

            with early_stop_ctx(early_stop):
                y = checkpoint(fn, x, use_reentrant=False)
            y.sum().backward()
            outs.append(y.detach())
        return dict(outs=outs, **grads(dict(x=x, w=w)))

    run_both_clean(program)
    assert_stacks_clean()


# ----------------------------------------------------------------------------------------
# checkpoint retain_graph / grad within, with scopes


@pytest.mark.parametrize("reentrant", [pytest.param(False, id="nonreentrant")])
def test_checkpoint_retain_graph_twice(reentrant, device):
    def program(scope):
        x, w = params((4, 6), (6, 6), device=device)

        def fn(a):
            with scope():
                h = (a @ w).sigmoid()
            return h * a

        with scope():
            y = ckpt(fn, x, reentrant=reentrant).exp()
        y.sum().backward(retain_graph=True)
        g1 = [x.grad.clone(), w.grad.clone()]
        y.sum().backward()
        return dict(g1=g1, **grads(dict(x=x, w=w)))

    run_both_clean(program)
    assert_stacks_clean()


@pytest.mark.parametrize("reentrant", REENTRANT)
def test_checkpointed_module_training_steps(reentrant, device):
    """A small model: checkpointed blocks with scopes inside, three SGD steps."""

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = torch.nn.Linear(8, 16)
            self.fc2 = torch.nn.Linear(16, 8)

        def forward(self, x, scope):
            with scope():
                h = F.gelu(self.fc1(x))
                h = F.dropout(h, 0.1, self.training)
            return x + self.fc2(h)

    def program(scope):
        blocks = torch.nn.ModuleList([Block() for _ in range(2)]).to(device)
        opt = torch.optim.SGD(blocks.parameters(), lr=0.1)
        losses = []
        for _ in range(3):
            x = torch.randn(4, 8, requires_grad=reentrant, device=device)
            opt.zero_grad()
            for b in blocks:
                x = checkpoint(b, x, scope, use_reentrant=reentrant)
            loss = x.pow(2).mean()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return dict(losses=losses, params=[p.detach().clone() for p in blocks.parameters()])

    run_both_clean(program)
    assert_stacks_clean()
