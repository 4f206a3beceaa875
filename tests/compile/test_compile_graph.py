"""Scopes as part of the compiled graph (torch.compile with AOTAutograd backends).

A scope inside compiled code becomes an FX annotation; a joint-graph pass tags the block's
forward nodes MUST_RECOMPUTE (MUST_SAVE for ``save=`` ops) and the partitioner recomputes
them in the compiled backward. What the compiled forward keeps for backward is observed
with a saved-tensor hook around the compiled call: AOTAutograd's ``CompiledFunction``
saves what its backward graph needs with ``ctx.save_for_backward``, which goes through
the hook (the hooks here are plain functions, which AOTAutograd does not trace into the
graph). Tensors are identified by storage: an input, a block tensor, an RNG state.

Gradients: a compiled program is compared with the same program compiled without the
scope (within compile's float tolerance: the partition, hence inductor's fused kernels,
differs) and with eager.
"""

import contextlib
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

import gradient_scope._adapters.compile.graph as gs_compile
from gradient_scope import apply_recompute, recompute, recompute_scope, save_matmuls

BACKENDS = ["aot_eager", "inductor"]

# On a torch that lacks a piece compiled scopes need, scopes in compiled code run
# eagerly (tests/compile/test_compile.py::test_fallback_warns_once_and_runs_eagerly).
pytestmark = [
    pytest.mark.skipif(
        gs_compile._MISSING is not None,
        reason=f"torch {torch.__version__} lacks {gs_compile._MISSING}: compiled scopes run eagerly",
    ),
    pytest.mark.usefixtures("fresh_dynamo"),  # tests/conftest.py
]


class Saved:
    """What autograd saves while the block runs: one entry per save, by storage."""

    def __init__(self, inputs):
        self.inputs = {t.untyped_storage().data_ptr() for t in inputs}
        self.entries = []

    def _pack(self, t):
        s = t.untyped_storage()
        self.entries.append((s.data_ptr(), s.nbytes(), tuple(t.shape), t.dtype))
        return t

    def __enter__(self):
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)

    def others(self):
        """(shape, dtype) of every saved tensor that is not (a view of) an input."""
        return sorted(((e[2], e[3]) for e in self.entries if e[0] not in self.inputs), key=str)

    def other_bytes(self):
        return sum({e[0]: e[1] for e in self.entries if e[0] not in self.inputs}.values())


def block_fn(scoped, **options):
    def f(x, w, c):
        with recompute_scope(**options) if scoped else contextlib.nullcontext():
            h = (x @ w).sin()
            k = F.gelu(h) * h
        # Ops after the block save block tensors: mul saves k and h, exp saves its output.
        return (k * c).exp() * h

    return f


def run(fn, inputs):
    """Forward under the probe, then backward; returns (Saved, output, grads)."""
    with Saved(inputs) as saved:
        y = fn(*inputs)
    y.sum().backward()
    grads = [t.grad.clone() for t in inputs]
    for t in inputs:
        t.grad = None
    return saved, y.detach(), grads


def make_inputs(*shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g).requires_grad_() for s in shapes]


def assert_close_all(actual, expected):
    for i, (a, e) in enumerate(zip(actual, expected)):
        torch.testing.assert_close(a, e, msg=lambda m: f"[{i}] {m}")


# ------------------------------------------------------------------ what the forward keeps


def test_compiled_forward_keeps_block_inputs_not_block_tensors():
    """aot_eager here; inductor in test_inductor_scoped_graph_and_the_aot_cache."""
    backend = "aot_eager"
    inputs = make_inputs((32, 32), (32, 32), (32, 32))
    plain = run(torch.compile(block_fn(False), backend=backend, fullgraph=True), inputs)
    scoped = run(torch.compile(block_fn(True), backend=backend, fullgraph=True), inputs)
    eager = run(block_fn(False), inputs)
    # Plain compiled keeps block tensors (the test can see them) ...
    assert (torch.Size([32, 32]), torch.float32) in [(torch.Size(s), d) for s, d in plain[0].others()]
    # ... the scoped graph keeps only the block's inputs: nothing else, not even the
    # block tensors that the mul and exp after the block save.
    # exp's output is created after the block: it is kept, as without the scope.
    assert scoped[0].others() == [((32, 32), torch.float32)]
    assert scoped[0].other_bytes() == 32 * 32 * 4
    assert plain[0].other_bytes() > scoped[0].other_bytes()  # plain keeps a block tensor too
    assert_close_all([scoped[1], *scoped[2]], [plain[1], *plain[2]])
    assert_close_all([scoped[1], *scoped[2]], [eager[1], *eager[2]])


