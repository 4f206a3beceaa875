"""``Budget``: say how much activation memory a model may keep after forward; the library
picks, per saved tensor, what to keep, offload or recompute.

RULES M1..M8: how a budget runs.

M1. [ a block's plan decides each save ] A scope with a budget gives its block a
    :class:`~gradient_scope._budget.block.BlockPlan`, the frame's ``store`` decision:
    the pack hook asks it, for each saved block tensor, whether to keep the tensor
    (True), offload it (the offload callable) or make a recompute handle. It never
    changes what is computed, only what is kept and where: gradients are those of the
    plain program.
M2. [ what a step is ] Steps: blocks and model regions entered while an earlier block of
    the budget may still be needed by backward (it has pending handles or stored
    tensors, and no backward pass that built no graph has used it yet:
    ``_restore.handles`` P10 [ a pass without a graph marks use ]), or while a region is
    open, belong to the same step; one entered when none is needed starts a new step, so
    a step ends with its backward also where the graph is retained
    (``backward(retain_graph=True)``). Within a step, a block is named by its site
    (where its scope was entered) and occurrence (how many blocks of that site came
    before it in the step), a region by its occurrence.
M3. [ a plan follows its structure ] A block whose structure (its signature,
    ``_record.signature``: the key replay shares its plans by) has a plan for its site
    and occurrence follows it. Each decision checks the op whose output it decides
    against the plan signature's entry for that op (the op, the output's shape and
    dtype: all that is known while the block is recorded), and the block's close
    compares the whole signature; on a mismatch it keeps nothing more and is measured. A
    block without a plan keeps nothing (the least memory) and is measured. A region
    offloads only saves whose shape and dtype are the plan's.
M4. [ an ended step is planned ] When a step ends (M2 [ what a step is ]) that had a
    measured block, or a region whose saves differ from its plan's, the step is planned
    (``_budget.step``, ``_budget.planner``) at the device's measured rates
    (``_budget.rates``). Plans are cached per site, occurrence and structure (a region's
    per occurrence and structure), so a new structure (another sequence length) runs
    unplanned once and its plan is kept next to the others: structures that alternate
    are each planned once.
M5. [ a budget below the floor warns ] A budget below the floor warns once, naming the
    floor, and keeps only what costs no bytes (``_budget.planner``
    K5 [ below the floor only free values ]).
M6. [ a model-level budget bounds the model ] A budget given to a model-level helper
    bounds the model's activation memory after forward: a region (``_budget.region``) is
    open during each forward of the model, and what the code outside the scopes saves
    there counts (N1 [ the bytes a budget bounds ] in ``_budget.step``). Where a scope
    would record nothing (scopes disabled, no grad, dynamo tracing) no region opens: a
    disabled process measures, counts and plans nothing.
M7. [ offload= moves what the plan offloads ] With ``offload=``, the budget's engine
    (``_budget.offload``) moves what the plan offloads. The plan fits the host bytes the
    pool counts into what the pool can hold (``_budget.hostpool`` H2..H4); copies the
    pool still refuses (its memory held by an earlier step's tensors) stay on the
    device, and one warning says how many bytes. On a device it cannot move (the CPU),
    offload changes nothing and one warning says so.
M8. [ the figures of the last step's plan ] The figures a budget shows (floor, planned
    bytes, predicted times, stored ops, curve) are those of the plan of the structure of
    the last step that ended: each step structure planned keeps its own, so a step that
    returns to an earlier structure (an earlier sequence length) shows that structure's
    again. A step whose blocks all have plans but in a combination not planned yet is
    planned.
"""

from __future__ import annotations

import inspect
import itertools
import math
import operator
import re
import weakref
from collections.abc import Callable, Hashable
from fractions import Fraction
from typing import Any, SupportsIndex

import torch

from .._base.feedback import unknown_options
from .._record.types import BlockRecord
from .block import BlockPlan
from .curve import BudgetCurve, StoredOp, fmt_bytes, fmt_seconds, stored_table
from .offload import engines
from .region import Region
from .run import Run
from .step import StepPlan

