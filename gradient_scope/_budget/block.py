"""One scoped block under a budget: the decision its frame carries for each saved
tensor (M1 [ a block's plan decides each save ], M3 [ a plan follows its structure ] in
``_budget.budget``), what it saw (for M4 [ an ended step is planned ]), and what its plan does
at its close (kept inputs offloaded in place, the record dropped when everything is kept)."""

from __future__ import annotations

import sys
import weakref
from collections.abc import Hashable
from typing import Any, NamedTuple, Protocol

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from .._base.lines import source, user_line
from .._base.subclass import data_tensors, is_wrapper
from .._record.context import running_module_path
from .._record.signature import output_matches, signature
from .._record.types import BlockRecord, Input, Var
from .measure import input_storages, kept_inputs, storage_of
from .offload import Offloader
from .timing import Stopwatch, syncs

__all__ = ["BlockPlan", "BlockRun", "Plan"]

Tensor = torch.Tensor
Place = tuple[int, int]  # (op, output)


class Plan(NamedTuple):
    """What a block of one structure does (``_budget.step.BlockChoice`` with its key)."""

    keys: tuple[Hashable, ...]  # the signature of the structure it was made for (an entry per op first)
    chosen: frozenset[Place]  # kept on the device
    offloaded: frozenset[Place]  # offloaded
    hold: frozenset[int]  # kept inputs offloaded in place: ordinals whose aliases to note
    evict: frozenset[int]  # of them, those this block offloads
    whole: bool  # every saved value kept: the record goes at close


class BlockRun(Protocol):
    """What a block asks of its budget at run time (``_budget.run.Run`` offers it; the
    run knows its blocks, a block knows only this)."""

    @property
    def engine(self) -> Offloader | None:
        """The offload engine (None: no offload)."""

    def saw_storage(self, ptr: int, storage: StorageWeakRef, block: BlockPlan, group: Place) -> None:
        """A block being measured saved a tensor of storage ``ptr``, of its group ``group``
        (K2 [ a candidate is one storage ])."""

    def measuring_ran(self, since: tuple[float, float], until: tuple[float, float]) -> None:
        """The measuring's own code ran from ``since`` to ``until``: not in the forward of
        the blocks open now (``_budget.timing``)."""

    def kept_for_replay(self, block: BlockPlan) -> None:
        """``block`` closed keeping ``block.inputs`` for replay (K2 [ a candidate is one storage ])."""

    def measured(self, block: BlockPlan, record: BlockRecord) -> None:
        """``block`` closed unplanned: measure ``record`` (M4 [ an ended step is planned ])."""

    def hold(self, ptr: int, aliases: list[Tensor], key: Hashable, evict: bool) -> None:
        """A kept input of storage ``ptr`` to offload in place
        (N3 [ an input offloaded by its last block ])."""

    def region_open(self) -> bool:
        """Whether a model region of the budget is open (N4 [ a budget above plain autograd ])."""


def _agrees(plan: Plan, rec: Any, place: Place, var: Var) -> bool:
    """M3 [ a plan follows its structure ] for one decision: ``plan``'s signature has the
    decided op and output as recorded."""
    j, k = place
    return j < len(plan.keys) and output_matches(plan.keys[j], rec.func, len(rec.outs), k, var.size, var.dtype)