@pytest.mark.parametrize("backend", BACKENDS)
def test_save_keeps_exactly_what_it_names(backend):
    def make(scoped, save):
        def f(x, w1, w2, z):
            with recompute_scope(save=save) if scoped else contextlib.nullcontext():
                a = x @ w1  # (8, 24): kept
                b = a.sin()  # recomputed from a
                c = b @ w2  # (8, 12): kept
                d = c.tanh()  # recomputed from c
            return d * z

        return f

    inputs = make_inputs((8, 16), (16, 24), (24, 12), (8, 12))
    expected = run(make(False, None), inputs)
    # Each inductor compile takes seconds: one policy there, all of them with aot_eager.
    policies = [[torch.ops.aten.mm]] if backend == "inductor" else [[torch.ops.aten.mm], save_matmuls]
    for save in policies:
        torch._dynamo.reset()
        saved, y, g = run(torch.compile(make(True, save), backend=backend, fullgraph=True), inputs)
        assert saved.others() == [((8, 12), torch.float32), ((8, 24), torch.float32)], (save, saved.others())
        assert_close_all([y, *g], [expected[1], *expected[2]])
    if backend == "aot_eager":
        torch._dynamo.reset()
        saved, y, g = run(torch.compile(make(True, None), backend=backend, fullgraph=True), inputs)
        assert saved.others() == []  # without save= nothing of the block is kept
        assert_close_all([y, *g], [expected[1], *expected[2]])


@pytest.mark.parametrize("backend", BACKENDS)
def test_random_ops_replay_consistently(backend):
    def block(x):
        h = F.dropout(x.sin(), 0.5, True)
        return h, torch.randn_like(h)

    def scoped_block(x):
        with recompute_scope():
            return block(x)

    variants = {
        "plain": block,
        "scoped": scoped_block,
        "checkpoint": lambda x: torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False),
    }

    def make(run_block):
        def f(x, c, d):
            h, n = run_block(x)
            # mul saves h and n: the backward needs the forward's mask and noise.
            return (h * c).sum() + (n * d).sum(), h.detach(), n.detach()

        return f

    results = {}
    for name, run_block in variants.items():
        torch._dynamo.reset()
        fn = torch.compile(make(run_block), backend=backend, fullgraph=True)
        x, c, d = make_inputs((16, 16), (16, 16), (16, 16))
        torch.manual_seed(7)
        with Saved([x, c, d]) as saved:
            loss, h, n = fn(x, c, d)
        loss.backward()
        results[name] = (saved, [loss.detach(), h, n, x.grad, c.grad, d.grad, torch.get_rng_state()])
    saved, (loss, h, n, gx, gc_, gd, rng) = results["scoped"]
    # The recomputed mask and noise are the forward's: d/dc = h, d/dd = n.
    assert torch.equal(gc_ == 0, h == 0)
    torch.testing.assert_close(gc_, h)
    torch.testing.assert_close(gd, n)
    assert torch.equal(gx == 0, h == 0)  # dropped elements get no gradient
    # Same seed: the same random numbers, gradients and final generator state as
    # torch.utils.checkpoint of the block compiled the same way ...
    scoped, plain, ckpt = (results[k][1] for k in ("scoped", "plain", "checkpoint"))
    assert all(torch.equal(a, b) for a, b in zip(scoped, ckpt))
    # ... and as the program without either, where checkpoint matches it (inductor
    # in torch 2.15 draws recomputed random ops differently from the plain graph).
    if all(torch.equal(a, b) for a, b in zip(ckpt, plain)):
        assert torch.equal(h == 0, plain[1] == 0)
        assert_close_all(scoped[:6], plain[:6])
        assert torch.equal(rng, plain[6])
    # Neither the mask nor the noise is kept: only RNG state to replay them.
    assert all(shape != (16, 16) for shape, _ in saved.others()), saved.others()
    assert any(shape == (16, 16) for shape, _ in results["plain"][0].others())  # plain keeps them


# ------------------------------------------------------------------ the AOTAutograd cache


