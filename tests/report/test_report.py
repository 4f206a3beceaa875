"""saved_tensors_report (``docs/debugging.md``): what autograd saves, by module and op.

Checked against the validated CPU memory probe (what autograd holds after forward) and
against hand counts; gradients with the report equal those of the same program without
it (``torch.equal``), also composed with scopes, checkpoint and other saved-tensor
hooks in every order; global state is restored, also when the block raises.
"""

import contextlib
import gc
import inspect
import os
import sys
import threading
import warnings
import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd.graph import save_on_cpu
from torch.multiprocessing.reductions import StorageWeakRef
from torch.nn.modules import module as module_globals
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import checkpoint

import gradient_scope
from benchmarks._harness.memory import profile_cpu_memory
from gradient_scope import SavedTensorsReport, SavedTensorsRow, recompute_scope, saved_tensors_report
from gradient_scope._save import pack as _pack

from support import RecordingHooks, assert_interception_gone, top_hooks

# torch >= 2.15 runs autograd.Function.apply in C++: a custom function's saves are
# then named after the Python function that called apply.
APPLY_IN_PYTHON = inspect.isfunction(getattr(torch.autograd.Function.apply, "__func__", None))

KiB = 1024


def report_state():
    """Everything a report installs while open."""
    return {
        "hooks": top_hooks(),
        "function_modes": torch._C._len_torch_function_stack(),
        "forward_pre_hooks": len(module_globals._global_forward_pre_hooks),
        "forward_hooks": len(module_globals._global_forward_hooks),
        "always_called": len(module_globals._global_forward_hooks_always_called),
        "listeners": len(_pack._listeners),
    }


def test_public_names():
    for name in ("saved_tensors_report", "SavedTensorsReport", "SavedTensorsRow"):
        assert name in gradient_scope.__all__
        assert ">>>" in getattr(gradient_scope, name).__doc__


# --------------------------------------------------------------------------------------
# what is counted


def functional_program(scope):
    """Every tensor is created in forward: the probe's held bytes are exactly what
    autograd keeps plus the 4-byte loss."""
    torch.manual_seed(0)
    x = torch.randn(64, 32, requires_grad=True)
    w1 = torch.randn(128, 32, requires_grad=True)
    w2 = torch.randn(32, 128, requires_grad=True)
    h = F.linear(x, w1)
    with scope():
        a = F.gelu(h).tanh()  # tanh saves its output a (64 x 128 floats)
    out = F.linear(a, w2)
    return F.dropout(out, 0.5).pow(2).sum()


@pytest.mark.parametrize("scoped", [False, True], ids=["plain", "scoped"])
def test_stored_bytes_equal_what_the_probe_sees_held(scoped):
    box = {}
    scopes = []

    def scope():
        if not scoped:
            return contextlib.nullcontext()
        scopes.append(recompute_scope())
        return scopes[-1]

    def forward():
        with saved_tensors_report() as report:
            loss = functional_program(scope)
        box["report"] = report
        return loss

    _, held, _ = profile_cpu_memory(forward, lambda loss: loss.backward())
    report = box["report"]
    assert report.stored_bytes == held - 4  # the loss scalar is the only other tensor held
    a_bytes = 64 * 128 * 4
    if scoped:
        # a is saved twice (tanh's output, the second linear's input): two handles, one storage.
        assert scopes[0].stats.tensors_packed == 2 and scopes[0].stats.bytes_packed == 2 * a_bytes
        assert report.recomputable_bytes == a_bytes
    else:
        assert report.recomputable_bytes == 0
    # By hand: x, w1, w2 (linear), h (gelu), a (tanh; also linear's input), dropout's
    # float mask and pow's input (dropout's output).
    by_hand = 4 * (64 * 32 + 128 * 32 + 32 * 128 + 64 * 128 + 64 * 32 + 64 * 32) + (0 if scoped else a_bytes)
    assert report.stored_bytes == by_hand


