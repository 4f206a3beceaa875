"""The saves of a steady-state block's runs: logged in its template's first run, sequenced after.

A block run in its steady state (``_adapters.steady``) has no recorder to ask what a
save is: its saves go to the thread's sequencer instead (``_save.pack``
S5 [ a steady run's saves go to its sequencer ]). The first run of a graph is recorded, and
:class:`Logger` classifies each of its saves as it happens, with the classifier of a recorded
save (:func:`classify`, built on ``_save.pack.find`` and ``replayable``:
T2 [ saves are classified as they happen ] of ``_record.template``). A later run's
:class:`Sequencer` takes its n-th save to be the template's n-th, checks it
(D3 [ saves checked against the template ] of ``_adapters.steady``), and decides S1..S4 for it
from the template, binding the run's own Vars as they are needed (``_record.bind``).
"""

from __future__ import annotations

from typing import Any

import torch

from .._base.errors import RecomputeError
from .._base.torch_compat import HookPair
from .._record import recorder as _recorder
from .._record.bind import Binding
from .._record.template import BLOCK, KEEP, OTHER, Log, Save, Template
from .._record.types import Frame, Input, Var
from .pack import find, may_be_new_output, new_handle, pack_as_usual, replayable, store_as_usual, store_chosen

__all__ = ["Logger", "Sequencer", "classify"]

Tensor = torch.Tensor


def classify(t: Tensor, owner: Any) -> tuple[Save, Var | None]:
    """T2 [ saves are classified as they happen ] for ``t``, saved in a recorded run whose
    block's replay state is ``owner``: its kind (a handle or a budget's choice, stored whatever
    the plan, or not the block's) as the pack hook decides it (``_save.pack.replayable``), with
    its Var."""
    e, view, _ = find(t)
    if e is None or e.frame.owner is not owner:
        return Save(OTHER, None, None, False, -1, t.shape, t.dtype), None
    var: Var = e  # type: ignore[assignment]
    if type(var.root) is Input:  # a view of an outside tensor: its counter is not the block's
        return Save(KEEP, var, view, False, -1, t.shape, t.dtype), var
    kind = BLOCK if replayable(e, t, view) is not None else KEEP
    itself = view is None and not may_be_new_output(t)
    return Save(kind, var, view, itself, t._version, t.shape, t.dtype), var


class Logger:
    """The sequencer of a template's first run: every save as usual, and logged
    (T2 [ saves are classified as they happen ])."""

    __slots__ = ("block", "log")

    def __init__(self, block: Any, log: Log) -> None:
        self.block, self.log = block, log

    def pack(self, below: HookPair | None, serial: int, t: Tensor) -> Any:
        _recorder.settle()  # R6 [ versions are read after the op ]: versions of the last op's writes
        log = self.log
        log.seen.append(len(self.block.record.ops))
        save, var = classify(t, self.block.owner)
        out = pack_as_usual(below, serial, t)
        log.saves.append((save, var))
        log.states.append({g: g.get_state() for g in log.start})
        return out


class Sequencer:
    """The saves of one steady run (S5 [ a steady run's saves go to its sequencer ],
    D3 [ saves checked against the template ], D4 [ a steady run's record is bound ]): the n-th
    is the template's n-th."""

    __slots__ = ("tpl", "frame", "state", "bound", "n", "states", "diverged")

    def __init__(self, tpl: Template, frame: Frame, state: Any, bound: Binding) -> None:
        self.tpl, self.frame, self.state, self.bound = tpl, frame, state, bound
        state.stats, state.site = frame.stats, frame.site  # the replay state reports for this run
        self.n = 0  # saves so far
        self.states: dict[int, dict[torch.Generator, Tensor]] = {}  # observation -> generator states
        self.states[0] = {g: g.get_state() for g in tpl.at_start}
        self.diverged = False

    def pack(self, below: HookPair | None, serial: int, t: Tensor) -> Any:
        n = self.n
        self.n = n + 1
        saves = self.tpl.saves
        if n >= len(saves):
            self._diverged(f"save {n + 1} of a run whose template saves {len(saves)} tensors")
        p = saves[n]
        if t.shape != p.shape or t.dtype != p.dtype:
            self._diverged(
                f"save {n + 1} is a tensor of shape {list(t.shape)} ({t.dtype}), the template's a "
                f"{list(p.shape)} ({p.dtype})"
            )
        kind, frame = p.kind, self.frame
        if kind == BLOCK:  # most saves: one frame less per save than a helper would cost
            var: Var = p.var  # type: ignore[assignment]
            version = p.version  # in the template's count, as its writes are (P2 [ a handle is its tensor as saved ])
            if id(var) in self.tpl.output_ids:
                var = self.bound.own(var, t if p.view is None or t._base is None else t._base)
                # D4 [ a steady run's record is bound ]: an output's own count
                # (``_record.bind.Binding.own``)
                if not var.root.writes:
                    version = t._version
            decision = frame.store(var, t) if frame.store is not None else False
            if decision:  # S4 [ a budget's choice is stored ]: kept or offloaded, as a recorded block's
                out = store_chosen(decision, self.state, var, t, p.view, below, version)
            else:  # S1 [ block tensors become handles ]
                out = new_handle(self.state, frame.stats, var, t, version, p.view, None, p.itself)
        elif kind == OTHER:
            out = pack_as_usual(below, serial, t)
        else:  # KEEP
            if frame.store is not None and p.var is not None:
                # asked for every save, as in a recorded run (M3 [ a plan follows its structure ]):
                # it measures
                frame.store(p.var, t)
            out = store_as_usual(below, t, True)
        gens = self.tpl.observe.get(n + 1)
        if gens:
            self.states[n + 1] = {g: g.get_state() for g in gens}
        return out

    def finish(self, out: Any, captured: list[Tensor]) -> None:
        """After the graph returned ``out``: the outside tensors the block made itself
        (T6 [ kept ops' outputs taken from the graph ], ``captured``), every save seen, outputs
        and random states bound (D4 [ a steady run's record is bound ])."""
        tpl, bound = self.tpl, self.bound
        if tpl.capture:
            bound.captured(captured)
        if self.n != len(tpl.saves):
            self._diverged(f"the run saved {self.n} tensors, its template {len(tpl.saves)}")
        bound.outputs(out)
        bound.random_states(self.states)
        if tpl.ops_saved:  # the ops save= kept ran in the graph, unseen by the recorder
            self.frame.stats.ops_saved += tpl.ops_saved
            self.frame.kept_any = True

    def _diverged(self, what: str) -> None:
        self.diverged = True
        raise RecomputeError(
            "gradient_scope: a block run in its steady state (captured by dynamo, bound from the "
            f"record of its first run) did not save what that run saved: {what}. Its guards passed, "
            "so this is a bug in gradient_scope: please report it. Workaround: set the environment "
            "variable GRADIENT_SCOPE_FAST=0 (every block is then recorded)."
        )
