"""The op vocabulary of the differential fuzzer (``test_fuzz_differential.py``): a pool of
4x4 tensors, real and complex (``Ctx``), and ops ``name -> f(ctx, i, j, k)`` that each
append at most one tensor to it -- elementwise, matmul, reductions, multi-output ops,
views of every kind, in-place ops, random ops, modules and custom Functions whose backward
writes its saved tensors (``OPS``, sampled through
``OP_NAMES``).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

N = 4  # every pool tensor is N x N
NEWEST = 99  # an operand index meaning "the newest tensor of that kind"


# --------------------------------------------------------------------------------------
# the pool


class Entry:
    __slots__ = ("t", "fresh", "block")

    def __init__(self, t: torch.Tensor, fresh: bool = False, block: bool = False) -> None:
        self.t = t
        self.fresh = fresh  # a clone read by nothing but in-place ops since: in-place is legal
        self.block = block  # created inside a scope


class Ctx:
    """Per-run state: the pool, outside tensors, modules, generator, scope depth."""

    def __init__(self, seed: int, made: list[weakref.ref] | None = None) -> None:
        torch.manual_seed(seed)
        self.leaves = [torch.randn(N, N, requires_grad=True) for _ in range(3)]
        self.cleaf = torch.randn(N, N, dtype=torch.complex64, requires_grad=True)
        self.x = torch.randn(N, N)  # an input without grad: may be saved, may be written
        self.xr = torch.randn(N, N)  # read by blocks only through ops that save nothing
        self.gen = torch.Generator().manual_seed(seed + 1)
        self.modules = {
            "lstm": nn.LSTM(N, N),
            "gru": nn.GRU(N, N),
            "rrelu": nn.RReLU(0.1, 0.4),
            "bn": nn.BatchNorm1d(N),
            "dropout": nn.Dropout(0.3),
            "mha": nn.MultiheadAttention(N, 2, dropout=0.2),
            "ln": nn.LayerNorm(N),
            "linear": nn.Linear(N, N),
        }
        for m in self.modules.values():
            m.train()
        self.pool = [Entry(t) for t in self.leaves] + [Entry(self.cleaf), Entry(self.x)]
        self.n_fixed = len(self.pool)  # never dropped
        self.depth = 0
        self.made = [] if made is None else made  # weak references: every tensor made

    def add(self, t: torch.Tensor, fresh: bool = False) -> None:
        self.pool.append(Entry(t, fresh=fresh, block=self.depth > 0))
        self.made.append(weakref.ref(t))

    def live(self, pred: Callable[[Entry], bool] = lambda e: True) -> list[int]:
        return [i for i, e in enumerate(self.pool) if e is not None and pred(e)]

    def pick(self, k: int, kind: str = "real") -> torch.Tensor:
        """A live tensor of that kind; k == NEWEST picks the newest one."""
        want_c = kind == "cplx"
        idx = self.live(lambda e: e.t.is_complex() == want_c)
        e = self.pool[idx[-1 if k == NEWEST else k % len(idx)]]
        e.fresh = False
        return e.t

    def params(self) -> list[torch.Tensor]:
        return [p for m in self.modules.values() for p in m.parameters()]


def _idx(k: int) -> torch.Tensor:
    return torch.tensor([(k + 3 * n) % N for n in range(N)])


# --------------------------------------------------------------------------------------
# ops: name -> f(ctx, i, j, k); each appends (at most) one entry


def _r(f: Callable[..., torch.Tensor], arity: int = 1) -> Callable[[Ctx, int, int, int], None]:
    """A real op of ``arity`` operands plus the integer k."""

    def op(ctx: Ctx, i: int, j: int, k: int) -> None:
        args = [ctx.pick(i)] + ([ctx.pick(j)] if arity == 2 else [])
        ctx.add(f(*args, k))

    return op


def _c(f: Callable[..., torch.Tensor], arity: int = 1, src: str = "cplx") -> Callable[[Ctx, int, int, int], None]:
    def op(ctx: Ctx, i: int, j: int, k: int) -> None:
        args = [ctx.pick(i, src)] + ([ctx.pick(j, src)] if arity == 2 else [])
        ctx.add(f(*args, k))

    return op


UNARY = {
    "sin": _r(lambda a, k: a.sin()),
    "tanh": _r(lambda a, k: a.tanh()),
    "sigmoid": _r(lambda a, k: torch.sigmoid(a)),
    "relu": _r(lambda a, k: F.relu(a)),
    "gelu": _r(lambda a, k: F.gelu(a)),
    "exp_tanh": _r(lambda a, k: a.tanh().exp()),
    "scale": _r(lambda a, k: a * 0.5),
    "softmax": _r(lambda a, k: a.softmax(dim=k % 2)),
    "log_softmax": _r(lambda a, k: F.log_softmax(a, dim=k % 2)),
    "pow2": _r(lambda a, k: a.pow(2) * 0.25),
    "abs": _r(lambda a, k: a.abs()),
    "clamp": _r(lambda a, k: a.clamp(-0.5, 0.7)),
    "cumsum": _r(lambda a, k: a.cumsum(k % 2) * 0.25),
    "norm_rows": _r(lambda a, k: a / (a.pow(2).sum(1, keepdim=True) + 1.0).sqrt()),
    "logsumexp": _r(lambda a, k: a - a.logsumexp(1, keepdim=True)),
    "sum0": _r(lambda a, k: a.sum(0, keepdim=True) * 0.25 + a),
    "mean_all": _r(lambda a, k: a * a.mean()),
}

BINARY = {
    "add": _r(lambda a, b, k: a + b, 2),
    "mul": _r(lambda a, b, k: a * b, 2),
    "sub": _r(lambda a, b, k: a - b, 2),
    "div": _r(lambda a, b, k: a / (b.abs() + 1.0), 2),
    "matmul": _r(lambda a, b, k: (a @ b) * 0.25, 2),
    "where": _r(lambda a, b, k: torch.where(a > 0, a, b), 2),
    "maximum": _r(lambda a, b, k: torch.maximum(a, b), 2),
    "lerp": _r(lambda a, b, k: torch.lerp(a, b, 0.3), 2),
    "addcmul": _r(lambda a, b, k: torch.addcmul(a, a, b, value=0.5), 2),
}


def _topk(a: torch.Tensor, k: int) -> torch.Tensor:
    v, i = a.topk(2, dim=1)
    return a.scatter(1, i, v * 2)


def _max_dim(a: torch.Tensor, k: int) -> torch.Tensor:
    v, i = (a.max if k % 2 else a.min)(dim=1, keepdim=True)
    return (a - v) * 0.5 + i.to(a.dtype)


def _sort(a: torch.Tensor, k: int) -> torch.Tensor:
    v, i = a.sort(dim=k % 2)
    return v * 0.5 + a.gather(k % 2, i.flip(k % 2))


MULTI = {
    "split_cat": _r(lambda a, k: torch.cat([a.split(2, 0)[1], a.split(2, 0)[0] * 0.5])),
    "unbind_stack": _r(lambda a, k: torch.stack(a.unbind(k % 2)[::-1], k % 2)),
    "chunk_cat": _r(lambda a, k: torch.cat(a.chunk(2, 1)[::-1], 1)),
    "topk": _r(_topk),
    "max_dim": _r(_max_dim),
    "sort": _r(_sort),
    "kthvalue": _r(lambda a, k: a * a.kthvalue(2, dim=1, keepdim=True)[0]),
    "var_mean": _r(lambda a, k: (lambda v, m: (a - m) / (v + 1.0).sqrt())(*torch.var_mean(a, dim=1, keepdim=True))),
    "std_mean": _r(lambda a, k: (lambda s, m: (a - m) * s)(*torch.std_mean(a, dim=0, keepdim=True))),
    "aminmax": _r(lambda a, k: (lambda mn, mx: (a - mn) * mx)(*torch.aminmax(a, dim=0, keepdim=True))),
    "cummax": _r(lambda a, k: a.cummax(1)[0] - a.cummin(0)[0]),
}


def _differentiable(fn) -> bool:
    try:
        fn(torch.ones(2, 2, requires_grad=True)).sum().backward()
    except RuntimeError as e:
        if "not implemented" in str(e):
            return False
        raise
    return True


if not _differentiable(lambda a: torch.aminmax(a, dim=0)[0]):  # torch < 2.9: no derivative
    del MULTI["aminmax"]


def _bits_abs(a: torch.Tensor, b: torch.Tensor, k: int) -> torch.Tensor:
    # |a| computed on the bits: int32 view of a float tensor, a mask, a float32 view back
    # (a block tensor seen through a dtype view, saved by mul for b's gradient).
    bits = a.detach().contiguous().view(torch.int32) & 0x7FFFFFFF
    return b * bits.view(torch.float32)


VIEWS = {
    "t": _r(lambda a, k: a.t()),
    "transpose": _r(lambda a, k: a.transpose(0, 1)),
    "view_roundtrip": _r(lambda a, k: a.contiguous().view(2, 8).view(N, N)),
    "reshape": _r(lambda a, k: a.reshape(N * N).reshape(N, N)),
    "slice_cat": _r(lambda a, k: torch.cat([a[2:], a[:2] * 0.5])),
    "narrow_cat": _r(lambda a, k: torch.cat([a.narrow(1, 2, 2), a.narrow(1, 0, 2)], 1)),
    "diagonal": _r(lambda a, k: torch.diag_embed(a.diagonal()) + a),
    "row_expand": _r(lambda a, k: a[k % N].expand(N, N)),
    "unsqueeze_squeeze": _r(lambda a, k: a.unsqueeze(0).squeeze(0)),
    "permute": _r(lambda a, k: a.unsqueeze(1).permute(2, 1, 0).squeeze(1)),
    "movedim": _r(lambda a, k: a.movedim(0, 1)),
    "as_strided": _r(lambda a, k: a.contiguous().as_strided((N, N), (1, N))),
    "unflatten": _r(lambda a, k: a.flatten().unflatten(0, (N, N))),
    "unfold": _r(lambda a, k: a.unfold(1, 2, 2).reshape(N, N)),
    "select_stack": _r(lambda a, k: torch.stack([a[:, (k + c) % N] for c in range(N)], 1)),
    "split_view": _r(lambda a, k: a.split(2, 0)[k % 2].repeat(2, 1)),
    "flip": _r(lambda a, k: a.flip(k % 2)),
    "bits_abs": _r(_bits_abs, 2),
}

COMPLEX = {
    # real -> complex
    "to_complex": _r(lambda a, b, k: torch.complex(a, b * 0.5), 2),
    "times_j": _r(lambda a, k: a * (1 - 2j)),
    "view_as_complex": _r(lambda a, b, k: torch.view_as_complex(torch.stack([a, b], -1)), 2),
    "view_as_complex_of_view": _r(
        lambda a, k: (lambda v: torch.cat([v * v, v.conj()], 1))(torch.view_as_complex(a.reshape(N, 2, 2)))
    ),
    "fft": _r(lambda a, k: torch.fft.fft(a, dim=k % 2)),
    "rfft_irfft": _r(lambda a, k: torch.fft.irfft(torch.fft.rfft(a) * (1 + 1j), n=N)),
    # complex -> complex (views that carry bits, and arithmetic)
    "conj": _c(lambda z, k: z.conj()),
    "neg_view": _c(lambda z, k: torch._neg_view(z)),
    "mH": _c(lambda z, k: z.mH),
    "mT": _c(lambda z, k: z.mT),
    "adjoint": _c(lambda z, k: z.adjoint()),
    "conj_t": _c(lambda z, k: z.conj().t()),
    "conj_slice_cat": _c(lambda z, k: torch.cat([z.conj()[2:], z[:2]])),
    "neg_view_of_conj": _c(lambda z, k: torch._neg_view(z.conj())),
    "cmovedim": _c(lambda z, k: z.movedim(0, 1)),
    "conj_physical": _c(lambda z, k: z.conj_physical()),
    "resolve_conj": _c(lambda z, k: z.conj().resolve_conj()),
    "cmul": _c(lambda z, w, k: z * w, 2),
    "cadd": _c(lambda z, w, k: z + w.conj(), 2),
    "cmatmul": _c(lambda z, w, k: (z @ w) * 0.25, 2),
    "csigmoid": _c(lambda z, k: torch.sigmoid(z * 0.1)),
    "cfft": _c(lambda z, k: torch.fft.fft(z, dim=k % 2) * 0.25),
    # complex -> real (dtype-changing views and reductions)
    "real": _c(lambda z, k: z.real),
    "imag": _c(lambda z, k: z.imag),
    "conj_imag": _c(lambda z, k: z.conj().imag),
    "abs_c": _c(lambda z, k: z.abs()),
    "angle": _c(lambda z, k: z.angle()),
    "view_as_real_select": _c(lambda z, k: torch.view_as_real(z)[..., k % 2]),
    "view_as_real_sum": _c(lambda z, k: torch.view_as_real(z).sum(-1)),
    "fft_abs": _c(lambda z, k: torch.fft.fft(z).abs()),
}


def _dropout(a, k):
    return F.dropout(a, 0.3, True)


def _gen_randn(ctx: Ctx, i: int, j: int, k: int) -> None:
    ctx.add(ctx.pick(i) + 0.1 * torch.randn(N, N, generator=ctx.gen))


def _multinomial(a, k):
    idx = torch.multinomial(a.detach().abs() + 0.1, 2)
    return a.scatter(1, idx, 0.0)


RANDOM_OPS = {
    "dropout": _r(_dropout),
    "alpha_dropout": _r(lambda a, k: F.alpha_dropout(a, 0.2, True)),
    "rrelu": _r(lambda a, k: F.rrelu(a, 0.1, 0.3, training=True)),
    "randn_like": _r(lambda a, k: a + 0.1 * torch.randn_like(a)),
    "rand_like": _r(lambda a, k: a * torch.rand_like(a)),
    "bernoulli": _r(lambda a, k: a * torch.bernoulli(torch.full_like(a, 0.7))),
    "generator": _gen_randn,
    "randint_index": _r(lambda a, k: a[torch.randint(0, N, (N,))]),
    "randperm_index": _r(lambda a, k: a[:, torch.randperm(N)]),
    "gather_rand": _r(lambda a, k: a.gather(1, torch.randint(0, N, (N, N)))),
    "multinomial": _r(_multinomial),
    "normal_buffer": _r(lambda a, k: a * torch.empty_like(a).normal_()),
    "uniform_buffer": _r(lambda a, k: a + torch.empty(N, N).uniform_(-1, 1)),
    "index_perm": _r(lambda a, k: a[_idx(k)] if len(set(_idx(k).tolist())) == N else a.flip(0)),
    "index_select": _r(lambda a, k: a.index_select(k % 2, torch.tensor([1, 3, 0, 2]))),
}


def _seq(module_name: str):
    def op(ctx: Ctx, i: int, j: int, k: int) -> None:
        out = ctx.modules[module_name](ctx.pick(i).unsqueeze(1))
        ctx.add(out[0].squeeze(1))

    return op


def _mha(need_weights: bool):
    def op(ctx: Ctx, i: int, j: int, k: int) -> None:
        q = ctx.pick(i).unsqueeze(1)
        kv = ctx.pick(j).unsqueeze(1)
        out, w = ctx.modules["mha"](q, kv, kv, need_weights=need_weights)
        ctx.add(out.squeeze(1) + (w.squeeze(0) if need_weights else 0))

    return op


def _mod(name: str):
    def op(ctx: Ctx, i: int, j: int, k: int) -> None:
        ctx.add(ctx.modules[name](ctx.pick(i)))

    return op


MODULES = {
    "lstm": _seq("lstm"),
    "gru": _seq("gru"),
    "rrelu_module": _mod("rrelu"),
    "batchnorm": _mod("bn"),
    "dropout_module": _mod("dropout"),
    "mha": _mha(False),
    "mha_weights": _mha(True),
    "layernorm": _mod("ln"),
    "linear": _mod("linear"),
}


# in-place ops on a fresh (cloned, unread) tensor, real or complex
def _inplace(ctx: Ctx, i: int, j: int, k: int) -> None:
    cplx = j % 7 == 6
    idx = ctx.live(lambda e: e.fresh and e.t.is_complex() == cplx)
    if not idx:
        ctx.add(ctx.pick(i, "cplx" if cplx else "real").clone(), fresh=True)
        idx = [len(ctx.pool) - 1]
    e = ctx.pool[idx[i % len(idx)]]
    u = e.t
    if cplx:
        if k % 2:
            u.mul_(1 - 1j)
        else:
            u.add_(ctx.pick(k, "cplx").conj())
        return
    kind = k % 15
    if kind == 0:
        u.mul_(0.5)
    elif kind == 1:
        u.add_(ctx.pick(j))
    elif kind == 2:
        u[1:3].mul_(2.0)  # in place on a view
    elif kind == 3:
        u.t().add_(0.25)
    elif kind == 4:
        u.tanh_()  # saves its result: no more in-place on u
        e.fresh = False
    elif kind == 5:
        u.sigmoid_()
        e.fresh = False
    elif kind == 6:
        F.rrelu(u, 0.1, 0.3, training=True, inplace=True)
        e.fresh = False
    elif kind == 7:
        F.dropout(u, 0.25, True, inplace=True)
    elif kind == 8:
        u.masked_fill_(u.detach() > 0.5, 0.1)
    elif kind == 9:
        u.index_add_(0, _idx(j), ctx.pick(j))
    elif kind == 10:
        u.copy_(ctx.pick(j).cos())
    elif kind == 11:
        u.clamp_(-0.6, 0.6)
    elif kind == 12:
        u.exponential_()
    elif kind == 13:
        u.bernoulli_(0.4)
    else:
        u.conj().mul_(3.0)  # real: conj is a no-op view
    e.fresh = e.fresh and kind not in (4, 5, 6)


def _clone(ctx: Ctx, i: int, j: int, k: int) -> None:
    ctx.add(ctx.pick(i, "cplx" if k % 5 == 4 else "real").clone(), fresh=True)


def _drop(ctx: Ctx, i: int, j: int, k: int) -> None:
    idx = ctx.live()
    n = idx[i % len(idx)]
    if n >= ctx.n_fixed:
        ctx.pool[n] = None


def _read_xr(ctx: Ctx, i: int, j: int, k: int) -> None:
    ctx.add(ctx.pick(i) + ctx.xr * 0.5)  # xr * 0.5: xr has no grad, nothing saves it


def _write_x_inside(ctx: Ctx, i: int, j: int, k: int) -> None:
    # an outside tensor written (inside a block when in one): replay must not write it
    # again, and ops that read it before the write must replay with the old value
    ctx.x.add_(0.125)
    ctx.add(ctx.pick(i) * ctx.x)


def _save_last(ctx: Ctx, i: int, j: int, k: int) -> None:
    # the newest tensor, saved by an op (mul saves it for the leaf's gradient)
    t = ctx.pool[ctx.live()[-1]].t
    ctx.add(t * ctx.leaves[i % len(ctx.leaves)])


def _drop_block(ctx: Ctx, i: int, j: int, k: int) -> None:
    for n in ctx.live(lambda e: e.block):
        ctx.pool[n] = None


class ScratchInput(torch.autograd.Function):
    """2 x; backward reuses its saved input as scratch (fused-loss kernels do)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 2.0

    @staticmethod
    def backward(ctx, g):
        (t,) = ctx.saved_tensors
        return t.mul_(0.0).add_(g * 2.0)


