"""Random ops replay with the numbers they drew in forward; autocast regions recompute
what they computed in forward.  Parametrised on device (CUDA skipped when absent)."""

import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from gradient_scope import recompute_scope

from support import DEVICES, assert_interception_gone, dead, grads, run_both, stat


def _noise_between(device, g=None):
    """Random work the user does between forward and backward."""
    torch.rand(7, device=device)
    F.dropout(torch.ones(33, device=device), 0.3, training=True)
    torch.randn(2, 3, device=device).bernoulli_(0.5)
    if g is not None:
        torch.randn(4, device=device, generator=g)


@pytest.mark.parametrize("device", DEVICES)
def test_random_ops_replay_exactly(device):
    def program(scope):
        a = torch.randn(4, 6, device=device, requires_grad=True)
        c = torch.randn(4, 6, device=device, requires_grad=True)
        g = torch.Generator(device=device)
        g.manual_seed(1234)
        with scope():
            h = F.dropout(a.sin(), p=0.5, training=True)
            n = torch.randn(4, 6, device=device)
            r = torch.rand_like(a)
            gn = torch.randn(4, 6, device=device, generator=g)
            bern = torch.bernoulli(torch.full((4, 6), 0.3, device=device))
            perm = torch.randperm(6, device=device)
            x = (h * n + r * gn + bern).index_select(1, perm)
        y = x * c
        refs = [weakref.ref(t) for t in (h, n, r, gn, bern, x)]
        del h, n, r, gn, bern, x, perm
        if scope.real:
            assert dead(*refs)
        _noise_between(device, g)
        y.sum().backward(retain_graph=True)
        first = [a.grad.clone(), c.grad.clone()]
        _noise_between(device, g)
        y.sum().backward()
        after = torch.rand(3, device=device)
        after_g = torch.rand(3, device=device, generator=g)
        return dict(y=y.detach(), first=first, after=after, after_g=after_g, **grads(dict(a=a, c=c)))

    scopes, _ = run_both(program)
    assert stat(scopes.created[0], "replays") >= 2


@pytest.mark.parametrize("device", DEVICES)
def test_random_value_needed_alone_and_out_of_order(device):
    """r2 is needed before r1 in backward (and r1's replay is not needed for r2): each
    gets exactly the numbers it drew."""

    def program(scope):
        a = torch.randn(8, device=device, requires_grad=True)
        b = torch.randn(8, device=device, requires_grad=True)
        c = torch.randn(8, device=device, requires_grad=True)
        with scope():
            r1 = F.dropout(a, 0.5, training=True)
            r2 = torch.rand(8, device=device) * b
            r3 = torch.randn(8, device=device) + r1
        d = (r1 * c).sum()
        loss = (r2 * d).sum() + (r3 * r3).sum()
        del r1, r2, r3
        torch.randn(100, device=device)
        (gb,) = torch.autograd.grad(loss, [b], retain_graph=True)  # needs r2 (and d) only
        torch.rand(5, device=device)
        loss.backward()
        return dict(gb=gb, after=torch.rand(2, device=device), **grads(dict(a=a, b=b, c=c)))

    run_both(program)


@pytest.mark.parametrize("device", DEVICES)
def test_two_scopes_random_side_by_side(device):
    def program(scope):
        a = torch.randn(5, 5, device=device, requires_grad=True)

        def f(t):
            with scope():
                return F.dropout(torch.tanh(t), 0.4, training=True) * torch.randn_like(t)

        y = f(a) * f(a.t())
        z = f(y)
        torch.rand(9, device=device)
        z.sum().backward()
        return dict(z=z.detach(), after=torch.randn(2, device=device), **grads(dict(a=a)))

    scopes, _ = run_both(program)
    assert len(scopes.created) == 3
    assert all(stat(s, "replays") >= 1 for s in scopes.created)


