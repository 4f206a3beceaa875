"""Writes between forward and backward that bypass PyTorch's version counter, and
``debug=True`` as the check for them (the guarantee of ``RecomputeError``: never
silently wrong for the writes PyTorch can see; the routes below are seen only by
``debug=True``). ``.data``, NumPy and ``untyped_storage()`` writes are covered in
tests/restore/test_hidden_writes.py; here: fused optimizers, a storage
``resize_`` round trip, and ``preserve_rng_state=False``.
"""

import pytest
import torch
import torch.nn.functional as F

from gradient_scope import RecomputeError, recompute_scope

OPTIMIZERS = {
    "Adam": lambda ps, **kw: torch.optim.Adam(ps, lr=0.1, **kw),
    "AdamW": lambda ps, **kw: torch.optim.AdamW(ps, lr=0.1, **kw),
    "SGD": lambda ps, **kw: torch.optim.SGD(ps, lr=0.1, momentum=0.9, **kw),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_fused_cpu_optimizers_do_not_bump_the_version(name):
    # Measured on torch 2.13 CPU (docs/limitations.md): fused=True writes parameters
    # without a version bump; foreach / for-loop steps bump it.
    for kw, bumps in (({"fused": True}, False), ({"foreach": True}, True), ({"foreach": False}, True)):
        p = torch.nn.Parameter(torch.randn(4))
        p.grad = torch.randn(4)
        before = p._version
        OPTIMIZERS[name]([p], **kw).step()
        assert (p._version != before) is bumps, kw


def _step_between_forward_and_backward(name, debug, **kw):
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    for p in lin.parameters():
        p.grad = torch.randn_like(p)
    opt = OPTIMIZERS[name](list(lin.parameters()), **kw)

    def fwd():
        with recompute_scope(debug=debug):
            h = torch.tanh(lin(x))
        return (h * h).sum()

    loss = fwd()
    opt.step()  # a weight update between forward and backward
    loss.backward()


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_fused_optimizer_step_caught_by_debug(name):
    with pytest.raises(RecomputeError, match="debug"):
        _step_between_forward_and_backward(name, True, fused=True)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_foreach_optimizer_step_caught_without_debug(name):
    with pytest.raises(RecomputeError, match="modified in place"):
        _step_between_forward_and_backward(name, False, foreach=True)


def test_storage_resize_round_trip_caught_by_debug():
    # The storage is freed and grown back (same storage, same version, new bytes).
    w = torch.randn(4, 4)
    x = torch.randn(4, 4, requires_grad=True)

    def fwd():
        with recompute_scope(debug=True):
            h = (x @ w).sin()
        return (h * h).sum()

    loss = fwd()
    s = w.untyped_storage()
    n = s.nbytes()
    s.resize_(0)
    s.resize_(n)
    w.detach().numpy().fill(3.0)  # new bytes, not a new version
    with pytest.raises(RecomputeError, match="debug"):
        loss.backward()


def _dropout_program(preserve, debug):
    torch.manual_seed(0)
    x = torch.randn(64, requires_grad=True)

    def fwd():
        with recompute_scope(preserve_rng_state=preserve, debug=debug):
            h = F.dropout(x * 2.0, p=0.5).exp()
        return h.sum()

    loss = fwd()
    torch.rand(3)  # the ambient RNG moves on between forward and backward
    loss.backward()
    return x.grad


def test_random_ops_without_rng_state_caught_by_debug():
    with pytest.raises(RecomputeError, match="debug"):
        _dropout_program(False, True)


def test_random_ops_with_rng_state_replay_exactly():
    torch.manual_seed(0)
    x = torch.randn(64, requires_grad=True)
    y = F.dropout(x * 2.0, p=0.5).exp()
    y.sum().backward()
    assert torch.equal(_dropout_program(True, True), x.grad)
