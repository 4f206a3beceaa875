"""Plans agreed across ranks: every rank of a process group runs the same plan.

RULES A1..A5: how the ranks of a distributed program agree on a budget's plan.

A1. [ a shared block needs one plan ] A block is *shared* when its replay may issue a
    collective: it recorded a collective op, read a DTensor (TP: its ops redistribute),
    or read a parameter FSDP2 gathers (a replay that finds it freed gathers it again,
    ``_adapters.fsdp``). A collective replayed on one rank and not on another, or in
    another order, deadlocks; so a step with a shared block follows one plan on every
    rank. A step without one exchanges nothing: its replays issue no collective (DDP,
    and the calibration's budgets, which run on one rank only), and each rank keeps
    its own plan. Whether a block is shared depends on the program, not on the rank:
    every rank of one program agrees on it.
A2. [ agreed where every rank is ] Ranks agree at one point of the program that every
    rank reaches in the same order of collectives: the first block or model forward of
    the step after a planned one (``_budget.run.Run`` calls :func:`agree` there), never
    in a user's query of the figures (which may run on one rank only) nor in backward.
    A step ended by a query is agreed at that next entry.
A3. [ rank 0's plan ] Each rank sends one small vector (its step structure's digest,
    whether it made a new plan, its block count); when the digests agree and any rank
    planned, rank 0's plan (made at rank 0's budget and rates) is broadcast and every
    rank installs it in place of its own, so a rank's figures are rank 0's too.
    Differing budgets or measured rates thus never make ranks replay differently.
    Process groups whose collectives the blocks recorded and that have no measured
    rates yet are measured here first, by every rank together (a measurement is a
    collective), and rank 0 plans again with its collectives priced.
A4. [ no agreement, an error ] Ranks whose step structures differ (other block
    structures, another number of blocks) cannot share a plan: every rank raises the
    same ``RuntimeError`` (all of them see the gathered vectors, so none waits for
    another), naming the structures. The saves of the code outside the blocks are not
    part of the structure agreed (compiled blocks, which decide what they keep at their
    own rank's budget when they compile, save differently by rank, and nothing there
    replays): a model forward takes rank 0's offloads where its saves are rank 0's, and
    keeps its own plan otherwise.
A5. [ the first step is checked before its backward ] Under tensor parallelism a
    block's replay runs collectives, so ranks whose first step's block structures differ
    would replay differently in that step's backward, before the next step's agreement
    could see it. At the end of a model forward (a model-level budget's region) every
    rank whose step has a shared block exchanges the agreement's vector, once, before any
    agreement; differing structures raise the same error there, before backward. A budget
    given to scopes only (no model forward to close) is checked when that step's backward
    is entered (``_save.interception`` I9 [ told before backward ]), before the engine runs
    any replay: every rank enters its backward before the replays' collectives.

Outside a distributed run (``torch.distributed`` not initialised, or one rank) nothing
is exchanged.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Hashable, Sequence
from dataclasses import replace
from typing import Any, Protocol

import torch

from .._base.subclass import is_wrapper
from .._base.torch_compat import without_python_dispatch, without_torch_function
from .._record.types import BlockRecord, Input
from .._record.wrappers import is_collective
from .block import Plan
from .rates import comm_rates, measure_comm
from .region import RegionPlan
from .step import StepPlan

__all__ = ["Agreement", "agree", "add_shared_check", "digest", "is_shared", "site_digest", "world"]

# Callbacks that say a record reads a tensor whose replay gathers (FSDP2's), registered
# by the public layer (``_adapters.fsdp``): the budget imports no adapter.
_shared_checks: list[Callable[[Any], bool]] = []


def add_shared_check(fn: Callable[[Any], bool]) -> Callable[[], None]:
    """Register ``fn(tensor) -> bool``: True for an outside tensor whose replay may run a
    collective (A1 [ a shared block needs one plan ]). Returns a function that removes it."""
    _shared_checks.append(fn)

    def remove() -> None:
        if fn in _shared_checks:
            _shared_checks.remove(fn)

    return remove


def world() -> tuple[Any, int, int] | None:
    """``(default group, its size, this rank)`` in a distributed run of more than one
    rank, else None."""
    if not torch.distributed.is_available():
        return None
    dist = torch.distributed
    if not dist.is_initialized() or dist.get_world_size() < 2:
        return None
    return dist.group.WORLD, dist.get_world_size(), dist.get_rank()


def is_shared(record: BlockRecord) -> bool:
    """A1 [ a shared block needs one plan ]: whether a replay of ``record`` may issue a
    collective."""
    for rec in record.ops:
        if is_collective(rec.func):
            return True
        for a in (*rec.args, *rec.kwargs.values()):
            if type(a) is Input:
                t = a.tensor
                if is_wrapper(t) or any(check(t) for check in _shared_checks):
                    return True
    return False


def site_digest(site: Hashable, occurrence: int, ops: int) -> int:
    """A process-independent digest of one block of a step: its site (file name, line,
    module path), its occurrence and its ops' :func:`digest`."""
    if isinstance(site, tuple) and len(site) == 3:
        file, line, what = site
        text = repr((str(file).rsplit("/", 1)[-1], line, what, occurrence, ops))
    else:
        text = repr((str(site), occurrence, ops))
    return _int64(hashlib.sha256(text.encode()).digest())


