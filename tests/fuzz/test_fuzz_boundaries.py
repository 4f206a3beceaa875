"""Property test: random programs with random scope boundaries give the plain program's
gradients, bitwise (CPU, same seed).

A program is a list of items; an item is an op or a scope holding a list of items (so
scopes nest and stand side by side).  Ops work on a pool of 4x4 tensors and mix
elementwise ops, matmul, reductions, views (view / transpose / slicing), in-place ops on
tensors made in a block (on the tensor or on a view of it, inside or after its block),
random ops (dropout, randn_like, rand_like, bernoulli, randint indices), indexing, and
drops of pool entries (so block tensors die and must be recomputed).  Tensors made in a
block are read after it.  Each program runs with scopes and without, each from the same
seed; the loss is built, every reference is dropped, backward runs, and all leaf gradients
must be ``torch.equal``.  Afterwards no saved-tensor hooks or dispatch modes are left.

Default: 60 examples (well under a minute).  Set GS_HYPOTHESIS_EXAMPLES=N for more.
"""

import contextlib
import os
import weakref

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from gradient_scope import recompute_scope

from support import dispatch_depth, top_hooks

N_EXAMPLES = int(os.environ.get("GS_HYPOTHESIS_EXAMPLES", "60"))

UNARY = ["sin", "tanh", "sigmoid", "relu", "gelu", "exp_tanh", "scale", "softmax"]
BINARY = ["add", "mul", "sub", "matmul", "where"]
REDUCE = ["sum0", "mean_all", "amax1", "norm_rows"]
VIEWS = [
    "t",
    "transpose",
    "view_roundtrip",
    "slice_cat",
    "slice_repeat",
    "flip",
    "unsqueeze_squeeze",
    "row_view",
    "diag_embed_view",
]
INDEX = ["perm_index", "randint_index", "gather_rand", "index_select"]
RANDOM = ["dropout", "randn_like", "rand_like", "bernoulli"]
INPLACE = ["clone", "inplace"]
OTHER = ["drop"]
OPS = UNARY + BINARY + REDUCE + VIEWS + INDEX + RANDOM + INPLACE * 3 + OTHER * 2

N_LEAVES = 4  # 3 parameters (requires_grad) + 1 input


class Entry:
    __slots__ = ("t", "fresh")

    def __init__(self, t, fresh=False):
        self.t = t
        self.fresh = fresh  # made by clone, read by nothing but in-place ops since


def _pick(pool, k, pred=lambda e: True):
    live = [i for i, e in enumerate(pool) if e is not None and pred(e)]
    return live[k % len(live)] if live else None


def _get(pool, k):
    e = pool[_pick(pool, k)]
    e.fresh = False
    return e.t


