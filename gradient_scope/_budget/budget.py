"""``Budget``: say how much memory the scoped blocks may hold; the library picks what to store.

RULES M1..M6: how a budget runs.

M1. A scope with a budget gives its block a :class:`_BlockPlan`, the frame's
    ``store`` decision: the pack hook asks it, for each saved block tensor, whether
    to store the tensor (True) or make a recompute handle. It never changes what is
    computed, only what is kept: gradients are those of the plain program.
M2. Steps: blocks entered while an earlier block of the budget may still be needed
    by backward (it has pending handles or stored tensors, and no backward pass that
    built no graph has used it yet: ``_restore.handles`` P10) belong to the same step;
    a block entered when none is needed starts a new step. So a step ends with its
    backward also where the graph is retained (``backward(retain_graph=True)``). Within a step, a block is
    named by its site (where its scope was entered) and occurrence (how many blocks
    of that site came before it in the step).
M3. A block whose structure (its signature, ``_record.signature``: the key replay
    shares its plans by) has a plan for its site and occurrence follows it. Each
    decision checks the op whose output it decides against the plan signature's entry
    for that op (the op, the output's shape and dtype: all that is known while the
    block is recorded), and the block's close compares the whole signature; on a
    mismatch it stores nothing more and is measured. A block without a plan stores
    nothing (the least memory) and is measured.
M4. When a step ends (M2) that had a measured block, the planner
    (``_budget.planner``) plans the whole step: the bytes left by the floor (the outside
    tensors the step's blocks keep for replay, each storage once) go to the stored
    tensors that spare the most recompute per byte. Plans are cached per site,
    occurrence and structure, so a new structure (another sequence length) runs
    unplanned once and its plan is kept next to the others.
M5. A budget below the floor warns once, naming the floor, and stores only what
    costs no bytes (``_budget.planner`` K5).
M6. The figures a budget shows (floor, planned bytes, predicted recompute, stored
    ops, curve) are those of the plan of the structure of the last step that ended:
    each step structure planned keeps its own, so a step that returns to an earlier
    structure (an earlier sequence length) shows that structure's again. A step whose
    blocks all have plans but in a combination not planned yet is planned.
"""

from __future__ import annotations

import operator
import os
import re
import weakref
from collections.abc import Hashable
from fractions import Fraction
from typing import Any, NamedTuple, SupportsIndex

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from .._base.feedback import warn_user
from .._record.signature import output_matches, signature
from .._record.types import BlockRecord, Input, Var
from .measure import Measured, input_storages, measure, storage_of
from .planner import BlockGraph, Candidate, build_chain, choose

__all__ = ["Budget", "BudgetCurve", "StoredOp", "parse_bytes"]

Tensor = torch.Tensor

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
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]*)\s*")


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
        n = round(Fraction(m.group(1)) * _UNITS[unit])  # exact: no float overflow or rounding
    if n < 0:
        raise ValueError(f"budget must be >= 0 bytes, got {value!r}")
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


class StoredOp(NamedTuple):
    """One stored output in a budget's plan: the block (``file.py:line#occurrence``),
    the op, which of its outputs, and the bytes of its storage (0: in memory anyway)."""

    block: str
    op: str
    output: int
    nbytes: int


