"""What the tests share, imported the same way from every folder of tests/::

    from support import Scopes, PlainScopes, run_both, grads, assert_same, DEVICES
    from support.contract import check, leaf          # the contract of a scoped program
    from support.hf_models import make_model          # tiny Hugging Face models

(``pyproject.toml`` puts ``tests/`` and the repository root on ``sys.path`` through
pytest's ``pythonpath``, so this works from any folder and for ``benchmarks`` too.) The
fixtures (``device``, ``fast``, ``fresh_dynamo`` and the autouse ``global_state_as_found``)
are in ``tests/conftest.py``; tests take them as arguments and never import conftest.

Every gradient test compares a scoped program against the *same* program run without any
scope (a ``contextlib.nullcontext`` in place of each scope), from the same seed, with
``torch.equal`` (no tolerances) on every device; on CUDA a test whose program runs a kernel
that is nondeterministic run to run says why with ``cuda_inexact=`` and is compared with
``torch.testing.assert_close`` there.  Programs are written as ``program(scope)`` where
``scope(**options)`` returns a fresh context manager for each region (``Scopes``, and
``PlainScopes`` for the plain program; ``run_both`` runs both and compares).

Global state: ``global_state()`` (saved-tensor hooks, dispatch modes, grad and inference
mode, autocast, default dtype and device) and ``patchable()`` (the PyTorch functions the
library patches while its hooks are installed) are what conftest's autouse fixture checks
after every test; ``assert_interception_gone()`` and ``assert_stacks_clean()`` check it
mid-test, without gc, against the state the test started from.

Submodules: ``contract`` (check a program: the plain result or ``RecomputeError``),
``interop`` (``run_both`` without tracebacks, clean failures), ``writes`` (writes between
forward and backward by every route), ``fuzz_ops`` (the differential fuzzer's ops),
``hf_models`` (tiny Hugging Face models; imports transformers).
"""

import contextlib
import gc
import math
import pathlib
import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import _get_current_dispatch_mode

from gradient_scope import recompute_scope
from gradient_scope._budget.rates import Rates, pinned_rates

#: The repository's root (docs/, examples/, benchmarks/ are read from it) and tests/.
ROOT = pathlib.Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"

# --------------------------------------------------------------------------------------
# devices

HAS_CUDA = torch.cuda.is_available()
NO_CUDA_REASON = "needs CUDA: torch.cuda.is_available() is False (the CUDA half of the suite runs on a GPU)"
DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param(
        "cuda",
        id="cuda",
        marks=pytest.mark.skipif(not HAS_CUDA, reason=NO_CUDA_REASON),
    ),
]


def steady_graphs(monkeypatch):
    """The graphs the steady state's backend makes from now on (``_Graph`` of
    ``gradient_scope/_adapters/steady/run.py``), appended as they are made."""
    from gradient_scope._adapters.steady import run as steady

    made = []

    class Counted(steady._Graph):
        def __init__(self, *args):
            super().__init__(*args)
            made.append(self)

    monkeypatch.setattr(steady, "_Graph", Counted)
    return made


def sync(device):
    """Wait for the device's queued kernels (a no-op on CPU): for checks that read
    allocator statistics or host-side state after asynchronous work."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def memory_allocated(device):
    """Bytes the CUDA caching allocator has handed out on ``device`` (None on CPU, where
    the weakref checks are the measure)."""
    if torch.device(device).type != "cuda":
        return None
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated(device)


# --------------------------------------------------------------------------------------
# global state


def top_hooks():
    """The innermost saved-tensor default hooks of this thread (None when none)."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


def dispatch_depth():
    return torch._C._len_torch_dispatch_stack()


def patchable():
    """The PyTorch functions the library may patch while a thread has its hook pair
    installed, as they are now (compare before and after)."""
    return (
        torch.autograd.graph.saved_tensors_hooks.__enter__,
        torch.autograd.graph.saved_tensors_hooks.__exit__,
        torch.autograd.backward,
        torch.autograd.grad,
        torch._C._autograd._push_saved_tensors_default_hooks,
        torch._C._autograd._pop_saved_tensors_default_hooks,
        torch._C._autograd._saved_tensors_hooks_disable,
    )


