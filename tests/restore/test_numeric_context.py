"""Replay runs each op under the numeric context forward ran it in.

Some op results depend on global flags read when the op runs: oneDNN / cuDNN on or
off, TF32 and matmul precision, deterministic algorithms (which also fill
uninitialised memory), and the default dtype through type promotion of Python
scalars. A block run under other flags than backward must recompute forward's
values, and the flags seen by the user's code are left as found.
"""

import contextlib

import pytest
import torch
import torch.nn.functional as F

from gradient_scope import RecomputeError, recompute_scope
from gradient_scope._base.torch_compat import numeric_context, set_numeric_context

from support import DEVICES, PlainScopes, Scopes, assert_all_same, grads


@pytest.fixture(autouse=True)
def _flags_as_found():
    before = numeric_context()
    yield
    after = numeric_context()
    set_numeric_context(before)
    assert after == before, "a test left the numeric context changed"


def _run_both(program, cuda_inexact=None):
    torch.manual_seed(0)
    expected = program(PlainScopes())
    torch.manual_seed(0)
    ambient = numeric_context()
    actual = program(Scopes())
    assert numeric_context() == ambient, "replay left the flags changed"
    assert_all_same(actual, expected, cuda_inexact=cuda_inexact)


def _conv_program(outer, inner):
    """A conv in a block (its output saved after the block), under ``outer`` flags
    around the block and ``inner`` flags around the conv; backward runs outside both."""

    def program(scope):
        x = torch.randn(2, 3, 16, 16, requires_grad=True)
        w = torch.randn(4, 3, 3, 3, requires_grad=True)
        c = torch.randn(4, 14, 14, requires_grad=True)

        def fwd():
            with outer(), scope():
                h = x * 1.0
                with inner():
                    y = F.conv2d(h, w)
                z = y + 0.0
            return (z * c).sum()

        fwd().backward()
        return grads({"x": x, "w": w, "c": c})

    return program


def _mkldnn_off():
    return torch.backends.mkldnn.flags(enabled=False)


def test_mkldnn_disabled_around_block():
    _run_both(_conv_program(_mkldnn_off, contextlib.nullcontext))


def test_mkldnn_disabled_inside_block():
    _run_both(_conv_program(contextlib.nullcontext, _mkldnn_off))


def test_mkldnn_disabled_at_backward_only():
    # Forward with oneDNN, backward without: replay turns it back on for the conv.
    def program(scope):
        x = torch.randn(2, 3, 16, 16, requires_grad=True)
        w = torch.randn(4, 3, 3, 3, requires_grad=True)
        c = torch.randn(4, 14, 14, requires_grad=True)

        def fwd():
            with scope():
                y = F.conv2d(x * 1.0, w)
            return (y * c).sum()

        loss = fwd()
        with _mkldnn_off():
            loss.backward()
        return grads({"x": x, "w": w, "c": c})

    _run_both(program)


@contextlib.contextmanager
def _default_dtype(dtype):
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


@pytest.mark.parametrize("where", ["around", "inside"])
def test_default_dtype_through_type_promotion(where):
    # int_tensor * 0.5 is float32 under the default dtype float32; backward runs
    # under float64 (a replay under it would make a float64 tensor).
    def program(scope):
        a = torch.randn(5, requires_grad=True)

        def fwd():
            with scope():
                i = torch.arange(5)
                with _default_dtype(torch.float32):
                    s = i * 0.5
                t = s.exp()
            return (t * a).sum()

        if where == "around":
            loss = fwd()  # the ambient default dtype is float32
        else:
            with _default_dtype(torch.float64):
                loss = fwd()  # float32 only around the op, inside the block
        with _default_dtype(torch.float64):
            loss.backward()
        return grads({"a": a})

    _run_both(program)


def test_deterministic_fills_uninitialized_memory():
    # Under use_deterministic_algorithms(True), torch.empty is filled with NaN
    # (fill_uninitialized_memory): a mask read from it must replay the same.
    def program(scope):
        a = torch.randn(6, requires_grad=True)

        def fwd():
            torch.use_deterministic_algorithms(True)
            try:
                with scope():
                    m = torch.isnan(torch.empty(6))
                    y = torch.where(m, a * 2.0, a * 3.0)
                    z = y.sin()
            finally:
                torch.use_deterministic_algorithms(False)
            return z.sum()

        fwd().backward()
        return grads({"a": a})

    _run_both(program)


# --- every flag of the context, through an op whose result reads it ------------------

