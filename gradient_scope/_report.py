"""``saved_tensors_report()``: what autograd saves for backward, by module and op.

Three observers, all removed when the ``with`` block ends (also when it raises):

* a saved-tensor hook pair that is *transparent*: it hands each tensor to the
  pair that was below it and returns that pair's packed object, wrapped, so
  what is saved and how it is unpacked do not change. With no pair below, it
  keeps the tensor detached together with its version and repeats PyTorch's
  in-place check on unpack (saved-tensor hooks switch PyTorch's own check off);
* a pack listener of the scopes' hook (:func:`._pack.add_pack_listener`):
  while a scope's pair is innermost, block tensors become handles without
  reaching our pair, and the listener reports them;
* global module forward pre/post hooks keeping the stack of running modules,
  and a :class:`~torch.overrides.TorchFunctionMode` noting the torch function
  being executed: together they say where each save happened.

Each storage is counted once: an entry per storage (keyed by its StorageImpl,
with a weak reference so that a new storage at a recycled address is a new
entry), charged to the first (module, op) that stored it, else to the first
that saved it as a recompute handle.
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType, TracebackType
from typing import Any

import torch
import torch.nn as nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.overrides import TorchFunctionMode

from ._pack import Foreign, Stored, add_pack_listener, unpack
from ._torch_compat import (
    innermost_function_mode,
    remove_function_mode_from_under,
    storage_id,
    top_saved_hooks,
    without_torch_function,
)

__all__ = ["SavedTensorsReport", "SavedTensorsRow", "saved_tensors_report"]

_NO_MODULE = "(no module)"
_UNKNOWN_OP = "(unknown)"


@dataclass(frozen=True)
class SavedTensorsRow:
    """One line of a :class:`SavedTensorsReport`: the saves of one (module, op).

    Example::

        >>> import torch
        >>> from gradient_scope import saved_tensors_report
        >>> fc = torch.nn.Linear(4, 4)
        >>> x = torch.randn(2, 4, requires_grad=True)
        >>> with saved_tensors_report() as report:
        ...     y = fc(x).relu()
        >>> [(row.module, row.op, row.count, row.stored_bytes) for row in report.rows]
        [('(Linear)', 'linear', 2, 96), ('(no module)', 'relu', 1, 32)]
    """

    #: path of the module whose forward was running, relative to the outermost
    #: running module (``"transformer.h.0.attn"``); the outermost module itself
    #: is its class name in parentheses (``"(GPT2LMHeadModel)"``), a save
    #: outside any module forward is ``"(no module)"``
    module: str
    #: the torch function that was executing (see :func:`saved_tensors_report`)
    op: str
    #: tensors saved (each save counts, also repeated saves of one tensor)
    count: int
    #: bytes of the distinct storages autograd keeps, charged to this row
    stored_bytes: int
    #: bytes of the distinct storages that scopes replaced by recompute handles
    recomputable_bytes: int


class _Storage:
    __slots__ = ("nbytes", "recomputable_row", "ref", "stored_row")

    def __init__(self, ref: Any, nbytes: int) -> None:
        self.ref = ref  # StorageWeakRef, or a weakref to the tensor (no storage)
        self.nbytes = nbytes
        self.stored_row: tuple[str, str] | None = None
        self.recomputable_row: tuple[str, str] | None = None


def _storage_of(t: torch.Tensor) -> tuple[int, Any, int]:
    """(key, weak reference, bytes) of the memory ``t`` keeps alive."""
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        storage = None
    if storage is None:
        # No storage (sparse, some subclasses): the tensor's logical size, per tensor object.
        return -id(t), weakref.ref(t), t.numel() * t.element_size()
    return storage_id(t), StorageWeakRef(storage), storage.nbytes()


def _expired(ref: Any) -> bool:
    return ref.expired() if isinstance(ref, StorageWeakRef) else ref() is None


def _op_name(func: Any) -> str:
    name = getattr(func, "__name__", None)
    if not isinstance(name, str):
        return _UNKNOWN_OP
    if name == "__get__":  # a Tensor property
        owner = getattr(func, "__self__", None)
        return getattr(owner, "__name__", name)
    if name.startswith("__r") and name.endswith("__") and len(name) > 5:
        return name[3:-2]  # __rmul__ -> mul
    if name.startswith("__i") and name.endswith("__") and name not in ("__index__", "__invert__"):
        return name[3:-2] + "_"  # __iadd__ -> add_
    return name.strip("_") if name.startswith("__") else name


class _OpTracker(TorchFunctionMode):
    """Notes the torch function being executed. PyTorch runs a mode's handler
    with the mode switched off, so functions called *inside* a torch function
    (``F.multi_head_attention_forward``'s matmuls, ...) are not seen: the op of
    a save is the outermost torch function running."""

    def __init__(self) -> None:
        super().__init__()
        self.current: Any = None

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        outer = self.current
        self.current = func
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.current = outer


_COMPREHENSIONS = frozenset({"<listcomp>", "<genexpr>", "<dictcomp>", "<setcomp>"})


def _python_caller() -> str:
    """Names the Python code that made autograd save with no torch function running:
    ``Name.apply`` for a custom ``autograd.Function`` (its saves happen in C++
    after its forward) where ``Function.apply`` is Python code, else the innermost
    Python function outside this package (``_CheckpointFrame.save_inputs`` for the
    inputs checkpoint keeps; the caller of ``apply`` on torch >= 2.15)."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if not (module == "gradient_scope" or module.startswith("gradient_scope.")):
            code = frame.f_code
            if code.co_name not in _COMPREHENSIONS:
                if code.co_name == "apply":
                    cls = frame.f_locals.get("cls")
                    if isinstance(cls, type) and issubclass(cls, torch.autograd.Function):
                        return f"{cls.__name__}.apply"
                return getattr(code, "co_qualname", code.co_name)
        frame = frame.f_back
    return _UNKNOWN_OP


def _fmt_bytes(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    value, unit = n / 1024, "KiB"
    for bigger in ("MiB", "GiB"):
        if round(value, 2) < 1024:
            break
        value, unit = value / 1024, bigger
    return f"{value:.2f} {unit}"


def _format_table(stored: int, recomputable: int, rows: list[SavedTensorsRow], top: int | None) -> str:
    """The text table of a report's rows and totals; ``top`` limits it to the largest rows."""
    shown = rows if top is None else rows[:top]
    header = ("module", "op", "count", "stored", "recomputable")
    lines = [
        (r.module, r.op, str(r.count), _fmt_bytes(r.stored_bytes), _fmt_bytes(r.recomputable_bytes)) for r in shown
    ]
    if len(shown) < len(rows):
        rest = rows[len(shown) :]
        lines.append(
            (
                f"... {len(rest)} more rows",
                "",
                str(sum(r.count for r in rest)),
                _fmt_bytes(sum(r.stored_bytes for r in rest)),
                _fmt_bytes(sum(r.recomputable_bytes for r in rest)),
            )
        )
    total = ("total", "", str(sum(r.count for r in rows)), _fmt_bytes(stored), _fmt_bytes(recomputable))
    widths = [max(len(x[i]) for x in (header, total, *lines)) for i in range(5)]

    def fmt(cols: tuple[str, ...]) -> str:
        left = [c.ljust(w) for c, w in zip(cols[:2], widths[:2], strict=True)]
        right = [c.rjust(w) for c, w in zip(cols[2:], widths[2:], strict=True)]
        return "  ".join(left + right).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([fmt(header), rule, *map(fmt, lines), rule, fmt(total)])


class _ModuleStack:
    """The modules whose forward is running in one thread, with their paths
    (relative to the outermost one), kept by global forward pre/post hooks."""

    __slots__ = ("thread", "stack", "names", "root_label", "names_fresh")

    def __init__(self, thread: int) -> None:
        self.thread = thread
        self.stack: list[tuple[nn.Module, str]] = []
        self.names: dict[int, tuple[weakref.ref[nn.Module], str]] = {}
        self.root_label = ""
        self.names_fresh = False

    def current(self) -> str:
        return self.stack[-1][1] if self.stack else _NO_MODULE

    def _label(self, module: nn.Module) -> str:
        if not self.stack:
            self.root_label = f"({type(module).__name__})"
            self.names = {}  # computed on the first submodule call of this root call
            self.names_fresh = False
            return self.root_label
        found = self.names.get(id(module))
        if (found is None or found[0]() is not module) and not self.names_fresh:
            # Submodules may have changed since the last look: once per root call.
            root = self.stack[0][0]
            self.names = {id(m): (weakref.ref(m), name) for name, m in root.named_modules()}
            self.names_fresh = True
            found = self.names.get(id(module))
        if found is not None and found[0]() is module:
            return found[1] or self.root_label
        # Not a submodule of the outermost running module.
        return f"{self.stack[-1][1]}.({type(module).__name__})"

    def pre_hook(self, module: nn.Module, args: Any) -> None:
        if threading.get_ident() == self.thread:
            self.stack.append((module, self._label(module)))

    def post_hook(self, module: nn.Module, args: Any, output: Any) -> None:
        if threading.get_ident() != self.thread:
            return
        stack = self.stack
        for i in range(len(stack) - 1, -1, -1):
            if stack[i][0] is module:
                del stack[i:]  # also modules whose forward raised without their hook
                return


class _Tally:
    """Saves counted per (module path, op) row, and bytes per storage (once each)."""

    __slots__ = ("rows", "storages", "retired")

    def __init__(self) -> None:
        self.rows: dict[tuple[str, str], list[int]] = {}  # key -> [count, stored, recomputable]
        self.storages: dict[int, _Storage] = {}
        self.retired: list[_Storage] = []  # entries whose storage died and whose key was reused

    def add(self, key: tuple[str, str], t: torch.Tensor, recomputable: bool) -> None:
        row = self.rows.get(key)
        if row is None:
            row = self.rows[key] = [0, 0, 0]
        row[0] += 1
        skey, ref, nbytes = _storage_of(t)
        entry = self.storages.get(skey)
        if entry is not None and _expired(entry.ref):
            self.retired.append(entry)
            entry = None
        if entry is None:
            entry = self.storages[skey] = _Storage(ref, nbytes)
        if recomputable:
            if entry.recomputable_row is None:
                entry.recomputable_row = key
        elif entry.stored_row is None:
            entry.stored_row = key

    def totals(self) -> tuple[int, int, list[SavedTensorsRow]]:
        rows = {key: [count, 0, 0] for key, (count, _, _) in self.rows.items()}
        stored = recomputable = 0
        for s in (*self.retired, *self.storages.values()):
            if s.stored_row is not None:
                rows[s.stored_row][1] += s.nbytes
                stored += s.nbytes
            elif s.recomputable_row is not None:
                rows[s.recomputable_row][2] += s.nbytes
                recomputable += s.nbytes
        ordered = sorted(
            (SavedTensorsRow(m, op, c, sb, rb) for (m, op), (c, sb, rb) in rows.items()),
            key=lambda r: (-(r.stored_bytes + r.recomputable_bytes), -r.count, r.module, r.op),
        )
        return stored, recomputable, ordered


class SavedTensorsReport:
    """What autograd saved for backward while a ``with`` block ran; see
    :func:`saved_tensors_report`.

    Example::

        >>> import torch
        >>> from gradient_scope import recompute_scope, saved_tensors_report
        >>> w = torch.randn(256, 256, requires_grad=True)
        >>> with saved_tensors_report() as report:
        ...     with recompute_scope():
        ...         h = torch.tanh(w @ w)      # tanh saves its output: a handle
        ...     loss = (h * w).sum()           # mul saves h (a handle) and w
        >>> report.recomputable_bytes         # h, once: 256 * 256 * 4 bytes
        262144
        >>> report.stored_bytes               # w, once (saved by matmul and mul)
        262144
    """

    def __init__(self) -> None:
        self._tally = _Tally()
        self._state = "new"
        self._thread = 0
        self._modules = _ModuleStack(0)
        self._tracker: _OpTracker | None = None
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None
        self._below: tuple[Callable[..., Any], Callable[..., Any]] | None = None
        self._handled = 0  # id() of the tensor a scope just turned into a handle
        self._cleanup: list[Callable[[], None]] = []
        self._totals: tuple[int, int, list[SavedTensorsRow]] | None = None

    # ---------------------------------------------------------------- results

    def _compute(self) -> tuple[int, int, list[SavedTensorsRow]]:
        if self._totals is not None:
            return self._totals
        result = self._tally.totals()
        if self._state == "done":
            self._totals = result
        return result

    @property
    def stored_bytes(self) -> int:
        """Bytes autograd keeps for backward: the distinct storages of the tensors
        it saved (parameters and inputs included), each counted once."""
        return self._compute()[0]

    @property
    def recomputable_bytes(self) -> int:
        """Bytes that scopes replaced with recompute handles (distinct storages
        that were never also stored)."""
        return self._compute()[1]

    @property
    def rows(self) -> list[SavedTensorsRow]:
        """One :class:`SavedTensorsRow` per (module, op), largest first."""
        return list(self._compute()[2])

    def table(self, top: int | None = None) -> str:
        """The report as a text table; ``top`` limits it to the largest rows."""
        return _format_table(*self._compute(), top)

    def __str__(self) -> str:
        return self.table()

    def __repr__(self) -> str:
        stored, recomputable, rows = self._compute()
        return (
            f"<SavedTensorsReport ({self._state}): {len(rows)} rows, stored {_fmt_bytes(stored)}, "
            f"recomputable {_fmt_bytes(recomputable)}>"
        )

    # ---------------------------------------------------------------- recording

    def _where(self) -> tuple[str, str]:
        module = self._modules.current()
        tracker = self._tracker
        func = tracker.current if tracker is not None else None
        if func is not None:
            op = _op_name(func)
        else:
            op = _python_caller()
        return module, op

    def _record(self, t: torch.Tensor, recomputable: bool) -> None:
        self._tally.add(self._where(), t, recomputable)

    def _pack(self, t: torch.Tensor) -> Any:
        below = self._below
        if below is None:
            # No pair of ours below: no block tensor of this thread is alive (I1).
            packed: Any = Stored(t, made_by_block=False)
            recomputable = False
        else:
            self._handled = 0
            packed = Foreign(below[1], below[0](t))
            recomputable = self._handled == id(t)  # the listener has recorded it
            self._handled = 0
        if not recomputable and self._state == "open" and threading.get_ident() == self._thread:
            with without_torch_function():
                self._record(t, False)
        return packed

    def _on_scope_pack(self, t: torch.Tensor, handle: Any) -> None:
        # A scope pair above ours turned ``t`` into a handle (stored and passed-on
        # tensors reach our own pack through the scope's pair).
        if self._state == "open" and threading.get_ident() == self._thread:
            with without_torch_function():
                self._record(t, True)
            self._handled = id(t)

    # ---------------------------------------------------------------- context

    def __enter__(self) -> SavedTensorsReport:
        if self._state != "new":
            raise RuntimeError(
                "saved_tensors_report: this report was already used; call saved_tensors_report() "
                "again for a new report."
            )
        self._thread = threading.get_ident()
        self._modules = _ModuleStack(self._thread)
        below = top_saved_hooks()
        hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, unpack)
        hooks.__enter__()  # raises (nothing changed) where saved-tensor hooks are disabled
        self._below = below
        self._hooks = hooks
        try:
            tracker = _OpTracker()
            tracker.__enter__()
            self._tracker = tracker
            self._cleanup.append(self._exit_tracker)
            self._cleanup.append(register_module_forward_pre_hook(self._modules.pre_hook).remove)
            self._cleanup.append(register_module_forward_hook(self._modules.post_hook, always_call=True).remove)
            self._cleanup.append(add_pack_listener(self._on_scope_pack))
        except BaseException:
            self._close()
            raise
        self._state = "open"
        return self

    def _exit_tracker(self) -> None:
        tracker = self._tracker
        self._tracker = None
        if tracker is None:
            return
        if innermost_function_mode() is tracker:
            tracker.__exit__(None, None, None)
            return
        # A mode entered inside the block is still active: take ours from under it.
        remove_function_mode_from_under(tracker)
        raise RuntimeError(
            "saved_tensors_report: a TorchFunctionMode entered inside the report's block is "
            "still active; exit it before the report."
        )

    def _close(self) -> None:
        error: BaseException | None = None
        for undo in reversed(self._cleanup):
            try:
                undo()
            except BaseException as e:  # noqa: BLE001  (undo the rest anyway; re-raised below)
                error = error or e
        self._cleanup.clear()
        self._modules = _ModuleStack(0)
        hooks, self._hooks = self._hooks, None
        if hooks is not None:
            hooks.__exit__(None, None, None)
        self._below = None
        if error is not None:
            raise error

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._state != "open":
            raise RuntimeError("saved_tensors_report: __exit__ without a matching __enter__.")
        if threading.get_ident() != self._thread:
            raise RuntimeError("saved_tensors_report: exited in another thread than it was entered in.")
        self._state = "done"
        self._close()


def saved_tensors_report() -> SavedTensorsReport:
    """Count what autograd saves for backward while the ``with`` block runs.

    ``with saved_tensors_report() as report:`` yields a
    :class:`SavedTensorsReport`. Every tensor that autograd saves for backward
    in this thread while the block runs is counted -- including the tensors
    that scopes replace with recompute handles -- by the module whose forward
    was running and the op that saved it:

    * ``report.stored_bytes``: bytes autograd keeps (distinct storages: a view,
      or a tensor saved by several ops, counts once; a saved view keeps its
      whole storage). Parameters and inputs that ops save count too: autograd
      holds them.
    * ``report.recomputable_bytes``: bytes of distinct storages that scopes
      saved as recompute handles (and that were not also stored).
    * ``report.rows``: one :class:`SavedTensorsRow` per (module path, op),
      largest first; each storage's bytes are charged to the first row that
      stored it (else the first that saved it as a handle).
    * ``print(report)`` (or ``report.table(top=10)``) prints them as a table:
      module path, op, count, stored bytes, recomputable bytes.

    The **module** is the innermost module whose forward was running, named
    by its path from the outermost running module (``transformer.h.0.attn``;
    the outermost module itself shows as its class name in parentheses). The
    **op** is the torch-level function that was executing when autograd saved
    the tensor, as a :class:`~torch.overrides.TorchFunctionMode` sees it: a
    ``torch.*`` / ``torch.nn.functional.*`` function or ``Tensor`` method
    (``linear``, ``matmul``, ``softmax``, ``scaled_dot_product_attention``,
    ``mul`` for ``*``, ...), the outermost one when torch functions call each
    other (``F.multi_head_attention_forward`` counts as one op);
    ``Name.apply`` for a custom ``autograd.Function`` (on torch >= 2.15, whose
    ``Function.apply`` is C++ code: the Python function that called it), ``backward`` for saves
    of a ``create_graph=True`` backward, and otherwise the Python function that
    saved (``_CheckpointFrame.save_inputs``: the inputs non-reentrant
    checkpoint keeps).

    It changes nothing about what is saved or how gradients are computed: its
    saved-tensor hooks hand every tensor to the hooks that were active before
    (or keep it, detached, with PyTorch's in-place check), and it composes with
    scopes, ``torch.utils.checkpoint`` and other ``saved_tensors_hooks``
    entered around it, inside it or after it. Tensors saved while a hook
    context entered *inside* the block is innermost (``save_on_cpu``,
    checkpoint's own hooks: what a checkpointed function saves is not kept)
    are that context's business and are not counted, except handles of
    scopes. Global state (saved-tensor hooks, torch function modes, module
    hooks) is restored when the block ends, also when it raises.

    Example::

        >>> import torch
        >>> import torch.nn as nn
        >>> from gradient_scope import apply_recompute, saved_tensors_report
        >>> model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
        >>> x = torch.randn(32, 64)
        >>> with saved_tensors_report() as plain:
        ...     loss = model(x).sum()
        >>> print(plain)
        module  op      count      stored  recomputable
        ------  ------  -----  ----------  ------------
        2       linear      2   96.00 KiB           0 B
        1       gelu        1   32.00 KiB           0 B
        0       linear      1    8.00 KiB           0 B
        ------  ------  -----  ----------  ------------
        total               4  136.00 KiB           0 B
        >>> _ = apply_recompute(model, check_fn=nn.GELU)
        >>> with saved_tensors_report() as scoped:
        ...     loss = model(x).sum()
        >>> scoped.recomputable_bytes   # gelu's output: recomputed, not kept
        32768
        >>> plain.stored_bytes - scoped.stored_bytes
        32768
    """
    return SavedTensorsReport()
