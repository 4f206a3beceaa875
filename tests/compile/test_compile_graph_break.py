"""A graph break inside a scope in compiled code: the block works as an eager scope.

Dynamo runs the frame that holds the block eagerly, so the scope is an eager scope. While
its block is open, the frames it calls (user modules, helper functions) run eagerly too
and are recorded; without that, dynamo compiled each of them as a frame of its own, their
ops ran unrecorded and the block saved as much as without the scope. Functions the user
wrapped with ``torch.compile`` still compile inside the block (what their graph keeps is
the compiled graph's choice), and after the block nested frames compile again.

Reference: the same program eager, with the eager scope (saved bytes, weakrefs,
gradients bitwise) and without any scope (gradients bitwise).
"""

import contextlib
import weakref

import pytest
import torch
import torch.nn as nn
from torch._dynamo.utils import counters

from gradient_scope import recompute_scope

# Each test compiles afresh (tests/conftest.py); dynamo's graph-break warnings are expected.
pytestmark = [pytest.mark.usefixtures("fresh_dynamo"), pytest.mark.filterwarnings("ignore")]


class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, h):
        return torch.tanh(self.fc(h)).exp()


def helper(k):
    return k.cos() * k


class Probe:
    """Bytes of distinct storages autograd saves that are not the program's inputs,
    entered outside the scope (an eager scope's handles are not seen)."""

    def __init__(self, inputs):
        self.inputs = {t.untyped_storage().data_ptr() for t in inputs}
        self.storages = {}

    def _pack(self, t):
        s = t.untyped_storage()
        if s.data_ptr() not in self.inputs:
            self.storages[s.data_ptr()] = s.nbytes()
        return t

    def __enter__(self):
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)

    @property
    def nbytes(self):
        return sum(self.storages.values())


def program(inner, scoped, refs):
    def f(x, c):
        with recompute_scope() if scoped else contextlib.nullcontext():
            h = x.sin()
            torch._dynamo.graph_break()
            k = inner(h)  # a user module called from the open block
            refs.append(weakref.ref(k))
            m = helper(k)  # a plain function called from the open block
        return m * c

    return f


def run(scoped, compiled):
    torch._dynamo.reset()
    torch.manual_seed(0)
    inner = Inner()
    x, c = torch.randn(32, 16, requires_grad=True), torch.randn(32, 16, requires_grad=True)
    refs = []
    f = program(inner, scoped, refs)
    if compiled:
        f = torch.compile(f, backend="aot_eager")
    params = [x, c, *inner.parameters()]
    with Probe(params) as probe:
        y = f(x, c)
    alive = refs[0]() is not None
    y.sum().backward()
    return probe.nbytes, alive, [y.detach(), *[p.grad for p in params]]


def test_graph_break_in_a_compiled_scope_saves_what_the_eager_scope_saves():
    eager_bytes, eager_alive, eager_grads = run(scoped=True, compiled=False)
    plain_bytes, _, plain_grads = run(scoped=False, compiled=False)
    bytes_, alive, grads = run(scoped=True, compiled=True)
    assert eager_bytes < plain_bytes and not eager_alive  # what the eager scope achieves
    assert bytes_ <= eager_bytes, (bytes_, eager_bytes, plain_bytes)
    assert not alive, "the module's output is kept alive for backward"
    for g, e, p in zip(grads, eager_grads, plain_grads):
        assert torch.equal(g, e) and torch.equal(g, p)


