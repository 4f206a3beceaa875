"""Scopes in compiled code whose graph writes its own inputs.

AOTAutograd applies a graph's writes to its inputs when the compiled forward ends (a
``copy_`` in the graph, or after it for inputs that require grad): the compiled backward
sees the *new* values. A block tensor recomputed there from such an input would be
computed from the wrong value (a read before the write) or get the write twice (a write
in the block). The joint-graph pass stores whatever reads a written input instead
(gradient_scope/_compile_inputs.py).

Reference: the same program without the scope, eager (ground truth) and compiled the
same way (within compile's float tolerance: the partition differs). Where plain compile
itself recomputes a read of a written input (a pointwise read, which the min-cut
partitioner recomputes on its own; torch 2.13), plain compile is wrong and the scoped
program is compared with eager only.
"""

import contextlib

import pytest
import torch

import gradient_scope._compile as gs_compile
from gradient_scope import recompute_scope

pytestmark = pytest.mark.skipif(
    gs_compile._MISSING is not None,
    reason=f"torch {torch.__version__} lacks {gs_compile._MISSING}: compiled scopes run eagerly",
)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def ctx(scoped):
    return recompute_scope() if scoped else contextlib.nullcontext()


def execute(make_fn, make_args, backend, scoped):
    """Run ``make_fn(scoped)`` (compiled with ``backend``, or eager for None) on fresh
    arguments; returns the output, the grads and the arguments' final values."""
    torch._dynamo.reset()
    fn = make_fn(scoped)
    if backend is not None:
        fn = torch.compile(fn, backend=backend)
    args = make_args()
    y = fn(*args)
    y.sum().backward()
    leaves = [a for a in args if a.is_leaf and a.requires_grad]
    return [y.detach(), *[a.grad for a in leaves], *[a.detach().clone() for a in args]]


def assert_close_all(actual, expected, what):
    assert len(actual) == len(expected)
    for i, (a, e) in enumerate(zip(actual, expected)):
        torch.testing.assert_close(a, e, msg=lambda m: f"{what} [{i}]: {m}")


def check(make_fn, make_args, backend="aot_eager", plain_compile_is_right=True):
    eager = execute(make_fn, make_args, None, False)
    scoped = execute(make_fn, make_args, backend, True)
    assert_close_all(scoped, eager, "scoped compiled vs eager")
    if plain_compile_is_right:
        plain = execute(make_fn, make_args, backend, False)
        assert_close_all(scoped, plain, "scoped compiled vs plain compiled")


def args_x_buf():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(6, 6, generator=g, requires_grad=True), torch.randn(6, 6, generator=g)]


# ------------------------------------------------------------------ (a) read, then written later


def _read_then_write(how):
    def make(scoped):
        def f(x, b):
            with ctx(scoped):
                # mm is not recomputed by the partitioner on its own: plain compile saves it.
                h = (x + b @ b).sin()
            if how == "no_grad":
                with torch.no_grad():
                    b.add_(1)
            else:
                b.add_(1)
            return h * x

        return f

    return make


@pytest.mark.parametrize("how", ["plain", "no_grad"])
def test_block_reads_an_argument_the_function_writes_later(how):
    check(_read_then_write(how), args_x_buf)


def test_block_reads_a_parameter_the_function_writes_under_no_grad():
    """A leaf parameter passed as an argument; the read saves nothing in eager (mul by a
    number), and plain compile recomputes it from the written parameter (torch 2.13)."""

    def make(scoped):
        def f(x, w):
            with ctx(scoped):
                h = (x + w * 2).sin()
            with torch.no_grad():
                w.mul_(0.5)
            return h * x

        return f

    def args():
        x, b = args_x_buf()
        return [x, torch.nn.Parameter(b)]

    check(make, args, plain_compile_is_right=False)


def test_pointwise_read_of_a_written_argument_matches_eager():
    """A pointwise read: the partitioner would recompute it from the argument (plain
    compile on torch 2.13 does, and is wrong). In a graph with a scope it is stored."""

    def make(scoped):
        def f(x, b):
            t = b * 3  # outside the block: the block recomputes from here
            with ctx(scoped):
                h = (x + b).sin() + t.cos()
            b.add_(1)
            return h * x

        return f

    check(make, args_x_buf, plain_compile_is_right=False)


