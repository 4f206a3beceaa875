"""Scopes in compiled code whose graph writes its own inputs.

AOTAutograd applies a graph's writes to its inputs when the compiled forward ends (a
``copy_`` in the graph, or after it for inputs that require grad): the compiled backward
sees the *new* values. A block tensor recomputed there from such an input would be
computed from the wrong value (a read before the write) or get the write twice (a write
in the block). The joint-graph pass stores whatever reads a written input instead
(gradient_scope/_adapters/compile/inputs.py).

Reference: the same program without the scope, eager (ground truth) and compiled the
same way (within compile's float tolerance: the partition differs). Where plain compile
itself recomputes a read of a written input (a pointwise read, which the min-cut
partitioner recomputes on its own; torch 2.13), plain compile is wrong and the scoped
program is compared with eager only.
"""

import contextlib
import re

import pytest
import torch

import gradient_scope._adapters.compile.graph as gs_compile
from gradient_scope import RecomputeError, recompute_scope

pytestmark = [
    pytest.mark.skipif(
        gs_compile._MISSING is not None,
        reason=f"torch {torch.__version__} lacks {gs_compile._MISSING}: compiled scopes run eagerly",
    ),
    pytest.mark.usefixtures("fresh_dynamo"),  # tests/conftest.py
]


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


WRITTEN_AFTER_FORWARD = (
    r"the backward of compiled code with a recompute_scope reads the parameter {name} of shape "
    r"\[6, \d\] \(torch.float32\), which was modified in place after the compiled forward "
    r"\(version (\d+) -> (\d+)\) and before backward. Likely cause: an optimizer step .* "
    r"Fix: call optimizer.step\(\) after backward"
)


