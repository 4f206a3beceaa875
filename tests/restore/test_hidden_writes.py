"""Writes that bypass the version counter, and storage swaps, between forward and backward
(or inside the block after a read).

Routes: in place through ``.data``, ``.data =`` (another storage), numpy arrays
(``Tensor.numpy``, ``torch.from_numpy``), ``untyped_storage()``, and ``set_`` (another
storage; it bumps the version counter). Targets: outside tensors the block read,
parameters, block tensors dropped or kept alive, tensors saved outside any block. The
scoped program equals the plain one or raises ``RecomputeError`` (``support.contract.check``);
with ``debug=True`` every route is caught. What no check can see without ``debug=True``
is a documented limitation (``docs/limitations.md``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn

from support import DEVICES, ROOT
from support.contract import check, leaf, weighted_sum
from support.writes import WRITES

# Routes that bypass the version counter, plus set_ (which bumps it).
ROUTES = {r: WRITES[r] for r in ("data_inplace", "data_assign", "numpy", "untyped_storage", "set_")}


# numpy arrays share memory with CPU tensors only: no such route to a CUDA tensor.
HOST_ONLY = {"numpy", "from_numpy_array"}


def _cases(routes, detectable):
    """(route, debug, device) triples: every route with debug=True (which must catch what
    it cannot replay faithfully), and without debug only the routes a check can see there.
    The others -- in-place writes through .data, numpy or untyped_storage() to a tensor that
    is gone (or, for outside tensors, not the scope's) at backward -- leave no trace
    without reading the values; they are documented limitations
    (test_limitations_document_undetectable_writes)."""
    cases = []
    for dev in DEVICES:
        (device,) = dev.values
        here = [r for r in routes if device == "cpu" or r not in HOST_ONLY]
        cases += [pytest.param(r, True, device, id=f"{r}-debug-{device}", marks=dev.marks) for r in here]
        cases += [
            pytest.param(r, False, device, id=f"{r}-default-{device}", marks=dev.marks) for r in here if r in detectable
        ]
    return cases


def _outside_read_program(route: str, device: str):
    """A tensor from outside the block (no grad) is read by the block and written by
    ``route`` after the block, before backward.  Nothing saves it: plain backward runs
    and uses the block tensor's forward value."""

    def program(scope):
        w = leaf(4, 4, device=device)
        if route == "from_numpy_array":
            x = torch.from_numpy(np.random.RandomState(0).randn(4, 4).astype(np.float32))
        else:
            x = torch.randn(4, 4, device=device)
        with scope():
            h = x + w  # add saves nothing
        y = h * h  # saves h: recomputed in backward from x and w
        del h
        if route == "from_numpy_array":
            x.numpy()[...] *= 3.0  # the array torch.from_numpy wrapped
        else:
            ROUTES[route](x)
        weighted_sum(y).backward()
        return [w.grad]

    return program


@pytest.mark.parametrize(("route", "debug", "device"), _cases([*ROUTES, "from_numpy_array"], {"data_assign", "set_"}))
def test_outside_tensor_read_by_block_written_after(route, debug, device):
    check(_outside_read_program(route, device), debug=debug)


@pytest.mark.parametrize("saved", ["leaf", "nonleaf", "nograd"])
@pytest.mark.parametrize("debug", [False, True], ids=["default", "debug"])
def test_tensor_saved_outside_any_block_then_data_assigned(saved, debug, device):
    """While a block tensor lives, the scope's hooks see every save, also of tensors no
    block made. Autograd keeps such a saved input itself, so plain backward sees a
    `.data = ...` made after the save; the scope must hand back the same."""

    def program(scope):
        w, v = leaf(4, 4, device=device), leaf(4, 4, device=device)
        with scope():
            h = v * 2.0  # alive until backward: the hooks stay on the stack
        u = {"leaf": w, "nonleaf": w * 1.5, "nograd": torch.randn(4, 4, device=device)}[saved]
        y = (u * w).sin() if saved == "nograd" else u.sin()  # saves u (or u * w)
        z = h * h
        ROUTES["data_assign"](u)
        weighted_sum(y + z).backward()
        return [w.grad, v.grad]

    check(program, must_work=True, debug=debug)


@pytest.mark.parametrize("saved", ["output_in_block", "input_after", "view_after", "lstm_input_after"])
@pytest.mark.parametrize("debug", [False, True], ids=["default", "debug"])
def test_block_tensor_given_another_storage_after_autograd_saved_it(saved, debug, device):
    """`h.data = ...` after autograd saved h (h alive at backward): autograd hands back
    the new data for a saved input and the data of the save for a saved output (a
    shallow copy) or a saved view (the view keeps the old storage)."""

    def program(scope):
        w = leaf(4, 4, device=device)
        lstm = nn.LSTM(4, 4).to(device)
        with scope():
            h = torch.sigmoid(w)  # saves its output h
        if saved == "output_in_block":
            y = h * 2.0
        elif saved == "input_after":
            y = h * w  # saves h as an input
        elif saved == "view_after":
            y = h.t() * w  # saves a view of h
        else:
            y = lstm(h)[0]  # saves h.unsqueeze(1), a view
        ROUTES["data_assign"](h)
        weighted_sum(y).backward()
        return [w.grad, *(p.grad for p in lstm.parameters())]

    # (cuDNN's LSTM on CUDA: not bitwise reproducible run to run, nn.LSTM's documented note)
    lstm_note = "cuDNN RNN, not bitwise reproducible" if saved == "lstm_input_after" else None
    check(program, must_work=not debug, debug=debug, cuda_inexact=lstm_note)


@pytest.mark.parametrize(("route", "debug", "device"), _cases([r for r in ROUTES if r != "set_"], {"data_assign"}))
def test_parameter_read_and_saved_in_block_written_after(route, debug, device):
    """w is read by the block and saved by mul inside it (for x's gradient): plain
    backward uses w as it is at backward time for x's gradient, and the forward value of
    the block tensor elsewhere.  (set_ bumps w's version: plain raises.)"""

    def program(scope):
        w = leaf(4, 4, device=device)
        x = leaf(4, 4, device=device)
        with scope():
            h = (x * w).sin()
        y = h * h
        del h
        ROUTES[route](w)
        weighted_sum(y).backward()
        return [x.grad]

    check(program, debug=debug)


NO_SET = [r for r in ROUTES if r != "set_"]  # set_ bumps the version: plain raises


@pytest.mark.parametrize("saved", ["inside", "after"])
@pytest.mark.parametrize(("route", "debug", "device"), _cases(NO_SET, set()))
def test_block_tensor_written_after_block_then_dropped(route, debug, saved, device):
    """A block tensor saved (inside or after the block), written by ``route`` after the
    block, then dropped: plain backward sees the written values through the saved tensor."""

    def program(scope):
        a = leaf(4, 4, device=device)
        c = leaf(4, 4, device=device)
        with scope():
            h = a.sin() + 0.5
            if saved == "inside":
                y = h * c
        if saved == "after":
            y = h * c
        ROUTES[route](h)
        del h
        weighted_sum(y).backward()
        return [a.grad, c.grad]

    check(program, debug=debug)


@pytest.mark.parametrize("saved", ["inside", "after"])
@pytest.mark.parametrize(("route", "debug", "device"), _cases(NO_SET, set(NO_SET)))
def test_block_tensor_written_after_block_kept_alive(route, debug, saved, device):
    """The same write, but the user keeps the block tensor until backward: a live block
    tensor is used as it is (``docs/concepts.md``), so backward sees the written values, as in the plain
    program.  Visible in every mode."""

    def program(scope):
        a = leaf(4, 4, device=device)
        c = leaf(4, 4, device=device)
        with scope():
            h = a.sin() + 0.5
            if saved == "inside":
                y = h * c
        if saved == "after":
            y = h * c
        ROUTES[route](h)
        weighted_sum(y).backward()
        return [a.grad, c.grad, h.detach().clone()]

    check(program, debug=debug)


@pytest.mark.parametrize(("route", "debug", "device"), _cases(NO_SET, {"data_assign"}))
def test_block_tensor_written_after_block_before_save(route, debug, device):
    """Written after the block without a version bump, then saved and dropped: the saved
    value is the written one.  (A .data assignment swaps the storage: visible to a check
    of the storage at save time.)"""

    def program(scope):
        a = leaf(4, 4, device=device)
        c = leaf(4, 4, device=device)
        with scope():
            h = a.sin() + 0.5
        ROUTES[route](h)
        y = h * c
        del h
        weighted_sum(y).backward()
        return [a.grad, c.grad]

    check(program, debug=debug)


@pytest.mark.parametrize(("route", "debug", "device"), _cases(NO_SET, {"data_assign"}))
def test_live_block_tensor_written_then_read_by_a_replay(route, debug, device):
    """A live block tensor written without a version bump, while a later block tensor
    computed from it is recomputed in backward: that replay must not read the written
    values (plain saved the later tensor's forward value).  Visible without debug only
    for a .data assignment (the storage changed); debug=True catches every route."""

    def program(scope):
        a = leaf(4, 4, device=device)
        c = leaf(4, 4, device=device)
        with scope():
            h = a.sin() + 0.5
            g = h * 2
        y = g * c  # saves g: recomputed from h in backward
        del g
        ROUTES[route](h)  # h stays alive
        weighted_sum(y).backward()
        return [a.grad, c.grad, h.detach().clone()]

    check(program, debug=debug)


def test_outside_tensor_set_inside_block_after_read(device):
    """set_ (a write to the tensor's storage pointer) inside the block, after the block
    read the tensor: replay must read what forward read."""

    def program(scope):
        w = leaf(4, 4, device=device)
        x = torch.randn(4, 4, device=device)
        with scope():
            h = x + w
            with torch.no_grad():
                x.set_(torch.randn(4, 4, device=device))
            g = (x + w) * h
        weighted_sum(g * h).backward()
        return [w.grad]

    check(program)


def test_limitations_document_undetectable_writes():
    """What no check can see without debug=True must be in the documented limitations
    (``docs/limitations.md``): writes through .data, through numpy arrays (Tensor.numpy /
    torch.from_numpy) and through untyped_storage()."""
    limitations = (ROOT / "docs" / "limitations.md").read_text()
    for needle in (".data", "numpy", "untyped_storage", "debug=True"):
        assert needle in limitations, f"the documented limitations do not mention {needle!r}"
