"""The "ideal" memory held after forward for a placement of recompute blocks.

What a perfect implementation of ``recompute_scope`` would hold after forward, for the
same blocks in the same model:

    ideal = plain_held - removed + retained

computed from one *plain* forward (no gradient_scope involved) instrumented with

* a ``saved_tensors_hooks`` pair over the whole forward that records the storage of every
  tensor autograd saves (the storages ``plain_held`` consists of, besides the loss);
* a do-nothing ``TorchDispatchMode`` entered exactly where the strategy enters its
  scopes (around the forward of the modules it selects), that records which storages
  the block's ops create (outputs whose storage is new; views and in-place results of
  other storages are not new), and which storages from outside the block its ops read.
  With a ``save=`` policy, the outputs of the ops it selects are stored, not recomputed:
  they count as outside tensors, as in the scope.

and

* ``removed``: bytes of the distinct storages that a block created, that autograd saved,
  and that no *other* block reads (a tensor that a later block reads is that block's
  input: the scope keeps its inputs alive, exactly as ``torch.utils.checkpoint`` keeps
  the inputs of its function);
* ``retained``: bytes of the distinct storages created during forward (not parameters,
  buffers or the batch) that a block reads from outside and that plain autograd does not
  save: the price of replaying the block (e.g. the whole ``qkv`` output when a block
  reads the views ``q`` and ``k`` of it, where plain autograd only keeps copies).

Storages, not tensors, are counted, so a tensor saved by several ops, or saved through
several views, counts once. That is why this is used as the ideal rather than
``plain_held - sum(scope.stats.bytes_packed)``: ``bytes_packed`` counts every saved
instance separately (``x`` saved by two ops counts twice, each view of ``x`` counts its own
``numel``), includes block tensors that stay alive as the input of the next block, and does
not see the inputs a block keeps alive. ``benchmarks.run`` reports both.

All block outputs are kept alive (strong references) until the analysis ends, so that no
storage address is reused during the analysed forward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["BlockAccounting", "storage_key"]


def storage_key(t: torch.Tensor) -> tuple[int, int] | None:
    s = t.untyped_storage()
    n = s.nbytes()
    if n == 0:
        return None
    return s.data_ptr(), n


class _Marker(TorchDispatchMode):
    def __init__(self, acct: BlockAccounting, block: int) -> None:
        super().__init__()
        self.acct = acct
        self.block = block

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not torch.is_grad_enabled():
            return out
        acct = self.acct
        if acct.policy is not None and acct.policy(func):
            acct.keep.append(out)  # stored op: its outputs are outside tensors
            return out
        inputs = set()
        for a in pytree.tree_leaves((args, kwargs)):
            if isinstance(a, torch.Tensor):
                k = storage_key(a)
                if k is None:
                    continue
                inputs.add(k)
                owner = acct.created.get(k)
                if owner != self.block:
                    acct.reads.setdefault(k, set()).add(self.block)
        for o in pytree.tree_leaves(out):
            if isinstance(o, torch.Tensor):
                k = storage_key(o)
                if k is not None and k not in inputs and k not in acct.created:
                    acct.created[k] = self.block
        acct.keep.append(out)
        return out


@dataclass
class BlockAccounting:
    """Collects storages created in / read by blocks and saved by autograd."""

    policy: Callable[[Any], bool] | None = None
    created: dict[tuple[int, int], int] = field(default_factory=dict)  # storage -> block id
    reads: dict[tuple[int, int], set[int]] = field(default_factory=dict)  # storage -> readers
    saved: set[tuple[int, int]] = field(default_factory=set)
    preexisting: set[tuple[int, int]] = field(default_factory=set)
    keep: list[Any] = field(default_factory=list)
    _blocks: int = 0

    def block(self) -> contextlib.AbstractContextManager:
        """A context manager to enter where the strategy enters a scope."""
        if not torch.is_grad_enabled():
            return contextlib.nullcontext()
        self._blocks += 1
        return _Marker(self, self._blocks)

    def mark_preexisting(self, tensors: Iterable[torch.Tensor]) -> None:
        for t in tensors:
            k = storage_key(t)
            if k is not None:
                self.preexisting.add(k)

    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        def pack(t: torch.Tensor) -> torch.Tensor:
            k = storage_key(t)
            if k is not None:
                self.saved.add(k)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield

    def result(self) -> dict[str, int]:
        removed = retained = 0
        for k, owner in self.created.items():
            readers = self.reads.get(k, set()) - {owner}
            if k in self.saved and not readers:
                removed += k[1]
        for k in self.reads:
            if k in self.preexisting or k in self.saved:
                continue
            owner = self.created.get(k)
            if owner is not None and not (self.reads[k] - {owner}):
                continue
            retained += k[1]
        return {"removed": removed, "retained": retained, "blocks": self._blocks}