class BlockPlan:
    """One block's decision (M1 [ a block's plan decides each save ],
    M3 [ a plan follows its structure ]) and what it saw (for M4 [ an ended step is planned ]).
    Refers to its budget and record weakly: the budget holds it until its step is planned, and a
    record must die with its last handle (``_restore.handles``
    P7 [ the record lives with its handles ])."""

    __slots__ = (
        "budget",
        "site",
        "occurrence",
        "position",
        "record",
        "state",
        "plans",
        "saved",
        "known",
        "keys",
        "inputs",
        "rng",
        "free",
        "whole",
        "views",
        "where",
        "watch",
        "__weakref__",
    )

    def __init__(self, budget: BlockRun, site: Hashable, occurrence: int, position: int, record: BlockRecord,
                 state: Any, plans: list[Plan]) -> None:  # fmt: skip
        self.budget = weakref.ref(budget)
        self.site = site
        self.occurrence = occurrence
        self.position = position  # its place among the step's blocks
        self.record = weakref.ref(record)
        self.state = weakref.ref(state)  # the block's ReplayState: is it needed still (M2 [ what a step is ])?
        self.plans = plans  # those still consistent with what was recorded (M3 [ a plan follows its structure ])
        # (op, output) of each saved block tensor -> (its storage group's root (op,
        # output), the storage's bytes)
        self.saved: dict[Place, tuple[Place, int] | None] = {}
        self.free: dict[Place, int] = {}  # groups another block keeps anyway -> that storage
        # measuring: (op, output) -> (the module path running when autograd saved it, the
        # source line of that save), as the saved-tensor report names a save (stored_ops)
        self.where: dict[Place, tuple[str, str]] = {}
        self.known = False  # closed with a structure that had a plan
        self.keys: tuple[Hashable, ...] | None = None  # set when closed cleanly
        self.inputs: dict[int, int] = {}  # storages of the outside tensors it keeps
        self.rng: frozenset[int] = frozenset()  # of them, generator states
        self.whole = False  # its record was dropped at close (N4 [ a budget above plain autograd ] in ``_budget.step``)
        self.views: set[int] = set()  # storages of outside tensors saved as views (kept by autograd too)
        # its forward and backward timed, while it may be measured (``_budget.timing``); a
        # block with plans is timed only where the marks cost no synchronization
        self.watch: Stopwatch | None = None if plans and syncs() else Stopwatch()

    def needed(self) -> bool:
        """Whether a backward pass is still to use this block (M2 [ what a step is ])."""
        if self.whole:
            return False
        state = self.state()
        return state is not None and bool(state.awaited())

    def _check(self, ops: list[Any], place: Place, var: Var) -> None:
        """Keep the plans whose signature has the decided op and output as recorded
        (M3 [ a plan follows its structure ])."""
        self.plans = [p for p in self.plans if _agrees(p, ops[place[0]], place, var)]

    def __call__(self, var: Var, t: Tensor) -> Any:
        """Whether the pack hook keeps ``t`` (``var``'s tensor or a view of it): True, the
        offload callable, or False (a handle)."""
        record = self.record()
        root = var.root
        if record is None or isinstance(root, Input):
            if record is not None and not self.plans:
                where = storage_of(t)
                if where is not None:
                    # measuring: autograd keeps this input too (N2 [ a storage with two holders ])
                    self.views.add(where[0])
            return False
        ops = record.ops
        rec = ops[var.op]
        place = (var.op, record.out_index(var))
        if self.plans and not _agrees(self.plans[0], rec, place, var):
            self._check(ops, place, var)
        wrapped = type(t) is not Tensor and is_wrapper(t)
        if (type(t) is not Tensor and not wrapped) or root.size is None:
            self.saved[place] = None  # no storage we can see: never stored
            return False
        # Storages are told apart by their group's root, not by address: an address
        # is reused as soon as an earlier tensor of the block is freed. A DTensor (a
        # wrapper, or its local tensor: its group's root is the DTensor) holds its local
        # storage, not its global shape's bytes (the smaller of the two).
        group = (root.op, record.out_index(root))
        nbytes = int(root.size.numel()) * root.dtype.itemsize
        held = root()  # None: dead (its bytes as recorded)
        if wrapped or (held is not None and type(held) is not Tensor):
            nbytes = min(nbytes, sum(d.untyped_storage().nbytes() for d in data_tensors(t)))
        self.saved[place] = (group, nbytes)
        if self.plans:
            plan = self.plans[0]
            if place in plan.chosen:
                return True
            # (a bound method made per call: kept on self it would be a reference cycle);
            # a wrapper is not offloaded (the engine moves plain storages): replayed
            return self._offload if place in plan.offloaded and not wrapped else False
        watch = self.watch
        since = watch.now() if watch is not None else (0.0, 0.0)
        budget = self.budget()
        self.where[place] = (running_module_path(), source(user_line(sys._getframe(1))))
        where = storage_of(t)
        # measuring: is it kept anyway (K2 [ a candidate is one storage ])?
        if budget is not None and where is not None:
            budget.saw_storage(where[0], StorageWeakRef(t.untyped_storage()), self, group)
        if watch is not None and budget is not None:
            budget.measuring_ran(since, watch.now())  # not run by a planned step
        return False

    def _offload(self, entry: Any, t: Tensor) -> Any:
        """The offload callable (``_save.pack`` S4 [ a budget's choice is stored ]): the
        engine's packed tensor, or None."""
        budget = self.budget()
        engine = budget.engine if budget is not None else None
        if engine is None:
            return None
        var: Var = entry
        rec = var.frame.owner.record if var.frame.owner is not None else None
        place = (var.op, rec.out_index(var)) if rec is not None else (var.op, 0)
        return engine.pack(t, (self.site, self.occurrence, place))

    def close(self, aborted: bool) -> None:
        """The block closed: keep the plan that matches it whole, or measure it
        (M3 [ a plan follows its structure ])."""
        record = self.record()
        budget = self.budget()
        watch, self.watch = self.watch, None
        if record is None or budget is None or aborted:
            self.plans = []
            return
        key: Any = signature(record)[0]  # computed once: replay reads it too
        self.plans = [p for p in self.plans if p.keys == key]
        self.known = bool(self.plans)
        self.keys = key
        if self.known:  # planned: nothing to measure (the per-step cost stays small)
            self._apply(self.plans[0], record, budget)
            return
        state = self.state()
        if watch is not None and state is not None:
            watch.close()  # the forward ends; what follows is the measuring's own
            self.watch = state.timer = watch  # its unpacks time its backward
        self.inputs = input_storages(record)
        kept = kept_inputs(record)
        self.rng = frozenset(p for p in self.inputs if p not in kept)
        budget.kept_for_replay(self)
        budget.measured(self, record)

    def _apply(self, plan: Plan, record: BlockRecord, budget: BlockRun) -> None:
        """What the plan does when the block closes: note and offload kept inputs
        (N3 [ an input offloaded by its last block ]),
        drop the record of a block that keeps everything (N4 [ a budget above plain autograd ])."""
        if plan.hold:
            kept = list(kept_inputs(record).items())
            for j in sorted(plan.hold):
                if j < len(kept):
                    ptr, inputs = kept[j]
                    key = (self.site, self.occurrence, "input", j)
                    budget.hold(ptr, [i.tensor for i in inputs], key, j in plan.evict)
        if plan.whole and budget.region_open():
            state = self.state()
            if state is not None and state.release_all_kept():
                self.whole = True
