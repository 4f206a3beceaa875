"""A budget at run time: its steps, blocks and regions, its cached plans, its offload
engine (M1..M8 in ``_budget.budget``; ``Budget`` is the public face of a :class:`Run`)."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable, Hashable
from dataclasses import astuple
from statistics import median_low
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from .._base.feedback import warn_user
from .._record.types import BlockRecord
from .._save import interception as _interception
from .._save import pack as _pack
from . import agree as _agree
from .block import BlockPlan, Plan
from .curve import fmt_bytes
from .measure import Measured, costs, measure
from .offload import Offloader, evict
from .planner import BlockGraph
from .rates import rates_for
from .region import Region, RegionPlan, tensors_in
from .step import _SPAN, BlockSeen, SaveSeen, StepPlan, plan_step
from .timing import Timing

# a region's entry pushes the pair, then opens the region
# (I8 [ the main thread's pair, removed later ])
_interception.add_unsafe_file(__file__)

__all__ = ["Run"]

Tensor = torch.Tensor
Place = tuple[int, int]
# free, inputs, rng, views, and its seconds (``_budget.timing``)
_Seen = tuple[dict[Place, int], dict[int, int], frozenset[int], set[int], Timing | None]


def where(site: Hashable) -> str:
    """A site (``_base.errors.Site``: file, line, what) in a few words: what the helper
    named (a module path), else ``file.py:line``."""
    if isinstance(site, tuple) and len(site) == 3:
        file, line, what = site
        return str(what) if what is not None else f"{str(file).rsplit('/', 1)[-1]}:{line}"
    return str(site)


class Run:
    """The run-time state of one budget of ``nbytes`` device bytes (``host``: bytes it
    may offload, None: off)."""

    def __init__(self, nbytes: int, host: float | None) -> None:
        self.bytes = nbytes
        self.host = host
        self.engine: Offloader | None = None  # (BlockRun, RegionRun)
        if host is not None:
            self.engine = Offloader(None if host == float("inf") else int(host))
        self.plans: dict[tuple[Hashable, int], list[Plan]] = {}
        # per occurrence, one per structure (M4 [ an ended step is planned ])
        self.region_plans: dict[int, list[RegionPlan]] = {}
        self.graphs: dict[tuple[Hashable, Any], tuple[BlockGraph, Measured]] = {}
        self.step: list[BlockPlan] = []
        self.regions: list[Region] = []
        self.open_regions: list[Region] = []
        # each open region's observer's remover (S6 [ a region's saves go to its observer ])
        self._closers: dict[Region, Callable[[], None]] = {}
        # This step's saved block storages (address -> weak ref, block, group): an
        # address names a storage only while it is alive.
        self._storages: dict[int, tuple[StorageWeakRef, BlockPlan, Place]] = {}
        self.occurrences: dict[Hashable, int] = {}
        self.saves_seen = 0
        # kept inputs to offload (N3 [ an input offloaded by its last block ])
        self.pending: dict[int, tuple[list[Tensor], Hashable]] = {}
        self.to_evict: list[int] = []
        self.warned: set[str] = set()
        # (site, occurrence, structure) -> (free groups, inputs, rng, views, seconds) last measured
        self.seen: dict[tuple[Hashable, int, Any], _Seen] = {}
        # the plan of the last step's structure (M8 [ the figures of the last step's plan ])
        self.result: StepPlan | None = None
        self.results: dict[Hashable, StepPlan] = {}  # every step structure planned -> its plan
        # (site, structure) -> where each save of its block ran, as last measured (stored_ops)
        self.wheres: dict[tuple[Hashable, Any], dict[Place, tuple[str, str]]] = {}
        # (site, structure) -> (its ops' digest, whether its replay may communicate),
        # as measured (A1 [ a shared block needs one plan ] in ``_budget.agree``)
        self.digests: dict[tuple[Hashable, Any], tuple[int, bool]] = {}
        # whether a step's structure was exchanged (A5 [ the first step is checked before its backward ])
        self.checked = False
        # the remover of the check at the next backward's entry, while one waits
        # (A5 [ the first step is checked before its backward ])
        self._check_at_backward: Callable[[], None] | None = None
        # the ended step the ranks have not agreed on yet (A2 [ agreed where every rank is ])
        self.unagreed: tuple[Any, ...] | None = None

    # -- steps (M2 [ what a step is ])

    def settle(self) -> None:
        if (self.step or self.regions) and not self.open_regions and not any(bp.needed() for bp in self.step):
            self.end_step()

    def _starting(self) -> None:
        self.settle()
        _agree_pending(self)
        if not self.step and not self.regions and self.engine is not None:
            self.engine.new_step()

    def open_block(self, site: Hashable, record: BlockRecord, state: Any) -> BlockPlan:
        """The decision for a block entered at ``site`` (M1..M3)."""
        self._starting()
        self.try_evictions()
        n = self.occurrences.get(site, 0)
        self.occurrences[site] = n + 1
        bp = BlockPlan(self, site, n, len(self.step), record, state, list(self.plans.get((site, n), ())))
        self.step.append(bp)
        return bp

    def open_region(self, module: torch.nn.Module, inputs: Any) -> Region:
        """A forward of the model starts (M6 [ a model-level budget bounds the model ]): our
        pair goes on top, the region observes."""
        _collect_ended(self)
        self._starting()
        occurrence = len(self.regions)
        region = Region(self, occurrence, module, inputs, list(self.region_plans.get(occurrence, ())))
        self.regions.append(region)
        self.open_regions.append(region)
        _interception.ensure_on_top(_interception.next_serial())
        self._closers[region] = _pack.open_region(region)
        return region

    def close_region(self, region: Region, output: Any) -> None:
        """The forward ends (also when it raised): the observer leaves; copies back start
        when backward reaches the output."""
        close = self._closers.pop(region, None)
        if close is not None:
            close()
        if region in self.open_regions:
            self.open_regions.remove(region)
        self.try_evictions()
        if not self.open_regions:  # what could not be offloaded by the end of forward stays
            self.pending, self.to_evict = {}, []
            _check_first(self)
        _interception.sweep()
        engine = self.engine
        if engine is None or output is None:
            return
        ref = weakref.ref(engine)

        def started(_: Tensor) -> None:
            e = ref()
            if e is not None:
                e.start_backward()

        for t in tensors_in(output):
            if t.requires_grad:
                t.register_hook(started)

    def region_open(self) -> bool:
        return bool(self.open_regions)

    def position(self) -> int:
        """Where a save outside the scopes falls among the step's blocks
        (N5 [ predicted seconds and peak ] order)."""
        self.saves_seen += 1
        return 2 * len(self.step) * _SPAN + self.saves_seen

    # -- kept inputs offloaded in place (N3 [ an input offloaded by its last block ])

    def hold(self, ptr: int, aliases: list[Tensor], key: Hashable, evict: bool) -> None:
        known = self.pending.get(ptr)
        self.pending[ptr] = ((known[0] if known else []) + aliases, key)
        if evict:
            self.to_evict.append(ptr)
        self.try_evictions()

    def try_evictions(self) -> None:
        engine = self.engine
        if engine is None or not self.to_evict:
            return
        left = []
        for ptr in self.to_evict:
            aliases, key = self.pending[ptr]
            if evict(engine, aliases, key):
                del self.pending[ptr]  # (the aliases are the records' to hold)
            else:
                left.append(ptr)  # still held elsewhere (the caller's variable): later
        self.to_evict = left
        if not self.open_regions and not left:
            self.pending = {}

    # -- measuring (M3 [ a plan follows its structure ], M4 [ an ended step is planned ])

    def saw_storage(self, ptr: int, storage: StorageWeakRef, block: BlockPlan, group: Place) -> None:
        """``block``, measured, saved a tensor of storage ``ptr`` (its group ``group``):
        a later block that keeps it for replay makes it free to store
        (K2 [ a candidate is one storage ])."""
        self._storages[ptr] = (storage, block, group)

    def measuring_ran(self, since: tuple[float, float], until: tuple[float, float]) -> None:
        """The measuring's own code ran from ``since`` to ``until`` (``_budget.timing``
        clocks): it is not in the forward of any block open now, whichever block's value it
        measured (a save after a block closed is in a later block's forward, or none)."""
        for bp in self.step:
            watch = bp.watch
            if watch is not None and watch.closed is None:
                watch.add_own(since, until)

    def kept_for_replay(self, bp: BlockPlan) -> None:
        """``bp`` closed keeping ``bp.inputs`` for replay: saved storages of earlier
        blocks among them are in memory anyway (storing them is free,
        K2 [ a candidate is one storage ])."""
        for ptr in bp.inputs:
            seen = self._storages.get(ptr)
            if seen is not None and seen[1] is not bp and not seen[0].expired():
                seen[1].free[seen[2]] = ptr

    def measured(self, bp: BlockPlan, record: BlockRecord) -> None:
        key = (bp.site, bp.keys)
        if key not in self.digests and _agree.world() is not None:
            _digested(self, key, record)
        if key not in self.graphs:
            m = measure(record)
            g = BlockGraph(where(bp.site), costs(m, rates_for(m.device)), tuple(m.reads), tuple(m.producers),
                           tuple(m.cuttable), tuple(m.needs), ())  # fmt: skip
            self.graphs[key] = (g, m)

    def end_step(self) -> None:
        _warn_refused(self)
        blocks = [bp for bp in self.step if bp.keys is not None]
        regions = self.regions
        self.step, self.regions, self._storages, self.occurrences = [], [], {}, {}
        self.saves_seen = 0
        self.pending, self.to_evict = {}, []
        if not blocks and not regions:
            return
        structure = (tuple((bp.site, bp.occurrence, bp.keys) for bp in blocks),
                     tuple((r.occurrence, tuple(r.keys)) for r in regions))  # fmt: skip
        known = self.results.get(structure)
        if known is not None and all(bp.known for bp in blocks) and all(r.matches() for r in regions):
            self.result = known  # M8 [ the figures of the last step's plan ]
            _to_agree(self, blocks, regions, structure, False)
            return
        _remember(self, blocks)
        _plan(self, blocks, regions)
        self.results[structure] = self.result  # type: ignore[assignment]
        _to_agree(self, blocks, regions, structure, True)

    def warn_once(self, what: str, message: str) -> None:
        """Warn once per budget, at the user's line."""
        if what not in self.warned:
            self.warned.add(what)
            warn_user(message)


def _warn_refused(self: Run) -> None:
    """Offloads the host pool refused in the ended step: one warning."""
    refused = self.engine.take_refused() if self.engine is not None else 0
    if refused:
        host = "True" if self.host == float("inf") else repr(fmt_bytes(self.host or 0))
        self.warn_once(
            "refused",
            f"gradient_scope: Budget({fmt_bytes(self.bytes)!r}, offload={host}): "
            f"{fmt_bytes(refused)} ({refused} bytes) that the plan offloads stayed on the device, over the "
            "plan: the host pool had no room for them (its memory is still held by offloaded tensors of an "
            "earlier step, such as a graph kept with retain_graph=True). Free that graph before the next "
            "step, or give offload= more bytes.",
        )


def _to_agree(self: Run, blocks: list[BlockPlan], regions: list[Region], structure: Hashable, planned: bool) -> None:
    """A2 [ agreed where every rank is ]: in a distributed run, an ended step with a shared
    block is agreed at the next block or forward entry."""
    if _agree.world() is None:
        return
    found = [self.digests.get((bp.site, bp.keys)) for bp in blocks]
    if not any(f is not None and f[1] for f in found):  # A1 [ a shared block needs one plan ]
        return
    digests = [_agree.site_digest(bp.site, bp.occurrence, f[0] if f else 0) for bp, f in zip(blocks, found)]
    # the process groups of the blocks' collectives, sorted: the same on every rank whose
    # step has this structure
    groups = sorted({g for bp in blocks if (bp.site, bp.keys) in self.graphs
                     for g in self.graphs[(bp.site, bp.keys)][1].groups if g is not None})  # fmt: skip

    def replan() -> None:  # (new rates were measured)
        _plan(self, blocks, regions)
        self.results[structure] = self.result  # type: ignore[assignment]

    self.unagreed = (blocks, regions, structure, digests, planned, groups, replan)


def _collect_ended(self: Run) -> None:
    """A2 [ agreed where every rank is ]: at a model forward, the last step ends on every
    rank, not when this rank's garbage collector frees a cycle holding its blocks' handles
    (DTensors): collected here where it has not ended and the ranks agree."""
    if self.step and not self.open_regions and _agree.world() is not None and self.digests:
        self.settle()
        if self.step:
            gc.collect()


def _digested(self: Run, key: tuple[Hashable, Any], record: BlockRecord) -> None:
    """A1 [ a shared block needs one plan ]: a measured block's digest and whether it is
    shared; the first shared block of an unchecked run asks to be checked before backward
    (A5 [ the first step is checked before its backward ])."""
    self.digests[key] = (_agree.digest(record), _agree.is_shared(record))
    if self.digests[key][1] and not self.checked and self._check_at_backward is None:
        self._check_at_backward = _interception.add_before_backward(_checker(self))
        weakref.finalize(self, self._check_at_backward)


def _unwatch(self: Run) -> None:
    """The check at the next backward's entry is no longer needed
    (A5 [ the first step is checked before its backward ])."""
    if self._check_at_backward is not None:
        self._check_at_backward()
        self._check_at_backward = None


def _checker(self: Run) -> Callable[[], None]:
    """A5 [ the first step is checked before its backward ] where no model forward ends
    first (a budget given to scopes only): at the entry of the step's backward
    (``_save.interception`` I9 [ told before backward ]). Holds the run weakly."""
    ref = weakref.ref(self)

    def check() -> None:
        run = ref()
        if run is None or run.open_regions:
            return  # (a backward inside a model forward: the forward's end checks)
        _check_first(run)

    return check


def _check_first(self: Run) -> None:
    """A5 [ the first step is checked before its backward ]: at the end of the first model
    forward with a shared block, or at its backward's entry, before any agreement."""
    _unwatch(self)
    if self.checked or _agree.world() is None:
        return
    blocks = [bp for bp in self.step if bp.keys is not None]
    found = [self.digests.get((bp.site, bp.keys)) for bp in blocks]
    if any(f is not None and f[1] for f in found):  # A1 [ a shared block needs one plan ]
        self.checked = True
        _agree.check([_agree.site_digest(bp.site, bp.occurrence, f[0] if f else 0) for bp, f in zip(blocks, found)])


def _agree_pending(self: Run) -> None:
    """A2 [ agreed where every rank is ]: every rank enters here, at a step's first block or
    forward."""
    pending, self.unagreed = self.unagreed, None
    if pending is not None:
        self.checked = True
        _unwatch(self)
        _agree.agree(self, *pending)


def _typical(self: Run, blocks: list[BlockPlan]) -> dict[Any, Timing]:
    """Per structure (signature), the lower median of each of the seconds its blocks of
    the step were last measured at (N5 [ predicted seconds and peak ]): blocks of one
    structure run the same ops on the same shapes; the first of them pays what runs once
    per process (caches filled, the replay's program made) and any block may be slowed by
    the machine, so with three or more the middle one counts (with one or two, the
    lesser). A structure with a block not timed has none."""
    out: dict[Any, list[Timing] | None] = {}
    for bp in blocks:
        seen = self.seen.get((bp.site, bp.occurrence, bp.keys))
        t = seen[4] if seen is not None else None
        got = out.get(bp.keys, [])
        out[bp.keys] = None if got is None or t is None else [*got, t]
    return {k: Timing(*(median_low(v) for v in zip(*map(astuple, ts)))) for k, ts in out.items() if ts}


def _remember(self: Run, blocks: list[BlockPlan]) -> None:
    """An ended step's blocks: what a measured one saw is kept (``seen``); a planned one,
    not measured, takes what its last measured step saw."""
    for bp in blocks:
        key = (bp.site, bp.occurrence, bp.keys)
        if bp.known and key in self.seen:
            # addresses of then, negated: they never match now's
            free, inputs, rng, views, _ = self.seen[key]
            bp.free = {g: -1 - p for g, p in free.items()}
            bp.inputs = {-1 - p: n for p, n in inputs.items()}
            bp.rng = frozenset(-1 - p for p in rng)
            bp.views = {-1 - p for p in views}
        else:
            self.seen[key] = (dict(bp.free), dict(bp.inputs), bp.rng, set(bp.views), _stop_watch(bp))


def _stop_watch(bp: BlockPlan) -> Timing | None:
    """The block's measuring step is over: its seconds; its replay state times no more
    unpacks."""
    watch, bp.watch = bp.watch, None
    state = bp.state()
    if state is not None and state.timer is watch:
        state.timer = None
    return watch.timing() if watch is not None else None


def _plan(self: Run, blocks: list[BlockPlan], regions: list[Region]) -> None:
    """M4 [ an ended step is planned ]: plan every block and region of a finished step."""
    seen = []
    typical = _typical(self, blocks)
    for bp in blocks:
        g, m = self.graphs[(bp.site, bp.keys)]
        label = f"{where(bp.site)}#{bp.occurrence}"
        index = {place: v for v, place in enumerate(m.places)}
        # a block's collectives are priced at plan time: their groups' rates are measured
        # where the ranks agree, after the block was measured (``_budget.rates`` CommRates)
        priced = costs(m, rates_for(m.device)) if any(m.groups) else g.costs
        graph = BlockGraph(label, priced, g.reads, g.producers, g.cuttable, g.needs,
                           tuple(index[p] for p in bp.saved if p in index))  # fmt: skip
        if bp.where:  # measured in this step: where its saves ran (kept for the planned steps)
            self.wheres[(bp.site, bp.keys)] = dict(bp.where)
        wheres = self.wheres.get((bp.site, bp.keys), {})
        seen.append(BlockSeen(label, graph, m, dict(bp.saved), dict(bp.free), dict(bp.inputs), bp.rng,
                              set(bp.views), wheres, typical.get(bp.keys)))  # fmt: skip
    saves: list[SaveSeen] = [s for r in regions for s in r.saves]
    exclude: set[int] = set().union(*(r.exclude for r in regions)) if regions else set()
    device = self.graphs[(blocks[0].site, blocks[0].keys)][1].device if blocks else torch.device("cpu")
    # K6 [ kept values may be offloaded ]: the pool's bytes
    host = self.engine.capacity(device) if self.engine is not None else None
    if self.engine is not None and host is None:
        self.warn_once(
            "cpu",
            f"gradient_scope: Budget(offload=...) changes nothing here: the tensors are on the {device.type}, "
            "which has no host memory to offload to. The budget keeps or recomputes.",
        )
    params = [pn for r in regions for pn in r.params.values()]
    plan = plan_step(seen, saves, exclude, self.bytes, host, rates_for(device), bool(regions), params)
    for bp, choice in zip(blocks, plan.blocks):
        key = (bp.site, bp.occurrence)
        kept = [p for p in self.plans.get(key, []) if p.keys != bp.keys]
        new = Plan(bp.keys, choice.chosen, choice.offloaded, choice.hold, choice.evict, choice.whole)  # type: ignore[arg-type]
        self.plans[key] = [*kept, new]
    for r in regions:
        keys = tuple(r.keys)
        others = [p for p in self.region_plans.get(r.occurrence, []) if p.keys != keys]
        self.region_plans[r.occurrence] = [*others, RegionPlan(keys, plan.regions.get(r.occurrence, frozenset()))]
    self.result = plan
    if self.engine is not None and plan.host:
        self.engine.expect(plan.host)
    if plan.below:
        self.warn_once(
            "floor",
            f"gradient_scope: Budget({fmt_bytes(self.bytes)}) is below the floor of these scopes, "
            f"{fmt_bytes(plan.floor)} ({plan.floor} bytes): what neither recompute nor offload can move "
            "(the outside tensors the blocks read, and what the code outside the scopes saves). Only what is "
            "in memory anyway is kept; memory stays at the floor. Raise the budget to at least the floor to "
            "make it bind.",
        )