_FLAGS = {
    "float32_matmul_precision": (
        lambda: torch.get_float32_matmul_precision(),
        lambda v: torch.set_float32_matmul_precision(v),
        "medium",
    ),
    "mkldnn_enabled": (lambda: torch.backends.mkldnn.enabled, lambda v: torch._C._set_mkldnn_enabled(v), False),
    "mkldnn_matmul_fp32_precision": (
        lambda: torch.backends.mkldnn.matmul.fp32_precision,
        lambda v: setattr(torch.backends.mkldnn.matmul, "fp32_precision", v),
        "bf16",
    ),
    "cudnn_enabled": (lambda: torch.backends.cudnn.enabled, lambda v: torch._C._set_cudnn_enabled(v), False),
    "cudnn_deterministic": (
        lambda: torch.backends.cudnn.deterministic,
        lambda v: torch._C._set_cudnn_deterministic(v),
        True,
    ),
    "cudnn_benchmark": (lambda: torch.backends.cudnn.benchmark, lambda v: torch._C._set_cudnn_benchmark(v), True),
    "cuda_matmul_allow_tf32": (
        lambda: torch.backends.cuda.matmul.allow_tf32,
        lambda v: torch._C._set_cublas_allow_tf32(v),
        True,
    ),
    "cudnn_allow_tf32": (
        lambda: torch.backends.cudnn.allow_tf32,
        lambda v: torch._C._set_cudnn_allow_tf32(v),
        False,
    ),
    "deterministic_algorithms": (
        lambda: torch.are_deterministic_algorithms_enabled(),
        lambda v: torch.use_deterministic_algorithms(v),
        True,
    ),
}

_probe_reads = []


@torch.library.custom_op("gs_test_numeric::probe", mutates_args=())
def _probe(x: torch.Tensor) -> torch.Tensor:
    """x + 1 when the flag under test has its forward value, else x."""
    get, _, value = _FLAGS[_probe_reads[-1]]
    return x + 1.0 if get() == value else x.clone()


@pytest.mark.parametrize("flag", sorted(_FLAGS))
def test_each_flag_is_replayed(flag):
    # An op that reads the flag: forward runs under the flag's other value, backward
    # under the ambient one. The flags themselves exist on CPU builds too.
    get, set_, value = _FLAGS[flag]
    _probe_reads.append(flag)

    def program(scope):
        a = torch.randn(4, requires_grad=True)

        def fwd():
            before = numeric_context()  # the public setters do not all round-trip
            set_(value)
            try:
                with scope():
                    p = _probe(torch.zeros(4))
                    q = p * 1.0
            finally:
                set_numeric_context(before)
            return (q * a).sum()

        fwd().backward()
        return grads({"a": a})

    try:
        _run_both(program)
    finally:
        _probe_reads.pop()


def test_flags_restored_when_replay_raises():
    a = torch.randn(4, requires_grad=True)
    src = torch.randn(4)
    torch._C._set_mkldnn_enabled(False)
    try:
        with recompute_scope():
            y = (src * 2.0).exp()
    finally:
        torch._C._set_mkldnn_enabled(True)
    loss = (y * a).sum()
    del y
    src.add_(1)  # an input the block read changed: replay raises
    ambient = numeric_context()
    with pytest.raises(RecomputeError):
        loss.backward()
    assert numeric_context() == ambient


# --- CUDA: the flags that choose kernels there ---------------------------------------


def _cuda_flag_cases():
    return {
        "cudnn_disabled": lambda: torch.backends.cudnn.flags(enabled=False),
        "cudnn_deterministic": lambda: torch.backends.cudnn.flags(enabled=True, deterministic=True),
        "cudnn_benchmark": lambda: torch.backends.cudnn.flags(enabled=True, benchmark=True),
        "cudnn_no_tf32": lambda: torch.backends.cudnn.flags(enabled=True, allow_tf32=False),
    }


@pytest.mark.parametrize("device", [d for d in DEVICES if d.id == "cuda"])
@pytest.mark.parametrize("case", sorted(_cuda_flag_cases()))
def test_cuda_conv_flags(device, case):
    flags = _cuda_flag_cases()[case]

    def program(scope):
        x = torch.randn(2, 3, 32, 32, device=device, requires_grad=True)
        w = torch.randn(8, 3, 3, 3, device=device, requires_grad=True)
        c = torch.randn(8, 30, 30, device=device, requires_grad=True)

        def fwd():
            with flags(), scope():
                y = F.conv2d(x * 1.0, w)
            return (y * c).sum()

        fwd().backward()
        return grads({"x": x, "w": w, "c": c})

    # cuDNN enabled and not deterministic: its convolution backward may sum in another
    # order from one run to the next (bitwise with cuDNN off or deterministic).
    nondeterministic = case in ("cudnn_benchmark", "cudnn_no_tf32")
    _run_both(program, cuda_inexact="cuDNN convolution backward" if nondeterministic else None)


@pytest.mark.parametrize("device", [d for d in DEVICES if d.id == "cuda"])
@pytest.mark.parametrize("precision", ["highest", "high"])
def test_cuda_matmul_tf32(device, precision):
    # Forward under one matmul precision (TF32 or not), backward under the other.
    other = "high" if precision == "highest" else "highest"

    def program(scope):
        a = torch.randn(64, 64, device=device, requires_grad=True)
        b = torch.randn(64, 64, device=device)
        c = torch.randn(64, 64, device=device, requires_grad=True)
        before = numeric_context()

        def fwd():
            with scope():
                y = (a * 1.0) @ b
            return (y * c).sum()

        torch.set_float32_matmul_precision(precision)
        try:
            loss = fwd()
            torch.set_float32_matmul_precision(other)
            loss.backward()
        finally:
            set_numeric_context(before)
        return grads({"a": a, "c": c})

    _run_both(program)