def _scoped_linear_program():
    """A Linear and a function whose scope reads its weight (the compiled backward
    recomputes from it)."""
    lin = torch.nn.Linear(6, 6)

    def f(x):
        with recompute_scope():
            h = (x + lin.weight * 2).sin()
        return h * x

    return lin, f


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_parameter_written_between_compiled_forward_and_backward_raises(backend):
    """The compiled backward would recompute from the parameter: backward raises
    RecomputeError naming it (not autograd's in-place error), and no gradient comes out."""
    lin, f = _scoped_linear_program()
    x = torch.randn(6, 6, requires_grad=True)
    y = torch.compile(f, backend=backend, fullgraph=True)(x)
    before = lin.weight._version
    with torch.no_grad():
        lin.weight.add_(1)
    with pytest.raises(RecomputeError, match=WRITTEN_AFTER_FORWARD.format(name=r"lin\.weight")) as info:
        y.sum().backward()
    assert re.search(r"version (\d+) -> (\d+)", str(info.value)).groups() == (str(before), str(before + 1))
    assert x.grad is None and lin.weight.grad is None


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(6, 6)
        self.out = torch.nn.Linear(6, 6)

    def forward(self, x):
        with recompute_scope():
            h = torch.tanh(self.fc(x)) * 2
        return self.out(h).sin()


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_optimizer_step_between_compiled_forward_and_backward_raises(backend):
    """An optimizer step (a write under no_grad) before backward: RecomputeError naming
    the module's parameter; training in the right order then goes on as without the
    scope (bitwise on aot_eager, which runs the same aten ops as eager)."""
    torch.manual_seed(0)
    net, ref = _Net(), _Net()
    ref.load_state_dict(net.state_dict())
    opt, ref_opt = torch.optim.SGD(net.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    compiled = torch.compile(net, backend=backend, fullgraph=True)
    x = torch.randn(4, 6)
    y = compiled(x)
    opt.step()  # no grads yet: SGD skips every parameter
    y = compiled(x)
    y.sum().backward()
    opt.step()  # forward, backward, step: right
    y = compiled(x)
    opt.step()  # writes every parameter (grads from the previous step)
    with pytest.raises(RecomputeError, match=WRITTEN_AFTER_FORWARD.format(name=r"self\.fc\.(weight|bias)")):
        y.sum().backward()
    ref_loss = ref(x).sum()
    ref_loss.backward()
    ref_opt.step()
    ref.load_state_dict(net.state_dict())
    for _ in range(2):
        opt.zero_grad()
        ref_opt.zero_grad()
        compiled(x).sum().backward()
        ref(x).sum().backward()
        for p, q in zip(net.parameters(), ref.parameters()):
            if backend == "aot_eager":
                assert torch.equal(p.grad, q.grad)
            else:
                torch.testing.assert_close(p.grad, q.grad)
        opt.step()
        ref_opt.step()


class _DropoutNet(torch.nn.Module):
    """Dropout in the block: the compiled backward replays it with the RNG state the
    forward saved, and a parameter outside the blocks feeds a pointwise op (bias + gelu)
    that the partitioner recomputes in the backward on its own."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(6, 6)
        self.b = torch.nn.Linear(6, 6)
        self.bias = torch.nn.Parameter(torch.zeros(6))

    def forward(self, x):
        with recompute_scope():
            h = self.b(torch.nn.functional.dropout(self.a(x), 0.3, True)).sin()
        return torch.nn.functional.gelu(h + self.bias) * x


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_every_parameter_the_backward_reads_raises_recompute_error(backend):
    """Each parameter written alone between the compiled forward and backward raises
    RecomputeError naming it: those a block reads next to a dropout (whose RNG state
    the forward saves too), and one only the partitioner's own recomputation outside
    the blocks reads (before: PyTorch's in-place error for both)."""
    torch.manual_seed(0)
    net = _DropoutNet()
    compiled = torch.compile(net, backend=backend)
    x = torch.randn(4, 6, requires_grad=True)
    for name, p in net.named_parameters():
        y = compiled(x)
        with torch.no_grad():
            p.add_(1)
        with pytest.raises(RecomputeError, match=rf"reads the parameter self\.{re.escape(name)} of shape") as info:
            y.sum().backward()
        assert "Fix: call optimizer.step() after backward" in str(info.value)
    y = compiled(x)
    for p in net.parameters():
        p.grad = torch.ones_like(p)
    torch.optim.SGD(net.parameters(), lr=0.1, foreach=True).step()  # writes all of them
    with pytest.raises(RecomputeError, match=r"reads the parameter self\.[\w.]+ of shape"):
        y.sum().backward()


def test_a_parameter_the_backward_does_not_read_may_be_written():
    """A parameter the compiled backward does not read (an embedding table outside the
    blocks: its backward reads only the indices) is not checked: writing it before
    backward is no error, as without the scope."""

    emb = torch.nn.Embedding(10, 6)
    lin = torch.nn.Linear(6, 6)

    def f(idx):
        e = emb(idx)
        with recompute_scope():
            h = lin(e).tanh()
        return h * 2

    idx = torch.tensor([1, 2, 3])
    y = torch.compile(f, backend="aot_eager")(idx)
    with torch.no_grad():
        emb.weight.add_(1)
    y.sum().backward()
    assert emb.weight.grad is not None


def test_buffer_the_graph_writes_keeps_working():
    """Inputs the graph writes (here BatchNorm's running statistics, in the block) are not
    checked: their versions move in every call. Two steps match eager."""

    def make(scoped):
        torch.manual_seed(0)
        bn = torch.nn.BatchNorm1d(6)
        lin = torch.nn.Linear(6, 6)

        def f(x, b):
            with ctx(scoped):
                h = bn(lin(x) + b).sin()
            return h * x

        return f

    check(make, args_x_buf)


def test_input_written_after_the_forward_keeps_pytorchs_error():
    """Only weights (parameters, buffers, leaves that require grad) are checked by the
    library: another input the block read and that is written after the forward keeps
    autograd's own error."""

    def f(x, b):
        with recompute_scope():
            h = (x @ b).sin()
        return h * x

    x, b = args_x_buf()
    y = torch.compile(f, backend="aot_eager")(x, b)
    b.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation") as info:
        y.sum().backward()
    assert not isinstance(info.value, RecomputeError)


def test_inference_tensor_buffer_raises_in_forward():
    with torch.inference_mode():
        buf = torch.ones(6, 6)
    lin = torch.nn.Linear(6, 6)
    lin.register_buffer("scale", buf)

    def f(x):
        with recompute_scope():
            h = (lin(x) * lin.scale).sin()
        return h * x

    with pytest.raises(RecomputeError, match=r"tensor lin\.scale of shape \[6, 6\] .* is an inference tensor"):
        torch.compile(f, backend="aot_eager")(torch.randn(6, 6, requires_grad=True))


def test_cuda_graphs_keep_pytorchs_check():
    """A graph compiled for CUDA graphs (mode="reduce-overhead") would replay without
    running the version ops: there the parameter keeps autograd's check."""
    import torch._inductor.config as inductor_config

    lin, f = _scoped_linear_program()
    x = torch.randn(6, 6, requires_grad=True)
    with inductor_config.patch({"triton.cudagraphs": True}):
        y = torch.compile(f, backend="aot_eager")(x)
    with torch.no_grad():
        lin.weight.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation") as info:
        y.sum().backward()
    assert not isinstance(info.value, RecomputeError)


def test_aotautograd_metadata_is_found(monkeypatch):
    """Inputs that AOTAutograd writes after the graph (those that require grad) are known
    only from its metadata, read from its partitioning step's frame: on this torch the
    frame must be found (otherwise test_block_writes_an_argument_that_requires_grad
    would fail, and docs/limitations.md says what is lost)."""
    import gradient_scope._adapters.compile.inputs as gs_inputs

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


def test_transformers_model_compiled_with_an_optimizer_step_before_backward():
    """A Hugging Face model (dropout in its layers) with a scope per layer, compiled
    whole: an optimizer step between forward and backward raises RecomputeError naming
    a parameter, as the same model does eagerly."""
    pytest.importorskip("transformers")
    import gradient_scope.integrations.transformers as gs_hf

    from support.hf_models import SEQ, VOCAB, make_model

    model = make_model("llama", layers=2, seed=0)
    model.train()
    gs_hf.enable(model)
    ids = torch.randint(3, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    loss = torch.compile(model, backend="aot_eager")(input_ids=ids, labels=ids).loss
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    torch.optim.AdamW(model.parameters(), lr=0.1).step()
    with pytest.raises(RecomputeError, match=r"reads the parameter self\.model\.[\w.]+ of shape"):
        loss.backward()
