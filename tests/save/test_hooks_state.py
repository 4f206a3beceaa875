"""Global state (saved-tensor hook stack, dispatch mode stack, grad mode, RNG) and
composition with foreign saved_tensors_hooks, threads and torch.func."""

import threading
import weakref

import pytest
import torch
import torch.nn.functional as F

from gradient_scope import recompute_scope

from support import (
    PlainScopes,
    RecordingHooks,
    Scopes,
    assert_all_same,
    assert_interception_gone,
    assert_stacks_clean,
    baseline_hooks,
    dead,
    dispatch_depth,
    global_state,
    grads,
    run_both,
    stat,
    top_hooks,
)

_ORIG_STH_ENTER = torch.autograd.graph.saved_tensors_hooks.__enter__
_ORIG_STH_EXIT = torch.autograd.graph.saved_tensors_hooks.__exit__


def _func_grad_works():
    g = torch.func.grad(lambda t: (t.sin() * t).sum())(torch.arange(3.0))
    return torch.allclose(g, torch.arange(3.0).cos() * torch.arange(3.0) + torch.arange(3.0).sin())


def test_state_restored_when_last_block_tensor_dies(device):
    before = global_state()
    depth = dispatch_depth()
    a = torch.randn(4, requires_grad=True, device=device)
    c = torch.randn(4, requires_grad=True, device=device)
    with recompute_scope():
        x = a.exp()
        x2 = x * 2
    y = x * c
    del x
    z = x2.sin()
    y.sum().backward(retain_graph=True)  # z's graph shares ExpBackward with y's
    del y
    # x2 is still alive: it may still be intercepted.  Once it dies, nothing is left.
    del x2
    assert top_hooks() == baseline_hooks()
    assert dispatch_depth() == depth
    assert_interception_gone(before)
    assert torch.autograd.graph.saved_tensors_hooks.__enter__ is _ORIG_STH_ENTER
    assert torch.autograd.graph.saved_tensors_hooks.__exit__ is _ORIG_STH_EXIT
    assert _func_grad_works()
    z.sum().backward()
    del z
    assert_interception_gone(before)


def test_state_restored_at_exit_when_nothing_survives(device):
    before = global_state()
    a = torch.randn(4, requires_grad=True, device=device)
    with recompute_scope():
        x = a.sin()
        y = (x * x).sum()
        y.backward()
        del x, y
    assert_interception_gone(before)
    with recompute_scope():
        pass
    assert_interception_gone(before)
    assert _func_grad_works()