@pytest.mark.parametrize("device", DEVICES)
def test_user_rng_stream_unchanged_by_replay(device):
    """Replay never changes the ambient RNG state: the RNG state right after backward is
    the one the plain program has."""

    def program(scope):
        a = torch.randn(16, device=device, requires_grad=True)
        with scope():
            x = F.dropout(a, 0.5, training=True)
            y = x * torch.rand(16, device=device)
        z = y * a
        del x, y
        z.sum().backward()
        state = torch.get_rng_state() if device == "cpu" else torch.cuda.get_rng_state()
        return dict(state=state, next=torch.rand(3, device=device), **grads(dict(a=a)))

    run_both(program)


@pytest.mark.parametrize("device", DEVICES)
def test_model_with_dropout_three_steps(device):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.l1 = nn.Linear(10, 20)
            self.l2 = nn.Linear(20, 20)
            self.l3 = nn.Linear(20, 3)

        def forward(self, x, scope):
            with scope():
                h = F.dropout(F.gelu(self.l1(x)), 0.2, training=True)
                h = F.dropout(torch.tanh(self.l2(h)), 0.2, training=True)
            return self.l3(h)

    def program(scope):
        net = Net().to(device)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        losses = []
        for _ in range(3):
            x = torch.randn(6, 10, device=device)
            loss = net(x, scope).pow(2).mean()
            _noise_between(device)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return dict(losses=losses, params=[p.detach().clone() for p in net.parameters()])

    run_both(program)


@pytest.mark.parametrize("device", DEVICES)
def test_preserve_rng_state_false_runs(device):
    """Random ops replay with whatever the state is then; deterministic parts are still
    exact, and the program runs."""

    # deterministic block: exact gradients
    def program(scope):
        a = torch.randn(5, device=device, requires_grad=True)
        with scope():
            x = torch.tanh(a) * 2
        y = x * a
        del x
        y.sum().backward()
        return grads(dict(a=a))

    scopes, _ = run_both(program, preserve_rng_state=False)
    assert stat(scopes.created[0], "replays") >= 1

    # random block: runs, right shapes, finite, and the random op was replayed
    s = recompute_scope(preserve_rng_state=False)
    a = torch.randn(64, device=device, requires_grad=True)
    with s:
        x = F.dropout(a.exp(), 0.5, training=True)
    y = (x * a).sum()
    del x
    torch.rand(3, device=device)
    y.backward()
    assert a.grad.shape == a.shape and torch.isfinite(a.grad).all()
    assert stat(s, "replays") >= 1
    del y
    assert_interception_gone()


# --------------------------------------------------------------------------------------
# autocast


def _amp_dtype(device):
    return torch.bfloat16


@pytest.mark.parametrize("backward_in_autocast", [False, True], ids=["bwd_plain", "bwd_autocast"])
@pytest.mark.parametrize("device", DEVICES)
def test_autocast_in_block(device, backward_in_autocast):
    def program(scope):
        lin = nn.Linear(8, 16).to(device)
        lin2 = nn.Linear(16, 4).to(device)
        x = torch.randn(3, 5, 8, device=device, requires_grad=True)
        c = torch.randn(3, 5, 16, device=device, requires_grad=True)
        with scope():
            with torch.autocast(device, dtype=_amp_dtype(device)):
                h = F.gelu(lin(x))  # bf16
                s = torch.softmax(h, dim=-1)  # autocast to float32
                m = torch.bmm(h, h.transpose(1, 2))  # bf16
            hf = h.float() * 3
        assert h.dtype == _amp_dtype(device)
        with torch.autocast(device, dtype=_amp_dtype(device)):
            out = lin2(h)  # block tensor (3-D, reshaped) saved under autocast after the block
        loss = out.float().sum() + (s * c).sum() + m.float().pow(2).sum() + (hf * c).sum()
        del h, s, m, hf
        if backward_in_autocast:
            with torch.autocast(device, dtype=_amp_dtype(device)):
                loss.backward()
        else:
            loss.backward()
        return dict(loss=loss.detach(), **grads(dict(x=x, c=c, lin=lin, lin2=lin2)))

    before = torch.is_autocast_enabled(device)
    scopes, _ = run_both(program)
    assert torch.is_autocast_enabled(device) == before
    assert stat(scopes.created[0], "replays") >= 1