def test_compiled_function_called_in_the_broken_block_is_compiled():
    """R7 inside the eager block a graph break made: torch.compile'd functions compile,
    and their graph's ops are not recorded; plain frames run eagerly and are."""
    cg = torch.compile(lambda a: torch.tanh(a) * a, backend="aot_eager", fullgraph=True)

    def f(x, c):
        with recompute_scope() as scope:
            h = x.sin()
            torch._dynamo.graph_break()
            k = cg(h)  # compiled: tanh, mul not recorded
            m = helper(k)  # eager: cos, mul recorded
        return m * c, scope

    x, c = torch.randn(8, requires_grad=True), torch.randn(8, requires_grad=True)
    graphs0 = counters["stats"]["unique_graphs"]
    y, scope = torch.compile(f, backend="aot_eager")(x, c)
    assert isinstance(scope, recompute_scope)
    assert scope.stats.ops_recorded == 3  # sin, cos, mul
    # cg's graph, and the graph before the break in f; helper is not compiled.
    assert counters["stats"]["unique_graphs"] - graphs0 <= 2
    y.sum().backward()
    gx, gc_ = x.grad.clone(), c.grad.clone()
    x.grad = c.grad = None
    k = torch.tanh(x.sin()) * x.sin()
    (helper(k) * c).sum().backward()
    torch.testing.assert_close(gx, x.grad)
    assert torch.equal(gc_, c.grad)


def test_frames_after_the_block_compile_again_and_errors_restore_dynamo():
    compiled_frames = []

    def g(a):
        return a.cos()

    def backend(gm, example_inputs):
        compiled_frames.append(gm)
        return gm.forward

    def f(x, fail):
        with recompute_scope():
            h = x.sin()
            torch._dynamo.graph_break()
            k = g(h)  # eager inside the block
            if fail:
                raise ValueError("user error in the block")
        return g(k)  # after the block: compiled again

    x = torch.randn(4, requires_grad=True)
    cf = torch.compile(f, backend=backend)
    cf(x, False).sum().backward()
    traced = [str(gm.code) for gm in compiled_frames]
    assert any("cos" in code for code in traced), traced  # g after the block
    with pytest.raises(ValueError, match="user error"):
        cf(x, True)
    # (the fresh_dynamo fixture checks that no dynamo callback is left set in this thread)


def test_eager_scope_outside_compiled_code_leaves_compiled_calls_compiled():
    """A scope entered by eager code (no torch.compile around it) changes nothing for
    compiled functions called in it, nor for the dynamo state."""
    cg = torch.compile(lambda a: a.sin() * 2, backend="aot_eager")
    x = torch.randn(4, requires_grad=True)
    graphs0 = counters["stats"]["unique_graphs"]
    with recompute_scope() as scope:
        y = cg(x).exp()
    assert counters["stats"]["unique_graphs"] == graphs0 + 1
    assert scope.stats.ops_recorded == 1  # exp only
    y.sum().backward()


def test_apply_recompute_on_blocks_with_a_graph_break_in_a_compiled_model():
    """apply_recompute's scope wraps each block's forward; a graph break inside it runs the
    block as an eager scope, and the block's submodules (compiled as frames of their own
    without the fix) are recorded: the compiled model keeps what the eager one keeps."""
    from gradient_scope import apply_recompute

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(16, 64), nn.Linear(64, 16)

        def forward(self, h):
            return self.fc2(torch.nn.functional.gelu(self.fc1(h)))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp, self.ln = MLP(), nn.LayerNorm(16)

        def forward(self, h):
            a = self.ln(h)
            torch._dynamo.graph_break()
            return h + self.mlp(a)

    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block())
    apply_recompute(model, check_fn=Block)

    def step(m):
        torch._dynamo.reset()
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
        params = [x, *model.parameters()]
        with Probe(params) as probe:
            y = m(x)
        y.sum().backward()
        grads = [p.grad.clone() for p in params]
        for p in params:
            p.grad = None
        return probe.nbytes, grads

    eager_bytes, eager_grads = step(model)
    bytes_, grads = step(torch.compile(model, backend="aot_eager"))
    assert eager_bytes == 0  # every block tensor is a handle of the eager scopes
    assert bytes_ <= eager_bytes
    for g, e in zip(grads, eager_grads):
        torch.testing.assert_close(g, e)  # the residual adds between the blocks are compiled
