"""Compiled replay (docs/internals.md, ``_restore.codegen`` C1..C3): a program that runs again
is compiled into straight-line Python, which must do what the interpreter does --
same values (bitwise), same checks and errors, same memory.

Most tests elsewhere replay a program once (interpreted); here programs are compiled
from their first run (``HOT = 1``) or never (``HOT`` huge), and compared."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, reject, settings

import gradient_scope._restore.codegen as plan_code
import gradient_scope._restore.replay as plan
from benchmarks._harness.memory import profile_cpu_memory
from gradient_scope import RecomputeError, recompute_scope

from support.fuzz_programs import DIFF_SETTINGS, FAMILIES, _count, _family_program, check_program, program_st

NEVER = 10**9


def _count_compiled_runs(monkeypatch) -> list[int]:
    """Patch replay to note each run of compiled code (the op count of its plan)."""
    runs: list[int] = []
    real = plan.compiled

    def counting(st, program, *rest):
        code = real(st, program, *rest)
        if code is not None:
            runs.append(len(program.plan))
        return code

    monkeypatch.setattr(plan, "compiled", counting)
    return runs


@pytest.fixture
def compiled_from_first_run(monkeypatch):
    """Every program is compiled the first time it runs; yields the list of the runs
    of compiled code (their op counts)."""
    monkeypatch.setattr(plan_code, "HOT", 1)
    return _count_compiled_runs(monkeypatch)


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("option", ["plain", "save_mm", "debug"])
def test_each_op_family_compiled(family, option, compiled_from_first_run):
    """Every op of the differential test's vocabulary, replayed by compiled code: equal
    to plain, or RecomputeError, as interpreted."""
    failures = []
    for name in FAMILIES[family]:
        try:
            check_program(_family_program(name, option))
        except AssertionError as e:
            failures.append(f"{name}: {str(e).splitlines()[0]}")
    assert not failures, "\n".join(failures)
    assert compiled_from_first_run, "no compiled code ran"


@settings(DIFF_SETTINGS, max_examples=max(DIFF_SETTINGS.max_examples // 4, 1))
@given(program=program_st)
def test_random_programs_compiled(program):
    """The differential test's random programs, every replay compiled."""
    if _count(program["items"], "ops") > 48:
        reject()
    hot = plan_code.HOT
    plan_code.HOT = 1  # a fixture would be shared between hypothesis examples
    try:
        check_program(program, generated=True)
    finally:
        plan_code.HOT = hot


def _block(x, w, mask, gen):
    """Op kinds a program is made of: one output, several outputs, an RNG state, a
    metadata-only argument, a Tensor[] list, a tensor keyword argument, an in-place
    write, views."""
    h = x.sin()
    var, mean = torch.var_mean(h, dim=1, keepdim=True)
    h = (h - mean) * var.rsqrt()
    h = F.dropout(h, 0.3, training=True)
    noise = torch.empty_like(h).normal_(generator=gen)
    h = torch.cat([h, noise * 0.1], dim=1)[:, : x.shape[1]]
    h.mul_(1.5)
    q = h.view(2, 4, 8).transpose(0, 1)
    a = F.scaled_dot_product_attention(q, q, q, attn_mask=mask)
    return a.transpose(0, 1).reshape(8, 8) @ w


def _step(x, w, mask, scoped, seed):
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    if scoped:
        with recompute_scope():
            y = _block(x, w, mask, gen)
    else:
        y = _block(x, w, mask, gen)
    (y.sin() * w).sum().backward()
    grads = [x.grad.clone(), w.grad.clone()]
    x.grad = w.grad = None
    return grads


def test_compiled_on_the_second_run_and_bitwise_every_step(monkeypatch):
    """C1: the first replay of a structure is interpreted, the next ones compiled; every
    step's gradients equal plain's, bitwise."""
    made = _count_compiled_runs(monkeypatch)
    torch.manual_seed(0)
    x = torch.randn(8, 8, requires_grad=True)
    w = torch.randn(8, 8, requires_grad=True)
    mask = torch.randn(4, 2, 2)  # additive: no row is fully masked
    for step in range(4):
        expected = _step(x, w, mask, False, step)
        got = _step(x, w, mask, True, step)
        assert all(torch.equal(a, b) for a, b in zip(got, expected)), step
        if step == 0:
            assert not made  # interpreted
    assert made  # compiled from the second step on


def _sized_step(x, w, scoped, seed):
    """A block whose ops take its sizes (a view and a reshape by its length), forward and
    backward: the gradients."""
    n = x.shape[0]

    def block():
        gen = torch.Generator().manual_seed(seed)
        h = F.dropout(x.sin(), 0.3, training=True)
        h = torch.cat([h, torch.empty_like(h).normal_(generator=gen)], dim=1)[:, :8]
        q = h.view(n, 2, 4).transpose(0, 1)
        return F.scaled_dot_product_attention(q, q, q).transpose(0, 1).reshape(n, 8) @ w

    torch.manual_seed(seed)
    if scoped:
        with recompute_scope():
            y = block()
    else:
        y = block()
    (y.sin() * w[0]).sum().backward()
    grads = [x.grad.clone(), w.grad.clone()]
    x.grad = w.grad = None
    return grads


