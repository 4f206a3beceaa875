"""What a memory budget reads from a block's record (for ``_budget.budget``).

* :func:`measure` -- the block as the planner's graph (``_budget.planner.BlockGraph``, without
  its saved values, which the pack hook reports): each op's cost and the values it reads.
* :func:`input_storages` -- what the record keeps for replay: the outside tensors it
  read and the generator states of its random ops; :func:`kept_inputs` -- the outside
  tensors among them, with the record's aliases of each (what offloading one moves).

Cost model (seconds): each op has its work -- the FLOPs of a formula registered in
``torch.utils.flop_counter`` (matmuls, convolutions, attention kernels; 0 for the rest)
and the bytes it reads and writes (0 for a view) -- and its replay takes the slower of
FLOPs and bytes at the device's measured rates, plus one op's overhead
(``_budget.rates.seconds``) and replay's bookkeeping (``Rates.replay``). A matmul does
hundreds of FLOPs per byte it moves, so at a device's rates its output spares more time
per byte than an elementwise op's.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.flop_counter import flop_registry

from .._base.subclass import data_tensors
from .._record.types import BlockRecord, Input, MetaArg, OpRecord, Var
from .._record.wrappers import INNER, is_collective
from .._restore.replay import op_refs
from .rates import Rates, comm_rates, comm_seconds, seconds

__all__ = [
    "value_index",
    "measure",
    "costs",
    "op_work",
    "local_bytes",
    "Measured",
    "input_storages",
    "kept_inputs",
    "storage_of",
]

Tensor = torch.Tensor


def value_index(record: BlockRecord) -> dict[Var, int]:
    """Each Var of the record, numbered in op order (the planner's value ids)."""
    return {v: n for n, v in enumerate(record.vars())}


def _number(index: dict[Var, int], record: BlockRecord, var: Var) -> int:
    """``var``'s number in ``index``; a template Var that a steady run's own Var replaced in
    its op's outputs (``BlockRecord.renamed``, D4 [ a steady run's record is bound ]) has that
    Var's: later ops of a bound record still name the template's."""
    n = index.get(var)
    if n is None:
        n = index[record.ops[var.op].outs[record.renamed[id(var)]]]  # type: ignore[index]
    return n


class Measured:
    """What :func:`measure` reads from a closed record (plain data)."""

    __slots__ = (
        "flops",
        "moved",
        "reads",
        "producers",
        "cuttable",
        "needs",
        "names",
        "places",
        "device",
        "params",
        "out",
        "groups",
        "comm",
    )

    def __init__(self) -> None:
        self.flops: list[float] = []  # per op
        self.moved: list[float] = []  # per op: bytes read and written
        self.device = torch.device("cpu")  # of the block's first output
        self.params = 0  # bytes of the parameters it reads that require grad: their gradients come
        self.out = 0  # bytes of its last op's first output (its output, usually)
        self.reads: list[tuple[int, ...]] = []
        self.names: list[str] = []  # per op
        self.producers: list[int] = []  # per value
        self.cuttable: list[bool] = []
        self.needs: list[tuple[int, ...]] = []
        self.places: list[tuple[int, int]] = []  # per value: (op, output index)
        # per op: the process group a collective runs on (None: not a collective), and
        # the local bytes of its larger side (what its time is priced by)
        self.groups: list[str | None] = []
        self.comm: list[int] = []


def measure(record: BlockRecord) -> Measured:
    """The work and reads of every op of a closed ``record``."""
    index = value_index(record)
    m = Measured()
    device = None
    local = local_bytes(record)
    for i, rec in enumerate(record.ops):
        flops, moved = op_work(rec, local)
        m.flops.append(flops)
        m.moved.append(moved)
        if device is None:
            device = next((v.device for v in rec.outs if v is not None), None)
        m.reads.append(tuple(_number(index, record, r) for r in op_refs(rec) if type(r) is Var))
        m.names.append(str(rec.func))
        group = _group(rec) if is_collective(rec.func) else None
        m.groups.append(group)
        m.comm.append(_comm_bytes(rec) if group is not None else 0)
        for k, v in enumerate(rec.outs):
            if v is not None:
                writes = v.root.writes
                m.producers.append(i)
                m.cuttable.append(not writes)
                m.needs.append(tuple(j for j, _ in writes))
                m.places.append((i, k))
    if device is not None:
        m.device = device
    m.params = _param_bytes(record)
    last = next((v for v in record.ops[-1].outs if v is not None), None) if record.ops else None
    m.out = _nbytes(last, local) if last is not None else 0
    return m


def local_bytes(record: BlockRecord) -> dict[int, int]:
    """The wrapper Vars of ``record`` (DTensors: their ``size`` is the global shape) by
    ``id``, each to the bytes of its local tensors (the ``INNER`` Vars recorded after it):
    what a kept DTensor holds on this rank."""
    out: dict[int, int] = {}
    for rec in record.ops:
        if rec.func is INNER and type(rec.args[0]) is Var:
            out[id(rec.args[0])] = out.get(id(rec.args[0]), 0) + _nbytes(rec.outs[0])
    return out


def _param_bytes(record: BlockRecord) -> int:
    seen: dict[int, int] = {}
    for rec in record.ops:
        for r in op_refs(rec):
            if type(r) is Input and not r.snapshot:
                src = r.source()
                if isinstance(src, torch.nn.Parameter) and src.requires_grad:
                    where = storage_of(r.tensor)
                    if where is not None:
                        seen[where[0]] = where[1]
    return sum(seen.values())


def costs(m: Measured, rates: Rates) -> tuple[float, ...]:
    """Each op's replay time in seconds at ``rates``: its kernel and replay's bookkeeping.
    A collective on a process group whose rates are measured (``rates.comm_rates``) is
    priced by them and its local bytes; before that, as any op moving its bytes."""
    out = []
    for f, b, group, n in zip(m.flops, m.moved, m.groups, m.comm):
        comm = comm_rates(group) if group is not None else None
        out.append((comm_seconds(n, comm) if comm is not None else seconds(f, b, rates)) + rates.replay)
    return tuple(out)


def _group(rec: OpRecord) -> str | None:
    """The process group name a functional collective's arguments carry (its last string
    argument: ``all_gather_into_tensor(input, group_size, group_name)``), or None."""
    for a in reversed((*rec.args, *rec.kwargs.values())):
        if isinstance(a, str):
            return a
    return None


def _comm_bytes(rec: OpRecord) -> int:
    """A collective's local bytes: its larger side on this rank (an all-gather's output,
    a reduce-scatter's input)."""
    sides = [_nbytes(a) for a in (*rec.args, *rec.kwargs.values())] + [_nbytes(v) for v in rec.outs if v is not None]
    return max(sides, default=0)


def _nbytes(a: Any, local: dict[int, int] | None = None) -> int:
    """The bytes of a record's value on this rank: a wrapper's (a DTensor's) by its local
    tensors (``local``: :func:`local_bytes`), not its global shape."""
    if type(a) is Var:
        if local and id(a) in local:
            return local[id(a)]
        if a.size is None:
            return 0
        return int(a.size.numel()) * a.dtype.itemsize
    if type(a) is Input:
        return sum(d.numel() * d.element_size() for d in data_tensors(a.tensor))
    return 0


def _shape(a: Any) -> Any:
    if type(a) is Var or type(a) is MetaArg:
        return a.size
    if type(a) is Input:
        return a.tensor.shape
    if type(a) is list:
        return [_shape(x) for x in a]
    return a


def op_work(rec: OpRecord, local: dict[int, int] | None = None) -> tuple[float, float]:
    """``(FLOPs, bytes moved)`` of one recorded op (see the module docstring); DTensors'
    bytes by their local tensors (``local``: :func:`local_bytes`)."""
    func, args, kwargs, outs = rec.func, rec.args, rec.kwargs, rec.outs
    flops = 0.0
    formula = flop_registry.get(getattr(func, "overloadpacket", None))
    if formula is not None:
        out_shapes = tuple(None if v is None else v.size for v in outs)
        try:
            flops = float(
                formula(
                    *[_shape(a) for a in args],
                    out_val=out_shapes[0] if len(out_shapes) == 1 else out_shapes,
                    **{k: _shape(a) for k, a in kwargs.items()},
                )
            )
        except Exception:  # noqa: BLE001  (a formula that cannot read this call: bytes only)
            flops = 0.0
    if getattr(func, "is_view", False):
        return flops, 0.0
    moved = sum(_nbytes(a, local) for a in (*args, *kwargs.values()))
    moved += sum(_nbytes(x, local) for a in args if type(a) is list for x in a)
    moved += sum(_nbytes(v, local) for v in outs if v is not None)
    return flops, float(moved)


def storage_of(t: Tensor) -> tuple[int, int] | None:
    """``(address, bytes)`` of ``t``'s storage; None where it has none we can see."""
    if type(t) is not Tensor and type(t) is not torch.nn.Parameter:
        return None
    try:
        s = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    n = s.nbytes()
    return (s.data_ptr(), n) if n else None


def _alive_anyway(r: Input) -> bool:
    """A parameter, or another leaf that requires grad: alive whatever the block keeps."""
    src = r.source()
    if r.snapshot or src is None:
        return False
    return isinstance(src, torch.nn.Parameter) or (src.is_leaf and src.requires_grad)


def input_storages(record: BlockRecord) -> dict[int, int]:
    """The storages (address -> bytes) of the outside tensors ``record`` keeps for
    replay, leaving out parameters and leaves that require grad (alive anyway), and of
    the generator states of its random ops (host memory: counted for a block on the CPU
    only)."""
    out: dict[int, int] = {}
    seen: set[int] = set()
    device = None
    for rec in record.ops:
        if device is None:
            device = next((v.device for v in rec.outs if v is not None), None)
        if rec.rng is not None and (device is None or device.type == "cpu"):
            where = storage_of(rec.rng[1])  # a random op's generator state, kept for its replay
            if where is not None:
                out[where[0]] = where[1]
        for _, (ptr, nbytes) in _kept_by(rec, seen):
            out[ptr] = nbytes
    return out


def kept_inputs(record: BlockRecord) -> dict[int, list[Input]]:
    """The outside tensors ``record`` keeps for replay (not the generator states), by
    storage address, with every Input of each: the order of :func:`input_storages`."""
    out: dict[int, list[Input]] = {}
    seen: set[int] = set()
    for rec in record.ops:
        for r, (ptr, _) in _kept_by(rec, seen):
            out.setdefault(ptr, []).append(r)
    return out


def _kept_by(rec: OpRecord, seen: set[int]) -> Iterator[tuple[Input, tuple[int, int]]]:
    """The outside tensors op ``rec`` reads that its record keeps for replay (not alive
    anyway) and that are not in ``seen`` (ids; added to it), with their storage's address
    and bytes."""
    for r in op_refs(rec):
        if type(r) is not Input or id(r) in seen:
            continue
        seen.add(id(r))
        if _alive_anyway(r):
            continue
        where = storage_of(r.tensor)
        if where is not None:
            yield r, where