def run_op(pool, op, i, j, k):
    if op == "drop":
        idx = _pick(pool, i, lambda e: True)
        if idx is not None and idx >= N_LEAVES:
            pool[idx] = None
        return
    if op == "inplace":
        idx = _pick(pool, i, lambda e: e.fresh)
        if idx is None:  # make a fresh one first
            pool.append(Entry(_get(pool, i).clone(), fresh=True))
            idx = len(pool) - 1
        u = pool[idx].t
        kind = j % 6
        if kind == 0:
            u.mul_(0.5)
        elif kind == 1:
            u.add_(_get(pool, k))
        elif kind == 2:
            u[1:3].mul_(2.0)  # in place on a view
        elif kind == 3:
            u.t().add_(0.25)
        elif kind == 4:
            u.tanh_()  # saves its result: no more in-place on u
            pool[idx].fresh = False
        else:
            u.sigmoid_()
            pool[idx].fresh = False
        return
    if op == "clone":
        pool.append(Entry(_get(pool, i).clone(), fresh=True))
        return
    a = _get(pool, i)
    if op in BINARY:
        b = _get(pool, j)
    if op == "sin":
        r = a.sin()
    elif op == "tanh":
        r = a.tanh()
    elif op == "sigmoid":
        r = torch.sigmoid(a)
    elif op == "relu":
        r = F.relu(a)
    elif op == "gelu":
        r = F.gelu(a)
    elif op == "exp_tanh":
        r = a.tanh().exp()
    elif op == "scale":
        r = a * 0.5
    elif op == "softmax":
        r = a.softmax(dim=k % 2)
    elif op == "add":
        r = a + b
    elif op == "mul":
        r = a * b
    elif op == "sub":
        r = a - b
    elif op == "matmul":
        r = (a @ b) * 0.25
    elif op == "where":
        r = torch.where(a > 0, a, b)
    elif op == "sum0":
        r = a.sum(0, keepdim=True) * 0.25 + a
    elif op == "mean_all":
        r = a * a.mean()
    elif op == "amax1":
        r = a - a.amax(1, keepdim=True)
    elif op == "norm_rows":
        r = a / (a.pow(2).sum(1, keepdim=True) + 1.0).sqrt()
    elif op == "t":
        r = a.t()
    elif op == "transpose":
        r = a.transpose(0, 1)
    elif op == "view_roundtrip":
        r = a.contiguous().view(2, 8).view(4, 4)
    elif op == "slice_cat":
        r = torch.cat([a[2:], a[:2] * 0.5])
    elif op == "slice_repeat":
        r = a[1:3].repeat(2, 1)
    elif op == "flip":
        r = a.flip(k % 2)
    elif op == "unsqueeze_squeeze":
        r = a.unsqueeze(0).squeeze(0)
    elif op == "row_view":
        r = a[k % 4].expand(4, 4)  # a view of a view
    elif op == "diag_embed_view":
        r = torch.diag_embed(a.diagonal()) + a
    elif op == "perm_index":
        perm = [(k + 3 * n) % 4 for n in range(4)]
        r = a[perm] if len(set(perm)) == 4 else a[[3, 1, 0, 2]]
    elif op == "randint_index":
        idx = torch.randint(0, 4, (4,))
        r = a[idx]
    elif op == "gather_rand":
        idx = torch.randint(0, 4, (4, 4))
        r = a.gather(1, idx)
    elif op == "index_select":
        r = a.index_select(k % 2, torch.tensor([1, 3, 0, 2]))
    elif op == "dropout":
        r = F.dropout(a, 0.3, True)
    elif op == "randn_like":
        r = a + 0.1 * torch.randn_like(a)
    elif op == "rand_like":
        r = a * torch.rand_like(a)
    elif op == "bernoulli":
        r = a * torch.bernoulli(torch.full_like(a, 0.7))
    else:
        raise AssertionError(op)
    pool.append(Entry(r))


def run_items(items, pool, scope_factory):
    for item in items:
        if item[0] == "scope":
            _, option, body = item
            with scope_factory(option):
                run_items(body, pool, scope_factory)
        else:
            run_op(pool, *item)


CREATED = []  # scopes of the last scoped run (for statistics)


def run_program(program, seed, scoped):
    CREATED.clear()

    def factory(option):
        if not scoped:
            return contextlib.nullcontext()
        if option == "save_mm":
            s = recompute_scope(save=[torch.ops.aten.mm])
        else:
            s = recompute_scope()
        CREATED.append(s)
        return s

    torch.manual_seed(seed)
    leaves = [torch.randn(4, 4, requires_grad=True) for _ in range(N_LEAVES - 1)]
    pool = [Entry(t) for t in leaves] + [Entry(torch.randn(4, 4))]
    run_items(program, pool, factory)
    gen = torch.Generator().manual_seed(seed)
    outs = [e.t for e in pool if e is not None][-4:]
    loss = sum((t * torch.randn(4, 4, generator=gen)).sum() for t in outs)
    values = [t.detach().clone() for t in outs]
    del pool, outs
    if loss.requires_grad:
        loss.backward()
    return [loss.detach(), *values, *[p.grad for p in leaves]]


def count_ops(items):
    return sum(count_ops(it[2]) if it[0] == "scope" else 1 for it in items)


