"""A budget at its edges (issue 37 items 1, 4, 5; issue 34 item 3): a bounded host pool
holds what the plan offloads and reports what the host holds; alternating lengths plan
once per structure and show the figures of the structure that ran; a disabled process
leaves a budget inert; the budget's rooms import one way and the seams between layers are
registered in one place, each with its remover.

On CPU the offload engine runs on the host-copy stand-in, whose "pinned" allocations are
rounded up to a power of two as CUDA's caching host allocator rounds them.
"""

import ast
import contextlib
import gc
import pathlib
import warnings

import pytest
import torch
import torch.nn as nn

import gradient_scope
from benchmarks._harness.memory import measure
from gradient_scope import Budget, apply_recompute
from gradient_scope._budget import run as _run_module
from gradient_scope._budget.hostpool import HostPool
from gradient_scope._budget.streams import HostCopyStandIn, host_copy_stand_in

from support import ResidualMLP, assert_all_same, pinned_cpu_rates

PACKAGE = pathlib.Path(gradient_scope.__file__).parent


@pytest.fixture(autouse=True)
def _fixed_rates():
    with pinned_cpu_rates():
        yield


def make_model(layers=3, d=8):
    """Pre-norm blocks, then a final norm and a head outside the scopes."""
    torch.manual_seed(0)
    return nn.Sequential(*[ResidualMLP(d) for _ in range(layers)], nn.LayerNorm(d), nn.Linear(d, 8))


def step(model, x, backend=None, budget=None):
    """One step: ``(held after forward, gradients, host bytes in use after forward)``."""
    model.zero_grad(set_to_none=True)
    x.grad = None
    torch.manual_seed(1)
    gc.collect()
    host = []

    def forward():
        out = model(x)
        if backend is not None:
            backend.drain()  # the copies out have run (a device copy finishes during forward)
        if budget is not None and budget._run.engine is not None:
            host.append(budget._run.engine.live_bytes)
        return out

    out, held, _ = measure(forward, lambda o: o.square().sum().backward(), x.device)
    held -= out.untyped_storage().nbytes()
    return held, [p.grad.clone() for p in model.parameters()] + [x.grad.clone()], host[0] if host else None


def plain_grads(x):
    return step(make_model(), x)[1]


# --------------------------------------------------------------------------------------
# issue 37.1: a bounded host pool holds what the plan offloads


def test_a_bounded_pool_holds_what_the_plan_offloads_and_the_device_stays_within_the_budget():
    """The issue's case: the pool rounded each block up to 512 bytes while the plan fit raw
    bytes into offload=; a copy that found no room stayed on the device, over the budget."""
    x = torch.randn(2, 8, 8, requires_grad=True)
    expected = plain_grads(x)
    with host_copy_stand_in() as backend, warnings.catch_warnings():
        warnings.simplefilter("error")  # no refused copy, no floor warning
        model = make_model()
        b = Budget(16_200, offload="1500B")
        apply_recompute(model, check_fn=ResidualMLP, budget=b)
        for _ in range(3):
            held, grads, host = step(model, x, backend, b)
            assert_all_same(grads, expected)
        assert b.planned_bytes <= b.bytes and b.offloaded_bytes > 0
        assert held == b.planned_bytes <= b.bytes, (held, b.planned_bytes)
        assert host == b.offloaded_bytes  # what the plan offloads is what the pool holds
        engine = b._run.engine
        assert engine.reserved_bytes == backend.pinned_bytes() <= 1500  # what the host really holds


@pytest.mark.parametrize("offload", ["600B", "1500B", "3000B", "5KiB"])
@pytest.mark.parametrize("budget", [15_500, 16_200, 17_000])
def test_held_is_within_the_budget_whenever_the_plan_is(offload, budget):
    x = torch.randn(2, 8, 8, requires_grad=True)
    expected = plain_grads(x)
    with host_copy_stand_in() as backend, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*below the floor")
        warnings.filterwarnings("error", message=".*stayed on the device")
        model = make_model()
        b = Budget(budget, offload=offload)
        apply_recompute(model, check_fn=ResidualMLP, budget=b)
        for _ in range(3):
            held, grads, host = step(model, x, backend, b)
            assert_all_same(grads, expected)
        if b.planned_bytes <= b.bytes:
            assert held <= b.bytes, (held, b.planned_bytes)
        assert held == b.planned_bytes and host == b.offloaded_bytes
        assert b._run.engine.reserved_bytes == backend.pinned_bytes() <= b.offload