__all__ = ["Budget", "BudgetCurve", "StoredOp", "parse_bytes", "budget_by_key", "offload_all"]

Tensor = torch.Tensor
_BlockPlan = BlockPlan  # (the benchmarks time it by this name)

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"\s*([-+]?\s*(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))\s*([A-Za-z]*)\s*")


#: The largest budget: no memory holds more bytes than a signed 64-bit count.
MAX_BYTES = 2**63 - 1


def parse_bytes(value: Any) -> int:
    """A number of bytes from an int or a string such as ``"1.5GiB"`` or ``"800MB"``.

    Units: B, kB/MB/GB/TB (powers of 1000), KiB/MiB/GiB/TiB (powers of 1024), any case.
    Integers of other types (``numpy.int64``, anything with ``__index__`` but a
    tensor) count as ints; bools and floats do not.

    Example::

        >>> parse_bytes("1.5GiB"), parse_bytes("800MB"), parse_bytes(4096)
        (1610612736, 800000000, 4096)
    """
    n = _as_int(value)
    if n is None:
        if not isinstance(value, str):
            raise TypeError(
                "budget must be an int number of bytes or a string such as '1.5GiB' or '800MB', "
                f"got {type(value).__name__} ({value!r})"
            )
        m = _SIZE.fullmatch(value)
        unit = m.group(2).lower() if m is not None else None
        if m is None or unit not in _UNITS:
            raise ValueError(
                f"budget {value!r} is not a size: write a number and a unit, e.g. '2GiB', '1.5GB', "
                "'800MB', '512MiB' or '1000000' (units B, kB, MB, GB, TB, KiB, MiB, GiB, TiB)"
            )
        n = round(Fraction(m.group(1).replace(" ", "")) * _UNITS[unit])  # exact: no float overflow or rounding
    if n < 0:
        raise ValueError(
            f"budget {value!r} is negative: a budget is a number of bytes >= 0 (0 keeps as little as "
            "recompute and offload can)"
        )
    if n > MAX_BYTES:
        text = repr(value) if len(repr(value)) <= 40 else f"{repr(value)[:20]}... ({len(str(value))} characters)"
        raise ValueError(f"budget {text} is more bytes than any memory holds: the largest is 2**63 - 1")
    return n


def _as_int(value: Any) -> int | None:
    """``value`` as an int if it is an integer (an int, ``numpy.int64``, anything with
    ``__index__``), else None. Not a bool (``True`` is no size), nor a tensor (reading
    one would synchronise with its device)."""
    if isinstance(value, (bool, str, torch.Tensor)) or type(value).__name__ in ("bool", "bool_"):
        return None
    if not hasattr(type(value), "__index__"):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _offload_limit(value: Any) -> float | None:
    """``offload=``: None or False (off), True (as much host memory as needed), or a
    number of host bytes (an int or a string, as the budget)."""
    if value is None or value is False:
        return None
    if value is True:
        return math.inf
    try:
        return float(parse_bytes(value))
    except (TypeError, ValueError) as e:
        raise type(e)(f"offload: {e}; or True (as much host memory as needed), or None/False (off)") from None


_keys = itertools.count(1)
_BY_KEY: weakref.WeakValueDictionary[int, Budget] = weakref.WeakValueDictionary()


def budget_by_key(key: int) -> Budget | None:
    """The live budget of ``key`` (``Budget.key``: how compiled code names it)."""
    return _BY_KEY.get(key)