# ------------------------------------------------------------------ (b), (c) the block writes an input


def test_block_writes_an_argument_that_needs_no_grad():
    def make(scoped):
        def f(x, b):
            with ctx(scoped):
                b.mul_(2)  # applied once: the backward must not recompute it from b
                h = (x + b).sin()
            return h * x

        return f

    check(make, args_x_buf)


def test_block_writes_a_view_of_an_argument():
    def make(scoped):
        def f(x, b):
            with ctx(scoped):
                b[:3].mul_(2)
                h = (x + b.t()).sin()
            return h * x

        return f

    check(make, args_x_buf)


def test_block_writes_an_argument_that_requires_grad():
    def make(scoped):
        def f(x, w):
            with ctx(scoped):
                w.mul_(2)  # w is not a leaf: autograd allows the write
                h = (x + w).sin()
            return h * x

        return f

    def args():
        x, b = args_x_buf()
        return [x, b.requires_grad_() * 1.0]

    check(make, args)


def test_inductor_block_reads_then_writes():
    """Inductor (the pass runs for every AOTAutograd backend): (a) and (b) in one graph."""

    def make(scoped):
        def f(x, b, c):
            with ctx(scoped):
                c.mul_(2)
                h = (x + b @ b + c).sin()
            b.add_(1)
            return h * x

        return f

    def args():
        return [*args_x_buf(), torch.randn(6, 6, generator=torch.Generator().manual_seed(1))]

    check(make, args, backend="inductor")


# ------------------------------------------------------------------ what is kept


def test_reads_of_unwritten_inputs_are_still_recomputed():
    """Only reads of written inputs are stored: the block's other tensors are not."""
    kept = []

    def pack(t):
        kept.append((t.untyped_storage().data_ptr(), tuple(t.shape)))
        return t

    def f(x, b, w):
        with recompute_scope():
            u = (x @ w).sin()  # (6, 8): recomputed from x and w
            h = (u @ w.t() + b).cos()  # reads b, which is written below: stored
        b.add_(1)
        return h * x

    g = torch.Generator().manual_seed(0)
    x, b = args_x_buf()
    w = torch.randn(6, 8, generator=g, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = torch.compile(f, backend="aot_eager")(x, b, w)
    inputs = {t.untyped_storage().data_ptr() for t in (x, b, w)}
    # One block tensor is kept: what the add that reads b produced (u is recomputed).
    assert [shape for ptr, shape in kept if ptr not in inputs] == [(6, 6)], kept
    y.sum().backward()


# ------------------------------------------------------------------ (d) written after the forward


def test_parameter_written_between_compiled_forward_and_backward_raises():
    """The compiled backward recomputes from the parameter, which AOTAutograd saves with
    autograd's version check: the write makes backward raise (autograd's in-place
    error; not yet a RecomputeError that names the parameter, see docs/limitations.md),
    never a gradient computed from the new value."""
    lin = torch.nn.Linear(6, 6)

    def f(x):
        with recompute_scope():
            h = (x + lin.weight * 2).sin()
        return h * x

    x = torch.randn(6, 6, requires_grad=True)
    y = torch.compile(f, backend="aot_eager")(x)
    with torch.no_grad():
        lin.weight.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_aotautograd_metadata_is_found(monkeypatch):
    """Inputs that AOTAutograd writes after the graph (those that require grad) are known
    only from its metadata, read from its partitioning step's frame: on this torch the
    frame must be found (otherwise test_block_writes_an_argument_that_requires_grad
    would fail, and docs/limitations.md says what is lost)."""
    import gradient_scope._compile_inputs as gs_inputs

    seen = []
    real = gs_inputs.written_inputs

    def spy(gm, input_info):
        seen.append(input_info)
        return real(gm, input_info)

    monkeypatch.setattr(gs_inputs, "written_inputs", spy)

    def f(x, w):
        with recompute_scope():
            w.mul_(2)
            h = (x + w).sin()
        return h * x

    x, b = args_x_buf()
    torch.compile(f, backend="aot_eager")(x, b.requires_grad_() * 1.0).sum().backward()
    assert len(seen) == 1 and seen[0] is not None
    assert sorted(bool(info.mutates_data) for info in seen[0]) == [False, True]  # w, not x
