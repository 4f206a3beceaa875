"""One forward of a model under a model-level budget: the observer of what the code
outside the scopes saves (``_save.pack`` S6 [ a region's saves go to its observer ]), and its
offloads.

A region is opened by a forward pre-hook of the module the budget was given with
(``apply_recompute(model, budget=)``), and closed by a forward hook that runs also when
the forward raises. It counts each tensor saved in it that is not a block tensor, a
parameter, a buffer, an input of the forward or older than the forward, once per
storage (N1 [ the bytes a budget bounds ] in ``_budget.step``); a save its plan offloads goes to
the budget's engine.
"""

from __future__ import annotations

import weakref
from collections.abc import Hashable
from typing import Any, NamedTuple, Protocol

import torch

from .._base.torch_compat import node_sequence_nr, sequence_nr
from .._record import recorder as _recorder
from .measure import storage_of
from .offload import Offloader
from .step import SaveSeen

__all__ = ["Region", "RegionPlan", "RegionRun", "tensors_in"]

Tensor = torch.Tensor


class RegionPlan(NamedTuple):
    """What a region of one structure offloads: the shapes and dtypes of its saves, in
    order (its structure), and the ordinals of those offloaded."""

    keys: tuple[Hashable, ...]
    offloaded: frozenset[int]


class RegionRun(Protocol):
    """What a region asks of its budget at run time (``_budget.run.Run`` offers it; the
    run knows its regions, a region knows only this)."""

    @property
    def engine(self) -> Offloader | None:
        """The offload engine (None: no offload)."""

    def position(self) -> int:
        """Where a save outside the scopes falls among the step's blocks
        (N5 [ predicted seconds and peak ])."""


def tensors_in(values: Any) -> list[Tensor]:
    """The tensors in nested tuples, lists and dicts (a ``ModelOutput`` is a dict). Not
    ``torch.utils._pytree``: its flatten leaves a reference cycle per call."""
    out: list[Tensor] = []
    stack = [values]
    while stack:
        v = stack.pop()
        if isinstance(v, Tensor):
            out.append(v)
        elif isinstance(v, (tuple, list)):
            stack.extend(v)
        elif isinstance(v, dict):
            stack.extend(v.values())
    return out


def _storages(values: Any) -> set[int]:
    out = set()
    for v in tensors_in(values):
        where = storage_of(v)
        if where is not None:
            out.add(where[0])
    return out


class Region:
    """The observer of one forward (S6 [ a region's saves go to its observer ]): it counts, and
    offloads what its plan says."""

    __slots__ = ("budget", "occurrence", "seq0", "exclude", "saves", "keys", "plans", "params", "__weakref__")

    def __init__(self, budget: RegionRun, occurrence: int, module: torch.nn.Module, inputs: Any,
                 plans: list[RegionPlan]) -> None:  # fmt: skip
        self.budget = weakref.ref(budget)
        self.occurrence = occurrence
        self.seq0 = sequence_nr()  # autograd nodes numbered from here are the forward's
        self.exclude = _storages(inputs) | _storages(list(module.buffers()))
        self.saves: list[SaveSeen] = []
        self.keys: list[Hashable] = []
        # the plans of this occurrence whose structure agrees with the saves so far
        # (M3 [ a plan follows its structure ])
        self.plans = plans
        self.params: dict[int, tuple[int, int]] = {}  # parameters saved here: storage -> (position, bytes)

    def __call__(self, t: Tensor, may_take: bool) -> Any:
        """``t`` is saved outside the scopes (S6 [ a region's saves go to its observer ]): count
        it; its offload, or None."""
        if type(t) is not Tensor:
            return None
        base = t._base if t._base is not None else t
        if isinstance(base, torch.nn.Parameter) or (base.is_leaf and base.requires_grad):
            budget = self.budget()
            where = storage_of(base)
            outside = _recorder.innermost() is None  # a block's own are counted with it
            if budget is not None and where is not None and outside and where[0] not in self.params:
                # its gradient comes (N5 [ predicted seconds and peak ])
                self.params[where[0]] = (budget.position(), where[1])
            return None  # a parameter, or another leaf: alive anyway
        g = t.grad_fn
        if g is not None and node_sequence_nr(g) < self.seq0:
            return None  # made before the forward
        where = storage_of(t)
        if where is None or where[0] in self.exclude:
            return None
        budget = self.budget()
        if budget is None:
            return None
        n = len(self.saves)
        key = (tuple(t.shape), t.dtype, where[1])
        self.keys.append(key)
        name = type(g).__name__ if g is not None else "(no node)"
        self.saves.append(SaveSeen(where[0], where[1], budget.position(), name, self.occurrence, n))
        plans = self.plans
        if plans and (n >= len(plans[0].keys) or plans[0].keys[n] != key):
            plans = self.plans = [p for p in plans if n < len(p.keys) and p.keys[n] == key]
        engine = budget.engine
        if not may_take or not plans or n not in plans[0].offloaded or engine is None:
            return None  # (no plan of this structure: kept, M3 [ a plan follows its structure ])
        return engine.pack(t, ("region", self.occurrence, n))

    def matches(self) -> bool:
        """Whether what was saved has the structure of the plan it followed."""
        return bool(self.plans) and self.plans[0].keys == tuple(self.keys)