class Budget:
    """A memory budget: how many bytes of activations a model (or the scopes given it) may
    keep on the device after forward; the library picks what to keep, offload and
    recompute to stay within it at the least predicted step time.

    ``budget`` is an int number of bytes (``numpy.int64`` too) or a string such as ``"1.5GiB"`` or
    ``"800MB"``. Given to :func:`apply_recompute` or the Hugging Face ``enable``, it
    bounds the model's activation memory after forward: everything its forward leaves
    for backward that is not a parameter, buffer or input -- scoped or not, each storage
    once. Given to :class:`recompute_scope` or :func:`checkpoint`, it bounds what those
    scopes keep. ``offload``: host bytes the budget may fill with offloaded tensors (an
    int or a string), ``True`` for as many as needed, or None (the default: no offload).
    Gradients are those of the plain program at every budget.

    The first step stores nothing and measures; from the next step on the plan applies
    (``plan()`` measures a step on demand). See ``docs/budget.md``.

    Example::

        >>> import torch, torch.nn as nn
        >>> from gradient_scope import Budget, apply_recompute
        >>> model = nn.Sequential(*(nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
        ...                         for _ in range(4)))
        >>> budget = Budget("400KiB")
        >>> _ = apply_recompute(model, check_fn=lambda m: m in list(model), budget=budget)
        >>> x = torch.randn(128, 64, requires_grad=True)
        >>> for step in range(2):
        ...     model(x).sum().backward()
        >>> budget.planned_bytes <= budget.bytes
        True
        >>> print(budget.curve())   # doctest: +ELLIPSIS
             budget    on device    offloaded    recompute    copy wait         step
        ----------------------------------------------------------------------------
        ...
    """

    def __init__(
        self, budget: int | str | SupportsIndex, offload: bool | int | str | None = None, **misspelled: Any
    ) -> None:
        if misspelled:
            raise unknown_options("Budget", misspelled, ("budget", "offload"))
        self.bytes = parse_bytes(budget)
        self._offload_arg = offload
        self.offload = _offload_limit(offload)
        self._run = Run(self.bytes, self.offload)
        if self._run.engine is not None:
            engines.add(self._run.engine)
        self.key = next(_keys)  # (what a compiled graph knows it by)
        _BY_KEY[self.key] = self

    def __repr__(self) -> str:
        if self.offload is None:
            return f"Budget({fmt_bytes(self.bytes)!r})"
        host = "True" if self.offload == math.inf else repr(fmt_bytes(self.offload))
        return f"Budget({fmt_bytes(self.bytes)!r}, offload={host})"

    def __reduce__(self) -> Any:
        # A copy (deepcopy of a model, pickle) is a fresh budget of the same size.
        return (Budget, (self.bytes, self._offload_arg))

    # -- what the plan is

    def _result(self) -> Any:
        self._run.settle()
        return self._run.result

    @property
    def floor_bytes(self) -> int | None:
        """Bytes neither recompute nor offload can move (what the blocks keep for replay
        and what code outside the scopes saves, less what may be offloaded); None until
        a step has been measured and planned."""
        r = self._result()
        return None if r is None else r.floor

    @property
    def planned_bytes(self) -> int | None:
        """Bytes the plan keeps on the device after forward; None before a plan."""
        r = self._result()
        return None if r is None else r.device

    @property
    def offloaded_bytes(self) -> int | None:
        """Bytes the plan offloads to host memory; None before a plan."""
        r = self._result()
        return None if r is None else r.host

    @property
    def predicted_recompute(self) -> float | None:
        """Seconds per step the plan spends recomputing (modelled per op at the device's
        rates, scaled to what the measuring step's replays took); None before a plan."""
        r = self._result()
        return None if r is None else r.recompute

    @property
    def predicted_transfer(self) -> float | None:
        """Seconds per step of offload copies that compute does not hide; None before a plan."""
        r = self._result()
        return None if r is None else r.transfer

    @property
    def predicted_step_time(self) -> float | None:
        """Predicted seconds of a step's blocks: their forward and backward as timed in the
        step the plan measured (the library's own work in them included: recording,
        packing; the measuring's own code and replays not), plus the plan's recompute
        (:attr:`predicted_recompute`) and the copies compute does not hide -- not the code
        outside the scopes, nor the library's work there (its hooks on the model, each
        block's call before its scope opens); None before a plan. Where a block was not
        timed, the modelled figure (see :meth:`summary`)."""
        r = self._result()
        return None if r is None else r.step

    @property
    def predicted_peak_bytes(self) -> int | None:
        """Predicted activation bytes at the backward peak: those after forward, the
        largest block's values rebuilt at once, and the bytes fetched ahead; None before
        a plan."""
        r = self._result()
        return None if r is None else r.peak

    def stored_ops(self) -> list[StoredOp]:
        """What the plan does with each saved output of each block -- ``"kept"``,
        ``"offloaded"`` or ``"recomputed"`` -- and which kept inputs and saves outside
        the scopes it offloads."""
        r = self._result()
        return [] if r is None else list(r.stored)

    def stored_table(self, by: str = "module") -> str:
        """:meth:`stored_ops` as a table, grouped ``by`` ``"module"`` (the module path inside
        the layer each tensor was saved in, as the saved-tensor report's ``by="module"``),
        ``"block"``, or ``"op"`` (module, op and source line, with the plan's reason): the
        bytes kept, offloaded and recomputed, largest first.

        Example::

            >>> import torch, torch.nn as nn
            >>> from gradient_scope import Budget, apply_recompute
            >>> model = nn.Sequential(*(nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(2)))
            >>> budget = Budget("16KiB")
            >>> _ = apply_recompute(model, check_fn=lambda m: m in list(model), budget=budget)
            >>> print(budget.plan(lambda: model(torch.randn(32, 32)).sum().backward()).stored_table())
            ... # doctest: +ELLIPSIS
            module        kept   offloaded  recomputed
            ------------------------------------------
            ...
        """
        return stored_table(self.stored_ops(), by)

    def curve(self) -> BudgetCurve:
        """The predicted bytes against step time for every budget, from the last
        measured step (a table with units, and a PNG with ``.plot(path)``)."""
        r = self._result()
        if r is None:
            raise RuntimeError(
                "Budget.curve(): no step has been measured yet. Run one forward and backward "
                "with the scopes of this budget first (or budget.plan(step))."
            )
        return BudgetCurve(list(r.curve), self.bytes, r.floor)

    def plan(self, step: Callable[[], Any]) -> Budget:
        """Plan before training: run ``step()`` -- one forward and backward of the model
        this budget is applied to -- measure it, and plan. Returns the budget, whose
        figures (``planned_bytes``, ``predicted_peak_bytes``, ``curve()``...) then say
        what the plan holds and costs; training from the next step on follows it. The
        step is a real one: zero the gradients afterwards.

        Example::

            >>> import torch, torch.nn as nn
            >>> from gradient_scope import Budget, apply_recompute
            >>> model = nn.Sequential(*(nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(3)))
            >>> budget = Budget("40KiB")
            >>> _ = apply_recompute(model, check_fn=lambda m: m in list(model), budget=budget)
            >>> x = torch.randn(64, 32)
            >>> budget.plan(lambda: model(x).sum().backward()).planned_bytes <= budget.bytes
            True
        """
        step()
        if self._result() is None:
            raise RuntimeError(
                "Budget.plan(step): the step ran no scope of this budget, or its backward has not "
                "finished. Pass a function that runs the model's forward and backward once."
            )
        return self

    def summary(self) -> str:
        """The plan in a few lines, with units, and what the predicted step counts.

        Example::

            >>> import torch, torch.nn as nn
            >>> from gradient_scope import Budget, apply_recompute
            >>> model = nn.Sequential(*(nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(3)))
            >>> budget = Budget("40KiB")
            >>> _ = apply_recompute(model, check_fn=lambda m: m in list(model), budget=budget)
            >>> print(budget.plan(lambda: model(torch.randn(64, 32)).sum().backward()).summary())  # doctest: +ELLIPSIS
            Budget('40.00 KiB'):
              floor (nothing can move it)  ...
              predicted step of the blocks ...
              the step counts the blocks' forward and backward as timed in the step the plan
            ...
        """
        r = self._result()
        if r is None:
            return f"{self!r}: no step measured yet"
        rows = [
            ("floor (nothing can move it)", fmt_bytes(r.floor)),
            ("on the device after forward", fmt_bytes(r.device)),
            ("offloaded to host memory", fmt_bytes(r.host)),
            ("predicted backward peak", fmt_bytes(r.peak)),
            ("predicted recompute per step", fmt_seconds(r.recompute)),
            ("predicted copy wait per step", fmt_seconds(r.transfer)),
            *([] if r.timed else [("predicted library cost per step", fmt_seconds(r.library))]),
            ("predicted step of the blocks", fmt_seconds(r.step)),
        ]
        lines = [f"{self!r}:", *(f"  {k:<32}{v:>12}" for k, v in rows)]
        if r.timed:
            lines += [
                "  the step counts the blocks' forward and backward as timed in the step the plan",
                f"  measured ({fmt_seconds(r.measured)}; the library's own cost per op -- recording, packing --",
                "  is inside it, replays are not), recompute (modelled per op at this device's rates,",
                f"  times {r.scale:.3g}: what that step's replays took, replay's bookkeeping included)",
                "  and copy wait; not the code outside the scopes, nor the library's work there",
                "  (its hooks on the model, each block's call before its scope opens)",
            ]
        elif r.blocks:  # an eager plan not timed (a compiled one counts its recompute only)
            lines += [
                "  the step counts the blocks' forward and backward (kernels and autograd per op,",
                f"  {fmt_seconds(r.compute)}), the library's own cost (recording {r.ops_recorded} ops,",
                f"  packing {r.saves} saved tensors, replaying {r.replayed} ops), recompute and copy wait,",
                "  at this device's measured rates; not the code outside the scopes",
            ]
        return "\n".join(lines)

    def release_host_memory(self) -> None:
        """Give back the pinned host memory no offloaded tensor uses now (the pool keeps
        it between steps otherwise)."""
        if self._run.engine is not None:
            self._run.engine.release_host_memory()

    # -- what the scopes and helpers call

    def _note_compiled(self, device: int, recompute: float, floor: int) -> None:
        """A compiled graph applied this budget (its device bytes, recompute, floor): the
        figures to show until an eager step is planned."""
        if self._run.result is None or self._run.result.blocks == []:
            below = device > self.bytes
            self._run.result = StepPlan([], {}, floor, device, 0, recompute, 0.0, recompute, device, below)
            if below:
                self._run.warn_once(
                    "floor",
                    f"gradient_scope: Budget({fmt_bytes(self.bytes)}) is below the floor of the compiled scopes, "
                    f"{fmt_bytes(floor)} ({floor} bytes): what their recompute reads from outside them. Raise the "
                    "budget to at least the floor to make it bind.",
                )

    def _open_block(self, site: Hashable, record: BlockRecord, state: Any) -> BlockPlan:
        """The decision for a block entered at ``site`` (M1..M3)."""
        return self._run.open_block(site, record, state)

    def _open_region(self, module: torch.nn.Module, inputs: Any) -> Region:
        """A forward of the model this budget bounds starts
        (M6 [ a model-level budget bounds the model ])."""
        return self._run.open_region(module, inputs)

    def _close_region(self, region: Region, output: Any) -> None:
        """That forward ended (also when it raised)."""
        self._run.close_region(region, output)


# help(), inspect.signature and IDEs show the real options (``**misspelled`` only catches
# misspellings, to name the option meant).
_init = inspect.signature(Budget.__init__)
Budget.__signature__ = _init.replace(  # type: ignore[attr-defined]
    parameters=[p for name, p in _init.parameters.items() if name not in ("self", "misspelled")],
    return_annotation=inspect.Signature.empty,
)


def offload_all() -> Budget:
    """What transformers' ``offload=True`` asks for, as a budget: ``Budget(0, offload=True)``,
    the device keeping as little as recompute and offload can make it -- each saved tensor
    of the scoped blocks recomputed or offloaded (whichever the plan predicts faster), and
    the inputs the blocks keep for replay and what the code outside them saves offloaded
    to pinned host memory, as many bytes as it takes. What neither can move (the floor)
    stays; being asked for the least, the budget does not warn that it is below it.

    Example::

        >>> offload_all()
        Budget('0 B', offload=True)
    """
    budget = Budget(0, offload=True)
    budget._run.warned.add("floor")  # (asked for the least: the floor is the answer, not a surprise)
    return budget