def test_scoped_stored_bytes_drop_by_the_recomputable_bytes():
    with saved_tensors_report() as plain:
        functional_program(lambda: contextlib.nullcontext())
    with saved_tensors_report() as scoped:
        functional_program(recompute_scope)
    assert scoped.recomputable_bytes > 0
    assert plain.stored_bytes - scoped.stored_bytes == scoped.recomputable_bytes
    assert sum(r.count for r in plain.rows) == sum(r.count for r in scoped.rows)


def test_each_storage_once_and_every_save_counted():
    torch.manual_seed(0)
    w = torch.randn(16, 16, requires_grad=True)
    with saved_tensors_report() as report:
        e = w.exp()  # saves its output e
        p = e * e  # saves e twice
        q = e.t() @ w  # saves a view of e and w
        r = w[0] * w[1]  # two views of w
    rows = {(row.module, row.op): row for row in report.rows}
    assert {k: v.count for k, v in rows.items()} == {
        ("(no module)", "exp"): 1,
        ("(no module)", "mul"): 4,
        ("(no module)", "matmul"): 2,
    }
    # Two storages of 1 KiB each: e (charged to exp, the first to save it) and w
    # (charged to matmul, the first to save it).
    assert report.stored_bytes == 2 * KiB
    assert rows[("(no module)", "exp")].stored_bytes == KiB
    assert rows[("(no module)", "matmul")].stored_bytes == KiB
    assert rows[("(no module)", "mul")].stored_bytes == 0
    del p, q, r


def test_storage_reused_after_death_is_a_new_entry():
    """A storage that died during the block and a new one at the same place both count."""
    x = torch.randn(256, requires_grad=True)
    with saved_tensors_report() as report:
        for _ in range(3):
            y = x.exp()  # saved; dies with its graph at the next iteration
            del y
    assert sum(r.count for r in report.rows) == 3
    assert report.stored_bytes == 3 * 256 * 4


def test_recomputable_and_stored_storage_counts_as_stored():
    """A block tensor first saved as a handle, then modified in place and stored: kept."""
    w = torch.randn(8, 8, requires_grad=True)
    with saved_tensors_report() as report:
        with recompute_scope():
            h = w * 2
        a = h.sin()  # a handle of h
        h.add_(1)  # h can no longer be replayed ...
        b = h.cos()  # ... so cos stores it
    assert report.recomputable_bytes == 0
    assert report.stored_bytes == 8 * 8 * 4  # h (a product with a number saves nothing)
    assert [(r.op, r.count, r.stored_bytes) for r in report.rows] == [("cos", 1, 256), ("sin", 1, 0)]
    del a, b


class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(8, 24)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return self.drop((q @ k.transpose(-2, -1)).softmax(-1)) @ v


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = Attn()
        self.mlp = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))

    def forward(self, x):
        x = x + self.attn(x)
        return x + self.mlp(x)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Layer(), Layer()])
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def test_module_paths_and_ops():
    torch.manual_seed(0)
    model = Model()
    x = torch.randn(2, 5, 8)
    with saved_tensors_report() as report:
        loss = F.cross_entropy(model(x).flatten(0, 1), torch.zeros(10, dtype=torch.long))
    keys = {(r.module, r.op) for r in report.rows}
    for i in (0, 1):
        assert {
            (f"layers.{i}.attn.qkv", "linear"),
            (f"layers.{i}.attn", "matmul"),
            (f"layers.{i}.attn", "softmax"),
            (f"layers.{i}.attn.drop", "dropout"),
            (f"layers.{i}.mlp.0", "linear"),
            (f"layers.{i}.mlp.1", "gelu"),
            (f"layers.{i}.mlp.2", "linear"),
        } <= keys
    assert ("head", "linear") in keys
    assert ("(no module)", "cross_entropy") in keys
    assert all(not m.startswith("(Model)") for m, _ in keys)
    # A submodule called on its own is the outermost module: its class name.
    with saved_tensors_report() as alone:
        model.layers[1].mlp(torch.randn(3, 8, requires_grad=True))
    assert {r.module for r in alone.rows} == {"0", "2", "1"}  # paths below the Sequential
    with saved_tensors_report() as single:
        nn.Linear(4, 4)(torch.randn(2, 4, requires_grad=True))
    assert [r.module for r in single.rows] == ["(Linear)"]
    del loss