class ScratchIntermediate(torch.autograd.Function):
    """exp(x) * 0.5, saving exp(x) (made in forward) and writing it in backward."""

    @staticmethod
    def forward(ctx, x):
        e = x.exp()
        ctx.save_for_backward(e)
        return e * 0.5

    @staticmethod
    def backward(ctx, g):
        (e,) = ctx.saved_tensors
        return e.mul_(g).mul_(0.5)


class ScratchPair(torch.autograd.Function):
    """a * b, saving both; the backward writes both (they may be one tensor)."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a * b

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        ga = b.mul_(g)
        gb = a.mul_(g)
        return ga, gb


def _scratch_fn(kind: int) -> Callable[[Ctx, int, int, int], None]:
    def op(ctx: Ctx, i: int, j: int, k: int) -> None:
        a = ctx.pick(i)
        if kind == 0:
            ctx.add(ScratchInput.apply(a.t() if k % 3 == 0 else a))
        elif kind == 1:
            ctx.add(ScratchIntermediate.apply(a.tanh()))
        else:
            ctx.add(ScratchPair.apply(a, ctx.pick(j)))

    return op


# custom autograd.Functions whose backward writes into the tensors it unpacks
SCRATCH = {
    "scratch_input": _scratch_fn(0),
    "scratch_intermediate": _scratch_fn(1),
    "scratch_pair": _scratch_fn(2),
}

OTHER = {
    "save_last": _save_last,
    "drop_block": _drop_block,
    "clone": _clone,
    "inplace": _inplace,
    "drop": _drop,
    "read_xr": _read_xr,
    "write_x": _write_x_inside,
}

OPS: dict[str, Callable[[Ctx, int, int, int], None]] = {
    **UNARY,
    **BINARY,
    **MULTI,
    **VIEWS,
    **COMPLEX,
    **RANDOM_OPS,
    **MODULES,
    **SCRATCH,
    **OTHER,
}
# sampling weights: in-place ops, clones and drops (which force recomputation) often
OP_NAMES = (
    list(OPS)
    + ["inplace"] * 6
    + ["clone"] * 4
    + ["save_last"] * 6
    + ["drop"] * 3
    + list(VIEWS)
    + list(COMPLEX) * 2
    + list(MODULES)
    + list(RANDOM_OPS)
    + list(SCRATCH) * 3
)