class _ScopedBackward(torch.autograd.Function):
    """Its backward builds a graph in a scope, as hand-written recomputation does
    (inside the backward pass, nothing scoped before it)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.sin() * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            with recompute_scope():
                c = x.sin() * x  # recomputed, to differentiate it here
            (dx,) = torch.autograd.grad(c.sum(), x)
        return g * dx


@pytest.mark.parametrize("where", ["nonreentrant_checkpoint", "reentrant_checkpoint", "function_backward"])
def test_scope_first_entered_inside_backward_leaves_no_trace(where, device):
    """A scope whose block runs only inside a backward pass (checkpoint's recomputation,
    a custom Function's backward), with no block tensor alive when the pass starts: the
    engine drops the hook pair pushed inside the pass, and once the pass ends nothing of
    the interception is left, the patched PyTorch functions included (no gc)."""
    from torch.utils.checkpoint import checkpoint

    def program(scope):
        torch.manual_seed(0)
        w = torch.randn(8, 8, requires_grad=True, device=device)
        x = torch.randn(4, 8, requires_grad=True, device=device)

        def fn(a):
            with scope():
                b = torch.tanh(a @ w)
            return b.exp()

        if where == "function_backward":
            y = _ScopedBackward.apply(x @ w)
        else:
            y = checkpoint(fn, x, use_reentrant=where == "reentrant_checkpoint")
        y.sum().backward()
        return dict(y=y.detach(), **grads(dict(x=x, w=w)))

    scoped = program(Scopes())
    assert_stacks_clean()  # before anything else runs autograd on this thread
    assert_all_same(scoped, program(PlainScopes()))
    assert _func_grad_works()


class _FailsInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        raise ValueError("backward fails here")


def test_scope_inside_a_backward_pass_that_raises_leaves_no_trace(device):
    """As above, when the pass raises after the scope's block ran in it (the engine
    then skips its end-of-pass callbacks)."""
    from torch.utils.checkpoint import checkpoint

    w = torch.randn(8, 8, requires_grad=True, device=device)
    x = torch.randn(4, 8, requires_grad=True, device=device)

    def fn(a):
        with recompute_scope():
            b = torch.tanh(a @ w)
        return b.exp()

    y = checkpoint(fn, _FailsInBackward.apply(x), use_reentrant=False)  # recomputed first
    with pytest.raises(ValueError, match="backward fails here"):
        y.sum().backward()
    del y
    assert_stacks_clean()
    assert _func_grad_works()


def test_disable_saved_tensors_hooks_works_after_interception_gone(device):
    a = torch.randn(4, requires_grad=True, device=device)
    with recompute_scope():
        x = a.sin()
    y = x * a
    del x, y
    with torch.autograd.graph.disable_saved_tensors_hooks("hooks are disabled here"):
        z = a.sin() * a  # saves tensors: would raise if any hook were still registered
    z.sum().backward()


def test_func_grad_works_after_model_step(device):
    from support import Transformer

    model = Transformer(mode="both").to(device)
    x = torch.randn(2, 4, 16, device=device)
    loss = model(x, lambda: recompute_scope()).pow(2).mean()
    loss.backward()
    del loss
    assert_interception_gone()
    assert _func_grad_works()


def _raise_inside(kind, device):
    """Raises ValueError("boom"), or RuntimeError from an op for kind == "op"."""
    a = torch.randn(5, requires_grad=True, device=device)
    with recompute_scope():
        x = a.sin()
        torch.randn(3, device=device)  # consumes RNG inside the block
        y = F.dropout(x, 0.5, training=True)
        if kind == "python":
            raise ValueError("boom")
        elif kind == "op":
            y @ torch.randn(7, 2, device=device)  # shape mismatch raised by the op itself
        elif kind == "no_grad":
            with torch.no_grad():
                z = y * 2
                raise ValueError("boom")
        elif kind == "autocast":
            with torch.autocast(device, dtype=torch.bfloat16):
                z = torch.mm(y[None], torch.randn(5, 2, device=device))
                raise ValueError("boom")


def _rng_state(device):
    return torch.get_rng_state() if device == "cpu" else torch.cuda.get_rng_state()


@pytest.mark.parametrize("kind", ["python", "op", "no_grad", "autocast"])
def test_exception_inside_block_leaves_state_clean(kind, device):
    before = global_state()
    torch.manual_seed(123)
    try:
        _raise_inside(kind, device)
    except Exception as e:  # noqa: BLE001 - `e` (and the frames it holds) is gone after this block
        caught = (type(e), str(e))
    else:
        caught = None
    if kind == "op":
        assert caught is not None and issubclass(caught[0], RuntimeError), caught
    else:
        assert caught == (ValueError, "boom"), caught
    rng_after = _rng_state(device)
    assert_interception_gone(before)
    assert torch.is_grad_enabled()
    assert _func_grad_works()

    # the RNG stream is the one the plain program leaves
    torch.manual_seed(123)
    torch.randn(5, device=device)
    torch.randn(3, device=device)
    F.dropout(torch.zeros(5, device=device), 0.5, training=True)
    if kind == "autocast":
        torch.randn(5, 2, device=device)
    elif kind == "op":
        torch.randn(7, 2, device=device)
    assert torch.equal(rng_after, _rng_state(device))

    # a later correct step works and gives the plain gradients
    def program(scope):
        a = torch.randn(5, requires_grad=True, device=device)
        c = torch.randn(5, requires_grad=True, device=device)
        with scope():
            x = torch.tanh(a) * 3
        y = x * c
        del x
        y.sum().backward()
        return grads(dict(a=a, c=c))

    scopes, _ = run_both(program)
    assert stat(scopes.created[0], "replays") >= 1
    assert_interception_gone(before)


def test_exception_with_block_tensor_alive_then_released(device):
    before = global_state()
    a = torch.randn(5, requires_grad=True, device=device)
    keep = []
    with pytest.raises(KeyError):
        with recompute_scope():
            keep.append(a.exp())
            raise KeyError("x")
    y = keep[0] * a
    y.sum().backward()
    a2 = a.detach().clone().requires_grad_()
    (a2.exp() * a2).sum().backward()
    assert torch.equal(a.grad, a2.grad)
    del keep, y
    assert_interception_gone(before)


# --------------------------------------------------------------------------------------
# foreign saved-tensor hooks
#
# Program, with distinct shapes so what a hook receives can be identified:
#   P0 | with scope: x = a @ b   saves A=(2,3), B=(3,5)   (outside tensors)
#      |             P1
#      |             u = x.sum(1).exp()   saves U=(2,)   (block-created)
#      |             P2
#   P3 | y = u[:, None] * c      saves UV=(2,1) (view of block tensor), C=(2,7) (outside)
#   P4 | del x, u; backward; del y       -> every block-created tensor is dead
#   P5 | probe = d * e           saves D=(11,), E=(11,)
#   P6

A, B, U, UV, C, D = (2, 3), (3, 5), (2,), (2, 1), (2, 7), (11,)

WINDOWS = [(0, 3), (0, 4), (0, 5), (0, 6), (1, 2), (3, 4), (3, 5), (3, 6), (4, 5), (4, 6), (5, 6)]


def _expected_shapes(enter, exit_, scoped):
    """What a hook open over [enter, exit_) receives, per ``docs/compatibility.md``."""
    got = set()
    open_at = lambda p: enter <= p < exit_
    if open_at(0):  # mm inside the block: outside tensors are handed on
        got |= {A, B}
    if open_at(1) and (enter == 1 or not scoped):  # exp in the block saves a block tensor
        got |= {U}
    if open_at(3):
        if enter == 3 or not scoped:
            got |= {UV}
        got |= {C}
    if open_at(5):
        got |= {D}
    return got


def _hooks_program(enter, exit_, make_hooks, device):
    def program(scope):
        hooks = make_hooks()
        checks = {}

        def at(p):
            if p == enter:
                hooks.__enter__()
            if p == exit_:
                hooks.__exit__(None, None, None)

        a = torch.randn(*A, requires_grad=True, device=device)
        b = torch.randn(*B, requires_grad=True, device=device)
        c = torch.randn(*C, requires_grad=True, device=device)
        d = torch.randn(*D, requires_grad=True, device=device)
        e = torch.randn(*D, requires_grad=True, device=device)
        at(0)
        with scope():
            x = a @ b
            at(1)
            u = x.sum(1).exp()
            at(2)
        at(3)
        y = u[:, None] * c
        at(4)
        refs = [weakref.ref(x), weakref.ref(u)]
        del x, u
        y.sum().backward()
        del y
        checks["block_tensors_dead"] = dead(*refs)
        hook_open = enter < 5 <= exit_
        checks["top_is_none_iff_hook_closed"] = (top_hooks() == baseline_hooks()) != hook_open
        at(5)
        probe = d * e
        probe.sum().backward()
        del probe
        at(6)
        checks["top_is_none_at_end"] = top_hooks() == baseline_hooks()
        out = grads(dict(a=a, b=b, c=c, d=d, e=e))
        out["checks"] = checks
        out["hooks"] = hooks
        return out

    return program


@pytest.mark.parametrize("enter,exit_", WINDOWS, ids=[f"P{a}-P{b}" for a, b in WINDOWS])
def test_recording_hooks_around_scope(enter, exit_, device):
    scoped = {}
    plain = {}

    def make(store):
        def f():
            store["h"] = RecordingHooks()
            return store["h"]

        return f

    from support import PlainScopes, Scopes, assert_all_same

    torch.manual_seed(0)
    got = _hooks_program(enter, exit_, make(scoped), device)(Scopes())
    torch.manual_seed(0)
    want = _hooks_program(enter, exit_, make(plain), device)(PlainScopes())
    got_checks, want_checks = got.pop("checks"), want.pop("checks")
    got.pop("hooks"), want.pop("hooks")
    assert_all_same(got, want)

    assert want_checks["top_is_none_at_end"] and want_checks["top_is_none_iff_hook_closed"]
    assert got_checks == {
        "block_tensors_dead": True,
        "top_is_none_iff_hook_closed": True,
        "top_is_none_at_end": True,
    }, got_checks

    h, hp = scoped["h"], plain["h"]
    assert h.packed_while_closed == [], "hook received tensors outside its with block"
    assert hp.packed_while_closed == []
    assert hp.shapes == _expected_shapes(enter, exit_, scoped=False)  # premise
    assert h.shapes == _expected_shapes(enter, exit_, scoped=True), (
        f"hook open over P{enter}..P{exit_} received {sorted(h.shapes)}"
    )


@pytest.mark.parametrize("enter,exit_", WINDOWS, ids=[f"P{a}-P{b}" for a, b in WINDOWS])
def test_save_on_cpu_around_scope(enter, exit_, device):
    def make():
        return torch.autograd.graph.save_on_cpu()

    def program(scope):
        out = _hooks_program(enter, exit_, make, device)(scope)
        checks = out.pop("checks")
        out.pop("hooks")
        assert checks["top_is_none_at_end"], checks
        if scope.real:
            assert checks["block_tensors_dead"] and checks["top_is_none_iff_hook_closed"], checks
        return out

    run_both(program)


def test_two_foreign_hooks_around_scope(device):
    """h1 entered before the block, h2 after it; h2 exits, then h1 exits while block
    tensors are alive (the scope's interception sits above h1 then)."""
    record = {}

    def program(scope):
        h1, h2 = RecordingHooks(), RecordingHooks()
        a = torch.randn(3, 4, requires_grad=True, device=device)
        c = torch.randn(4, 5, requires_grad=True, device=device)
        d = torch.randn(6, requires_grad=True, device=device)
        h1.__enter__()
        with scope():
            x = torch.tanh(a)  # saves x (block-created, while the scope is innermost)
        h2.__enter__()
        y = x @ c  # innermost is h2: gets (3, 4) and (4, 5)
        h2.__exit__(None, None, None)
        z = y.sin()  # y is not block-created: handed on to h1 -> (3, 5)
        h1.__exit__(None, None, None)
        w = d * d  # no foreign hook open
        del x
        (z.sum() + w.sum()).backward()
        record[scope.real] = (h1, h2)
        return dict(z=z.detach(), **grads(dict(a=a, c=c, d=d)))

    run_both(program)
    for real in (True, False):
        h1, h2 = record[real]
        assert h1.packed_while_closed == [] and h2.packed_while_closed == [], real
        assert h2.shapes == {(3, 4), (4, 5)}, (real, h2.packed)
    assert record[False][0].shapes == {(3, 4), (3, 5)}  # premise: plain tanh saves its output
    assert record[True][0].shapes == {(3, 5)}, record[True][0].packed
    assert_interception_gone()


# --------------------------------------------------------------------------------------
# threads


def _thread_program(drop_in_worker, device):
    def program(scope):
        a = torch.randn(6, 4, requires_grad=True, device=device)
        c = torch.randn(4, 3, requires_grad=True, device=device)
        with scope():
            h = torch.tanh(a @ torch.ones(4, 4, device=device)) * 2
            k = h.exp()
        y = (h @ c).sum() + (k @ c).sum()
        box = [k]
        del h, k
        if not drop_in_worker:
            box.clear()  # every block tensor is dead before backward
        errors, thread_state = [], {}

        def work():
            try:
                y.backward()
                box.clear()  # with drop_in_worker, the last block tensor dies here
                thread_state["top"] = top_hooks()
            except BaseException as e:  # noqa: BLE001  # pragma: no cover - reported below
                errors.append(e)

        t = threading.Thread(target=work)
        t.start()
        t.join()
        assert not errors, errors
        assert thread_state["top"] is None, "hooks left on the backward thread's stack"
        return dict(y=y.detach(), **grads(dict(a=a, c=c)))

    return program


def test_backward_in_another_thread(device):
    scopes, _ = run_both(_thread_program(drop_in_worker=False, device=device))
    assert stat(scopes.created[0], "replays") >= 1
    assert_interception_gone()
    assert _func_grad_works()


def test_last_block_tensor_dies_in_backward_thread(device):
    """The last block tensor dies in the worker thread.  The forward thread's hook stack
    cannot be touched from there; but tensors saved here afterwards must be handled
    exactly as without a scope, and by the time library code next runs on this thread
    (entering any scope) nothing of the old interception may be left."""
    scopes, _ = run_both(_thread_program(drop_in_worker=True, device=device))
    assert stat(scopes.created[0], "replays") >= 1

    def program(scope):  # plain autograd on this thread, no new scope
        p = torch.randn(5, requires_grad=True, device=device)
        q = p * 2
        y = q.sin() * q.exp()
        y.sum().backward()
        return dict(y=y.detach(), p=p.grad)

    run_both(program)
    q = torch.randn(5, requires_grad=True, device=device) * 1
    y = q.sin()
    q.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
    del q, y
    with recompute_scope():
        pass
    assert_interception_gone()
    assert _func_grad_works()


def test_forward_in_another_thread_backward_here(device):
    a = torch.randn(5, requires_grad=True, device=device)
    a_ref = a.detach().clone().requires_grad_()
    result = {}

    def forward():
        try:
            with recompute_scope():
                x = a.exp() * 2
            result["y"] = (x * a).sum()
            result["top"] = top_hooks()  # x still alive here
            del x
            result["top_after_del"] = top_hooks()
        except BaseException as e:  # noqa: BLE001  # pragma: no cover
            result["error"] = e

    t = threading.Thread(target=forward)
    t.start()
    t.join()
    assert "error" not in result, result.get("error")
    assert result["top_after_del"] is None
    assert top_hooks() == baseline_hooks()  # hooks are thread-local: nothing pushed here
    result.pop("y").backward()
    (a_ref.exp() * 2 * a_ref).sum().backward()
    assert torch.equal(a.grad, a_ref.grad)
    assert top_hooks() == baseline_hooks()


def test_two_threads_with_own_scopes(device):
    inputs = [torch.randn(64, device=device) for _ in range(2)]
    out = {}
    barrier = threading.Barrier(2)

    def worker(i):
        try:
            a = inputs[i].clone().requires_grad_()
            barrier.wait()
            for _ in range(5):
                with recompute_scope():
                    x = torch.sigmoid(a * (i + 1)).exp()
                y = (x * x).sum()
                del x
                y.backward()
                del y
            out[i] = (a.grad.clone(), top_hooks())
        except BaseException as e:  # noqa: BLE001  # pragma: no cover
            out[i] = e

    ts = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    for i in range(2):
        assert not isinstance(out[i], BaseException), out[i]
        a = inputs[i].clone().requires_grad_()
        for _ in range(5):
            x = torch.sigmoid(a * (i + 1)).exp()
            (x * x).sum().backward()
        assert torch.equal(out[i][0], a.grad)
        assert out[i][1] is None