def test_module_forward_raising_keeps_the_stack_right():
    class Boom(nn.Module):
        def forward(self, x):
            x.exp()
            raise ValueError("boom")

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.boom, self.fc = Boom(), nn.Linear(4, 4)

        def forward(self, x):
            with contextlib.suppress(ValueError):
                self.boom(x)
            return self.fc(x).sin()

    x = torch.randn(2, 4, requires_grad=True)
    with saved_tensors_report() as report:
        Outer()(x)
    assert {(r.module, r.op) for r in report.rows} == {("boom", "exp"), ("fc", "linear"), ("(Outer)", "sin")}


def test_op_names_custom_function_and_create_graph():
    class Square(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * x

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return 2 * x * g

    x = torch.randn(4, requires_grad=True)
    with saved_tensors_report() as report:
        y = Square.apply(x)
        z = x @ x
        w = torch.ops.aten.sin(x)
        (g,) = torch.autograd.grad(x.tanh().sum(), x, create_graph=True)
    ops = {r.op for r in report.rows}
    square = "Square.apply" if APPLY_IN_PYTHON else "test_op_names_custom_function_and_create_graph"
    assert {square, "matmul", "sin", "tanh", "grad"} <= ops, ops
    del y, z, w, g


def test_checkpoint_inputs_are_counted_not_its_insides():
    w = torch.randn(32, 32, requires_grad=True)
    x = torch.randn(16, 32, requires_grad=True)
    # Non-reentrant checkpoint keeps its inputs through _CheckpointFrame.save_inputs
    # (torch >= 2.9) or a _NoopSaveInputs function that also saves an empty tensor.
    if hasattr(torch.utils.checkpoint._CheckpointFrame, "save_inputs"):
        non_reentrant = ("_CheckpointFrame.save_inputs", 1)
    else:
        non_reentrant = ("_NoopSaveInputs.apply", 2)
    reentrant_op = "CheckpointFunction.apply" if APPLY_IN_PYTHON else "_checkpoint_impl"
    for reentrant, (op, count) in ((False, non_reentrant), (True, (reentrant_op, 1))):
        with saved_tensors_report() as report:
            y = checkpoint(lambda a: torch.tanh(a @ w).sin(), x, use_reentrant=reentrant)
        assert [(r.op, r.count, r.stored_bytes) for r in report.rows] == [(op, count, 16 * 32 * 4)]
        y.sum().backward()


def test_table():
    torch.manual_seed(0)
    model = Model()
    with saved_tensors_report() as report:
        model(torch.randn(2, 5, 8)).sum()
    text = str(report)
    lines = text.splitlines()
    assert lines[0].split() == ["module", "op", "count", "activations", "recomputable", "params", "largest", "saved"]
    assert lines[-2].split()[0] == "total"
    assert lines[-1].startswith("held by scopes for replay")
    assert len(lines) == len(report.rows) + 5
    rows = report.rows
    assert rows == sorted(rows, key=lambda r: (-(r.activation_bytes + r.recomputable_bytes), -r.param_bytes))
    top = report.table(top=3).splitlines()
    assert len(top) == 3 + 6 and top[-4].startswith(f"... {len(rows) - 3} more rows")
    assert "SavedTensorsReport (done)" in repr(report)
    assert isinstance(rows[0], SavedTensorsRow) and isinstance(report, SavedTensorsReport)


# --------------------------------------------------------------------------------------
# activations apart from parameters, held by scopes, grouping, source lines, diff


def made_in_forward_program(scope):
    """Parameters made before forward; everything else (x included) made in it."""
    torch.manual_seed(0)
    w1 = torch.randn(128, 32, requires_grad=True)
    w2 = torch.randn(32, 128, requires_grad=True)
    box = {}

    def forward():
        with saved_tensors_report() as box["report"]:
            x = torch.randn(64, 32)
            y = torch.randn(64, 128)  # read by the block (add), saved by no op
            with scope():
                a = (F.linear(x, w1) + y).tanh()  # linear saves x, tanh its output
            out = F.linear(a, w2)
            loss = F.dropout(out, 0.5).pow(2).sum()
        return loss

    _, held, _ = profile_cpu_memory(forward, lambda loss: loss.backward())
    return box["report"], held


def test_activation_bytes_are_what_forward_holds_and_param_bytes_the_rest():
    report, held = made_in_forward_program(contextlib.nullcontext)
    # Held after forward: what autograd keeps that forward made, and the loss scalar.
    assert report.activation_bytes == held - 4
    # w2 (saved by the second linear for its input's gradient): alive before, alive after.
    # (x needs no gradient: the first linear saves x, not w1.)
    assert report.param_bytes == 128 * 32 * 4
    assert report.stored_bytes == report.activation_bytes + report.param_bytes
    assert report.held_by_scopes_bytes == 0
    rows = {(r.module, r.op): r for r in report.rows}
    # dropout's mask is made inside the op that saves it: an activation.
    assert rows[("(no module)", "dropout")].activation_bytes == 64 * 32 * 4
    assert rows[("(no module)", "linear")].param_bytes == 128 * 32 * 4


def test_held_by_scopes_bytes_are_what_blocks_keep_that_autograd_does_not():
    report, held = made_in_forward_program(recompute_scope)
    # The block read x, w1 and y; autograd saved x only. The block keeps y (made in
    # forward) alive for replay; w1, from before, is alive anyway.
    assert report.held_by_scopes_bytes == 64 * 128 * 4
    assert report.activation_bytes + report.held_by_scopes_bytes == held - 4
    assert report.recomputable_bytes == 64 * 128 * 4  # a, once


@pytest.mark.parametrize("budget", [0, 100_000, 10**12])  # below the floor; room for a; for all
def test_under_a_budget_what_the_plan_stores_counts_as_activations(budget):
    """After the plan applies (step 3): activations + held by scopes = what forward
    leaves, whatever the plan stores; with room for everything the activations are
    plain's (the plan stores what plain stores)."""
    b = gradient_scope.Budget(budget)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # budget 0 is below the floor
        for _ in range(2):
            made_in_forward_program(lambda: recompute_scope(budget=b))
        report, held = made_in_forward_program(lambda: recompute_scope(budget=b))
    assert report.activation_bytes + report.held_by_scopes_bytes == held - 4
    a_bytes = 64 * 128 * 4
    assert report.recomputable_bytes == (a_bytes if budget == 0 else 0)
    if budget == 10**12:
        plain, _ = made_in_forward_program(contextlib.nullcontext)
        assert report.activation_bytes == plain.activation_bytes
        assert report.held_by_scopes_bytes == 64 * 128 * 4  # y, read by the block, saved by no op


def test_held_by_scopes_counts_each_storage_once_and_rng_states():
    w = torch.randn(64, requires_grad=True)
    older = torch.randn(64)
    with saved_tensors_report() as report:
        base = torch.randn(64, 64)
        with recompute_scope():
            h = (base[:32] + w + older).sin() + (base[32:] + w).cos()  # two views of one storage
        y = h.exp()
    # add saves nothing: the block keeps base (the whole storage, once), w and older
    # (from before the report: alive anyway, not counted).
    assert report.held_by_scopes_bytes == 64 * 64 * 4
    with saved_tensors_report() as dropout:
        with recompute_scope():
            d = F.dropout(w * 2, 0.5)  # the block keeps the CPU generator's state to replay it
        z = d.exp()
    assert dropout.held_by_scopes_bytes == torch.get_rng_state().nbytes
    del h, y, d, z


def test_alias_of_a_tensor_from_before_the_block_is_not_an_activation():
    w = torch.randn(64, 64, requires_grad=True)
    x = torch.randn(8, 64, requires_grad=True)
    with saved_tensors_report() as report:
        y = x @ w.detach()  # matmul saves the detached alias of w (a no-grad tensor made in the block)
        z = (x * 2) @ w  # saves a new tensor (x * 2) and w
    assert report.param_bytes == 64 * 64 * 4
    assert report.activation_bytes == 8 * 64 * 4
    del y, z


def test_a_view_an_op_returns_of_what_it_made_is_an_activation():
    fc = nn.Linear(8, 32)  # with a bias, F.linear on 3-D input returns a view of its result
    x = torch.randn(2, 5, 8)
    with saved_tensors_report() as report:
        h = fc(x)
        assert h._is_view()
        y = F.gelu(h)  # saves h
        z = h[0].exp()  # saves its output: a view's op makes new memory
    rows = {r.op: r for r in report.rows}
    assert rows["gelu"].activation_bytes == 2 * 5 * 32 * 4 and rows["gelu"].param_bytes == 0
    assert rows["exp"].activation_bytes == 5 * 32 * 4
    assert rows["linear"].param_bytes == 8 * 2 * 5 * 4  # x; the weight is not saved (x needs no grad)
    del y, z


def test_largest_tensor_names_shape_dtype_and_the_source_line():
    w = torch.randn(16, 16, requires_grad=True)
    with saved_tensors_report() as report:
        h = torch.tanh(w.double() @ w.double())
        line = sys._getframe().f_lineno - 1
        y = h.sum()
    (tanh,) = [r for r in report.rows if r.op == "tanh"]
    assert tanh.largest_shape == (16, 16) and tanh.largest_dtype == torch.float64
    assert tanh.largest_source == f"test_report.py:{line}"
    assert f"float64[16, 16] at test_report.py:{line}" in report.table()
    del y


def test_table_by_groups_and_params_false():
    torch.manual_seed(0)
    model = Model()
    x = torch.randn(2, 5, 8)  # from before the block: the first linear saves only old tensors
    with saved_tensors_report() as report:
        model(x).sum()
    rows = report.rows
    for by in ("op", "module", "layer", "class"):
        text = report.table(by=by)
        assert text.splitlines()[0].split()[0] == by if by != "module" else "module"
        assert text.splitlines()[-2].split()[1] == str(sum(r.count for r in rows))
    layer = report.table(by="layer")
    assert {line.split()[0] for line in layer.splitlines()[2:-3]} == {"layers.0", "layers.1", "head"}
    assert "Attn " in report.table(by="class") and "Dropout " in report.table(by="class")
    assert "params" not in report.table(params=False).splitlines()[0]
    hidden = report.table(params=False).splitlines()[2:-3]
    assert len(hidden) == sum(1 for r in rows if r.activation_bytes or r.recomputable_bytes) < len(rows)
    with pytest.raises(ValueError, match="by must be one of"):
        report.table(by="layers")


def test_paths_from_the_model_given():
    torch.manual_seed(0)
    model = Model()
    with saved_tensors_report(model) as report:
        model.layers[1].mlp(torch.randn(3, 8, requires_grad=True))  # called on its own
    assert {r.module for r in report.rows} == {"layers.1.mlp.0", "layers.1.mlp.1", "layers.1.mlp.2"}
    with saved_tensors_report(model) as whole:
        model(torch.randn(2, 5, 8)).sum()
    assert {"layers.0.attn.qkv", "head"} <= {r.module for r in whole.rows}
    assert {r.module_class for r in whole.rows} >= {"Attn", "Linear", "GELU"}


def test_diff_puts_two_reports_side_by_side():
    with saved_tensors_report() as plain:
        functional_program(lambda: contextlib.nullcontext())
    with saved_tensors_report() as scoped:
        functional_program(recompute_scope)
    text = plain.diff(scoped, labels=("plain", "scoped"))
    lines = text.splitlines()
    assert lines[0].split()[:4] == ["module", "op", "plain", "stored"]
    tanh = next(line for line in lines if " tanh " in line)
    assert tanh.split()[-2:] == ["-32.00", "KiB"]  # a: 64 x 128 floats, a handle when scoped
    kept = next(line for line in lines if line.startswith("kept in all"))
    assert "-32.00 KiB" in kept
    assert "tanh" in plain.diff(scoped, by="op")
    with pytest.raises(TypeError, match="must be a SavedTensorsReport"):
        plain.diff("scoped")


# --------------------------------------------------------------------------------------
# transparency: gradients, what other hooks receive, in-place checks, no leaks


def compose_program(order, report, foreign):
    """One small program per ordering of report, scope, checkpoint and foreign hooks."""
    torch.manual_seed(0)
    w = torch.randn(32, 32, requires_grad=True)
    c = torch.randn(32, requires_grad=True)
    x = torch.randn(16, 32)
    if order == "report_outside_scope":
        with report():
            with recompute_scope():
                h = torch.tanh(x @ w)
            y = (h * c).sum()
    elif order == "report_inside_block":
        with recompute_scope():
            with report():
                h = torch.tanh(x @ w)
            h = h.exp()
        y = (h * c).sum()
    elif order == "report_after_block":
        with recompute_scope():
            h = torch.tanh(x @ w)
        with report():
            y = (h * c).sum()
    elif order == "report_exits_before_block_tensors_die":
        with report():
            with recompute_scope():
                h = torch.tanh(x @ w)
        y = (h * c).sum()
    elif order == "checkpoint_inside_report":
        with report():
            y = (checkpoint(lambda a: torch.tanh(a @ w), x, use_reentrant=False) * c).sum()
    elif order == "reentrant_checkpoint_inside_report":
        with report():
            y = (checkpoint(lambda a: torch.tanh(a @ w), x.requires_grad_(), use_reentrant=True) * c).sum()
    elif order == "report_inside_checkpoint":

        def fn(a):
            with report():
                with recompute_scope():
                    b = torch.tanh(a @ w)
                return b.exp()

        y = (checkpoint(fn, x, use_reentrant=False) * c).sum()
    elif order == "foreign_inside_report":
        with report():
            with foreign():
                h = torch.tanh(x @ w)
            y = (h * c).sum()
    elif order == "report_inside_foreign":
        with foreign():
            with report():
                h = torch.tanh(x @ w)
            y = (h * c).sum()
    elif order == "foreign_inside_report_inside_block":
        with recompute_scope():
            with report():
                with foreign():
                    h = torch.tanh(x @ w)
                h = h.exp()
        y = (h * c).sum()
    elif order == "report_inside_foreign_inside_block":
        with recompute_scope():
            with foreign():
                with report():
                    h = torch.tanh(x @ w)
                h = h.exp()
        y = (h * c).sum()
    elif order == "report_in_report":
        with report():
            with recompute_scope():
                h = torch.tanh(x @ w)
            with report():
                y = (h * c).sum()
    else:
        raise AssertionError(order)
    y.backward()
    return w.grad, c.grad


ORDERS = [
    "report_outside_scope",
    "report_inside_block",
    "report_after_block",
    "report_exits_before_block_tensors_die",
    "checkpoint_inside_report",
    "reentrant_checkpoint_inside_report",
    "report_inside_checkpoint",
    "foreign_inside_report",
    "report_inside_foreign",
    "foreign_inside_report_inside_block",
    "report_inside_foreign_inside_block",
    "report_in_report",
]


@pytest.mark.parametrize(
    "order,foreign_kind",
    [(order, "recording") for order in ORDERS] + [(order, "save_on_cpu") for order in ORDERS if "foreign" in order],
)
def test_changes_nothing(order, foreign_kind):
    """Same gradients, the same tensors reach other hooks, state restored (no gc)."""
    reports = []
    foreigns = []

    def make_report():
        reports.append(saved_tensors_report())
        return reports[-1]

    def make_foreign():
        foreigns.append(RecordingHooks() if foreign_kind == "recording" else save_on_cpu())
        return foreigns[-1]

    before = report_state()
    with_report = compose_program(order, make_report, make_foreign)
    seen_with = [f.packed for f in foreigns if isinstance(f, RecordingHooks)]
    foreigns.clear()
    without = compose_program(order, contextlib.nullcontext, make_foreign)
    seen_without = [f.packed for f in foreigns if isinstance(f, RecordingHooks)]
    for a, b in zip(with_report, without):
        assert torch.equal(a, b)
    assert seen_with == seen_without
    assert reports and all(r.rows for r in reports)
    del a, b, with_report, without
    assert report_state() == before
    assert_interception_gone()


def test_report_outside_scope_counts_the_handles():
    torch.manual_seed(0)
    w = torch.randn(32, 32, requires_grad=True)
    x = torch.randn(16, 32)
    c = torch.randn(32, requires_grad=True)
    scope = recompute_scope()
    with saved_tensors_report() as report:
        with scope:
            h = torch.tanh(x @ w)  # tanh saves h: a handle
        y = h * c  # mul saves h (a handle) and c
    assert scope.stats.tensors_packed == 2
    assert report.recomputable_bytes == scope.stats.bytes_packed // 2 == 16 * 32 * 4  # h, once
    assert report.stored_bytes == (16 * 32 + 32) * 4  # x (matmul) and c
    assert {(r.op, r.count) for r in report.rows} == {("matmul", 1), ("tanh", 1), ("mul", 2)}
    y.sum().backward()


def test_report_inside_block_counts_block_tensors_as_handles():
    torch.manual_seed(0)
    w = torch.randn(32, 32, requires_grad=True)
    with recompute_scope():
        with saved_tensors_report() as report:
            h = torch.tanh(w * w)
    assert report.recomputable_bytes == 32 * 32 * 4  # tanh's output: a handle
    assert report.stored_bytes == 32 * 32 * 4  # w (saved twice by mul): from outside the block
    h.sum().backward()


def test_inplace_check_with_no_hooks_below():
    b = torch.randn(5, requires_grad=True).clone()
    with saved_tensors_report():
        y = b.sin()
        b.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_no_reference_cycle_when_an_op_saves_its_output():
    x = torch.randn(64, requires_grad=True)
    with saved_tensors_report():
        y = x.exp()  # saves its own output
    probe = weakref.ref(y)
    storage = weakref.ref(y.untyped_storage())
    del y
    assert probe() is None and storage() is None  # without gc.collect()


def test_report_keeps_no_tensor_alive():
    with saved_tensors_report() as report:
        x = torch.randn(64, requires_grad=True)
        y = x.exp()
    # (A weakref.ref to a storage object can outlive its storage on torch < 2.9.)
    probe, storage = weakref.ref(x), StorageWeakRef(y.untyped_storage())
    del x, y
    assert probe() is None and storage.expired()
    assert report.stored_bytes == 64 * 4


# --------------------------------------------------------------------------------------
# global state


def test_state_restored_when_the_block_raises():
    before = report_state()
    model = Model()
    with pytest.raises(KeyError, match="inside"):
        with saved_tensors_report() as report:
            with recompute_scope():
                model(torch.randn(2, 3, 8))
            raise KeyError("inside")
    assert report_state() == before
    assert report.rows  # what was counted before the error is kept
    gc.collect()
    assert_interception_gone()


def test_reuse_and_misuse():
    report = saved_tensors_report()
    with report:
        pass
    with pytest.raises(RuntimeError, match="already used"):
        with report:
            pass
    with pytest.raises(RuntimeError, match="without a matching __enter__"):
        saved_tensors_report().__exit__(None, None, None)


def test_function_mode_left_open_inside_is_an_error_and_state_is_restored():
    class Mode(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    before = report_state()
    mode = Mode()
    report = saved_tensors_report()
    report.__enter__()
    mode.__enter__()
    with pytest.raises(RuntimeError, match="TorchFunctionMode entered inside"):
        report.__exit__(None, None, None)
    assert torch._C._len_torch_function_stack() == before["function_modes"] + 1
    assert torch._C._get_function_stack_at(before["function_modes"]) is mode
    mode.__exit__(None, None, None)
    assert report_state() == before


def test_disabled_saved_tensor_hooks_raise_and_change_nothing():
    before = report_state()
    with torch.autograd.graph.disable_saved_tensors_hooks("no hooks here"):
        with pytest.raises(RuntimeError, match="no hooks here"):
            with saved_tensors_report():
                pass
    assert report_state() == before


def test_other_threads_are_not_counted():
    x = torch.randn(8, requires_grad=True)
    results = []

    def work():
        lin = nn.Linear(8, 8)
        results.append(lin(x).exp())

    with saved_tensors_report() as report:
        t = threading.Thread(target=work)
        t.start()
        t.join()
        y = x.sin()
    assert [(r.module, r.op) for r in report.rows] == [("(no module)", "sin")]
    del y, results


# --------------------------------------------------------------------------------------
# around compiled models: the report measures the program the user compiles


class SaveCounter:
    """An independent counter of what autograd saves (a plain saved_tensors_hooks pair)."""

    def __init__(self):
        self.count = 0
        self.storages = {}

    def pack(self, t):
        self.count += 1
        self.storages[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
        return t

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)) for _ in range(3))

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x.tanh()


