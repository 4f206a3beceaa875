"""One training step's plan, on plain data: what each block keeps, offloads and
recomputes, which kept inputs and which saves outside the scopes are offloaded, and the
predicted figures (for ``_budget.budget``; the choice itself is ``_budget.planner``'s).

RULES N1..N5: what a step's plan covers.

N1. [ the bytes a budget bounds ] The bytes a budget bounds: the block tensors kept,
    each storage once; the outside tensors the blocks keep for replay and the generator
    states of their random ops (on the device's memory only); and, for a model-level
    budget, what the code outside the scopes saves during the model's forward (not the
    model's inputs, parameters or buffers). The last two are the floor: only offloading
    moves them.
N2. [ a storage with two holders ] A storage kept both for a replay and by a save
    outside the scopes (or a saved view of it in the block) has two holders: offloading
    one would free nothing, so it is not offloaded, and plain autograd keeps it too.
N3. [ an input offloaded by its last block ] A kept input offloaded in place is
    offloaded by the last block of the step that keeps it, once every block's aliases of
    it are known; a block's tensor living in it is then not kept by its own block (a
    replay reads it back from the input).
N4. [ a budget above plain autograd ] At a model-level budget of at least what plain
    autograd keeps (every block tensor and every save outside the scopes), every block
    keeps everything. Under a model-level budget a block that keeps all it saved drops
    its record at its close (it will never replay): what only its record held is not
    held, and memory at such a budget is plain's.
N5. [ predicted seconds and peak ] Predicted step seconds, anchored to the measuring
    step (``_budget.timing``): each block's forward and backward as measured there
    (without the measuring's own code and without replay; the library's own cost per
    op, recording and packing, is inside them; blocks of one structure count as the
    lower median of them: with one or two, the lesser), plus the plan's recompute --
    its modelled seconds (each replayed op's kernel at the device's rates and replay's
    bookkeeping, ``Rates.replay``) times the measured replay's seconds per modelled
    second (in the measuring step every block replays all it saved but the values in
    memory anyway, which every plan keeps, ``_budget.planner``
    K2 [ a candidate is one storage ]) -- and the copies compute does not hide. Where a
    block of the step was not timed, the modelled step instead: three times the ops'
    kernel seconds, autograd's own cost per op (``Rates.train``), the library's
    (recording each op, ``Rates.record``; packing each saved tensor, ``Rates.save``),
    the modelled recompute and the copies.
    The code outside the scopes is not counted. The predicted peak: at each block's
    backward (backward goes from the last block to the first), the bytes kept for it and
    for the blocks before it, the gradients of the parameters of it and of the code
    after it, its values rebuilt at once by its replay, and the gradients flowing
    through it (twice its output); the largest of these, plus the bytes prefetched ahead
    (twice the largest offloaded storage).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from .curve import CurvePoint, StoredOp, fmt_bytes, fmt_seconds
from .hostpool import footprint
from .measure import Measured
from .planner import BlockGraph, Candidate, Chain, Decision, Item, Transfer, build_chain, decide, recompute_cost
from .rates import Rates, seconds
from .timing import Timing

__all__ = ["BlockSeen", "SaveSeen", "StepPlan", "BlockChoice", "plan_step"]

_SPAN = 1 << 20  # positions: block b's items at (2b + 1) * _SPAN + k, saves before it at 2b * _SPAN + n


@dataclass
class BlockSeen:
    """One block of the step as measured: its graph and what it saved and kept."""

    label: str
    graph: BlockGraph
    measured: Measured
    # (op, output) of each saved value -> (its storage group, the storage's bytes), None: unseen
    saved: dict[tuple[int, int], tuple[tuple[int, int], int] | None]
    free: dict[tuple[int, int], int]  # groups another block keeps for replay -> that storage
    inputs: dict[int, int]  # storages kept for replay (address -> bytes), in the record's order
    rng: frozenset[int]  # of them, generator states (host memory, never offloaded)
    # of them, saved as views by autograd too (N2 [ a storage with two holders ])
    views: set[int] = field(default_factory=set)
    where: dict[tuple[int, int], tuple[str, str]] = field(default_factory=dict)  # (module, line) of each save
    timing: Timing | None = None  # its measuring step's seconds (``_budget.timing``)


@dataclass
class SaveSeen:
    """A tensor the code outside the scopes saved (N1 [ the bytes a budget bounds ])."""

    ptr: int
    nbytes: int
    position: int
    name: str  # the autograd node that saved it
    region: int  # which forward of the step (its occurrence)
    ordinal: int  # which save of that forward


@dataclass
class BlockChoice:
    """What one block does under the plan (``_budget.block.Plan`` without its key)."""

    chosen: frozenset[tuple[int, int]]
    offloaded: frozenset[tuple[int, int]]
    # ordinals of kept inputs offloaded in place (N3 [ an input offloaded by its last block ]): note
    # their aliases
    hold: frozenset[int]
    evict: frozenset[int]  # of them, those this block offloads (the last holder)
    whole: bool  # N4 [ a budget above plain autograd ]


@dataclass
class StepPlan:
    """A step's plan and its predicted figures (N5 [ predicted seconds and peak ])."""

    blocks: list[BlockChoice]
    regions: dict[int, frozenset[int]]  # per region occurrence, the ordinals of the saves offloaded
    floor: int
    device: int
    host: int
    recompute: float
    transfer: float
    step: float
    peak: int
    below: bool
    # N5 [ predicted seconds and peak ]'s parts of ``step``: the blocks' forward and backward
    # without the library, and
    # what the library adds (recording, saves, replay's bookkeeping; in ``recompute`` too)
    compute: float = 0.0
    library: float = 0.0
    ops_recorded: int = 0  # the blocks' ops, recorded
    saves: int = 0  # the tensors they save
    replayed: int = 0  # ops replayed per step
    # N5 [ predicted seconds and peak ], anchored to the measuring step (``timed``): the blocks'
    # forward and backward as measured, without replay, and the measured replay's seconds per
    # modelled second of recompute (``recompute`` counts them: it is the modelled figure times
    # ``scale``; 1 where not timed)
    timed: bool = False
    measured: float = 0.0
    scale: float = 1.0
    stored: list[StoredOp] = field(default_factory=list)
    curve: list[CurvePoint] = field(default_factory=list)
    seen: list[BlockSeen] = field(default_factory=list)  # what it was planned from