def test_inductor_scoped_graph_and_the_aot_cache():
    """Default caches on: the plain function is compiled with inductor (and its artifact
    stored), then the same function with a scope, then the plain one again, in one
    process. The scoped graph must neither load nor store an AOTAutograd artifact (the
    annotation is not part of the cache key in torch 2.13), and keeps only its inputs."""
    inputs = make_inputs((24, 24), (24, 24), (24, 24), seed=3)
    hits = lambda: counters["aot_autograd"]["autograd_cache_hit"]
    bypasses = lambda: counters["aot_autograd"]["autograd_cache_bypass"]
    from torch._functorch._aot_autograd.autograd_cache import should_use_local_autograd_cache

    if not (should_use_local_autograd_cache() and torch._inductor.config.fx_graph_cache):
        pytest.skip("the environment turned the AOTAutograd / FX graph caches off")

    plain1 = run(torch.compile(block_fn(False), backend="inductor", fullgraph=True), inputs)
    torch._dynamo.reset()
    h0, b0 = hits(), bypasses()
    scoped = run(torch.compile(block_fn(True), backend="inductor", fullgraph=True), inputs)
    assert hits() == h0 and bypasses() == b0 + 1
    # Nothing but inputs: inductor also recomputes the exp after the block (pointwise).
    assert scoped[0].others() == [], "the scoped graph got the plain graph's artifact"
    torch._dynamo.reset()
    plain2 = run(torch.compile(block_fn(False), backend="inductor", fullgraph=True), inputs)
    assert hits() == h0 + 1, "the plain artifact should come from the cache (caching is on)"
    assert plain2[0].others() == plain1[0].others() != []
    assert_close_all([scoped[1], *scoped[2]], [plain1[1], *plain1[2]])
    eager = run(block_fn(False), inputs)
    assert_close_all([scoped[1], *scoped[2]], [eager[1], *eager[2]])


# ------------------------------------------------------------------ decorators, helpers, nesting


def test_decorators_and_apply_recompute_fullgraph():
    """Dynamo-level behaviour (the same for every AOTAutograd backend): aot_eager."""
    backend = "aot_eager"

    @recompute
    def bare(x, w):
        return F.gelu((x @ w).sin())

    @recompute_scope(save=[torch.ops.aten.mm])
    def saving(x, w):
        return F.gelu((x @ w).sin())

    def plain(x, w):
        return F.gelu((x @ w).sin())

    inputs = make_inputs((8, 16), (16, 16), (8, 16))
    expected = run(lambda x, w, c: plain(x, w) * c, inputs)
    for fn, kept in ((bare, []), (saving, [((8, 16), torch.float32)])):
        torch._dynamo.reset()
        compiled = torch.compile(lambda x, w, c: fn(x, w) * c, backend=backend, fullgraph=True)
        saved, y, g = run(compiled, inputs)
        assert saved.others() == kept, fn
        assert_close_all([y, *g], [expected[1], *expected[2]])

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(16, 64), nn.Linear(64, 16)

        def forward(self, h):
            return h + self.fc2(F.gelu(self.fc1(h)))

    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block())
    x = torch.randn(8, 16, requires_grad=True)
    params = [x, *model.parameters()]

    def step(m):
        with Saved(params) as saved:
            y = m(x)
        y.sum().backward()
        g = [p.grad.clone() for p in params]
        for p in params:
            p.grad = None
        return saved, g

    _, g_eager = step(model)
    apply_recompute(model, check_fn=lambda m: isinstance(m, Block))
    saved, g = step(torch.compile(model, backend=backend, fullgraph=True))
    # Only the boundary between the two blocks (the second block's input) is kept.
    assert saved.others() == [((8, 16), torch.float32)]
    assert_close_all(g, g_eager)
    apply_recompute(model, check_fn=lambda m: isinstance(m, Block), save=save_matmuls)
    torch._dynamo.reset()
    saved, g = step(torch.compile(model, backend=backend, fullgraph=True))
    # ... plus each block's fc1 output (addmm, which save_matmuls names; GELU's backward
    # reads it). fc2's outputs are matmuls too, but no backward op reads them.
    assert saved.others() == [((8, 16), torch.float32)] + [((8, 64), torch.float32)] * 2
    assert_close_all(g, g_eager)