def test_the_pool_reports_the_pinned_bytes_the_host_really_holds():
    """H3: a pinned allocation is rounded up to a power of two; the pool asks for the
    rounded size, counts it, and never reserves more than its limit."""
    backend = HostCopyStandIn()
    pool = HostPool(backend, limit=1500)
    assert pool.capacity == 1024  # the largest slab whose pinned size is within 1500 bytes
    blocks = [pool.alloc(n) for n in (100, 512, 64)]
    assert blocks[2] is None  # 512 + 512 taken: a third block has no room (H2)
    assert pool.live == 1024 and pool.reserved == backend.pinned_bytes() == 1024
    for blk in blocks[:2]:
        pool.free(blk)
    unbounded = HostPool(backend, limit=None, slab=3000)
    unbounded.alloc(2500)
    assert unbounded.reserved == 4096 and backend.pinned_bytes() == 1024 + 4096
    pool.expect(10**6)  # a plan expecting more than the capacity gets the capacity
    assert pool.alloc(1024) is not None and pool.reserved <= 1500


def test_a_copy_the_pool_cannot_place_is_said_not_dropped_silently():
    """A graph kept alive across steps holds its offloaded copies: the next step's copies
    find no room; they stay on the device, and the budget says how many bytes."""
    x = torch.randn(2, 8, 8, requires_grad=True)
    with host_copy_stand_in():
        model = make_model()
        b = Budget(16_200, offload="1500B")
        apply_recompute(model, check_fn=ResidualMLP, budget=b)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                model(x).square().sum().backward()
            kept = model(x).square().sum()  # offloads under the plan; its graph lives on
            kept.backward(retain_graph=True)
            model(x).square().sum().backward()  # no room: the pool is held by ``kept``'s graph
            del kept
            model(x).square().sum().backward()
            assert b.planned_bytes is not None  # (ends the step)
        said = [str(w.message) for w in caught if "stayed on the device" in str(w.message)]
        assert len(said) == 1 and "host pool had no room" in said[0], [str(w.message) for w in caught]


# --------------------------------------------------------------------------------------
# issue 37.4: alternating lengths plan once per structure


def test_alternating_lengths_plan_once_per_structure_and_show_the_figures_of_the_one_that_ran(monkeypatch):
    plans = []
    planner = _run_module._plan

    def counting(*args, **kwargs):
        plans.append(1)
        return planner(*args, **kwargs)

    monkeypatch.setattr(_run_module, "_plan", counting)
    model = make_model()
    b = Budget(25_000)
    apply_recompute(model, check_fn=ResidualMLP, budget=b)
    figures: dict[int, list] = {8: [], 12: []}
    helds: dict[int, list] = {8: [], 12: []}
    for i in range(10):
        length = 8 if i % 2 == 0 else 12
        x = torch.randn(2, length, 8, requires_grad=True)
        held, _, _ = step(model, x)
        figures[length].append((b.planned_bytes, b.floor_bytes, b.predicted_recompute))
        if i >= 2:  # planned from the third step: the first of each length measures
            helds[length].append(held)
    assert len(plans) == 2, f"{len(plans)} plans in 10 steps of 2 structures"
    for length in (8, 12):
        assert len(set(figures[length])) == 1, (length, figures[length])  # as its first plan
        assert set(helds[length]) == {figures[length][0][0]}, (length, helds[length], figures[length][0])
    assert figures[8][0] != figures[12][0]


# --------------------------------------------------------------------------------------
# issue 37.5: a disabled process leaves a budget inert