@pytest.mark.parametrize("backward_in_autocast", [False, True], ids=["bwd_plain", "bwd_autocast"])
@pytest.mark.parametrize("device", DEVICES)
def test_scope_inside_autocast_region(device, backward_in_autocast):
    def program(scope):
        w = torch.randn(6, 6, device=device, requires_grad=True)
        x = torch.randn(4, 6, device=device, requires_grad=True)
        with torch.autocast(device, dtype=_amp_dtype(device)):
            with scope():
                h = torch.relu(x @ w)
                h2 = (h @ w).sigmoid()
            out = h2 @ w
        loss = out.float().sum()
        del h, h2
        if backward_in_autocast:
            with torch.autocast(device, dtype=_amp_dtype(device)):
                loss.backward()
        else:
            loss.backward()
        return dict(out=out.detach(), **grads(dict(w=w, x=x)))

    run_both(program)


@pytest.mark.parametrize("device", DEVICES)
def test_autocast_disabled_inside_block(device):
    def program(scope):
        w = torch.randn(6, 6, device=device, requires_grad=True)
        x = torch.randn(4, 6, device=device, requires_grad=True)
        with torch.autocast(device, dtype=_amp_dtype(device)):
            with scope():
                h = x @ w  # bf16
                with torch.autocast(device, enabled=False):
                    f = h.float() @ w  # float32
                g = f @ w  # bf16 again
        loss = (g.float() * f).sum()
        del h, f, g
        loss.backward()
        return dict(loss=loss.detach(), **grads(dict(w=w, x=x)))

    run_both(program)


@pytest.mark.parametrize("device", DEVICES)
def test_reseed_and_dropped_generator_between_forward_and_backward(device):
    def program(scope):
        a = torch.randn(6, 5, device=device, requires_grad=True)
        g = torch.Generator(device=device)
        g.manual_seed(77)
        with scope():
            h = F.dropout(torch.tanh(a), 0.5, training=True, inplace=False)
            h = F.dropout(h * 2, 0.25, training=True, inplace=True)  # in-place on a block tensor
            with scope():  # nested random work
                n = torch.randn(6, 5, device=device, generator=g) * h
            x = n.exp() + torch.rand_like(n)
        y = x * a
        del h, n, x, g  # the generator object is gone before backward
        torch.manual_seed(999)  # the user reseeds between forward and backward
        if device == "cuda":
            torch.cuda.manual_seed(999)
        y.sum().backward()
        return dict(y=y.detach(), after=torch.rand(4, device=device), **grads(dict(a=a)))

    run_both(program)


@pytest.mark.parametrize("device", DEVICES)
def test_random_ops_replay_bitwise_under_deterministic_algorithms(device):
    """Under ``torch.use_deterministic_algorithms(True)`` (restored after, also when the
    run fails): dropout, bernoulli and rand_like in a block replay in backward with the
    numbers they drew in forward, and the gradients are bitwise those of the plain program
    (``torch.equal`` on CUDA too).  Elementwise ops only: no cuBLAS call, which would need
    ``CUBLAS_WORKSPACE_CONFIG`` set before the process starts."""

    def program(scope):
        a = torch.randn(64, 48, device=device, requires_grad=True)
        c = torch.randn(64, 48, device=device, requires_grad=True)
        with scope():
            h = F.dropout(a.sin(), 0.3, training=True)
            m = torch.bernoulli(torch.sigmoid(a.detach()))
            r = torch.rand_like(a)
            x = (h * m + r * a.cos()).tanh()
        y = x * c
        refs = [weakref.ref(t) for t in (h, m, r, x)]
        del h, m, r, x
        if scope.real:
            assert dead(*refs)
        _noise_between(device)
        y.sum().backward()
        return dict(y=y.detach(), after=torch.rand(3, device=device), **grads(dict(a=a, c=c)))

    mode = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        scopes, _ = run_both(program)
    finally:
        torch.use_deterministic_algorithms(mode, warn_only=warn_only)
    assert stat(scopes.created[0], "replays") >= 1