def test_nested_scopes_in_compiled_code():
    """An inner scope belongs to the outer block (no boundary kept between them) and
    applies its own options to its own ops, as nested eager scopes do."""

    def make(scoped):
        def ctx(**o):
            return recompute_scope(**o) if scoped else contextlib.nullcontext()

        def f(x, w, z):
            with ctx() as outer:
                h = (x @ w).sin()  # (8, 16)
                with ctx(save=[torch.ops.aten.mm]) as inner:
                    k = h @ w  # (8, 16), kept by the inner policy
                    k2 = k.cos()
                k3 = k2.tanh()
            return k3 * z, outer, inner

        return f

    inputs = make_inputs((8, 16), (16, 16), (8, 16))
    expected = run(lambda *a: make(False)(*a)[0], inputs)
    fn = torch.compile(make(True), backend="aot_eager", fullgraph=True)
    with Saved(inputs) as saved:
        y, outer, inner = fn(*inputs)
    y.sum().backward()
    assert saved.others() == [((8, 16), torch.float32)]  # k only
    assert_close_all([y.detach(), *[t.grad for t in inputs]], [expected[1], *expected[2]])
    # Per-scope compile-time counts: outer has mm, sin, tanh; inner mm, cos.
    assert (outer.stats.ops_recorded, inner.stats.ops_recorded) == (3, 2)


