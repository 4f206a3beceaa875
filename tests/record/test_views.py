"""Views that carry more than shape, and outputs that alias their input.

* Views whose dtype, conj or neg bits differ from their base's (``conj``, ``mH``,
  ``view_as_real``/``view_as_complex``, ``Tensor.view(dtype)``), taken inside or after
  the block, saved inside or after it: the scoped program equals the plain one or raises
  ``RecomputeError`` (``support.contract.check``).
* Outputs that alias an input without saying so in their schema (``unsafe_split``,
  ``unsafe_chunk``; GRU's gates are ``addmm(...).unsafe_chunk(3)`` written in place).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn as nn

from support.contract import check, leaf, weighted_sum


def _cplx(a: torch.Tensor) -> torch.Tensor:
    return a * (2 - 1j) + 1j


COMPLEX_VIEWS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "conj": lambda h: h.conj(),
    "mH": lambda h: h.mH,
    "mT": lambda h: h.mT,
    "H": lambda h: h.H,
    "adjoint": lambda h: h.adjoint(),
    "neg_view": lambda h: torch._neg_view(h),
    "real": lambda h: h.real,
    "imag": lambda h: h.imag,
    "view_as_real": lambda h: torch.view_as_real(h),
    "conj_imag": lambda h: h.conj().imag,
    "conj_t": lambda h: h.conj().t(),
    "conj_slice": lambda h: h.conj()[1:3],
    "conj_diagonal": lambda h: h.conj().diagonal(),
    "conj_unbind": lambda h: h.conj().unbind(0)[2],
    "conj_expand": lambda h: h.conj().unsqueeze(0).expand(2, 4, 4),
    "conj_view": lambda h: h.conj().view(2, 8),
    "neg_view_of_conj": lambda h: torch._neg_view(h.conj()),
    "mH_slice": lambda h: h.mH[:, 1:],
    "real_slice": lambda h: h.real[1:3],
    "imag_t": lambda h: h.imag.t(),
    "view_as_real_select": lambda h: torch.view_as_real(h)[..., 1],
    "fft_abs": lambda h: torch.fft.fft(h).abs(),
    "fft_real": lambda h: torch.fft.fft(h).real,
    "ifft_view_as_real": lambda h: torch.view_as_real(torch.fft.ifft(h, dim=0)),
}

REAL_VIEWS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "view_as_complex": lambda h: torch.view_as_complex(h.view(4, 2, 2)),
    "view_as_complex_conj": lambda h: torch.view_as_complex(h.view(4, 2, 2)).conj(),
    "view_as_complex_imag": lambda h: torch.view_as_complex(h.view(4, 2, 2)).imag,
    "rfft_abs": lambda h: torch.fft.rfft(h).abs(),
    "fft_view_as_real": lambda h: torch.view_as_real(torch.fft.fft(h)),
    "complex_conj": lambda h: torch.complex(h, -h).conj(),
}

# (view taken, saved by a later op): the view op inside or after the block, and the
# tensor saved by an op inside the block or after it (or read by a later scope);
# "inside_then_t": the view inside the block, then a plain shape view of it (a
# transpose) after the block -- a view of a block tensor whose dtype / conj / neg bits
# differ from its base's.
WHERE = [
    ("inside", "inside"),
    ("inside", "after"),
    ("after", "after"),
    ("later_scope", "after"),
    ("inside_then_t", "after"),
]


def _view_program(make_base, view, where_view, where_save, device):
    def program(scope):
        a = leaf(4, 4, device=device)
        w = leaf(4, 4, device=device)
        with scope():
            h = make_base(a * w)
            if where_view in ("inside", "inside_then_t"):
                v = view(h)
                if where_save == "inside":
                    y = v * v
        if where_view == "inside_then_t":
            v = v.movedim(0, -1)
        if where_view == "after":
            v = view(h)
        if where_view == "later_scope":
            with scope():
                v = view(h)
        if where_save == "after":
            y = v * v
        del h, v
        weighted_sum(y).backward()
        return [a.grad, w.grad]

    return program


@pytest.mark.parametrize("where", WHERE, ids=["-".join(w) for w in WHERE])
@pytest.mark.parametrize("view", list(COMPLEX_VIEWS))
def test_complex_views(view, where, device):
    check(_view_program(_cplx, COMPLEX_VIEWS[view], *where, device))


@pytest.mark.parametrize("where", WHERE, ids=["-".join(w) for w in WHERE])
@pytest.mark.parametrize("view", list(REAL_VIEWS))
def test_real_to_complex_views(view, where, device):
    check(_view_program(lambda t: t * 2 + 1, REAL_VIEWS[view], *where, device))


@pytest.mark.parametrize("where", WHERE, ids=["-".join(w) for w in WHERE])
def test_dtype_view_of_block_tensor_saved(where, device):
    """Tensor.view(dtype): an int64 block tensor seen as float64 (same itemsize) and
    saved by mul for the gradient of a float64 leaf."""

    def program(scope):
        w = leaf(4, 4, dtype=torch.float64, device=device)
        src = torch.randint(0, 1000, (4, 4), device=device)
        with scope():
            idx = src * 3 + 1
            if where[0] in ("inside", "inside_then_t"):
                f = idx.view(torch.float64)
                if where[1] == "inside":
                    y = w * f
        if where[0] == "inside_then_t":
            f = f.t()
        if where[0] == "after":
            f = idx.view(torch.float64)
        if where[0] == "later_scope":
            with scope():
                f = idx.view(torch.float64)
        if where[1] == "after":
            y = w * f
        del idx, f
        (y * 1e300).sum().backward()
        return [w.grad]

    check(program)


def test_conj_view_with_debug_and_retain_graph(device):
    """The same conj view served twice (retain_graph) and checked by debug."""

    def program(scope):
        a = leaf(4, 4, device=device)
        with scope():
            h = _cplx(a)
        v = h.conj()
        y = v * v
        del h, v
        loss = weighted_sum(y)
        g1 = torch.autograd.grad(loss, a, retain_graph=True)[0]
        g2 = torch.autograd.grad(loss, a)[0]
        return [g1, g2]

    check(program, debug=True)


# --------------------------------------------------------------------------------------
# outputs that alias an input without saying so in their schema

UNSAFE_SPLITS = {
    "unsafe_split": lambda x: x.unsafe_split(2, 1),
    "unsafe_chunk": lambda x: x.unsafe_chunk(2, 1),
    "unsafe_split_with_sizes": lambda x: x.unsafe_split_with_sizes([1, 3], 1),
}


@pytest.mark.parametrize("where", ["inside", "after"])
@pytest.mark.parametrize("split", list(UNSAFE_SPLITS))
def test_unsafe_split_pieces_alias_their_input(split, where, device):
    """unsafe_split / unsafe_chunk pieces share the input's storage (but not its version
    counter) although the schema declares no alias: an in-place write to a piece -- in
    the block or after it -- changes the input, which is then saved."""

    def program(scope):
        a = leaf(4, 4, device=device)
        c = leaf(4, 4, device=device)
        with scope():
            x = a * 2
            pieces = UNSAFE_SPLITS[split](x)
            if where == "inside":
                pieces[0].add_(1.0)
        if where == "after":
            pieces[0].add_(1.0)
        y = x * c
        del x, pieces
        weighted_sum(y).backward()
        return [a.grad, c.grad]

    check(program)


@pytest.mark.parametrize("save", ["addmm", "all_matmuls"])
@pytest.mark.parametrize("module", ["gru", "gru_cell"])
def test_gru_with_saved_matmuls(module, save):
    """GRU / GRUCell on CPU: gates = addmm(...).unsafe_chunk(3), then add_ / sigmoid_ in
    place on the pieces.  With addmm's output stored (save=), those writes land in the
    stored tensor."""
    # CPU only: on CUDA GRU and GRUCell run fused kernels (cuDNN's RNN, _thnn_fused_gru_cell)
    # with neither the addmm nor the unsafe_chunk under test.
    ops = [torch.ops.aten.addmm] if save == "addmm" else [torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm]

    def program(scope):
        m = nn.GRU(4, 5) if module == "gru" else nn.GRUCell(4, 5)
        x = leaf(3, 2, 4) if module == "gru" else leaf(2, 4)
        with scope(save=ops):
            out = m(x * 0.5)
            o = out[0] if isinstance(out, tuple) else out
        y = o.tanh() * o
        del out, o
        weighted_sum(y).backward()
        return [x.grad] + [p.grad for p in m.parameters()]

    check(program, must_work=True)