def count_scopes(items):
    return sum(1 + count_scopes(it[2]) for it in items if it[0] == "scope")


op_st = st.tuples(st.sampled_from(OPS), st.integers(0, 99), st.integers(0, 99), st.integers(0, 99))
item_st = st.recursive(
    op_st,
    lambda children: st.tuples(
        st.just("scope"),
        st.sampled_from(["plain", "plain", "save_mm"]),
        st.lists(children, min_size=1, max_size=6),
    ),
    max_leaves=30,
)
program_st = st.lists(item_st, min_size=1, max_size=10)


@settings(
    max_examples=N_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]
)
@given(program=program_st, seed=st.integers(0, 2**16))
def test_random_programs_match_plain(program, seed):
    assume(5 <= count_ops(program) <= 30)
    assume(count_scopes(program) >= 1)
    hooks0, depth0 = top_hooks(), dispatch_depth()
    expected = run_program(program, seed, scoped=False)
    actual = run_program(program, seed, scoped=True)
    event(f"replayed ops: {'yes' if any(s.stats.ops_replayed for s in CREATED) else 'no'}")
    CREATED.clear()
    assert len(actual) == len(expected)
    for n, (a, e) in enumerate(zip(actual, expected)):
        if e is None:
            assert a is None, f"output {n}: plain has no grad, scoped has one"
            continue
        assert a is not None, f"output {n}: scoped has no grad"
        assert a.shape == e.shape
        assert torch.equal(a, e), (
            f"output {n} differs from the plain program (max |diff| "
            f"{(a - e).abs().max().item()})\nprogram={program!r} seed={seed}"
        )
    del actual, expected
    assert top_hooks() == hooks0, "saved-tensor hooks left after the program"
    assert dispatch_depth() == depth0, "dispatch mode left after the program"


def test_fixed_program_replays():
    """Sanity check of the generator: a fixed program does recompute."""
    program = [
        ("scope", "plain", [("sin", 0, 0, 0), ("matmul", 4, 1, 0), ("dropout", 5, 0, 0), ("t", 6, 0, 0)]),
        ("drop", 4, 0, 0),
        ("drop", 4, 0, 0),
        ("mul", 5, 2, 0),
        ("scope", "plain", [("inplace", 0, 0, 0)]),
        ("tanh", 6, 0, 0),
    ]
    expected = run_program(program, 1, scoped=False)
    actual = run_program(program, 1, scoped=True)
    assert any(s.stats.ops_replayed for s in CREATED)
    CREATED.clear()
    for a, e in zip(actual, expected):
        assert (a is None and e is None) or torch.equal(a, e)


class _Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * x * g


def _stored_mm(h, b):
    with recompute_scope(save=[torch.ops.aten.mm]):
        g = h * 2
        m = g @ b  # stored; MmBackward saves g: a handle into this block's record
        return m.tanh()  # the record keeps m, an input of tanh


def _function_in_block(h, b):
    with recompute_scope():
        g = h * 2
        m = _Square.apply(g)  # autograd.Function output, read by a recorded op
        return m.tanh()


@pytest.mark.parametrize("body", [_stored_mm, _function_in_block])
def test_regression_record_cycle_keeps_earlier_block_tensor(body):
    """Shrunk from a hypothesis failure (seen at commit f25a1f3): a tensor that is not
    recomputed (save= output, autograd.Function output) read by a later op of the same
    block formed a cycle through the autograd graph (tensor -> grad_fn -> handle ->
    record -> tensor) that also kept an earlier block's tensor alive, and with it the
    interception.  Everything must die without gc."""
    hooks0 = top_hooks()
    a = torch.randn(4, 4, requires_grad=True)
    b = torch.randn(4, 4, requires_grad=True)
    with recompute_scope():
        h = a.sin()
    r = weakref.ref(h)
    y = body(h, b)
    ry = weakref.ref(y)
    del h, y
    assert r() is None and ry() is None, "block tensors kept alive after all references died"
    assert top_hooks() == hooks0