@pytest.mark.parametrize("how", ["environment", "context"])
def test_a_budget_in_a_disabled_process_records_plans_and_shows_nothing(monkeypatch, how):
    x = torch.randn(2, 8, 8, requires_grad=True)
    expected = plain_grads(x)
    model = make_model()
    b = Budget(25_000)
    apply_recompute(model, check_fn=ResidualMLP, budget=b)
    if how == "environment":
        monkeypatch.setenv("GRADIENT_SCOPE_DISABLE", "1")  # read as test_scope_options reads it
        ctx = contextlib.nullcontext()
    else:
        ctx = gradient_scope.disabled()
    with ctx:
        for _ in range(3):
            assert_all_same(step(model, x)[1], expected)
        assert (b.planned_bytes, b.floor_bytes, b.offloaded_bytes, b.predicted_peak_bytes) == (None,) * 4
        assert b.stored_ops() == [] and "no step measured" in b.summary()
    monkeypatch.delenv("GRADIENT_SCOPE_DISABLE", raising=False)
    for _ in range(2):
        assert_all_same(step(model, x)[1], expected)
    assert b.planned_bytes is not None  # enabled again: it measures and plans


# --------------------------------------------------------------------------------------
# issue 34.3: one direction in _budget; the seams in one place, each with its remover


def _imports(path: pathlib.Path) -> set[str]:
    """The sibling modules ``path`` imports, also under ``if TYPE_CHECKING``."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module is not None:
                out.add(node.module.split(".")[0])
            else:
                out.update(a.name for a in node.names)
    return out


def test_the_budget_rooms_import_one_way():
    rooms = {p.stem: p for p in (PACKAGE / "_budget").glob("*.py") if p.stem != "__init__"}
    graph = {name: _imports(path) & set(rooms) for name, path in rooms.items()}
    assert "run" not in graph["block"] and "run" not in graph["region"]
    seen: dict[str, int] = {}

    def visit(name, path):
        if seen.get(name) == 1:
            raise AssertionError(f"an import circle in _budget: {' -> '.join([*path, name])}")
        if seen.get(name) == 2:
            return
        seen[name] = 1
        for other in sorted(graph[name]):
            visit(other, [*path, name])
        seen[name] = 2

    for name in sorted(graph):
        visit(name, [])
    for name in ("block", "region"):  # they ask the run; they never reach into its state
        tree = ast.parse(rooms[name].read_text())
        private = [
            n.attr
            for n in ast.walk(tree)
            if isinstance(n, ast.Attribute)
            and isinstance(n.value, ast.Name)
            and n.value.id == "budget"
            and n.attr.startswith("_")
        ]
        assert private == [], (name, private)


SEAMS = (
    "add_freed_storage_handler",
    "add_empty_listener",
    "add_close_listener",
    "set_traced_block",
    "set_steady_runner",
    "set_calibration",
    "add_shared_check",
)


def test_the_seams_between_layers_are_registered_in_the_package_only():
    where = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
                if name in SEAMS:
                    where.append((str(path.relative_to(PACKAGE)), name))
    assert where and {w for w, _ in where} == {"__init__.py"}, where
    assert len(gradient_scope._SEAMS) == len(where) and all(callable(r) for r in gradient_scope._SEAMS)


def test_each_seam_registration_returns_its_remover():
    from gradient_scope._api import scope as _scope
    from gradient_scope._record import recorder, registry
    from gradient_scope._restore import replay
    from gradient_scope._save import pack

    def handler(t):
        return False

    remove = replay.add_freed_storage_handler(handler)
    assert replay._freed_storage_handlers[-1] is handler
    remove()
    assert handler not in replay._freed_storage_handlers

    closed = []
    remove = recorder.add_close_listener(closed.append)
    w = torch.randn(3, 3, requires_grad=True)
    with gradient_scope.recompute_scope():
        (w * 2).sum()
    assert len(closed) == 1
    remove()
    with gradient_scope.recompute_scope():
        (w * 2).sum()
    assert len(closed) == 1

    def listener(lg):
        pass

    remove = registry.add_empty_listener(listener)
    assert listener in registry._empty_listeners
    remove()
    assert listener not in registry._empty_listeners

    ran = []
    original = _scope._steady_runner[0]
    try:
        remove = _scope.set_steady_runner(lambda options, scope, fn, args, kwargs: ran.append(1) or fn(*args, **kwargs))
        assert _scope.run_in_scope(gradient_scope.recompute_scope(), lambda: 5, (), {}) == 5 and ran == [1]
        remove()
        assert _scope.run_in_scope(gradient_scope.recompute_scope(), lambda: 6, (), {}) == 6 and ran == [1]
    finally:
        _scope.set_steady_runner(original)

    close = pack.open_region(lambda t, may_take: None)
    assert pack.regions_open()
    close()
    assert not pack.regions_open()