def global_state():
    """The global PyTorch state a scope must leave as it found it (the RNG aside: tests
    draw from it; the fixture below restores it)."""
    return {
        "saved_tensors_hooks": top_hooks(),
        "dispatch_stack_len": dispatch_depth(),
        "dispatch_mode": _get_current_dispatch_mode(),
        "grad_enabled": torch.is_grad_enabled(),
        "inference_mode": torch.is_inference_mode_enabled(),
        "autocast_cpu": torch.is_autocast_enabled("cpu"),
        "autocast_cpu_dtype": torch.get_autocast_dtype("cpu"),
        "autocast_cuda": torch.is_autocast_enabled("cuda"),
        "autocast_cuda_dtype": torch.get_autocast_dtype("cuda"),
        "deterministic": (
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
        ),
        # (read only once CUDA is initialised: reading it initialises CUDA, and before that
        # it is the default, 0)
        "cuda_sync_debug_mode": torch.cuda.get_sync_debug_mode() if torch.cuda.is_initialized() else 0,
        "default_dtype": torch.get_default_dtype(),
        "default_device": torch.get_default_device(),
    }


# State at the start of the current test.  Normally hooks None / no dispatch mode; if an
# earlier test leaked an interception, comparing against this baseline (instead of None)
# keeps that one failure from cascading into every later test.
_BASELINE = {}
_BASELINE_PATCHED = []  # patchable() at the start of the current test


def baseline_hooks():
    """The saved-tensor hooks that were on top when the current test started (None)."""
    return _BASELINE.get("saved_tensors_hooks")


def assert_interception_gone(before=None):
    """No saved-tensor hooks and no dispatch mode left behind, and the rest of
    ``global_state()`` unchanged (checked without gc, so a test calls it after dropping
    its tensors): the state is that of ``before`` (default: the start of the test)."""
    before = before if before is not None else _BASELINE
    now = global_state()
    assert now["saved_tensors_hooks"] == before["saved_tensors_hooks"], (
        f"saved-tensor hooks still active: {now['saved_tensors_hooks']}"
    )
    assert now == before, f"global state changed:\nbefore={before}\nnow={now}"


def assert_stacks_clean():
    """The saved-tensor hook stack and the dispatch stack are as at the start of the test,
    and no PyTorch function is left patched (checked without gc, so a test calls it after
    dropping its tensors)."""
    assert top_hooks() == _BASELINE["saved_tensors_hooks"], f"saved-tensor hooks left behind: {top_hooks()}"
    assert dispatch_depth() == _BASELINE["dispatch_stack_len"], "dispatch mode left on the stack"
    assert patchable() == _BASELINE_PATCHED[0], (
        "PyTorch functions left patched (saved_tensors_hooks.__enter__/__exit__, "
        "autograd.backward/grad, _push/_pop_saved_tensors_default_hooks, _saved_tensors_hooks_disable): "
        f"{patchable()} != {_BASELINE_PATCHED[0]}"
    )


def _put_back(before):
    """Undo what a failed test left (the library's own interception first), so that the
    following tests start from ``before``."""
    while dispatch_depth() > before["dispatch_stack_len"]:
        torch._C._pop_torch_dispatch_mode()
    if top_hooks() != before["saved_tensors_hooks"]:
        with contextlib.suppress(Exception):
            from gradient_scope._save import interception as _interception

            _interception.sweep()
    while top_hooks() is not None and top_hooks() != before["saved_tensors_hooks"]:
        torch._C._autograd._pop_saved_tensors_default_hooks()
    torch.set_grad_enabled(before["grad_enabled"])
    torch.set_autocast_enabled("cpu", before["autocast_cpu"])
    torch.set_autocast_dtype("cpu", before["autocast_cpu_dtype"])
    torch.set_autocast_enabled("cuda", before["autocast_cuda"])
    torch.set_autocast_dtype("cuda", before["autocast_cuda_dtype"])
    mode, warn_only = before["deterministic"]
    torch.use_deterministic_algorithms(mode, warn_only=warn_only)
    if torch.cuda.is_initialized():
        torch.cuda.set_sync_debug_mode(before["cuda_sync_debug_mode"])
    torch.set_default_dtype(before["default_dtype"])
    if torch.get_default_device() != before["default_device"]:
        # (set_default_device("cpu") would leave a DeviceContext mode on; None removes it)
        device = before["default_device"]
        torch.set_default_device(None if device.type == "cpu" else device)


# --------------------------------------------------------------------------------------
# scope factories


class PlainScopes:
    """Stand-in for Scopes: every region is a no-op block (the ground-truth program)."""

    real = False

    def __init__(self):
        self.created = []

    def __call__(self, **options):
        return contextlib.nullcontext()


class Scopes:
    """Returns a fresh ``recompute_scope(**options)`` per region and remembers them
    (so tests can read ``.stats``)."""

    real = True

    def __init__(self, **options):
        self.options = options
        self.created = []

    def __call__(self, **options):
        s = recompute_scope(**{**self.options, **options})
        self.created.append(s)
        return s