def digest(record: BlockRecord) -> int:
    """A process-independent digest of a block's ops: each op's name with its outputs'
    shapes and dtypes (the signature's op entries are ``id()``s, which differ from process
    to process)."""
    h = hashlib.sha256()
    for rec in record.ops:
        outs = tuple(None if v is None or v.size is None else (tuple(v.size), str(v.dtype)) for v in rec.outs)
        h.update(repr((str(rec.func), outs)).encode())
    return _int64(h.digest())


def _int64(b: bytes) -> int:
    return int.from_bytes(b[:8], "little", signed=True)


class Agreement(Protocol):
    """What :func:`agree` asks of a budget's run (``_budget.run.Run`` offers it)."""

    plans: dict[tuple[Hashable, int], list[Plan]]
    region_plans: dict[int, list[RegionPlan]]
    results: dict[Hashable, StepPlan]
    result: StepPlan | None


class Ended(Protocol):
    """One block of an ended step, as :func:`agree` reads it (``_budget.block.BlockPlan``)."""

    site: Hashable
    occurrence: int
    keys: tuple[Hashable, ...] | None


class EndedRegion(Protocol):
    """One model forward of an ended step (``_budget.region.Region``)."""

    occurrence: int
    keys: list[Hashable]


def agree(run: Agreement, blocks: Sequence[Ended], regions: Sequence[EndedRegion], structure: Hashable,
          digests: Sequence[int], planned: bool, groups: Sequence[str],
          replan: Callable[[], None]) -> None:  # fmt: skip
    """A2 [ agreed where every rank is ] .. A4 [ no agreement, an error ]: agree the plan of
    the step that ended (``blocks``, ``regions`` of ``structure``, their ``digests``) with
    the other ranks; ``planned``: this rank made a new plan for it; ``groups``: the process
    groups of its collectives; ``replan()`` plans it again (with new rates)."""
    where = world()
    if where is None:
        return
    group, _, rank = where
    dist = torch.distributed
    # the blocks only: what the code outside them saves (compiled blocks, planned at each
    # rank's own budget when they compile) may differ by rank and replays nothing
    with torch.no_grad(), without_torch_function(), without_python_dispatch():
        seen = _gathered(where, digests, planned)
        if not any(s[1] for s in seen):
            return  # every rank follows the plan agreed before
        unmeasured = [g for g in groups if comm_rates(g) is None]
        if unmeasured:  # the same groups on every rank (the same structure): measured together
            measure_comm(unmeasured)
            if rank == 0:  # rank 0's plan, now with its collectives priced
                replan()
        box: list[Any] = [_export(run, blocks, regions, structure) if rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=group)
    _install(run, blocks, regions, structure, box[0])