def test_records_that_differ_in_sizes_share_one_compiled_code(compiled_from_first_run, monkeypatch):
    """C3: a block at another length is another structure with its own programs, with the same
    sources: Python compiles them at the first length only, each program binds them to its own
    sizes (the shape checks see those), and every length's gradients equal plain's, bitwise."""
    monkeypatch.setattr(plan_code, "_CODES", {}, raising=False)
    compiles: list[str] = []

    def counting(source, *rest):
        compiles.append(source)
        return compile(source, *rest)

    monkeypatch.setitem(plan_code.__dict__, "compile", counting)
    w = torch.randn(8, 8, requires_grad=True)
    made = []
    for n in (3, 5, 7):
        x = torch.randn(n, 8, requires_grad=True)
        got, expected = _sized_step(x, w, True, n), _sized_step(x, w, False, n)
        assert all(torch.equal(a, b) for a, b in zip(got, expected)), n
        made.append((len(compiles), len(compiled_from_first_run)))
    assert made[0][0] > 0 and made[2][0] == made[0][0]  # compiled at the first length only
    assert made[0][1] < made[1][1] < made[2][1]  # and compiled code ran at every length


def _failing_op_program(calls):
    @torch.library.custom_op("gs_test_replay_code::flaky", mutates_args=())
    def flaky(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        if len(calls) > 1:
            raise ValueError("flaky op refused to run twice")
        return x * 2

    flaky.register_fake(lambda x: torch.empty_like(x))
    flaky.register_autograd(lambda ctx, g: g * 2, setup_context=lambda ctx, inputs, output: None)
    return flaky


def test_an_op_that_fails_in_compiled_replay_names_itself(compiled_from_first_run):
    """An op raising in compiled code gives the interpreter's RecomputeError, naming the op."""
    calls: list[int] = []
    flaky = _failing_op_program(calls)
    x = torch.randn(4, requires_grad=True)
    with recompute_scope():
        h = flaky(x.cos()).exp()
    loss = (h * h).sum()
    del h  # replay must rebuild it
    with pytest.raises(RecomputeError, match=r"replaying gs_test_replay_code\.flaky\.default failed.*refused"):
        loss.backward()
    assert compiled_from_first_run


def test_a_changed_output_shape_is_refused_by_compiled_code(compiled_from_first_run):
    """P5 in compiled code: a replayed output of another shape than forward's raises."""
    state = {"n": 4}

    @torch.library.custom_op("gs_test_replay_code::grows", mutates_args=())
    def grows(x: torch.Tensor) -> torch.Tensor:
        return x.new_ones(state["n"]) * x.sum()

    grows.register_fake(lambda x: x.new_empty(4))
    grows.register_autograd(lambda ctx, g: g.sum().expand(4), setup_context=lambda ctx, inputs, output: None)
    x = torch.randn(4, requires_grad=True)
    with recompute_scope():
        h = grows(x.sin()).exp()
    loss = (h * h).sum()
    del h  # replay must rebuild it
    state["n"] = 5
    with pytest.raises(RecomputeError, match=r"produced a tensor of shape \[5\]"):
        loss.backward()
    assert compiled_from_first_run


def _chain_peak(hot: int, monkeypatch) -> int:
    monkeypatch.setattr(plan_code, "HOT", hot)
    x = torch.randn(256, 256, requires_grad=True)
    w = torch.randn(256, 256, requires_grad=True)

    def forward():
        with recompute_scope():
            h = x
            for _ in range(12):
                h = h * 1.5 + 0.1  # saves nothing: only h * w's save of h is a handle
        return h * w

    return profile_cpu_memory(forward, lambda y: y.sum().backward())[2]


def test_compiled_replay_frees_as_the_interpreter(monkeypatch):
    """Compiled code drops each value after its last reader, as the interpreter does:
    the backward peak is the same, and it is that of a few 256x256 values at once, not
    of the 24 the replay makes."""
    interpreted = _chain_peak(NEVER, monkeypatch)
    compiled = _chain_peak(1, monkeypatch)
    assert compiled == interpreted
    assert compiled <= 6 * 256 * 256 * 4


def test_numeric_context_changes_inside_a_compiled_block(compiled_from_first_run):
    """R9 in compiled code: ops replay under the context each was recorded in, also
    where it changes in the middle of the block; the ambient one is restored."""
    torch.manual_seed(0)
    x = torch.randn(64, 64, requires_grad=True, dtype=torch.float32)

    def block():
        h = x @ x
        with torch.backends.mkldnn.flags(enabled=False):
            h = h @ x
        return (h @ x).tanh()

    expected_y = block()
    (expected_y * 2).sum().backward()
    expected = x.grad.clone()
    x.grad = None
    with recompute_scope():
        y = block()
    before = torch.backends.mkldnn.enabled
    (y * 2).sum().backward()
    assert torch.backends.mkldnn.enabled == before
    assert torch.equal(x.grad, expected)
    assert compiled_from_first_run
