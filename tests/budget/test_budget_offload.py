"""Offload, the budget's third choice (API.md section 13), end to end: ``Budget(device_bytes,
offload=...)`` on a model-level budget and on hand-written scopes.

On CPU the offload engine runs on the host-copy stand-in: side streams run their copies
only when something waits for them, and fresh "device" buffers hold NaN, so a missing
stream wait shows in the gradients. Device bytes after forward are the probe's held bytes
with the stand-in's queued copies run first (what a finished device copy frees); the host
pool's slabs exist before the measured step, so they are not in it. On CUDA the same
tests run on real streams.
"""

import contextlib
import gc
import os
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import gradient_scope
from benchmarks._harness.memory import measure
from gradient_scope import Budget, apply_recompute, recompute_scope
from gradient_scope._budget.streams import host_copy_stand_in

from support import DEVICES, ResidualMLP, assert_all_same, pinned_cpu_rates

STRESS_STEPS = int(os.environ.get("GRADIENT_SCOPE_OFFLOAD_STRESS_STEPS", "6"))


@pytest.fixture(autouse=True)
def _fixed_rates():
    """The device's rates pinned (a plan depends on them; measured, they vary from run to
    run on a shared machine)."""
    with pinned_cpu_rates():
        yield


class Block(ResidualMLP):
    """support's residual MLP whose output also goes through a saved view with strides of its own."""

    def forward(self, x):
        h = F.gelu(self.fc1(self.ln(x)))
        y = self.fc2(F.dropout(h, 0.1, self.training))
        return x + y * torch.sigmoid(y.transpose(1, 2)).transpose(1, 2)  # a saved view with its own strides


def make_model(device="cpu", layers=3, d=32):
    torch.manual_seed(0)
    return nn.Sequential(*[Block(d) for _ in range(layers)], nn.LayerNorm(d), nn.Linear(d, 8)).to(device)


@contextlib.contextmanager
def offload_device(device):
    """The stand-in on CPU; CUDA as it is."""
    if device == "cpu":
        with host_copy_stand_in() as b:
            yield b
    else:
        yield None


def probe(model, x, backend=None, seed=1):
    model.zero_grad(set_to_none=True)
    x.grad = None
    torch.manual_seed(seed)
    gc.collect()

    def forward():
        out = model(x)
        if backend is not None:
            backend.drain()  # the copies out have run (a device copy finishes during forward)
        return out

    # The collector stays off in the window: a cycle of an earlier step that it frees
    # during forward would be counted as a negative allocation of this step.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        out, held, peak = measure(forward, lambda o: o.square().sum().backward(), x.device)
    finally:
        if was_enabled:
            gc.enable()
    held -= out.untyped_storage().nbytes()
    return held, peak, [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]


def grads(model, x, seed=1):
    """The gradients of one step (no memory probe: faster)."""
    model.zero_grad(set_to_none=True)
    x.grad = None
    torch.manual_seed(seed)
    model(x).square().sum().backward()
    return [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]


