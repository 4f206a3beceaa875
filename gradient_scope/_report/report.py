"""``saved_tensors_report()``: what autograd saves for backward, by module and op.

Three observers, all removed when the ``with`` block ends (also when it raises):

* a saved-tensor hook pair that is *transparent*: it hands each tensor to the
  pair that was below it and returns that pair's packed object, wrapped, so
  what is saved and how it is unpacked do not change. With no pair below, it
  keeps the tensor detached together with its version and repeats PyTorch's
  in-place check on unpack (saved-tensor hooks switch PyTorch's own check off);
* a pack listener of the scopes' hook (:func:`._pack.add_pack_listener`):
  while a scope's pair is innermost, block tensors become handles without
  reaching our pair, and the listener reports them (and the blocks they come
  from: what those keep alive is ``held_by_scopes_bytes``); a store listener
  (:func:`._pack.add_store_listener`) reports the blocks of the tensors a
  budget's plan stores, which reach our pair as stored tensors;
* the module stack and op tracker of ``_report.where``: where each save happened.

The pieces: ``_report.where`` (where), ``_report.tally`` (counting, grouping),
``_report.format`` (tables), this module (the context manager and its results).
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Callable
from types import TracebackType
from typing import Any

import torch
import torch.nn as nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

from .._base.torch_compat import (
    innermost_function_mode,
    node_sequence_nr,
    remove_function_mode_from_under,
    sequence_nr,
    top_saved_hooks,
    without_torch_function,
)
from .._budget.offload import Offloaded, evicted_bytes
from .._record.registry import lookup
from .._record.types import Input
from .._record.wrappers import is_collective
from .._save.pack import Foreign, Stored, add_pack_listener, add_store_listener, unpack
from .format import Totals, diff_table, fmt_bytes, table
from .tally import SavedTensorsRow, Tally, held_outside
from .where import Location, ModuleStack, OpTracker, op_name, python_caller, user_line

__all__ = ["SavedTensorsReport", "SavedTensorsRow", "saved_tensors_report"]


class _Transparent:
    """The report's pack hook: transparent (``_save.pack`` S4 [ a budget's choice is stored ],
    S6 [ a region's saves go to its observer ]), a budget below it still offloads, and tells the
    report through the pack listener."""

    transparent = True
    __slots__ = ("fn",)

    def __init__(self, fn: Callable[[torch.Tensor], Any]) -> None:
        self.fn = fn

    def __call__(self, t: torch.Tensor) -> Any:
        return self.fn(t)


class _Observer:
    """The hooks of one report while its block runs, and what they counted."""

    def __init__(self, model: nn.Module | None) -> None:
        self.tally = Tally()
        self.model = model
        self.open = False
        self.thread = 0
        self.seq0 = 0  # autograd nodes numbered from here were made in the block
        self.modules = ModuleStack(0)
        self.tracker: OpTracker | None = None
        self.hooks: torch.autograd.graph.saved_tensors_hooks | None = None
        self.below: tuple[Callable[..., Any], Callable[..., Any]] | None = None
        self.handled = 0  # id() of the tensor a scope just turned into a handle
        self.cleanup: list[Callable[[], None]] = []
        self.states: dict[int, weakref.ref[Any]] = {}  # replay states of the blocks seen
        self.replaying: dict[int, weakref.ref[Any]] = {}  # those whose handles autograd saved
        self.made: dict[int, Any] = {}  # the op tracker's storages made in the block

    # -- where and what

    def _record(self, t: torch.Tensor, recomputable: bool, offloaded: bool = False) -> None:
        module, cls = self.modules.current()
        tracker = self.tracker
        func = tracker.current if tracker is not None else None
        op = op_name(func) if func is not None else python_caller()
        self.tally.add((module, op, cls), t, recomputable, self._made_in_block, self._made_at, offloaded)

    def _note_block(self, t: torch.Tensor) -> None:
        """A block tensor (or a view of one) kept or offloaded by a budget: its block's
        replay state, whose record holds what it keeps for replay."""
        entry = lookup(t)
        if entry is None and t._base is not None:
            entry = lookup(t._base)
        state = entry.frame.owner if entry is not None else None
        seen = self.states.get(id(state))
        if state is not None and (seen is None or seen() is not state):
            self.states[id(state)] = weakref.ref(state)

    def _made_in_block(self, t: torch.Tensor, key: int) -> bool:
        tracker = self.tracker
        if tracker is not None:
            if key in tracker.made:
                return True
            if tracker.current is not None:
                return tracker.made_by_running_op(t, key)
        # No torch function running (a custom autograd.Function, a compiled program):
        # a tensor with history tells by its node; a leaf that requires grad is a
        # parameter; what else such code saves it made itself.
        g = t.grad_fn
        if g is not None:
            return node_sequence_nr(g) >= self.seq0
        return not t.requires_grad

    def _made_at(self, t: torch.Tensor, key: int) -> Location | None:
        tracker = self.tracker
        if tracker is not None and key in tracker.made:
            return tracker.made[key]
        return user_line(sys._getframe(1))  # made by the op saving it

    # -- hooks

    def pack(self, t: torch.Tensor) -> Any:
        below = self.below
        if below is None:
            # No pair of ours below: no block tensor of this thread is alive
            # (I1 [ one pair of ours while needed ]).
            packed: Any = Stored(t, made_by_block=False)
            recomputable = False
        else:
            self.handled = 0
            packed = Foreign(below[1], below[0](t))
            recomputable = self.handled == id(t)  # the listener has recorded it
            self.handled = 0
        if not recomputable and self.open and threading.get_ident() == self.thread:
            with without_torch_function():
                self._record(t, False)
                self._note_block(t)
        return packed

    def on_scope_pack(self, t: torch.Tensor, handle: Any) -> None:
        # A scope pair above ours turned ``t`` into a handle (stored and passed-on
        # tensors reach our own pack through the scope's pair).
        if self.open and threading.get_ident() == self.thread:
            offloaded = isinstance(handle, Offloaded)  # a budget moved it to host memory
            with without_torch_function():
                self._record(t, not offloaded, offloaded)
                if offloaded:
                    self._note_block(t)
            self.handled = id(t)
            state = getattr(handle, "state", None)
            self._note_state(state)
            if not offloaded and state is not None:
                self.replaying[id(state)] = weakref.ref(state)

    def on_scope_store(self, t: torch.Tensor, state: Any) -> None:
        # A budget's plan stored ``t``: it is counted as stored where it reaches a pack
        # of ours (below or above the scope's pair); its block keeps what it read for
        # replays of its other values.
        if self.open and threading.get_ident() == self.thread:
            self._note_state(state)

    def _note_state(self, state: Any) -> None:
        seen = self.states.get(id(state))
        if state is not None and (seen is None or seen() is not state):
            self.states[id(state)] = weakref.ref(state)

    def held(self) -> int:
        """Bytes the blocks seen keep alive for replay that autograd does not store."""
        records = [r for r in (getattr(ref(), "record", None) for ref in self.states.values()) if r is not None]
        old = self.modules.state_keys()
        made = self.made

        def held_for_replay(inp: Input, key: int) -> bool:
            # Whether only the scope's hold keeps an Input's storage: a private copy, a
            # tensor made in the block, one whose own tensor has died; not the
            # parameters and buffers of the modules that ran, nor an older live tensor.
            if inp.snapshot or key in made:
                return True
            if key in old:
                return False
            src = inp.source()
            if src is None:
                return True
            g = src.grad_fn
            return g is not None and node_sequence_nr(g) >= self.seq0

        return held_outside(records, Input, self.tally.stored_keys(), held_for_replay)

    # -- entering and leaving

    def enter(self) -> None:
        self.thread = threading.get_ident()
        self.seq0 = sequence_nr()
        self.modules = ModuleStack(self.thread, self.model)
        below = top_saved_hooks()
        hooks = torch.autograd.graph.saved_tensors_hooks(_Transparent(self.pack), unpack)
        hooks.__enter__()  # raises (nothing changed) where saved-tensor hooks are disabled
        self.below = below
        self.hooks = hooks
        try:
            tracker = OpTracker()
            tracker.__enter__()
            self.tracker = tracker
            self.made = tracker.made
            self.cleanup.append(self._exit_tracker)
            self.cleanup.append(register_module_forward_pre_hook(self.modules.pre_hook).remove)
            self.cleanup.append(register_module_forward_hook(self.modules.post_hook, always_call=True).remove)
            self.cleanup.append(add_pack_listener(self.on_scope_pack))
            self.cleanup.append(add_store_listener(self.on_scope_store))
        except BaseException:
            self.close()
            raise
        self.open = True

    def _exit_tracker(self) -> None:
        tracker = self.tracker
        self.tracker = None
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

    def close(self) -> None:
        self.open = False
        error: BaseException | None = None
        for undo in reversed(self.cleanup):
            try:
                undo()
            except BaseException as e:  # noqa: BLE001  (undo the rest anyway; re-raised below)
                error = error or e
        self.cleanup.clear()
        self.modules.stack = []  # no module kept alive (the roots are weak)
        hooks, self.hooks = self.hooks, None
        if hooks is not None:
            hooks.__exit__(None, None, None)
        self.below = None
        if error is not None:
            raise error


def _replayed_collectives(states: dict[int, weakref.ref[Any]]) -> tuple[tuple[str, int], ...]:
    """(name, count) of the functional collectives (``_record.wrappers.Collective``) in the
    records of the blocks whose handles autograd saved: what their replays run in backward,
    in the order first recorded."""
    counts: dict[str, int] = {}
    for ref in states.values():
        record = getattr(ref(), "record", None)
        for rec in record.ops if record is not None else ():
            if is_collective(rec.func):
                counts[str(rec.func)] = counts.get(str(rec.func), 0) + 1
    return tuple(counts.items())


def _offloaded_inputs(states: dict[int, weakref.ref[Any]]) -> int:
    """Bytes of the outside tensors the blocks seen keep for replay that a budget
    offloaded in place (each storage once)."""
    seen: set[int] = set()
    total = 0
    for ref in states.values():
        record = getattr(ref(), "record", None)
        for rec in record.ops if record is not None else ():
            for a in (*rec.args, *rec.kwargs.values()):
                for x in a if isinstance(a, (list, tuple)) else (a,):
                    if isinstance(x, Input):
                        key, n = evicted_bytes(x.tensor)
                        if n and key not in seen:
                            seen.add(key)
                            total += n
    return total


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
        >>> report.stored_bytes               # w, once (saved by matmul and mul) ...
        262144
        >>> report.param_bytes, report.activation_bytes   # ... which existed before the block
        (262144, 0)
    """

    def __init__(self, model: nn.Module | None = None) -> None:
        self._observer = _Observer(model)
        self._state = "new"
        self._result: tuple[Totals, list[SavedTensorsRow]] | None = None

    # ---------------------------------------------------------------- results

    def _compute(self) -> tuple[Totals, list[SavedTensorsRow]]:
        if self._result is not None:
            return self._result
        rows = self._observer.tally.rows_list()
        totals = Totals(
            sum(r.activation_bytes for r in rows),
            sum(r.param_bytes for r in rows),
            sum(r.recomputable_bytes for r in rows),
            self._observer.held(),
            sum(r.offloaded_bytes for r in rows) + _offloaded_inputs(self._observer.states),
            _replayed_collectives(self._observer.replaying),
        )
        if self._state == "done":
            self._result = totals, rows
        return totals, rows

    @property
    def stored_bytes(self) -> int:
        """Bytes autograd keeps for backward: the distinct storages of the tensors
        it saved, each counted once (``activation_bytes + param_bytes``)."""
        totals = self._compute()[0]
        return totals.activation + totals.param

    @property
    def activation_bytes(self) -> int:
        """The part of ``stored_bytes`` made during the block: what scoping can save."""
        return self._compute()[0].activation

    @property
    def param_bytes(self) -> int:
        """The part of ``stored_bytes`` that existed before the block (parameters,
        inputs): alive anyway."""
        return self._compute()[0].param

    @property
    def recomputable_bytes(self) -> int:
        """Bytes that scopes replaced with recompute handles (distinct storages
        that were never also stored)."""
        return self._compute()[0].recomputable

    @property
    def held_by_scopes_bytes(self) -> int:
        """Bytes that scopes keep alive for replay and autograd does not store: the
        tensors made during the report's block that their blocks read (whole
        storages, each once; parameters and other older tensors are alive anyway),
        and the RNG states of their random ops, measured when the block ends."""
        return self._compute()[0].held_by_scopes

    @property
    def offloaded_bytes(self) -> int:
        """Bytes a memory budget moved to host memory (``Budget(..., offload=)``): saved
        tensors and the outside tensors blocks keep for replay, each storage once. Under
        a budget, ``activation_bytes + held_by_scopes_bytes + offloaded_bytes`` is what
        the forward leaves, on the device and off it."""
        return self._compute()[0].offloaded

    @property
    def replayed_collectives(self) -> dict[str, int]:
        """The functional collectives that the replays of the scopes whose handles were
        saved run in backward, by name (``"_c10d_functional::all_reduce"``), with how many
        each (one per recorded call, over all those blocks); empty without tensor
        parallelism. Collectives that a DTensor op runs inside its own dispatch (sharding
        propagation's redistributes) replay inside that op and are not listed. Every
        collective recorded in those blocks counts, also one whose output a memory budget
        stores.

        Example::

            >>> import torch
            >>> from gradient_scope import recompute_scope, saved_tensors_report
            >>> w = torch.randn(8, 8, requires_grad=True)
            >>> with saved_tensors_report() as report:
            ...     with recompute_scope():
            ...         h = torch.tanh(w)
            ...     loss = (h * w).sum()
            >>> report.replayed_collectives   # no collective in the block
            {}
        """
        return dict(self._compute()[0].collectives)

    @property
    def rows(self) -> list[SavedTensorsRow]:
        """One :class:`SavedTensorsRow` per (module, op), largest first (by
        activation and recomputable bytes, then parameter bytes)."""
        return list(self._compute()[1])

    def table(self, top: int | None = None, *, by: str | None = None, params: bool = True) -> str:
        """The report as a text table.

        Args:
            top: show only the largest rows (the rest summed in one line).
            by: group rows by ``"op"``, ``"module"``, ``"layer"`` (the module
                path up to its first number: ``model.layers.3``) or ``"class"``
                (the module's class); None: one row per (module, op).
            params: False leaves out the parameter column and the rows that
                only save tensors from before the block.
        """
        totals, rows = self._compute()
        return table(rows, totals, by, top, params)

    def diff(
        self, other: SavedTensorsReport, *, by: str | None = None, top: int | None = None,
        labels: tuple[str, str] = ("this", "other"),
    ) -> str:  # fmt: skip
        """This report and ``other`` side by side (e.g. ``plain.diff(scoped)``): stored
        and recomputable bytes per row, largest change first, with the totals of
        activations, parameters, bytes held by scopes, and all that is kept."""
        if not isinstance(other, SavedTensorsReport):
            raise TypeError(f"SavedTensorsReport.diff: other must be a SavedTensorsReport, got {type(other).__name__}")
        (ta, a), (tb, b) = self._compute(), other._compute()
        return diff_table(a, b, ta, tb, by, top, labels)

    def __str__(self) -> str:
        return self.table()

    def __repr__(self) -> str:
        totals, rows = self._compute()
        return (
            f"<SavedTensorsReport ({self._state}): {len(rows)} rows, activations {fmt_bytes(totals.activation)}, "
            f"params {fmt_bytes(totals.param)}, recomputable {fmt_bytes(totals.recomputable)}, "
            f"held by scopes {fmt_bytes(totals.held_by_scopes)}>"
        )

    # ---------------------------------------------------------------- context

    def __enter__(self) -> SavedTensorsReport:
        if self._state != "new":
            raise RuntimeError(
                "saved_tensors_report: this report was already used; call saved_tensors_report() "
                "again for a new report."
            )
        self._observer.enter()
        self._state = "open"
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._state != "open":
            raise RuntimeError("saved_tensors_report: __exit__ without a matching __enter__.")
        if threading.get_ident() != self._observer.thread:
            raise RuntimeError("saved_tensors_report: exited in another thread than it was entered in.")
        self._state = "done"
        try:
            self._observer.close()
        finally:
            self._compute()  # the totals as they are when the block ends
            self._observer.states.clear()
            self._observer.replaying.clear()
            self._observer.made = {}


def saved_tensors_report(model: nn.Module | None = None) -> SavedTensorsReport:
    """Count what autograd saves for backward while the ``with`` block runs.

    ``with saved_tensors_report() as report:`` yields a
    :class:`SavedTensorsReport`. Every tensor that autograd saves for backward
    in this thread while the block runs is counted -- including the tensors
    that scopes replace with recompute handles -- by the module whose forward
    was running and the op that saved it:

    * ``report.stored_bytes``: bytes autograd keeps (distinct storages: a view,
      or a tensor saved by several ops, counts once; a saved view keeps its
      whole storage). It splits into ``report.activation_bytes``, the storages
      made during the block (what scoping can save), and ``report.param_bytes``,
      those that existed before it (parameters, inputs: alive anyway).
    * ``report.recomputable_bytes``: bytes of distinct storages that scopes
      saved as recompute handles (and that were not also stored).
    * ``report.held_by_scopes_bytes``: what the scopes whose handles were saved
      keep alive for replay that autograd does not store (the tensors made in the
      block that their blocks read, whole storages, each once, and the RNG states
      of their random ops), when the block ends. What forward leaves in memory is
      ``activation_bytes + held_by_scopes_bytes`` (and what it returns).
    * ``report.offloaded_bytes``: under a memory budget with ``offload=``, what the
      budget moved to host memory (its own column; a budget's kept tensors count as
      stored activations): activations + held by scopes + offloaded is what forward
      leaves.
    * ``report.rows``: one :class:`SavedTensorsRow` per (module path, op),
      largest first; each storage's bytes are charged to the first row that
      stored it (else the first that saved it as a handle). A row names the
      shape, dtype and source line (``model.py:57``, the first frame outside
      torch) of the op that made its largest tensor.
    * ``print(report)`` (or ``report.table(top=10, by="layer", params=False)``)
      prints them as a table, grouped by ``"op"``, ``"module"``, ``"layer"``
      or ``"class"`` if asked; ``report.diff(other)`` puts two reports side by
      side (plain vs scoped).

    The **module** is the innermost module whose forward was running, named
    by its path from ``model`` when given (``transformer.h.0.attn``), else
    from the outermost running module; that root itself shows as its class
    name in parentheses. Under ``torch.compile`` the module hooks and the op
    tracker stand aside while dynamo traces (the compiled program is the one
    compiled without the report): the compiled program's saves show as
    ``CompiledFunction.apply`` of the module that called it. The
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

    A tensor counts as made in the block when a torch function run in the
    block returned it or made it while saving it; with no torch function
    running (a custom ``autograd.Function`` on torch >= 2.15, a compiled
    program), when its autograd node is newer than the block or, without one,
    when it does not require grad.

    Example::

        >>> import torch
        >>> import torch.nn as nn
        >>> from gradient_scope import apply_recompute, saved_tensors_report
        >>> model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
        >>> x = torch.randn(32, 64)
        >>> with saved_tensors_report() as plain:
        ...     loss = model(x).sum()
        >>> print(plain.table(params=False))  # doctest: +ELLIPSIS
        module  op      count  activations  recomputable  largest saved
        ...
        2       linear      2    32.00 KiB           0 B  float32[32, 256] at <doctest ...>:2
        1       gelu        1    32.00 KiB           0 B  float32[32, 256] at <doctest ...>:2
        ...
        total               3    64.00 KiB           0 B
        held by scopes for replay (not saved by autograd): 0 B
        >>> plain.activation_bytes, plain.param_bytes   # params: the weights and x
        (65536, 73728)
        >>> _ = apply_recompute(model, check_fn=nn.GELU)
        >>> with saved_tensors_report() as scoped:
        ...     loss = model(x).sum()
        >>> scoped.recomputable_bytes   # gelu's output: recomputed, not kept
        32768
        >>> plain.stored_bytes - scoped.stored_bytes
        32768
        >>> print(plain.diff(scoped, labels=("plain", "scoped"), by="op"))
        op              plain stored  plain recomputable  scoped stored  scoped recomputable  change in stored
        --------------  ------------  ------------------  -------------  -------------------  ----------------
        linear            104.00 KiB                 0 B      72.00 KiB            32.00 KiB        -32.00 KiB
        gelu               32.00 KiB                 0 B      32.00 KiB                  0 B               0 B
        --------------  ------------  ------------------  -------------  -------------------  ----------------
        activations        64.00 KiB                 0 B      32.00 KiB            32.00 KiB        -32.00 KiB
        params             72.00 KiB                 0 B      72.00 KiB                  0 B               0 B
        held by scopes           0 B                 0 B            0 B                  0 B               0 B
        kept in all       136.00 KiB                 0 B     104.00 KiB            32.00 KiB        -32.00 KiB
    """
    return SavedTensorsReport(model)
