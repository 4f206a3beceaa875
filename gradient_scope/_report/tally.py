"""The tally of a :func:`saved_tensors_report`: saves per row, bytes per storage.

Each storage is counted once: an entry per storage (keyed by its StorageImpl,
with a weak reference so that a new storage at a recycled address is a new
entry), charged to the first row that stored it, else to the first that saved
it as a recompute handle. An entry notes, from the first save of the storage,
whether it was made during the report's block (an activation) or existed before
it (a parameter, an input), and the shape, dtype and source line of that save.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from .._base.lines import source
from .where import Location, storage_of

__all__ = ["SavedTensorsRow", "Tally", "RowKey", "group_rows", "GROUPINGS"]

#: (module path, op, module class)
RowKey = tuple[str, str, str]
_ALL = "(all)"


@dataclass(frozen=True)
class SavedTensorsRow:
    """One line of a :class:`SavedTensorsReport`: the saves of one (module, op).

    ``stored_bytes`` is ``activation_bytes + param_bytes``. The ``largest_*``
    fields describe the largest storage charged to the row, as its first save
    saw it: ``shape`` and ``dtype``, and ``source``, the line of user code
    (``model.py:57``) that ran the op that made the tensor ("" for a tensor
    that existed before the block, or where no line outside torch was found).

    Example::

        >>> import torch
        >>> from gradient_scope import saved_tensors_report
        >>> fc = torch.nn.Linear(4, 4)
        >>> x = torch.randn(2, 4, requires_grad=True)
        >>> with saved_tensors_report() as report:
        ...     y = fc(x).relu()
        >>> [(row.module, row.op, row.count, row.activation_bytes, row.param_bytes) for row in report.rows]
        [('(no module)', 'relu', 1, 32, 0), ('(Linear)', 'linear', 2, 0, 96)]
        >>> row = report.rows[0]
        >>> row.largest_shape, row.largest_dtype, row.largest_source.startswith("<doctest")
        ((2, 4), torch.float32, True)
    """

    #: path of the module whose forward was running (relative to the report's
    #: ``model``, else to the outermost running module, which itself is its class
    #: name in parentheses, ``"(GPT2LMHeadModel)"``); ``"(no module)"`` outside
    #: any module forward
    module: str
    #: the torch function that was executing (see :func:`saved_tensors_report`)
    op: str
    #: tensors saved (each save counts, also repeated saves of one tensor)
    count: int
    #: bytes of the distinct storages autograd keeps, charged to this row
    stored_bytes: int
    #: bytes of the distinct storages that scopes replaced by recompute handles
    recomputable_bytes: int
    #: the part of ``stored_bytes`` made during the report's block
    activation_bytes: int = 0
    #: the part of ``stored_bytes`` that existed before it (parameters, inputs)
    param_bytes: int = 0
    #: class name of the module (``"(no module)"`` outside any module forward)
    module_class: str = ""
    #: bytes of the largest storage charged to this row
    largest_bytes: int = 0
    largest_shape: tuple[int, ...] | None = None
    largest_dtype: torch.dtype | None = None
    largest_source: str = ""
    #: bytes of the distinct storages a memory budget offloaded to host memory
    offloaded_bytes: int = 0


class _Storage:
    __slots__ = (
        "nbytes",
        "recomputable_row",
        "ref",
        "stored_row",
        "activation",
        "shape",
        "dtype",
        "where",
        "serial",
        "offloaded_row",
    )

    def __init__(
        self, ref: Any, nbytes: int, t: torch.Tensor, activation: bool, where: Location | None, serial: int
    ) -> None:
        self.ref = ref  # StorageWeakRef, or a weakref to the tensor (no storage)
        self.nbytes = nbytes
        self.stored_row: RowKey | None = None
        self.recomputable_row: RowKey | None = None
        self.offloaded_row: RowKey | None = None
        self.activation = activation
        self.shape = tuple(t.shape)
        self.dtype = t.dtype
        self.where = where
        self.serial = serial  # order of first saves: ties go to the first saved (run to run)


def _expired(ref: Any) -> bool:
    return ref.expired() if isinstance(ref, StorageWeakRef) else ref() is None


def _rank(s: _Storage) -> tuple[bool, int, int]:
    return s.stored_row is None or s.activation, s.nbytes, -s.serial


def _source(where: Location | None) -> str:
    return source(where)


class Tally:
    """Saves counted per row, and bytes per storage (once each)."""

    __slots__ = ("rows", "storages", "retired")

    def __init__(self) -> None:
        self.rows: dict[RowKey, int] = {}  # key -> saves
        self.storages: dict[int, _Storage] = {}
        self.retired: list[_Storage] = []  # entries whose storage died and whose key was reused

    def add(
        self,
        key: RowKey,
        t: torch.Tensor,
        recomputable: bool,
        activation: Callable[[torch.Tensor, int], bool],
        where: Callable[[torch.Tensor, int], Location | None],
        offloaded: bool = False,
    ) -> None:
        """Count one save of ``t`` (``recomputable``: as a handle; ``offloaded``: moved to
        host memory); ``activation`` and ``where`` are asked only for the first save of a
        storage."""
        self.rows[key] = self.rows.get(key, 0) + 1
        skey, ref, nbytes = storage_of(t)
        entry = self.storages.get(skey)
        if entry is not None and _expired(entry.ref):
            self.retired.append(entry)
            entry = None
        if entry is None:
            made = activation(t, skey)
            where_made = where(t, skey) if made else None
            serial = len(self.storages) + len(self.retired)
            entry = self.storages[skey] = _Storage(ref, nbytes, t, made, where_made, serial)
        if offloaded:
            if entry.offloaded_row is None:
                entry.offloaded_row = key
        elif recomputable:
            if entry.recomputable_row is None:
                entry.recomputable_row = key
        elif entry.stored_row is None:
            entry.stored_row = key

    def stored_keys(self) -> set[int]:
        """Keys of the live storages autograd stores."""
        return {k for k, s in self.storages.items() if s.stored_row is not None and not _expired(s.ref)}

    def rows_list(self) -> list[SavedTensorsRow]:
        """One row per key, largest first (activations and handles, then parameters)."""
        acc: dict[RowKey, list[Any]] = {key: [0, 0, 0, None, 0] for key in self.rows}
        for s in (*self.retired, *self.storages.values()):
            key: RowKey | None
            if s.stored_row is not None:
                key, column = s.stored_row, (1 if s.activation else 2)
            elif s.offloaded_row is not None:
                key, column = s.offloaded_row, 4  # on the host: neither kept nor recomputed
            else:
                key, column = s.recomputable_row, 0
            if key is None:
                continue
            a = acc[key]
            a[column] += s.nbytes
            if a[3] is None or _rank(s) > _rank(a[3]):
                a[3] = s  # the largest, an activation or a handle before a parameter
        rows = []
        for (module, op, cls), (rec, act, par, big, off) in acc.items():
            count = self.rows[(module, op, cls)]
            row = SavedTensorsRow(module, op, count, act + par, rec, act, par, cls, offloaded_bytes=off)
            if big is not None:
                row = replace(row, largest_bytes=big.nbytes, largest_shape=big.shape, largest_dtype=big.dtype,
                              largest_source=_source(big.where))  # fmt: skip
            rows.append(row)
        return sort_rows(rows)


def sort_rows(rows: Iterable[SavedTensorsRow]) -> list[SavedTensorsRow]:
    return sorted(
        rows,
        key=lambda r: (
            -(r.activation_bytes + r.recomputable_bytes + r.offloaded_bytes),
            -r.param_bytes,
            -r.count,
            r.module,
            r.op,
        ),
    )


_INDEX = re.compile(r"^(.*?\.\d+)(?:\.|$)")


def _layer(row: SavedTensorsRow) -> str:
    """The path up to its first numeric part (``model.layers.3``), else the path."""
    m = _INDEX.match(row.module)
    return m.group(1) if m else row.module


#: ``by=`` -> (module column of the grouped row, op column of the grouped row)
GROUPINGS: dict[str | None, Callable[[SavedTensorsRow], tuple[str, str]]] = {
    None: lambda r: (r.module, r.op),
    "op": lambda r: (_ALL, r.op),
    "module": lambda r: (r.module, _ALL),
    "layer": lambda r: (_layer(r), _ALL),
    "class": lambda r: (r.module_class, _ALL),
}


def group_rows(rows: Iterable[SavedTensorsRow], by: str | None) -> list[SavedTensorsRow]:
    """``rows`` summed by the grouping ``by`` (see :data:`GROUPINGS`)."""
    keyfn = GROUPINGS.get(by)
    if keyfn is None:
        raise ValueError(
            f"saved_tensors_report: by must be one of 'op', 'module', 'layer', 'class' or None, got {by!r}"
        )
    if by is None:
        return list(rows)
    groups: dict[tuple[str, str], SavedTensorsRow] = {}
    for r in rows:
        module, op = keyfn(r)
        g = groups.get((module, op))
        if g is None:
            groups[(module, op)] = replace(r, module=module, op=op, module_class="" if by != "class" else module)
            continue
        big = r if r.largest_bytes > g.largest_bytes else g
        groups[(module, op)] = replace(
            big,
            module=module,
            op=op,
            module_class=g.module_class,
            count=g.count + r.count,
            stored_bytes=g.stored_bytes + r.stored_bytes,
            recomputable_bytes=g.recomputable_bytes + r.recomputable_bytes,
            activation_bytes=g.activation_bytes + r.activation_bytes,
            param_bytes=g.param_bytes + r.param_bytes,
            offloaded_bytes=g.offloaded_bytes + r.offloaded_bytes,
        )
    return sort_rows(groups.values())


def held_outside(records: Iterable[Any], input_type: type, stored: set[int], new: Callable[[Any, int], bool]) -> int:
    """Bytes of the distinct live storages that ``records`` (block records) keep and
    that are not in ``stored``: the Inputs for which ``new(input, key)`` says the
    scope's hold is what keeps them (not parameters, not tensors alive anyway), and
    the generator states of their random ops."""
    seen: set[int] = set()
    total = 0

    def count(t: torch.Tensor, inp: Any) -> None:
        nonlocal total
        key, _, nbytes = storage_of(t)
        if key not in stored and key not in seen and (inp is None or new(inp, key)):
            seen.add(key)
            total += nbytes

    for record in records:
        for rec in record.ops:
            for arg in (*rec.args, *rec.kwargs.values()):
                for a in arg if isinstance(arg, (list, tuple)) else (arg,):
                    if isinstance(a, input_type):
                        count(a.tensor, a)  # type: ignore[attr-defined]
            if rec.rng is not None:
                count(rec.rng[1], None)  # (generator, state): captured by the scope
    return total
