"""A steady run's record, bound from its block's template instead of recorded.

A block run in its steady state (``_adapters.steady``) runs its ops without the
recorder; its record is the template's (``_record.template``) with this run's own
objects put in (rule D4 [ a steady run's record is bound ] of ``_adapters.steady``): an Input
per outside tensor, a Var for each tensor that outlives the run (made when it is first saved or
when the graph returns, registered, and put in its op's outputs in the template Var's place, which
``BlockRecord.renamed`` notes), the random states the run's random ops drew, and the
signature. :class:`Binding` is that record, bound step by step as the run goes.
"""

from __future__ import annotations

from typing import Any

import torch

from .registry import _LIVE, note_alias, register
from .signature import Slots
from .template import Marker, Template
from .types import BlockRecord, Frame, Input, OpRecord, Var, new_var

__all__ = ["Binding", "input_of", "bound_op"]

Tensor = torch.Tensor


class Binding:
    """The record of one steady run of ``tpl``'s graph, bound as the run goes
    (D4 [ a steady run's record is bound ])."""

    __slots__ = ("tpl", "frame", "record", "refs", "of", "vars", "inputs")

    def __init__(self, tpl: Template, record: BlockRecord, frame: Frame, args: list[Any]) -> None:
        """Binds what is known before the run: its Inputs (graph arguments ``args``), the
        ops that read them, the signature with this run's slots; no Var registered yet."""
        self.tpl, self.frame, self.record = tpl, frame, record
        inputs: list[Any] = [input_of(args[k], _LIVE.get(id(args[k]))) if k >= 0 else None for k in tpl.args]
        ops = list(tpl.ops)
        for i in tpl.input_ops:
            ops[i] = bound_op(ops[i], inputs)
        refs, of = list(tpl.refs), dict(tpl.of)
        for inp, s in zip(inputs, tpl.input_slots):
            if inp is not None:
                refs[s] = inp
                of[id(inp)] = s
        record.ops.extend(ops)
        record.signature = (tpl.key, Slots(refs, of))
        # D4 [ a steady run's record is bound ]: the Vars of the tensors that outlive the run, as
        # they are made
        record.registered = []
        self.refs, self.of, self.inputs = refs, of, inputs
        self.vars: dict[int, Var] = {}  # id(template Var) -> this run's Var of a tensor that outlives it

    def own(self, tv: Var, t: Tensor) -> Var:
        """This run's Var of ``t``, the tensor template Var ``tv`` stands for, which
        outlives the run (an output): registered, its op rebuilt
        (D4 [ a steady run's record is bound ])."""
        var = self.vars.get(id(tv))
        if var is not None:
            return var
        root = tv.base
        if type(root) is Var and id(root) in self.tpl.output_ids:
            root = self.own(root, t._base if t._base is not None else t)
        # Its version: the template's where its group has recorded writes
        # (P2 [ a handle is its tensor as saved ] compares them), else the tensor's own -- a
        # custom op whose kernel fills its output in place bumps the output's counter when no
        # dispatch mode is on, not under one.
        var = new_var(t, tv.op, self.frame, root, tv.version if tv.root.writes else t._version)
        if tv.writes:
            var.writes = tv.writes
        register(var)
        record = self.record
        record.registered.append(var)  # type: ignore[union-attr]
        self.vars[id(tv)] = var
        s = self.of[id(tv)]
        self.refs[s] = var
        self.of[id(var)] = s
        ops = record.ops
        rec = ops[tv.op]
        record.renamed[id(tv)] = next(k for k, v in enumerate(rec.outs) if v is tv)
        ops[tv.op] = rec._replace(outs=tuple(var if v is tv else v for v in rec.outs))
        return var

    def captured(self, tensors: list[Tensor]) -> None:
        """T6 [ kept ops' outputs taken from the graph ]: the outside tensors the run made
        itself, taken from the graph's values (one per ``tpl.captured``), bound with the ops
        that read them."""
        tpl, inputs = self.tpl, self.inputs
        for k, t in zip(tpl.captured, tensors):
            inp = inputs[k] = Input(t)
            s = tpl.input_slots[k]
            marker = tpl.refs[s]
            # ``t`` is the graph's copy of one the block writes to (R1 [ a written input is copied ])
            if marker.snapshot:
                inp.snapshot, inp.writes = True, marker.writes
            self.refs[s] = inp
            self.of[id(inp)] = s
        ops = self.record.ops
        for i in tpl.late_ops:
            ops[i] = bound_op(ops[i], inputs)

    def outputs(self, out: Any) -> None:
        """The graph returned ``out``: a Var of its own for each output the template's
        block made (D4 [ a steady run's record is bound ])."""
        outs = out if isinstance(out, (tuple, list)) else (out,)
        for tv, o in zip(self.tpl.outputs, outs):
            if tv is not None and isinstance(o, Tensor):
                self.own(tv, o)

    def random_states(self, states: dict[int, dict[torch.Generator, Tensor]]) -> None:
        """T3 [ random states observed at saves ]: each random op's state, from the states the
        run observed (by observation)."""
        ops = self.record.ops
        for i, gen, at in self.tpl.rng_ops:
            ops[i] = ops[i]._replace(rng=(gen, states[at][gen]))


def input_of(t: Tensor, registered: Any) -> Input:
    """A run's Input for graph argument ``t`` (R5 [ another block's live tensor is noted ]:
    another block's live tensor is noted)."""
    inp = Input(t)
    if registered is not None and registered() is t and not inp.snapshot:
        note_alias(registered, inp.tensor)
    return inp


def bound_op(rec: OpRecord, inputs: list[Input]) -> OpRecord:
    """``rec`` with its markers replaced by this run's Inputs."""
    args = rec.args.copy()
    for i, a in enumerate(args):  # most markers are positional arguments themselves
        t = type(a)
        if t is Marker:
            args[i] = inputs[a.k]
        elif t is list:
            args[i] = _bind(a, inputs)
    kwargs = {k: _bind(a, inputs) for k, a in rec.kwargs.items()} if rec.kwargs else rec.kwargs
    return tuple.__new__(OpRecord, (rec.func, args, kwargs, rec.rng, rec.outs))  # OpRecord(...), in C


def _bind(a: Any, inputs: list[Input]) -> Any:
    # A module-level function, not a closure: a recursive closure is a reference cycle
    # that would keep the run's Inputs (its activations) alive until a collection.
    if type(a) is Marker:
        return inputs[a.k]
    if type(a) is list:
        return [_bind(x, inputs) for x in a]
    return a