@dataclass
class _Items:
    cands: list[Candidate]
    cand_items: list[Item]
    floor: list[Item]
    floor_ptrs: list[int]
    floor_kind: list[tuple[int, int]]  # (-1, region save index) or (block, ordinal)
    real: dict[int, int]  # candidate -> its storage's bytes, also when free
    # per block, the values living in storages in memory anyway (the free ones of
    # K2 [ a candidate is one storage ]): no step replays them, the measuring step neither
    free: dict[int, set[int]] = field(default_factory=dict)


def _collect(blocks: list[BlockSeen], saves: list[SaveSeen], exclude: set[int], offload: bool) -> _Items:
    it = _Items([], [], [], [], [], {})
    for b, bs in enumerate(blocks):
        index = {place: v for v, place in enumerate(bs.measured.places)}
        groups: dict[tuple[int, int], list[int]] = {}
        sizes: dict[tuple[int, int], int] = {}
        for place, seen in bs.saved.items():
            if place in index and seen is not None:
                group, nbytes = seen
                groups.setdefault(group, []).append(index[place])
                sizes[group] = max(nbytes, sizes.get(group, 0))
        for group, vals in groups.items():
            nbytes = 0 if group in bs.free else sizes[group]
            if group in bs.free:
                it.free.setdefault(b, set()).update(vals)
            it.real[len(it.cands)] = sizes[group]
            position = (2 * b + 1) * _SPAN + len(it.cands)
            it.cands.append(Candidate(b, tuple(vals), nbytes))
            it.cand_items.append(Item(nbytes, position, offload and nbytes > 0, footprint(nbytes)))
    where: dict[int, int] = {}
    saved_ptrs = {s.ptr for s in saves}
    for n, s in enumerate(saves):
        if s.ptr in exclude or s.ptr in where:
            continue
        where[s.ptr] = len(it.floor)
        it.floor.append(Item(s.nbytes, s.position, offload, footprint(s.nbytes)))
        it.floor_ptrs.append(s.ptr)
        it.floor_kind.append((-1, n))
    for b, bs in enumerate(blocks):
        for j, (ptr, nbytes) in enumerate(bs.inputs.items()):
            if ptr in exclude:
                continue
            if ptr in where:
                i = where[ptr]
                # N2 [ a storage with two holders ]: two holders
                if it.floor_kind[i][0] == -1 and it.floor[i].offloadable:
                    it.floor[i] = replace(it.floor[i], offloadable=False)
                continue
            where[ptr] = len(it.floor)
            ok = offload and ptr not in bs.rng and ptr not in saved_ptrs and ptr not in bs.views
            it.floor.append(Item(nbytes, (2 * b + 1) * _SPAN - _SPAN // 2 + j, ok, footprint(nbytes)))
            it.floor_ptrs.append(ptr)
            it.floor_kind.append((b, j))
    return it


def _choices(blocks: list[BlockSeen], it: _Items, d: Decision, extra: frozenset[int],
             whole: bool) -> list[BlockChoice]:  # fmt: skip
    """What each block does; ``extra``: the candidates kept (on the device or offloaded)."""
    evicted = {it.floor_ptrs[i] for i in d.offloaded_floor if it.floor_kind[i][0] != -1}
    chosen: list[set[tuple[int, int]]] = [set() for _ in blocks]
    offloaded: list[set[tuple[int, int]]] = [set() for _ in blocks]
    kept = range(len(it.cands)) if whole else sorted(extra)
    for c in kept:
        cand = it.cands[c]
        bs = blocks[cand.block]
        places = {bs.measured.places[v] for v in cand.values}
        if c in d.offloaded_candidates and not whole:
            offloaded[cand.block] |= places
            continue
        group = next((bs.saved[p][0] for p in places if bs.saved.get(p) is not None), None)  # type: ignore[index]
        if not whole and cand.nbytes == 0 and bs.free.get(group, -1) in evicted:  # type: ignore[arg-type]
            continue  # N3 [ an input offloaded by its last block ]: read back from the input offloaded in place
        chosen[cand.block] |= places
    last: dict[int, int] = {}
    for b, bs in enumerate(blocks):
        for ptr in bs.inputs:
            if ptr in evicted:
                last[ptr] = b
    out = []
    for b, bs in enumerate(blocks):
        hold = frozenset(j for j, ptr in enumerate(bs.inputs) if ptr in evicted and not whole)
        evict = frozenset(j for j, ptr in enumerate(bs.inputs) if j in hold and last[ptr] == b)
        every = {p for p, seen in bs.saved.items() if seen is not None}
        full = whole or (not offloaded[b] and not hold and every <= chosen[b])
        out.append(BlockChoice(frozenset(chosen[b]), frozenset(offloaded[b]), hold, evict, full))
    return out


def _released(blocks: list[BlockSeen], it: _Items, choices: list[BlockChoice], d: Decision) -> int:
    """N4 [ a budget above plain autograd ]: what the records of the blocks that keep everything
    held for replay, and no one holds once those records are dropped."""
    holders: dict[int, list[int]] = {}
    for b, bs in enumerate(blocks):
        for ptr in bs.inputs:
            holders.setdefault(ptr, []).append(b)
    views = set().union(*(bs.views for bs in blocks))
    kept = {bs.free[g] for bs, ch in zip(blocks, choices) for g in _groups(bs, ch.chosen) if g in bs.free}
    out = 0
    for i, (item, ptr, (b, _)) in enumerate(zip(it.floor, it.floor_ptrs, it.floor_kind)):
        if b == -1 or i in d.offloaded_floor or ptr in views or ptr in kept:
            continue
        if all(choices[h].whole for h in holders.get(ptr, ())):
            out += item.nbytes
    return out


def _groups(bs: BlockSeen, places: frozenset[tuple[int, int]]) -> set[tuple[int, int]]:
    return {seen[0] for p in places if (seen := bs.saved.get(p)) is not None}


def _peak(blocks: list[BlockSeen], choices: list[BlockChoice], it: _Items, d: Decision,
          params: list[tuple[int, int]]) -> int:  # fmt: skip
    """N5 [ predicted seconds and peak ]: the activation bytes and gradients at each block's
    backward, at most."""
    held: list[tuple[int, int]] = [(i.position, i.nbytes) for f, i in enumerate(it.floor) if f not in d.offloaded_floor]
    for c, cand in enumerate(it.cands):
        ch = choices[cand.block]
        place = blocks[cand.block].measured.places[cand.values[0]]
        if place in ch.chosen:
            held.append((it.cand_items[c].position, cand.nbytes))
    grads = list(params) + [((2 * b + 1) * _SPAN, bs.measured.params) for b, bs in enumerate(blocks)]
    end = 2 * len(blocks) * _SPAN
    top = sum(n for _, n in held) + sum(n for p, n in grads if p >= end)  # backward starts
    for b, (bs, ch) in enumerate(zip(blocks, choices)):
        groups: dict[tuple[int, int], int] = {}
        for place, seen in bs.saved.items():
            if seen is not None and place not in ch.chosen:
                groups[seen[0]] = seen[1]  # rebuilt at once by the block's replay
        upto, since = (2 * b + 2) * _SPAN, (2 * b + 1) * _SPAN - _SPAN // 2
        flowing = 2 * bs.measured.out  # the gradients of its output and input
        here = sum(n for p, n in held if p < upto) + sum(n for p, n in grads if p >= since) + sum(groups.values())
        top = max(top, here + flowing)
    sizes = [it.floor[i].nbytes for i in d.offloaded_floor] + [it.cand_items[c].nbytes for c in d.offloaded_candidates]
    return top + 2 * max(sizes, default=0)


def _why(how: str, spared: float, nbytes: int) -> str:
    """The plan's reason for one candidate, in words (K3 [ the plan is a chain ],
    K7 [ the prefix of least predicted time ])."""
    if nbytes == 0:
        return "in memory anyway (another block keeps its storage): keeping it costs no bytes"
    per = f"{fmt_seconds(spared)} of recompute per step for {fmt_bytes(nbytes)}"
    per += f" ({fmt_seconds(spared * 2**20 / nbytes)} per MiB)"
    if how == "kept":
        return f"kept: spares {per}, among the most per byte that fit the budget"
    if how == "offloaded":
        return f"offloaded: spares {per}; no room on the device, and its copy is predicted to cost less"
    return f"recomputed: keeping it would spare {per}; the budget is filled by tensors sparing more per byte"


def _stored(blocks: list[BlockSeen], choices: list[BlockChoice], saves: list[SaveSeen],
            it: _Items, d: Decision, chain: Chain, per: float) -> list[StoredOp]:  # fmt: skip
    out: list[StoredOp] = []
    at = {c: k for k, c in enumerate(chain.order)}
    for c, cand in enumerate(it.cands):
        bs, ch = blocks[cand.block], choices[cand.block]
        k0 = at.get(c)
        # K3 [ the plan is a chain ]: its gain in the chain
        spared = 0.0 if k0 is None else per * (chain.cost[k0] - chain.cost[k0 + 1])
        for v in cand.values:
            op, k = bs.measured.places[v]
            how = "kept" if (op, k) in ch.chosen else "offloaded" if (op, k) in ch.offloaded else "recomputed"
            module, line = bs.where.get((op, k), ("", ""))
            why = _why(how, spared, cand.nbytes)
            out.append(StoredOp(bs.label, bs.measured.names[op], k, cand.nbytes, how, module, line, why))
    for i in d.offloaded_floor:
        b, n = it.floor_kind[i]
        if b == -1:
            name, label, why = saves[n].name, "(outside scopes)", "saved by code outside the scopes"
        else:
            name, label, why = "input", blocks[b].label, "kept by the block for its replay"
        why = f"offloaded: {why}, so it cannot be recomputed; the device budget moves it to host memory"
        out.append(StoredOp(label, name, n, it.floor[i].nbytes, "offloaded", why=why))
    return out


_Eval = tuple[Decision, frozenset[int]]  # a decision and the candidates it keeps


def _at(chain: Chain, it: _Items, budget: int, transfer: Transfer | None) -> _Eval:
    """The decision of K7 [ the prefix of least predicted time ] at ``budget``, and the
    candidates it keeps (on the device or offloaded): a prefix of the chain, so a larger budget
    keeps a superset."""
    d = decide(chain, it.cand_items, it.floor, budget, transfer)
    return d, frozenset(chain.order[: d.kept])


def plan_step(blocks: list[BlockSeen], saves: list[SaveSeen], exclude: set[int], budget: int,
              host: float | None, rates: Rates, model_level: bool,
              params: list[tuple[int, int]] | None = None) -> StepPlan:  # fmt: skip
    """M4 [ an ended step is planned ]: plan a finished step (see the module docstring). ``host``:
    the host bytes the
    budget's pool can hold (its capacity, ``_budget.hostpool``; None: no offload)."""
    it = _collect(blocks, saves, exclude, host is not None)
    chain = build_chain([bs.graph for bs in blocks], it.cands)
    forward = sum(seconds(f, b, rates) for bs in blocks for f, b in zip(bs.measured.flops, bs.measured.moved))
    ops = sum(len(bs.measured.flops) for bs in blocks)
    nsaves = sum(len(bs.saved) for bs in blocks)
    compute = 3 * forward + ops * rates.train
    modelled = compute + ops * rates.record + nsaves * rates.save
    anchor = _anchor(blocks, it.free)
    # N5 [ predicted seconds and peak ]: the step without recompute and copies, and the seconds
    # of one modelled second of recompute
    fixed, per = anchor if anchor is not None else (modelled, 1.0)
    transfer = None if host is None else Transfer(rates.to_host, rates.to_device, forward, 2 * forward, host)
    views = set().union(*(bs.views for bs in blocks)) if blocks else set()
    plain = sum(it.real.values()) + sum(
        i.nbytes for i, p, (b, _) in zip(it.floor, it.floor_ptrs, it.floor_kind) if b == -1 or p in views
    )
    whole = model_level and budget >= plain
    points = _curve(chain, it, budget, transfer, (fixed, per), plain if model_level else None)
    d, extra = _at(chain, it, budget, transfer)
    if whole:
        d, extra = Decision(len(chain.order), frozenset(), frozenset(), plain, 0, 0.0, 0.0, False), frozenset()
    choices = _choices(blocks, it, d, extra, whole)
    if model_level and not whole:
        d = replace(d, device=d.device - _released(blocks, it, choices, d))
    regions: dict[int, set[int]] = {}
    for i in d.offloaded_floor:
        b, n = it.floor_kind[i]
        if b == -1:
            regions.setdefault(saves[n].region, set()).add(saves[n].ordinal)
    unmovable = sum(i.nbytes for i in it.floor if not i.offloadable)
    floor = unmovable if host is not None else sum(i.nbytes for i in it.floor)
    plan = StepPlan(
        choices,
        {r: frozenset(ords) for r, ords in regions.items()},
        floor,
        d.device,
        d.host,
        per * d.recompute,
        d.transfer,
        fixed + per * d.recompute + d.transfer,
        _peak(blocks, choices, it, d, params or []),
        d.below,
    )
    plan.replayed = _replayed(blocks, choices)
    plan.compute, plan.ops_recorded, plan.saves = compute, ops, nsaves
    plan.library = modelled - compute + plan.replayed * rates.replay
    plan.timed, plan.measured, plan.scale = anchor is not None, fixed if anchor else 0.0, per
    plan.stored = _stored(blocks, choices, saves, it, d, chain, per)
    plan.seen = blocks
    plan.curve = points
    return plan


def _replayed(blocks: list[BlockSeen], choices: list[BlockChoice]) -> int:
    """The ops the plan replays per step (K1 [ the recompute cost of a block ] with a cost of 1 per op)."""
    out = 0
    for bs, ch in zip(blocks, choices):
        if ch.whole:
            continue
        g = bs.graph
        index = {place: v for v, place in enumerate(bs.measured.places)}
        stored = {index[p] for p in ch.chosen | ch.offloaded if p in index}
        out += int(recompute_cost(replace(g, costs=(1.0,) * len(g.costs)), stored))
    return out


def _anchor(blocks: list[BlockSeen], free: dict[int, set[int]]) -> tuple[float, float] | None:
    """N5 [ predicted seconds and peak ] from the measuring step: the blocks' forward and
    backward seconds, and the measured replay's seconds per modelled second of recompute;
    None where a block was not timed. ``free``: per block, the values in memory anyway."""
    if not blocks or any(bs.timing is None for bs in blocks):
        return None
    timings = [bs.timing for bs in blocks if bs.timing is not None]
    # what the measuring step replayed: every saved value but those in memory anyway (its
    # handles find them alive), as every plan keeps them (their candidates cost 0 bytes)
    full = sum(recompute_cost(bs.graph, free.get(b, set())) for b, bs in enumerate(blocks))
    replay = sum(t.replay for t in timings)
    return sum(t.forward + t.backward for t in timings), (replay / full if full > 0 and replay > 0 else 1.0)


def _curve(chain: Chain, it: _Items, budget: int, transfer: Transfer | None, anchor: tuple[float, float],
           plain: int | None) -> list[CurvePoint]:  # fmt: skip
    """The plan at the budgets where it changes (at most about 64 of them); ``anchor``:
    N5 [ predicted seconds and peak ]'s seconds other than recompute and copies, and the
    seconds of one modelled second of recompute."""
    fixed, per = anchor
    total = sum(i.nbytes for i in it.floor)
    low = sum(i.nbytes for i in it.floor if not i.offloadable) if transfer is not None else total
    marks = {total + n for n in chain.nbytes}
    step = max(1, len(marks) // 48)
    budgets = [*sorted(marks)[::step], total + chain.nbytes[-1], budget]
    if transfer is not None:
        budgets += [low + (total - low) * i // 16 for i in range(16)]
    if plain is not None:
        budgets.append(plain)
    points: list[CurvePoint] = []
    for b in sorted(set(budgets)):
        if plain is not None and b >= plain:
            p = CurvePoint(b, plain, 0, 0.0, 0.0, fixed)
        else:
            d = _at(chain, it, b, transfer)[0]
            if d.below:
                continue
            p = CurvePoint(b, d.device, d.host, per * d.recompute, d.transfer, fixed + per * d.recompute + d.transfer)
        if not points or p.step < points[-1].step:
            points.append(p)
    return points