def quietly(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


def plain_of(device):
    x = torch.randn(4, 16, 32, device=device, requires_grad=True)
    return x, probe(make_model(device), x)


@pytest.mark.parametrize("device", DEVICES)
def test_gradients_bitwise_at_every_budget_and_offload_setting(device):
    x, (plain_held, _, plain_grads) = plain_of(device)
    with offload_device(device):
        for offload in (True, "48KiB", None):
            for budget in (0, 20_000, 60_000, 150_000, plain_held):
                model = make_model(device)
                b = Budget(budget, offload=offload)
                apply_recompute(model, check_fn=Block, budget=b)
                for _ in range(3):
                    assert_all_same(quietly(grads, model, x), plain_grads)


@pytest.mark.parametrize("device", DEVICES)
def test_offload_keeps_device_bytes_within_a_budget_below_the_recompute_floor(device):
    x, (plain_held, _, plain_grads) = plain_of(device)
    no_offload = Budget(0)
    model = make_model(device)
    apply_recompute(model, check_fn=Block, budget=no_offload)
    quietly(probe, model, x)
    quietly(probe, model, x)
    with offload_device(device) as backend:
        for budget in (no_offload.floor_bytes // 2, no_offload.floor_bytes + 30_000):
            model = make_model(device)
            b = Budget(budget, offload=True)
            apply_recompute(model, check_fn=Block, budget=b)
            steps = [quietly(probe, model, x, backend) for _ in range(3)]
            assert_all_same(steps[2][2], plain_grads)
            assert b.floor_bytes < no_offload.floor_bytes  # what only offload can move
            held = steps[2][0]
            assert held == b.planned_bytes <= budget, (budget, held, b.planned_bytes)
            assert b.offloaded_bytes > 0 and {"offloaded"} <= {s.how for s in b.stored_ops()}
            assert any(s.op == "input" for s in b.stored_ops() if s.how == "offloaded")  # kept inputs too
            engine = b._run.engine
            assert engine.live_bytes == 0 and engine.in_flight == 0  # all came back and went
            if backend is not None:
                assert backend.pending() == 0


def test_offload_on_cpu_tensors_changes_nothing_and_says_so_once():
    x, (plain_held, _, plain_grads) = plain_of("cpu")
    model, ref = make_model(), make_model()
    b = Budget(60_000, offload=True)
    b_ref = Budget(60_000)
    apply_recompute(model, check_fn=Block, budget=b)
    apply_recompute(ref, check_fn=Block, budget=b_ref)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        steps = [probe(model, x) for _ in range(3)]
        ref_steps = [probe(ref, x) for _ in range(3)]
    said = [w for w in caught if "offload=" in str(w.message) and "changes nothing" in str(w.message)]
    assert len(said) == 1
    assert [s[0] for s in steps] == [s[0] for s in ref_steps]
    assert b.offloaded_bytes == 0 and b.planned_bytes == b_ref.planned_bytes
    assert_all_same(steps[2][2], plain_grads)


def test_copies_back_are_prefetched_in_the_recorded_backward_order_ahead_of_need():
    x, _ = plain_of("cpu")
    with host_copy_stand_in():
        model = make_model()
        b = Budget(0, offload=True)
        apply_recompute(model, check_fn=Block, budget=b)
        engine = b._run.engine
        for _ in range(2):
            quietly(probe, model, x)
        issued = []
        real = engine.copy_back

        def spy(hc):
            issued.append((hc.key, len(engine.used)))
            real(hc)

        engine.copy_back = spy
        quietly(probe, model, x)
        used = list(dict.fromkeys(engine.used))
        keys = [k for k, _ in issued]
        assert keys and keys == [k for k in used if k in keys]  # the recorded backward order
        ahead = sum(1 for k, n in issued if k not in used[:n])
        assert ahead == len(issued)  # each issued before it was asked for


@pytest.mark.parametrize("device", DEVICES)
def test_an_exception_mid_backward_leaves_no_copy_in_flight_and_no_memory_held(device):
    class Boom(torch.autograd.Function):
        armed = False

        @staticmethod
        def forward(ctx, h):
            return h.clone()

        @staticmethod
        def backward(ctx, g):
            if Boom.armed:
                raise ValueError("boom")
            return g

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = make_model(device)

        def forward(self, x):
            return self.inner(Boom.apply(x))

    x, (_, _, plain_grads) = plain_of(device)
    with offload_device(device) as backend:
        model = Model()
        b = Budget(0, offload=True)
        apply_recompute(model, check_fn=Block, budget=b)
        quietly(probe, model, x)
        quietly(probe, model, x)
        Boom.armed = True
        with pytest.raises(ValueError, match="boom"):
            quietly(probe, model, x)
        Boom.armed = False
        engine = b._run.engine
        assert engine.live_bytes == 0 and engine.in_flight == 0
        if backend is not None:
            assert backend.pending() == 0
        b.release_host_memory()
        assert engine.reserved_bytes == 0
        assert_all_same(quietly(probe, model, x)[2], plain_grads)  # and the next step is right


@pytest.mark.parametrize("device", DEVICES)
def test_two_models_with_their_own_budgets_interleaved(device):
    x = torch.randn(4, 16, 32, device=device, requires_grad=True)
    with offload_device(device):
        a, c = make_model(device), make_model(device, layers=2)
        ref_a, ref_c = probe(make_model(device), x)[2], probe(make_model(device, layers=2), x)[2]
        apply_recompute(a, check_fn=Block, budget=Budget(20_000, offload=True))
        apply_recompute(c, check_fn=Block, budget=Budget(10_000, offload=True))
        for _ in range(3):
            for model in (a, c):
                model.zero_grad(set_to_none=True)
            x.grad = None
            torch.manual_seed(1)
            la = quietly(a, x)
            torch.manual_seed(1)
            lc = quietly(c, x)
            lc.square().sum().backward()
            got_c = [p.grad.clone() for p in c.parameters()]
            x.grad = None
            la.square().sum().backward()
            got_a = [p.grad.clone() for p in a.parameters()] + [x.grad.clone()]
            assert_all_same(got_a, ref_a)
            assert_all_same(got_c, ref_c[:-1])


def test_stress_delayed_copies_over_steps_and_structures():
    """Many steps, sequence lengths changing, copies run only when waited for: any
    missing wait would read NaN."""
    with host_copy_stand_in():
        model = make_model()
        b = Budget(30_000, offload=True)
        apply_recompute(model, check_fn=Block, budget=b)
        for i in range(STRESS_STEPS):
            x = torch.randn(4, 16 if i % 3 else 12, 32, requires_grad=True)
            ref = grads(make_model(), x)
            assert_all_same(quietly(grads, model, x), ref)


def test_save_on_cpu_entered_around_the_model_gets_what_the_budget_keeps_or_offloads():
    x, (_, _, plain_grads) = plain_of("cpu")
    with host_copy_stand_in():
        model = make_model()
        b = Budget(0, offload=True)
        apply_recompute(model, check_fn=Block, budget=b)
        for _ in range(3):
            model.zero_grad(set_to_none=True)
            x.grad = None
            torch.manual_seed(1)
            with torch.autograd.graph.save_on_cpu():
                loss = quietly(model, x).square().sum()
            loss.backward()
            assert_all_same([p.grad for p in model.parameters()] + [x.grad], plain_grads)
        assert b._run.engine.live_bytes == 0


def test_the_host_pool_is_bounded_by_offload_bytes():
    x, (_, _, plain_grads) = plain_of("cpu")
    with host_copy_stand_in():
        model = make_model()
        b = Budget(0, offload="20KiB")
        apply_recompute(model, check_fn=Block, budget=b)
        for _ in range(3):
            assert_all_same(quietly(grads, model, x), plain_grads)
        assert b.offloaded_bytes <= 20 * 1024
        assert b._run.engine.reserved_bytes <= 20 * 1024


def test_hand_written_scopes_offload_with_their_budget():
    torch.manual_seed(0)
    layers = [Block(16) for _ in range(3)]
    x = torch.randn(2, 8, 16, requires_grad=True)

    def run(budget):
        for p in (p for m in layers for p in m.parameters()):
            p.grad = None
        x.grad = None
        torch.manual_seed(3)
        h = x
        for layer in layers:
            with recompute_scope(budget=budget) if budget is not None else contextlib.nullcontext():
                h = layer(h)
        h.square().sum().backward()
        return [p.grad.clone() for m in layers for p in m.parameters()] + [x.grad.clone()]

    ref = run(None)
    with host_copy_stand_in():
        budget = Budget(16_000, offload=True)  # below the 17 KB the blocks keep for replay
        for _ in range(3):
            assert_all_same(quietly(run, budget), ref)
        assert budget.offloaded_bytes > 0 and budget.planned_bytes <= 16_000


def test_offload_argument_checks():
    assert Budget("1GiB", offload="2GiB").offload == 2 * 2**30
    assert Budget(10, offload=True).offload == float("inf")
    assert Budget(10, offload=False).offload is None and Budget(10).offload is None
    assert repr(Budget("1GiB", offload=True)) == "Budget('1.00 GiB', offload=True)"
    with pytest.raises(ValueError, match="offload"):
        Budget(10, offload="lots")
    with pytest.raises(TypeError, match="offload"):
        Budget(10, offload=1.5)
    copy = __import__("copy").deepcopy(Budget("1MiB", offload="1GiB"))
    assert copy.offload == 2**30 and copy.bytes == 2**20
    assert gradient_scope.Budget is Budget


@pytest.mark.parametrize("offload", [None, True])
def test_a_budgeted_model_leaves_no_reference_cycle(offload):
    """None of the budget's objects is in a reference cycle: they die as soon as nothing
    refers to them, not at the next garbage collection (which would hold what they refer
    to, and run collections in the middle of a later forward)."""
    from gradient_scope._budget.block import BlockPlan
    from gradient_scope._budget.offload import HostCopy, Offloaded, Offloader
    from gradient_scope._budget.region import Region
    from gradient_scope._budget.run import Run

    x = torch.randn(4, 16, 32, requires_grad=True)
    warm = make_model()  # (a process's first scoped step leaves cycles of its own: not ours)
    apply_recompute(warm, check_fn=Block)
    quietly(grads, warm, x)
    del warm
    was = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        with host_copy_stand_in():
            model = make_model()
            b = Budget(30_000, offload=offload)
            apply_recompute(model, check_fn=Block, budget=b)
            for _ in range(3):
                quietly(grads, model, x)
            del model, b
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        ours = (BlockPlan, Region, Run, Budget, HostCopy, Offloaded, Offloader)
        cyclic = [type(o).__name__ for o in gc.garbage if isinstance(o, ours)]
        assert not cyclic, cyclic
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        if was:
            gc.enable()