def check(digests: Sequence[int]) -> None:
    """A5 [ the first step is checked before its backward ]: the step's blocks so far
    (``digests``, as :func:`agree` takes them) against the other ranks'; raises
    A4 [ no agreement, an error ] where they differ."""
    where = world()
    if where is not None:
        with torch.no_grad(), without_torch_function(), without_python_dispatch():
            _gathered(where, digests, False)


def _gathered(where: tuple[Any, int, int], digests: Sequence[int], planned: bool) -> list[list[int]]:
    """Every rank's ``[structure digest, planned, block count]`` (A3 [ rank 0's plan ]);
    A4 [ no agreement, an error ] on every rank where the digests differ."""
    group, size, _ = where
    mine = [_int64(hashlib.sha256(repr(tuple(digests)).encode()).digest()), int(planned), len(digests)]
    local = torch.tensor(mine, dtype=torch.int64, device=_device(group))
    out = [torch.empty_like(local) for _ in range(size)]
    torch.distributed.all_gather(out, local, group=group)
    seen = [[int(x) for x in t.tolist()] for t in out]
    if len({s[0] for s in seen}) > 1:  # A4 [ no agreement, an error ]
        counts = ", ".join(f"rank {r}: {s[2]} blocks, structure {s[0] & 0xFFFFFFFF:08x}" for r, s in enumerate(seen))
        raise RuntimeError(
            "gradient_scope: the ranks ran different scoped block structures in one step under a budget "
            f"({counts}), and their replays run collectives (tensor parallelism, FSDP2 or a collective in "
            "a block): ranks that replay differently would wait on each other forever, so no plan is "
            "applied. Give every rank of the process group the same block structure (the same sequence "
            "length and the same scoped layers), or train these ranks without a budget."
        )
    return seen


def _device(group: Any) -> torch.device:
    backend = str(torch.distributed.get_backend(group))
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


_Fields = tuple[Any, ...]


def _export(run: Agreement, blocks: Sequence[Ended], regions: Sequence[EndedRegion], structure: Hashable) -> Any:
    """Rank 0's plan of the step: per block (in step order) its plan's decisions, per
    region its offloads, and the step's figures (plain data: keys hold ``id()``s)."""
    per_block: list[_Fields | None] = []
    for bp in blocks:
        plan = next((p for p in run.plans.get((bp.site, bp.occurrence), ()) if p.keys == bp.keys), None)
        per_block.append(None if plan is None else tuple(plan)[1:])
    per_region: list[RegionPlan | None] = []
    for r in regions:
        keys = tuple(r.keys)
        per_region.append(next((p for p in run.region_plans.get(r.occurrence, ()) if p.keys == keys), None))
    result = run.results.get(structure)
    return per_block, per_region, None if result is None else replace(result, seen=[])


def _install(run: Agreement, blocks: Sequence[Ended], regions: Sequence[EndedRegion], structure: Hashable,
             plan: Any) -> None:  # fmt: skip
    per_block, per_region, result = plan
    for bp, fields in zip(blocks, per_block):
        if fields is None or bp.keys is None:
            continue
        key = (bp.site, bp.occurrence)
        others = [p for p in run.plans.get(key, []) if p.keys != bp.keys]
        run.plans[key] = [*others, Plan(bp.keys, *fields)]
    for r, rp in zip(regions, per_region):
        keys = tuple(r.keys)
        if rp is None or rp.keys != keys:
            continue  # saves outside the blocks differ from rank 0's: this rank's own plan
        others_r = [p for p in run.region_plans.get(r.occurrence, []) if p.keys != keys]
        run.region_plans[r.occurrence] = [*others_r, rp]
    if result is not None:
        local = run.results.get(structure)
        agreed = replace(result, seen=local.seen if local is not None else [])
        run.results[structure] = agreed
        if run.result is local:
            run.result = agreed