def _fmt(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


class BudgetCurve:
    """Predicted recompute for every budget, from what the first step measured.

    ``rows``: ``(budget bytes, predicted recompute)`` pairs, budgets ascending; any
    budget between two rows gets the recompute of the lower one. ``budget``: the
    bytes of the Budget it came from. ``str(curve)`` is a table; :meth:`plot` writes
    a PNG (needs matplotlib).
    """

    def __init__(self, rows: list[tuple[int, float]], budget: int, floor: int) -> None:
        self.rows = rows
        self.budget = budget
        self.floor = floor

    def recompute_at(self, nbytes: int) -> float | None:
        """The predicted recompute at a budget of ``nbytes`` (None below the floor)."""
        best = None
        for b, c in self.rows:
            if b <= nbytes:
                best = c
        return best

    def __str__(self) -> str:
        top = self.rows[0][1] if self.rows and self.rows[0][1] else 1.0
        lines = [f"{'budget':>12}  {'recompute':>14}  {'of all':>7}", "-" * 37]
        for b, c in self.rows:
            mark = "  <- this budget" if b <= self.budget and self.recompute_at(self.budget) == c else ""
            lines.append(f"{_fmt(b):>12}  {c:14.4g}  {100 * c / top:6.1f}%{mark}")
        return "\n".join(lines)

    def plot(self, path: str | os.PathLike[str]) -> None:
        """Write the curve as a PNG to ``path`` (requires matplotlib)."""
        try:
            import matplotlib
        except ImportError as e:
            raise ImportError("Budget.curve().plot() needs matplotlib: pip install matplotlib") from e

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        xs = [b / 2**20 for b, _ in self.rows]
        ax.step(xs, [c for _, c in self.rows], where="post", label="predicted recompute")
        ax.axvline(self.budget / 2**20, color="gray", linestyle="--", label="this budget")
        ax.set_xlabel("budget (MiB held after forward)")
        ax.set_ylabel("recompute (cost units)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)


def _where(site: Hashable) -> str:
    """A site (``_base.errors.Site``: file, line, what) in a few words: what the helper
    named (a module path), else ``file.py:line``."""
    if isinstance(site, tuple) and len(site) == 3:
        file, line, what = site
        return str(what) if what is not None else f"{os.path.basename(str(file))}:{line}"
    return str(site)


def _candidates(bp: _BlockPlan, b: int, index: dict[tuple[int, int], int]) -> list[Candidate]:
    """K2: block ``b``'s saved values, grouped by storage, with the storage's bytes."""
    groups: dict[tuple[int, int], list[int]] = {}
    sizes: dict[tuple[int, int], int] = {}
    for place, seen in bp.saved.items():
        if place in index and seen is not None:
            group, nbytes = seen
            groups.setdefault(group, []).append(index[place])
            sizes[group] = max(nbytes, sizes.get(group, 0))
    return [Candidate(b, tuple(vals), 0 if group in bp.free else sizes[group]) for group, vals in groups.items()]


class _Figures(NamedTuple):
    """What a step structure's plan keeps and leaves (M6)."""

    floor: int
    planned: int
    predicted: float
    stored: tuple[StoredOp, ...]
    curve: tuple[tuple[int, float], ...]


class _Plan(NamedTuple):
    keys: tuple[Hashable, ...]  # the signature of the structure it was made for (an entry per op first)
    chosen: frozenset[tuple[int, int]]  # (op, output) of the values to store


def _agrees(plan: _Plan, rec: Any, place: tuple[int, int], var: Var) -> bool:
    """M3 for one decision: ``plan``'s signature has the decided op and output as
    recorded."""
    j, k = place
    return j < len(plan.keys) and output_matches(plan.keys[j], rec.func, len(rec.outs), k, var.size, var.dtype)


class _BlockPlan:
    """One block's decision (M1, M3) and what it saw (for M4). Refers to its budget
    and record weakly: the budget holds it until its step is planned, and a record
    must die with its last handle (``_restore.handles`` P7)."""

    __slots__ = (
        "budget",
        "site",
        "occurrence",
        "record",
        "state",
        "plans",
        "saved",
        "known",
        "keys",
        "inputs",
        "free",
    )

    def __init__(
        self, budget: Budget, site: Hashable, occurrence: int, record: BlockRecord, state: Any, plans: list[_Plan]
    ) -> None:
        self.budget = weakref.ref(budget)
        self.site = site
        self.occurrence = occurrence
        self.record = weakref.ref(record)
        self.state = weakref.ref(state)  # the block's ReplayState: is it needed still (M2)?
        self.plans = plans  # those still consistent with what was recorded (M3)
        # (op, output) of each saved block tensor -> (its storage group's root (op,
        # output), the storage's bytes)
        self.saved: dict[tuple[int, int], tuple[tuple[int, int], int] | None] = {}
        self.free: set[tuple[int, int]] = set()  # groups another block keeps anyway
        self.known = False  # closed with a structure that had a plan
        self.keys: tuple[Hashable, ...] | None = None  # set when closed cleanly
        self.inputs: dict[int, int] = {}  # storages of the outside tensors it keeps

    def needed(self) -> bool:
        """Whether a backward pass is still to use this block (M2)."""
        state = self.state()
        return state is not None and bool(state.awaited())

    def _check(self, ops: list[Any], place: tuple[int, int], var: Var) -> None:
        """Keep the plans whose signature has the decided op and output as recorded (M3)."""
        self.plans = [p for p in self.plans if _agrees(p, ops[place[0]], place, var)]

    def __call__(self, var: Var, t: Tensor) -> bool:
        """Whether the pack hook stores ``t`` (``var``'s tensor or a view of it)."""
        record = self.record()
        root = var.root
        if record is None or isinstance(root, Input):
            return False
        ops = record.ops
        rec = ops[var.op]
        place = (var.op, rec.outs.index(var))
        if self.plans and not _agrees(self.plans[0], rec, place, var):
            self._check(ops, place, var)
        if type(t) is not Tensor or root.size is None:
            self.saved[place] = None  # no storage we can see: never stored
        else:
            # Storages are told apart by their group's root, not by address: an address
            # is reused as soon as an earlier tensor of the block is freed.
            group = (root.op, ops[root.op].outs.index(root))
            self.saved[place] = (group, int(root.size.numel()) * root.dtype.itemsize)
            if self.plans:
                return place in self.plans[0].chosen
            budget = self.budget()
            where = storage_of(t)
            if budget is not None and where is not None:  # measuring: is it kept anyway (K2)?
                budget._storages[where[0]] = (StorageWeakRef(t.untyped_storage()), self, group)
        return False

    def close(self, aborted: bool) -> None:
        """The block closed: keep the plan that matches it whole, or measure it (M3)."""
        record = self.record()
        budget = self.budget()
        if record is None or budget is None or aborted:
            self.plans = []
            return
        key: Any = signature(record)[0]  # computed once: replay reads it too
        self.plans = [p for p in self.plans if p.keys == key]
        self.known = bool(self.plans)
        self.keys = key
        if self.known:  # planned: nothing to measure (the per-step cost stays small)
            return
        self.inputs = input_storages(record)
        budget._kept_for_replay(self)
        budget._measured(self, record)


class Budget:
    """A memory budget shared by scopes: how many bytes their blocks may keep for backward.

    ``budget`` is an int number of bytes (``numpy.int64`` too) or a string such as
    ``"1.5GiB"`` or ``"800MB"``. The budget bounds what the scopes given this object keep for
    backward after forward: the block tensors they store plus the outside tensors
    they keep for replay (each storage once; parameters, and leaves that require
    grad, are alive anyway and not counted). Gradients are those of the plain
    program at every budget.

    The first step with an unseen block structure stores nothing and measures each
    saved block tensor; from the next step on, the scopes store the tensors that
    spare the most recompute per byte until the budget is used (see
    ``docs/budget.md``). Pass it to :func:`apply_recompute` (which also takes an int
    or a string), :class:`recompute_scope` or :func:`checkpoint`.

    Example::

        >>> import torch, torch.nn as nn
        >>> from gradient_scope import Budget, apply_recompute
        >>> model = nn.Sequential(*(nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
        ...                         for _ in range(4)))
        >>> budget = Budget("256KiB")
        >>> _ = apply_recompute(model, check_fn=lambda m: m in list(model), budget=budget)
        >>> x = torch.randn(128, 64, requires_grad=True)
        >>> for step in range(2):
        ...     model(x).sum().backward()
        >>> budget.planned_bytes <= budget.bytes
        True
        >>> print(budget.curve())   # doctest: +ELLIPSIS
              budget       recompute   of all
        -------------------------------------
        ...
    """

    def __init__(self, budget: int | str | SupportsIndex) -> None:
        self.bytes = parse_bytes(budget)
        self._plans: dict[tuple[Hashable, int], list[_Plan]] = {}
        self._graphs: dict[tuple[Hashable, tuple[Hashable, ...]], tuple[BlockGraph, Measured]] = {}
        self._step: list[_BlockPlan] = []
        # This step's saved block storages (address -> weak ref, block, group): an
        # address names a storage only while it is alive.
        self._storages: dict[int, tuple[StorageWeakRef, _BlockPlan, tuple[int, int]]] = {}
        self._occurrences: dict[Hashable, int] = {}
        self._warned = False
        # (site, occurrence, structure) -> (free groups, input storages) last measured
        self._seen: dict[tuple[Hashable, int, Any], tuple[frozenset[tuple[int, int]], dict[int, int]]] = {}
        # The figures of the plan of the structure running now (M6), and those of every
        # step structure planned: (site, occurrence, signature) of each block -> figures.
        self._now: _Figures | None = None
        self._figures: dict[tuple[Any, ...], _Figures] = {}

    def __repr__(self) -> str:
        return f"Budget({_fmt(self.bytes)!r})"

    def __reduce__(self) -> Any:
        # A copy (deepcopy of a model, pickle) is a fresh budget of the same size.
        return (Budget, (self.bytes,))

    # -- what the plan is

    def _current(self) -> _Figures | None:
        self._settle()
        return self._now

    @property
    def floor_bytes(self) -> int | None:
        """Bytes kept when nothing is stored (the outside tensors kept for replay), for
        the structure of the last step; None until a step has been measured and planned."""
        now = self._current()
        return None if now is None else now.floor

    @property
    def planned_bytes(self) -> int | None:
        """Bytes the plan of the last step's structure keeps (floor + stored), as
        measured; None before a plan."""
        now = self._current()
        return None if now is None else now.planned

    @property
    def predicted_recompute(self) -> float | None:
        """Recompute the plan of the last step's structure leaves, in cost units (FLOPs
        for matmul-like ops, bytes moved for the rest); None before a plan."""
        now = self._current()
        return None if now is None else now.predicted

    def stored_ops(self) -> list[StoredOp]:
        """Which outputs of which ops of which block the plan of the last step's
        structure stores."""
        now = self._current()
        return [] if now is None else list(now.stored)

    def curve(self) -> BudgetCurve:
        """Predicted recompute for every budget, for the last step's structure."""
        now = self._current()
        if now is None:
            raise RuntimeError(
                "Budget.curve(): no step has been measured yet. Run one forward and backward "
                "with the scopes of this budget first."
            )
        return BudgetCurve(list(now.curve), self.bytes, now.floor)

    # -- steps (M2)

    def _settle(self) -> None:
        if self._step and not any(bp.needed() for bp in self._step):
            self._end_step()

    def _open_block(self, site: Hashable, record: BlockRecord, state: Any) -> _BlockPlan:
        """The decision for a block entered at ``site`` (M1..M3)."""
        self._settle()
        n = self._occurrences.get(site, 0)
        self._occurrences[site] = n + 1
        bp = _BlockPlan(self, site, n, record, state, list(self._plans.get((site, n), ())))
        self._step.append(bp)
        return bp

    def _kept_for_replay(self, bp: _BlockPlan) -> None:
        """``bp`` closed keeping ``bp.inputs`` for replay: saved storages of earlier
        blocks among them are in memory anyway (storing them is free, K2)."""
        for ptr in bp.inputs:
            seen = self._storages.get(ptr)
            if seen is not None and seen[1] is not bp and not seen[0].expired():
                seen[1].free.add(seen[2])

    def _measured(self, bp: _BlockPlan, record: BlockRecord) -> None:
        key = (bp.site, bp.keys)
        if key not in self._graphs:
            m = measure(record)
            g = BlockGraph(
                _where(bp.site),
                tuple(m.costs),
                tuple(m.reads),
                tuple(m.producers),
                tuple(m.cuttable),
                tuple(m.needs),
                (),
            )
            self._graphs[key] = (g, m)  # type: ignore[index]

    def _end_step(self) -> None:
        blocks = [bp for bp in self._step if bp.keys is not None]
        self._step = []
        self._storages = {}
        self._occurrences = {}
        if not blocks:
            return
        structure = tuple((bp.site, bp.occurrence, bp.keys) for bp in blocks)
        if any(not bp.known for bp in blocks) or structure not in self._figures:
            for bp in blocks:
                key = (bp.site, bp.occurrence, bp.keys)
                if bp.known and key in self._seen:
                    # Planned in this step, so not measured: what its last measured step
                    # saw (addresses of then: tagged, so that they never match now's).
                    free, inputs = self._seen[key]
                    bp.free = set(free)
                    bp.inputs = {hash((key, ptr)): n for ptr, n in inputs.items()}
                else:
                    self._seen[key] = (frozenset(bp.free), dict(bp.inputs))
            self._figures[structure] = self._plan_step(blocks)
        self._now = self._figures[structure]  # M6

    def _plan_step(self, blocks: list[_BlockPlan]) -> _Figures:
        """M4: plan every block of a finished step that had a measured block."""
        floor_storages: dict[int, int] = {}
        for bp in blocks:
            floor_storages.update(bp.inputs)
        floor = sum(floor_storages.values())
        graphs: list[BlockGraph] = []
        measured: list[Measured] = []
        cands: list[Candidate] = []
        for b, bp in enumerate(blocks):
            g, m = self._graphs[(bp.site, bp.keys)]  # type: ignore[index]
            index = {place: v for v, place in enumerate(m.places)}
            saved = tuple(index[p] for p in bp.saved if p in index)
            label = f"{_where(bp.site)}#{bp.occurrence}"
            graphs.append(BlockGraph(label, g.costs, g.reads, g.producers, g.cuttable, g.needs, saved))
            measured.append(m)
            cands.extend(_candidates(bp, b, index))
        chain = build_chain(graphs, cands)
        k, below = choose(chain, floor, self.bytes)
        if below and not self._warned:
            self._warned = True
            warn_user(
                f"gradient_scope: Budget({_fmt(self.bytes)}) is below the floor of these scopes, "
                f"{_fmt(floor)} ({floor} bytes): what recomputing everything keeps (the outside "
                "tensors the blocks read). Only what is in memory anyway is stored; memory stays "
                "at the floor. Raise the budget to at least the floor to make it bind."
            )
        chosen: list[set[tuple[int, int]]] = [set() for _ in blocks]
        stored: list[StoredOp] = []
        for c in chain.order[:k]:
            cand = cands[c]
            m = measured[cand.block]
            for v in cand.values:
                op, out = m.places[v]
                chosen[cand.block].add((op, out))
                stored.append(StoredOp(graphs[cand.block].label, m.names[op], out, cand.nbytes))
        for bp, places in zip(blocks, chosen):
            key = (bp.site, bp.occurrence)
            kept = [p for p in self._plans.get(key, []) if p.keys != bp.keys]
            self._plans[key] = [*kept, _Plan(bp.keys, frozenset(places))]  # type: ignore[arg-type]
        rows: list[tuple[int, float]] = []
        for used, left in zip(chain.nbytes, chain.cost):
            if rows and rows[-1][0] == floor + used:
                rows[-1] = (floor + used, left)
            elif not rows or left < rows[-1][1]:
                rows.append((floor + used, left))
        return _Figures(floor, floor + chain.nbytes[k], chain.cost[k], tuple(stored), tuple(rows))