# --------------------------------------------------------------------------------------
# comparisons


def assert_same(actual, expected, name="tensor", *, cuda_inexact=None):
    """``actual`` is ``expected`` bitwise (``torch.equal``), on every device.

    ``cuda_inexact``: on CUDA only, the reason the program's kernels may differ run to run
    (atomic accumulation, cuDNN's algorithm choice, ...); the tensors are then compared
    with ``torch.testing.assert_close`` at its default tolerances.  CPU stays bitwise."""
    assert isinstance(actual, torch.Tensor), f"{name}: got {type(actual)}"
    assert isinstance(expected, torch.Tensor), f"{name}: expected is {type(expected)}"
    assert actual.shape == expected.shape, f"{name}: shape {actual.shape} != {expected.shape}"
    assert actual.dtype == expected.dtype, f"{name}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.device == expected.device, f"{name}: {actual.device} != {expected.device}"
    if actual.device.type == "cuda" and cuda_inexact:
        torch.testing.assert_close(actual, expected, msg=lambda m: f"{name} ({cuda_inexact}): {m}")
    elif not torch.equal(actual, expected):
        diff = (actual.double() - expected.double()).abs()
        diff = diff[~torch.isnan(diff)]
        worst = diff.max().item() if diff.numel() else float("nan")
        raise AssertionError(f"{name}: not bitwise equal to the plain program on {actual.device} (max |diff| {worst})")


def assert_all_same(actual, expected, *, cuda_inexact=None):
    """Compare two dicts (or lists) of tensors / None / plain values."""
    if isinstance(expected, dict):
        assert set(actual) == set(expected)
        items = [(k, actual[k], expected[k]) for k in expected]
    else:
        assert len(actual) == len(expected)
        items = [(str(i), a, e) for i, (a, e) in enumerate(zip(actual, expected))]
    for name, a, e in items:
        if isinstance(e, torch.Tensor):
            assert_same(a, e, name, cuda_inexact=cuda_inexact)
        elif isinstance(e, (list, tuple)) and e and isinstance(e[0], torch.Tensor):
            assert len(a) == len(e), name
            for i, (ai, ei) in enumerate(zip(a, e)):
                assert_same(ai, ei, f"{name}[{i}]", cuda_inexact=cuda_inexact)
        else:
            assert a == e, f"{name}: {a!r} != {e!r}"


def run_both(program, seed=0, *, cuda_inexact=None, **options):
    """Run ``program(scope)`` with real scopes and without, from the same seed; assert
    all returned tensors are equal (``cuda_inexact``: see ``assert_same``).  Returns the
    Scopes object of the scoped run and its result."""
    scopes = Scopes(**options)
    torch.manual_seed(seed)
    actual = program(scopes)
    torch.manual_seed(seed)
    expected = program(PlainScopes())
    assert_all_same(actual, expected, cuda_inexact=cuda_inexact)
    return scopes, actual


def grads(named):
    """{name: grad} for a dict of name -> tensor (or module)."""
    out = {}
    for name, t in named.items():
        if isinstance(t, nn.Module):
            for pn, p in t.named_parameters():
                out[f"{name}.{pn}.grad"] = p.grad
        else:
            out[f"{name}.grad"] = t.grad
    for k, v in out.items():
        assert v is not None, f"{k} is None: backward did not reach it"
    return out


def stat(scope, field):
    """Read a field of ``scope.stats`` (attribute or mapping access)."""
    st = scope.stats
    if isinstance(st, dict):
        return st[field]
    return getattr(st, field)


def stats(scope):
    return {f: stat(scope, f) for f in ("ops_recorded", "tensors_packed", "bytes_packed", "replays", "ops_replayed")}


def dead(*refs):
    return all(r() is None for r in refs)


# --------------------------------------------------------------------------------------
# saved-tensor hooks that record what they receive


class RecordingHooks(torch.autograd.graph.saved_tensors_hooks):
    """A foreign saved_tensors_hooks pair recording the shape of every packed tensor, and
    any pack/unpack that happens while its ``with`` is not open (pack only)."""

    def __init__(self):
        self.packed = []
        self.unpacked = 0
        self.packed_while_closed = []
        self.is_open = False
        super().__init__(self._pack, self._unpack)

    def _pack(self, t):
        shape = tuple(t.shape)
        if not self.is_open:
            self.packed_while_closed.append(shape)
        self.packed.append(shape)
        return (shape, t.detach())

    def _unpack(self, packed):
        self.unpacked += 1
        return packed[1]

    def __enter__(self):
        self.is_open = True
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self.is_open = False

    @property
    def shapes(self):
        return set(self.packed)