def test_graph_break_inside_a_compiled_scope_runs_it_eagerly():
    def f(x, c):
        with recompute_scope() as scope:
            h = x.sin().exp()
            torch._dynamo.graph_break()
            k = h.cos()
        return k * c, scope

    x, c = make_inputs((8,), (8,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # dynamo warns about tracing the eager scope's internals
        y, scope = torch.compile(f, backend="aot_eager")(x, c)
    assert isinstance(scope, recompute_scope)  # dynamo ran the frame eagerly: an eager scope
    assert scope.stats.tensors_packed >= 1
    y.sum().backward()
    gx, gcc = x.grad.clone(), c.grad.clone()
    x.grad = c.grad = None
    (x.sin().exp().cos() * c).sum().backward()
    assert torch.equal(gx, x.grad) and torch.equal(gcc, c.grad)


# ------------------------------------------------------------------ stats and options


def test_stats_of_a_compiled_scope():
    def f(x, c):
        with recompute_scope() as scope:
            h = x.sin()
            k = h.exp()
        return k * c, scope

    fn = torch.compile(f, backend="aot_eager", fullgraph=True)
    x, c = make_inputs((4, 8), (4, 8))
    y, scope = fn(x, c)
    # Nothing of ours is active at run time: no saved-tensor hooks, no dispatch mode.
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    assert torch._C._len_torch_dispatch_stack() == 0
    y.sum().backward()
    # Filled when the graph was compiled: sin and exp are the block's ops; the backward
    # reads one block tensor (exp's output: exp's own backward and k * c need it; sin's
    # backward reads x), recomputed there.
    s = scope.stats
    assert (s.ops_recorded, s.tensors_packed, s.bytes_packed) == (2, 1, 4 * 8 * 4)
    assert (s.replays, s.ops_replayed) == (0, 0)  # the compiled backward counts nothing
    y2, scope2 = fn(x, c)
    assert scope2 is scope  # one per scope in the traced code, not per call
    assert "compiled recompute_scope" in repr(scope)


def test_disabled_and_no_grad_scopes_in_compiled_code():
    inputs = make_inputs((16, 16), (16, 16), (16, 16))
    plain = run(torch.compile(block_fn(False), backend="aot_eager", fullgraph=True), inputs)
    torch._dynamo.reset()
    off = run(torch.compile(block_fn(True, enabled=False), backend="aot_eager", fullgraph=True), inputs)
    assert off[0].others() == plain[0].others()
    assert_close_all([off[1], *off[2]], [plain[1], *plain[2]])
    torch._dynamo.reset()
    with torch.no_grad():
        y = torch.compile(block_fn(True), backend="aot_eager", fullgraph=True)(*inputs)
    torch.testing.assert_close(y, plain[1])


def test_invalid_options_in_compiled_code_raise_and_leave_config():
    def f(x):
        with recompute_scope(save=3):
            h = x.sin()
        return h * x

    with pytest.raises(Exception, match="save= takes an iterable of ops"):
        torch.compile(f, backend="aot_eager", fullgraph=True)(torch.randn(4, requires_grad=True))


def test_compile_error_inside_a_scope_leaves_config():
    """The session opened when dynamo met the scope is closed when the compile fails."""

    def f(x):
        with recompute_scope():
            h = x.sin()
            torch._dynamo.graph_break()  # fullgraph=True: dynamo raises here
        return h * x

    with pytest.raises(torch._dynamo.exc.Unsupported):
        torch.compile(f, backend="aot_eager", fullgraph=True)(torch.randn(4, requires_grad=True))
    # (the fresh_dynamo fixture checks joint_custom_pass, the end callbacks and the session)


def test_existing_joint_custom_pass_is_chained_and_restored():
    seen = []

    def user_pass(gm, joint_inputs):
        seen.append(sorted(str(n.meta["recompute"]) for n in gm.graph.nodes if "recompute" in n.meta))
        return gm

    old = torch._functorch.config.joint_custom_pass
    torch._functorch.config.joint_custom_pass = user_pass
    try:
        inputs = make_inputs((8, 8), (8, 8), (8, 8))
        run(torch.compile(block_fn(True), backend="aot_eager", fullgraph=True), inputs)
        assert torch._functorch.config.joint_custom_pass is user_pass
        # The user's pass ran after ours: it saw the block's 4 forward ops tagged, and the
        # version record of its inputs that are weights (leaves requiring grad) kept.
        assert seen == [["CheckpointPolicy.MUST_RECOMPUTE"] * 4 + ["CheckpointPolicy.MUST_SAVE"]]
        torch._dynamo.reset()
        run(torch.compile(block_fn(False), backend="aot_eager", fullgraph=True), inputs)
        assert seen[1] == []  # no scope: the user's pass alone, nothing tagged
    finally:
        torch._functorch.config.joint_custom_pass = old


# ------------------------------------------------------------------ compiled code inside an eager block


@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_function_inside_eager_scope_is_compiled_and_not_recorded(backend):
    def g(h, w):
        return torch.tanh(h @ w) * h.sum(dim=1, keepdim=True)

    cg = torch.compile(g, backend=backend, fullgraph=True)

    def program(scoped):
        torch.manual_seed(0)
        x, w, c = make_inputs((6, 5), (5, 5), (6, 5))
        scope = recompute_scope() if scoped else contextlib.nullcontext()
        with scope:
            h = x.sin()
            y = cg(h, w)
            k = y.exp()
        z = (k * c + y * h).sum()
        del h, k
        z.backward()
        return scope, [z.detach(), x.grad, w.grad, c.grad]

    frames0 = counters["stats"]["unique_graphs"]
    _, expected = program(False)
    scope, actual = program(True)
    assert counters["stats"]["unique_graphs"] == frames0 + 1  # compiled once, run twice
    for a, e in zip(actual, expected):
        assert torch.equal(a, e)
    # Only the block's own eager ops (sin, exp) are recorded: the compiled graph's ops run
    # unrecorded (aot_eager runs aten ops, inductor mm.out into its own buffers).
    assert scope.stats.ops_recorded == 2
    assert scope.stats.tensors_packed >= 2  # h (saved by mul) and k (by exp)


def test_inference_graph_inside_eager_scope_is_not_recorded():
    """Inputs that need no gradient: AOTAutograd runs an inference graph (grad disabled,
    no autograd.Function); its ops are not recorded either."""
    cg = torch.compile(lambda a, b: (a @ b).relu() + 1, backend="aot_eager", fullgraph=True)
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    w = torch.randn(4, 4, requires_grad=True)
    with recompute_scope() as scope:
        h = cg(a, b)  # mm, relu, add in the graph: not recorded
        k = h * w  # recorded
    assert scope.stats.ops_recorded == 1
    k.sum().backward()
    assert torch.equal(w.grad, (a @ b).relu() + 1)


def test_compiled_scope_inside_eager_scope():
    def g(h, w, c):
        with recompute_scope():
            a = (h @ w).sin()
        return a * c

    cg = torch.compile(g, backend="aot_eager", fullgraph=True)

    def program(scoped):
        x, w, c = make_inputs((6, 6), (6, 6), (6, 6))
        with Saved([x, w, c]) as saved:
            with recompute_scope() if scoped else contextlib.nullcontext():
                h = x.cos()
                y = cg(h, w, c)
        y.sum().backward()
        return saved, [y.detach(), x.grad, w.grad, c.grad]

    saved_plain, expected = program(False)
    saved, actual = program(True)
    for a, e in zip(actual, expected):
        assert torch.equal(a, e)
    # Without the eager scope the probe sees h, which the compiled graph keeps to
    # recompute its own block; never the compiled block's tensor a.
    assert saved_plain.others() == [((6, 6), torch.float32)]
    # With it, h (an eager block tensor that the graph saves as it is) is handed to the
    # eager scope's handle: the probe, entered before the scope, sees only inputs.
    assert saved.others() == []
