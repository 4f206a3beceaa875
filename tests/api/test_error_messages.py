"""What the library's error messages say: where the block was entered, the likely
cause with its fix; PyTorch's in-place error with PyTorch's own hint; torch.func's
refusal naming gradient_scope's hooks."""

import os
import time

import pytest
import torch
import torch.nn as nn

import gradient_scope
from gradient_scope import RecomputeError, apply_recompute, checkpoint, recompute, recompute_scope

HERE = os.path.basename(__file__)


def _line(fn, marker):
    """The line number of the source line of ``fn``'s module containing ``marker``."""
    with open(__file__) as f:
        for i, text in enumerate(f, 1):
            if marker in text and "_line(" not in text:
                return i
    raise AssertionError(marker)


def _backward_error(y):
    with pytest.raises(RecomputeError) as info:
        y.backward()
    return str(info.value)


def test_with_block_names_its_file_and_line_and_a_weight_update():
    w = torch.randn(3, requires_grad=True)
    with recompute_scope():  # SITE-WITH
        h = w.sin()
    y = (h * h).sum()
    del h
    with torch.no_grad():
        w.add_(1)  # an optimizer step between forward and backward
    msg = _backward_error(y)
    assert "aten.sin" in msg and "[3]" in msg  # the op and shape, as before
    assert "input parameter of shape [3]" in msg
    assert "optimizer step" in msg and "call optimizer.step() after backward" in msg
    assert f"the recompute_scope entered at {__file__}:{_line(None, '# SITE-WITH')}" in msg


def test_outside_tensor_written_after_the_block():
    x = torch.randn(3)  # an input, not a weight
    w = torch.randn(3, requires_grad=True)
    with recompute_scope():
        h = (w * x).sin()
    y = (h * h).sum()
    del h
    x.mul_(2)
    msg = _backward_error(y)
    assert "written in place after the block" in msg and "x.clone()" in msg
    assert "optimizer" not in msg


@recompute
def _decorated(w):
    return w.sin()


def test_decorated_call_names_the_call_site():
    w = torch.randn(3, requires_grad=True)
    h = _decorated(w)  # SITE-CALL
    y = (h * h).sum()
    del h
    with torch.no_grad():
        w.mul_(3)
    msg = _backward_error(y)
    assert f"entered at {__file__}:{_line(None, '# SITE-CALL')}" in msg


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x).tanh()


def test_apply_recompute_block_names_the_module_path():
    model = nn.Sequential(nn.Linear(4, 4), nn.ModuleDict({"inner": Block()}))
    apply_recompute(model, check_fn=Block)
    x = torch.randn(2, 4)
    y = model[1]["inner"](model[0](x)).pow(2).sum()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model[1]["inner"].lin.weight.grad = torch.ones(4, 4)
    opt.step()  # the classic mistake: a step before backward
    msg = _backward_error(y)
    assert "The block: 1.inner (Block), scoped by apply_recompute." in msg
    assert "call optimizer.step() after backward" in msg


def test_checkpoint_block_names_the_function_and_call_site():
    block = Block()
    x = torch.randn(2, 4)
    y = checkpoint(block, x, use_reentrant=False).pow(2).sum()  # SITE-CKPT
    with torch.no_grad():
        block.lin.weight.add_(1)
    msg = _backward_error(y)
    assert f"The block: gradient_scope.checkpoint(Block), called at {__file__}:{_line(None, '# SITE-CKPT')}." in msg
    y = checkpoint(block.forward, x).pow(2).sum()
    with torch.no_grad():
        block.lin.bias.add_(1)
    assert "gradient_scope.checkpoint(Block.forward)" in _backward_error(y)


def test_replaced_data_names_the_cause():
    w = torch.randn(3, requires_grad=True)
    with recompute_scope():
        h = w.sin()
    y = (h * h).sum()
    del h
    w.data = torch.randn(3)
    msg = _backward_error(y)
    assert "`tensor.data = ...`" in msg and "Likely cause" in msg and "The block: the recompute_scope entered at" in msg


def _pytorch_inplace_message(anomaly):
    """PyTorch's own message for a saved tensor modified in place (no hooks on the stack)."""
    a = torch.randn(3, requires_grad=True)
    b = a.exp()
    c = b * 2
    b.add_(1)
    with torch.autograd.set_detect_anomaly(anomaly), pytest.warns() if anomaly else _nothing():
        with pytest.raises(RuntimeError) as info:
            c.sum().backward()
    return str(info.value)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("anomaly", [False, True])
def test_inplace_error_keeps_pytorchs_message_and_hint(anomaly):
    pytorch = _pytorch_inplace_message(anomaly)
    hint = pytorch[pytorch.index("Hint:") :]
    a = torch.randn(3, requires_grad=True)
    with recompute_scope():
        alive = a * 2  # keeps gradient_scope's hooks on the stack
    b = a.exp()
    c = b * 2
    b.add_(1)
    with torch.autograd.set_detect_anomaly(anomaly), pytest.warns() if anomaly else _nothing():
        with pytest.raises(RuntimeError) as info:
            c.sum().backward()
    msg = str(info.value)
    assert not isinstance(info.value, RecomputeError)
    assert msg.startswith(
        "one of the variables needed for gradient computation has been modified by an inplace "
        "operation: [torch.FloatTensor [3]]"
    )
    assert "is at version 1; expected version 0 instead." in msg
    assert hint in msg  # PyTorch's own hint, as PyTorch words it
    assert "gradient_scope's saved-tensor hooks were on the stack" in msg
    del alive


def test_torch_func_refusal_names_gradient_scope():
    x = torch.randn(3, requires_grad=True)
    with recompute_scope():
        alive = x.sin()
    with pytest.raises(RuntimeError) as info:
        torch.func.grad(lambda t: (t * t).sum())(torch.randn(3))
    msg = str(info.value)
    assert "don't yet support saved tensor hooks" in msg  # torch.func's own message
    assert "gradient_scope: its saved-tensor hooks are on this thread's stack" in msg
    assert "gradient_scope.disabled()" in msg and "let the block's tensors die" in msg
    del alive
    # No live block tensor: the hooks are gone, torch.func runs.
    assert torch.func.grad(lambda t: (t * t).sum())(torch.ones(3)).tolist() == [2.0, 2.0, 2.0]


def test_torch_func_refusal_without_our_hooks_is_pytorchs_alone():
    with torch.autograd.graph.save_on_cpu():
        with pytest.raises(RuntimeError) as info:
            torch.func.grad(lambda t: (t * t).sum())(torch.randn(3))
    assert "gradient_scope" not in str(info.value)


def test_scope_entry_cost():
    """Capturing the site costs little next to entering a scope (loosely bounded)."""
    x = torch.randn(4, requires_grad=True)
    scope_cls = recompute_scope

    def enter_exit(n):
        t0 = time.perf_counter()
        for _ in range(n):
            with scope_cls():
                pass
        return (time.perf_counter() - t0) / n

    def getframe(n):
        t0 = time.perf_counter()
        for _ in range(n):
            gradient_scope._api.scope._caller_site()
        return (time.perf_counter() - t0) / n

    enter_exit(200)
    entry = min(enter_exit(2000) for _ in range(3))
    site = min(getframe(2000) for _ in range(3))
    assert site < 0.25 * entry, f"scope enter+exit {entry * 1e6:.2f} us, site capture {site * 1e6:.3f} us"
    del x