def compiled_step(scoped, with_report, backend, fullgraph):
    """One fresh compile and first call (inside the report when asked), counted from outside."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = Stack()
    if scoped:
        gradient_scope.apply_recompute(model, check_fn=nn.Sequential)
    compiled = torch.compile(model, backend=backend, fullgraph=fullgraph)
    x = torch.randn(8, 16, requires_grad=True)
    counter = SaveCounter()
    report = saved_tensors_report(model) if with_report else contextlib.nullcontext()
    with warnings.catch_warnings():
        # torch warns that global module hooks also fire for the OptimizedModule.
        warnings.filterwarnings("ignore", message=".*global hooks on modules.*")
        with counter.hooks(), report:
            out = compiled(x)
    out.sum().backward()
    breaks = sum(counters["graph_break"].values())
    grads = [x.grad] + [p.grad for p in model.parameters()]
    torch._dynamo.reset()
    return counter, breaks, grads, report


@pytest.mark.parametrize("scoped", [False, True], ids=["plain", "scoped"])
@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "breaks_allowed"])
def test_report_does_not_change_what_a_compiled_model_saves(scoped, fullgraph):
    without, breaks_without, grads_without, _ = compiled_step(scoped, False, "aot_eager", fullgraph)
    counted, breaks, grads, report = compiled_step(scoped, True, "aot_eager", fullgraph)
    assert breaks == breaks_without == 0
    assert counted.count == without.count
    assert sum(counted.storages.values()) == sum(without.storages.values())
    # It measures that program: every save of the compiled function, each storage once.
    assert report.stored_bytes == sum(counted.storages.values())
    assert sum(r.count for r in report.rows) == counted.count
    assert {r.op for r in report.rows} == {"CompiledFunction.apply"}
    for a, b in zip(grads, grads_without):
        assert torch.equal(a, b)


def test_report_around_a_scoped_model_compiled_with_inductor():
    without, _, grads_without, _ = compiled_step(True, False, "inductor", True)
    counted, breaks, grads, report = compiled_step(True, True, "inductor", True)
    assert breaks == 0
    assert (counted.count, sum(counted.storages.values())) == (without.count, sum(without.storages.values()))
    assert report.stored_bytes == sum(counted.storages.values())
    for a, b in zip(grads, grads_without):
        torch.testing.assert_close(a, b)


def test_source_lines_name_user_code_not_the_package():
    """A row's source line is the first frame outside torch and the whole package (the pack
    hook, the helpers' forward, any room of gradient_scope), also for scoped modules."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8), nn.Tanh())
    gradient_scope.apply_recompute(model, check_fn=lambda m: isinstance(m, (nn.GELU, nn.Tanh)))
    x = torch.randn(4, 8, requires_grad=True)
    with saved_tensors_report(model) as report:
        loss = model(x).exp().sum()
    package = os.path.dirname(gradient_scope.__file__)
    ours = {f for _, _, files in os.walk(package) for f in files if f.endswith(".py")}
    sources = [row.largest_source for row in report.rows if row.largest_source]
    assert sources, report
    assert not [s for s in sources if s.split(":")[0] in ours], sources
    loss.backward()