# --------------------------------------------------------------------------------------
# models


class MLP(nn.Module):
    """Linear -> GELU (in a scope) -> Linear -> tanh -> Linear (second act. also scoped)."""

    def __init__(self, d_in=12, d_hidden=24, d_out=5):
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_hidden)
        self.fc3 = nn.Linear(d_hidden, d_out)
        self.probes = []  # weakrefs to block-created tensors of the last forward

    def forward(self, x, scope):
        self.probes = []
        h = self.fc1(x)
        with scope():
            h = F.gelu(h)
        self.probes.append(weakref.ref(h))
        with scope():
            h2 = torch.tanh(self.fc2(h))
        self.probes.append(weakref.ref(h2))
        return self.fc3(h2)


class Layer(nn.Module):
    """Pre-LN transformer layer, causal attention written out by hand.

    mode: "inner"  -- scopes around attention probs and around the MLP activation
          "outer"  -- one scope around the whole layer
          "both"   -- outer scope with the inner ones nested in it
    """

    def __init__(self, d=16, heads=2, ff=32, mode="inner"):
        super().__init__()
        self.d, self.heads, self.mode = d, heads, mode
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, ff)
        self.fc2 = nn.Linear(ff, d)
        self.probes = []

    def _inner(self, scope):
        return scope() if self.mode in ("inner", "both") else contextlib.nullcontext()

    def _outer(self, scope):
        return scope() if self.mode in ("outer", "both") else contextlib.nullcontext()

    def forward(self, x, scope):
        self.probes = []
        with self._outer(scope):
            out = self._body(x, scope)
        return out

    def _body(self, x, scope):
        B, T, D = x.shape
        H = self.heads
        h = self.ln1(x)
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        q = q.view(B, T, H, D // H).transpose(1, 2)
        k = k.view(B, T, H, D // H).transpose(1, 2)
        v = v.view(B, T, H, D // H).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(D // H))
        mask = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
        att = att.masked_fill(mask, float("-inf"))
        with self._inner(scope):
            probs = att.softmax(dim=-1)
        self.probes.append(weakref.ref(probs))
        o = (probs @ v).transpose(1, 2).reshape(B, T, D)
        x = x + self.proj(o)
        a = self.fc1(self.ln2(x))
        with self._inner(scope):
            a = F.gelu(a)
        self.probes.append(weakref.ref(a))
        return x + self.fc2(a)


class Transformer(nn.Module):
    def __init__(self, d=16, n_layers=2, vocab_out=7, mode="inner"):
        super().__init__()
        self.layers = nn.ModuleList([Layer(d=d, mode=mode) for _ in range(n_layers)])
        self.head = nn.Linear(d, vocab_out)

    def forward(self, x, scope):
        for layer in self.layers:
            x = layer(x, scope)
        return self.head(x)  # F.linear on 3-D input

    def probes(self):
        return [r for layer in self.layers for r in layer.probes]


# --------------------------------------------------------------------------------------
# budgets

#: The device rates budget tests pin (``pinned_cpu_rates``): a plan depends on them, and
#: measured they vary from run to run on a shared machine. CPU-like figures, FLOPs and
#: bytes both counting; the per-op costs of autograd and the library as calibrated on a
#: shared 2-core CPU (``_api.calibrate``).
PINNED_RATES = Rates(flops=2.8e9, memory=1.5e9, overhead=6.6e-6, to_host=7.5e8, to_device=7.5e8,
                     train=2e-6, record=6e-5, save=8e-5, replay=5e-6)


def pinned_cpu_rates():
    """The CPU's rates pinned to ``PINNED_RATES`` while the context is open."""
    return pinned_rates("cpu", PINNED_RATES)


class ResidualFF(nn.Module):
    """``x + fc2(gelu(fc1(x)))``, 16 -> 64 -> 16: the block the model_stats tests scope."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 64), nn.Linear(64, 16)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(x)))


class ResidualMLP(nn.Module):
    """A pre-norm residual MLP with dropout: the layer the budget tests scope."""

    def __init__(self, d=32):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):
        h = F.gelu(self.fc1(self.ln(x)))
        return x + self.fc2(F.dropout(h, 0.1, self.training))


def older_objects_out_of_sight():
    """A module-scoped fixture's body for test modules that run many full collections
    (memory probes, liveness checks): what the worker holds from before (torch's,
    transformers' and the suite's modules, other modules' objects) is left out of their
    scans while the module runs (``gc.freeze``); each scan then costs a fraction. The same
    garbage is found: what existed before the module was alive then. Use as
    ``_older = pytest.fixture(autouse=True, scope="module")(older_objects_out_of_sight)``."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
