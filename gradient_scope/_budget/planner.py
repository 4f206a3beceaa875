"""What a memory budget keeps, offloads and recomputes: a pure planner on plain data (no
tensors, no torch).

The planner sees one training step's scoped blocks as :class:`BlockGraph` objects
(measured by ``_budget.budget`` from the records of an unplanned step), a list of
:class:`Candidate` storages that could be kept instead of recomputed, and the
:class:`Item` storages that nothing can recompute (the floor: what blocks keep for
replay, what code outside the scopes saves), which only offloading can move.

RULES K1..K8: what a budget's plan keeps, offloads and recomputes.

K1. [ the recompute cost of a block ] The recompute cost of a block under a set of
    stored values is the summed cost of the ops in the union of the replay closures of
    its saved values that are not stored: a replay runs each op at most once per
    backward pass (``_restore.handles`` P4 [ each op at most once per pass ]), and a
    stored value whose storage group is never written (``cuttable``) ends the closure of
    everything that reads it (closure-aware). Costs are seconds (``_budget.measure``):
    FLOPs and bytes moved at the device's rates.
K2. [ a candidate is one storage ] A candidate is one storage of a block: storing it
    keeps every saved value of that block living in it. Its bytes count once; a storage
    that is in memory anyway after forward (an outside tensor another block of the step
    keeps for replay) costs 0 bytes.
K3. [ the plan is a chain ] The plan is a chain: starting from nothing stored,
    repeatedly add the candidate that spares the most recompute per byte (free
    candidates first), recomputing the gains of the block that changed
    (K1 [ the recompute cost of a block ] is not additive: storing a value changes what
    its neighbours spare). When no candidate spares anything, the smallest is added, so
    the chain ends with everything stored (nothing recomputed).
K4. [ the longest prefix that fits ] A budget takes the longest prefix of the chain that
    fits. Prefixes are nested sets, so the predicted recompute never grows with the
    budget and the stored set of a smaller budget is a subset of a larger one's.
K5. [ below the floor only free values ] A budget below the floor (the bytes kept when
    nothing is stored) is met as closely as possible: only what costs no bytes is
    stored.
K6. [ kept values may be offloaded ] With a host budget, any floor item or chain
    candidate a prefix keeps may be offloaded instead: it leaves the device after
    forward and comes back before backward needs it. Offloaded bytes cost the transfer
    time that compute cannot hide: copies out overlap the forward, copies back the
    backward (:meth:`Transfer.exposed`). Host room is counted in the bytes each item
    takes in host memory (``Item.host``: the pool's block for it, ``_budget.hostpool``
    H2 [ a block's bytes as the plan counts them ]), against the bytes the pool can hold
    (``Transfer.host``): an offload the plan makes is one the pool can place.
K7. [ the prefix of least predicted time ] :func:`decide` takes, for every prefix of the
    chain, the bytes over the budget as offloaded (when the offloadable bytes and the
    host room suffice) and picks the prefix of least predicted time (recompute + exposed
    transfer); ties go to fewer offloaded bytes, then the longer prefix. Without a host
    budget it is K4 [ the longest prefix that fits ]'s prefix. The offloaded items are
    the earliest in forward order (their copies back have the most time).
K8. [ time never grows with the budget ] Predicted time never grows with the budget: a
    larger budget has every choice a smaller one has, and more.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "BlockGraph",
    "Candidate",
    "Chain",
    "Item",
    "Transfer",
    "Decision",
    "recompute_cost",
    "build_chain",
    "choose",
    "decide",
]


@dataclass(frozen=True)
class BlockGraph:
    """One block as the planner sees it.

    Values are numbered ``0..len(producers)-1``; ops ``0..len(costs)-1``.

    Attributes:
        label: names the block in reports (``file.py:12#0``).
        costs: the replay cost of each op (cost units, see ``_budget.budget``).
        reads: per op, the values it reads that the block made.
        producers: per value, the op that makes it.
        cuttable: per value, whether a stored copy can stand in for it in other
            replays (its storage group is never written in place).
        needs: per value, ops that must run whenever it is rebuilt (writes to its
            storage group).
        saved: the values autograd saved (what backward asks for).
    """

    label: str
    costs: tuple[float, ...]
    reads: tuple[tuple[int, ...], ...]
    producers: tuple[int, ...]
    cuttable: tuple[bool, ...]
    needs: tuple[tuple[int, ...], ...]
    saved: tuple[int, ...]


@dataclass(frozen=True)
class Candidate:
    """A storage of block ``block`` that may be stored: ``values`` live in it
    (K2 [ a candidate is one storage ])."""

    block: int
    values: tuple[int, ...]
    nbytes: int


def recompute_cost(g: BlockGraph, stored: frozenset[int] | set[int]) -> float:
    """K1 [ the recompute cost of a block ]: the cost of replaying what backward asks of ``g``
    when ``stored`` are kept.

    Example::

        >>> g = BlockGraph("b", costs=(10.0, 1.0, 5.0), reads=((), (0,), (1,)),
        ...                producers=(0, 1, 2), cuttable=(True, True, True),
        ...                needs=((), (), ()), saved=(1, 2))
        >>> recompute_cost(g, set())       # both saved values: ops 0, 1, 2
        16.0
        >>> recompute_cost(g, {1})         # value 1 kept: op 2 reads it, op 0 is spared
        5.0
    """
    need = bytearray(len(g.costs))
    stack: list[int] = []

    def mark(v: int) -> None:
        for j in (g.producers[v], *g.needs[v]):
            if not need[j]:
                need[j] = 1
                stack.append(j)

    for v in g.saved:
        if v not in stored:
            mark(v)
    while stack:
        i = stack.pop()
        for v in g.reads[i]:
            if v in stored and g.cuttable[v]:
                continue
            mark(v)
    return float(sum(c for c, n in zip(g.costs, need) if n))


@dataclass(frozen=True)
class Chain:
    """The chain of K3 [ the plan is a chain ]. ``order[k]`` is the candidate added at step
    ``k``; after it, the stored candidates cost ``nbytes[k + 1]`` bytes and leave ``cost[k + 1]`` to
    recompute (``nbytes[0] == 0`` and ``cost[0]``: nothing stored)."""

    order: tuple[int, ...]
    nbytes: tuple[int, ...]
    cost: tuple[float, ...]

    def prefix(self, room: int) -> int:
        """K4 [ the longest prefix that fits ]: the length of the longest prefix whose bytes fit
        in ``room``.

        Example::

            >>> Chain(order=(2, 0), nbytes=(0, 10, 30), cost=(9.0, 4.0, 0.0)).prefix(29)
            1
        """
        k = 0
        for n in range(len(self.order) + 1):
            if self.nbytes[n] <= room:
                k = n
            else:
                break
        return k


def build_chain(blocks: Sequence[BlockGraph], candidates: Sequence[Candidate]) -> Chain:
    """K3 [ the plan is a chain ]: the greedy chain over ``candidates`` of ``blocks``.

    Example (storing the matmul output, candidate 1, spares 100 per byte; the
    elementwise output spares 1 per byte)::

        >>> g = BlockGraph("b", costs=(400.0, 4.0), reads=((), (0,)), producers=(0, 1),
        ...                cuttable=(True, True), needs=((), ()), saved=(0, 1))
        >>> chain = build_chain([g], [Candidate(0, (1,), 4), Candidate(0, (0,), 4)])
        >>> chain.order, chain.cost
        ((1, 0), (404.0, 4.0, 0.0))
    """
    stored: list[set[int]] = [set() for _ in blocks]
    cost = [recompute_cost(g, s) for g, s in zip(blocks, stored)]
    by_block: dict[int, list[int]] = {}
    for c, cand in enumerate(candidates):
        by_block.setdefault(cand.block, []).append(c)

    def gain(c: int) -> float:
        cand = candidates[c]
        return cost[cand.block] - recompute_cost(blocks[cand.block], stored[cand.block] | set(cand.values))

    gains = {c: gain(c) for c in range(len(candidates))}
    order: list[int] = []
    nbytes, total = [0], [sum(cost)]
    while gains:
        best = max(gains, key=lambda c: (_ratio(gains[c], candidates[c].nbytes), gains[c], -c))
        if gains[best] <= 0:  # nothing spares anything now: the smallest goes next (K3 [ the plan is a chain ])
            best = min(gains, key=lambda c: (candidates[c].nbytes, c))
        cand = candidates[best]
        del gains[best]
        stored[cand.block] |= set(cand.values)
        cost[cand.block] = recompute_cost(blocks[cand.block], stored[cand.block])
        for c in by_block[cand.block]:
            if c in gains:
                gains[c] = gain(c)
        order.append(best)
        nbytes.append(nbytes[-1] + cand.nbytes)
        total.append(sum(cost))
    return Chain(tuple(order), tuple(nbytes), tuple(total))


def _ratio(gain: float, nbytes: int) -> float:
    if gain <= 0:
        return -1.0
    return float("inf") if nbytes == 0 else gain / nbytes


def choose(chain: Chain, floor: int, budget: int) -> tuple[int, bool]:
    """K4 [ the longest prefix that fits ], K5 [ below the floor only free values ]: ``(prefix
    length, below floor)`` for ``budget`` bytes, ``floor`` of which are kept whatever is stored.

    Example::

        >>> chain = Chain(order=(0, 1, 2), nbytes=(0, 0, 10, 30), cost=(9.0, 7.0, 4.0, 0.0))
        >>> choose(chain, floor=100, budget=115), choose(chain, floor=100, budget=50)
        ((2, False), (1, True))
    """
    below = budget < floor
    return chain.prefix(max(budget - floor, 0)), below


@dataclass(frozen=True)
class Item:
    """A storage on the device that may be offloaded (K6 [ kept values may be offloaded ]): its
    bytes, its place in
    forward order, whether it can be (a storage the engine can copy), and the host bytes
    it takes when offloaded (None: ``nbytes``).

    Example::

        >>> Item(100, 0).host_bytes, Item(100, 0, host=512).host_bytes
        (100, 512)
    """

    nbytes: int
    position: int
    offloadable: bool = True
    host: int | None = None

    @property
    def host_bytes(self) -> int:
        """The host bytes it takes when offloaded."""
        return self.nbytes if self.host is None else self.host


@dataclass(frozen=True)
class Transfer:
    """The offload side of a plan (K6 [ kept values may be offloaded ]): copy rates (bytes/s), the
    compute (seconds) that
    the copies out and back overlap, and the host bytes available (counted as
    ``Item.host_bytes``)."""

    to_host: float
    to_device: float
    forward: float
    backward: float
    host: float

    def exposed(self, nbytes: float) -> float:
        """Seconds of copying of ``nbytes`` out and back that compute does not hide.

        Example::

            >>> Transfer(1e9, 1e9, forward=0.5, backward=1.0, host=1e12).exposed(2e9)
            2.5
        """
        return max(0.0, nbytes / self.to_host - self.forward) + max(0.0, nbytes / self.to_device - self.backward)


@dataclass(frozen=True)
class Decision:
    """What a budget does (K7 [ the prefix of least predicted time ]): the chain prefix ``kept`` is
    not recomputed; of it and of
    the floor, ``offloaded_candidates`` and ``offloaded_floor`` (indices) are offloaded.
    ``device`` and ``host`` bytes after forward (``host``: the items' ``host_bytes``);
    predicted seconds of ``recompute`` and of exposed ``transfer``; ``below``: the budget
    could not be met."""

    kept: int
    offloaded_candidates: frozenset[int]
    offloaded_floor: frozenset[int]
    device: int
    host: int
    recompute: float
    transfer: float
    below: bool


def decide(
    chain: Chain, candidates: Sequence[Item], floor: Sequence[Item], budget: int, transfer: Transfer | None
) -> Decision:
    """K6 [ kept values may be offloaded ], K7 [ the prefix of least predicted time ]: keep,
    offload and recompute for ``budget`` device bytes.

    ``candidates[c]`` is chain candidate ``c`` as an item (its bytes, position, whether
    it can be offloaded); ``floor`` the items nothing recomputes.

    Example (a floor of 100 bytes, two candidates of 50 bytes each sparing 1 s; copies
    of 100 bytes hide behind compute)::

        >>> chain = Chain(order=(0, 1), nbytes=(0, 50, 100), cost=(2.0, 1.0, 0.0))
        >>> cands, floor = [Item(50, 1), Item(50, 2)], [Item(100, 0)]
        >>> decide(chain, cands, floor, 150, None).kept  # K4 [ the longest prefix that fits ]: one fits
        1
        >>> d = decide(chain, cands, floor, 150, Transfer(1e3, 1e3, 0.1, 0.1, 1e9))
        >>> d.kept, sorted(d.offloaded_floor), d.device, d.recompute  # offload the floor
        (2, [0], 100, 0.0)
    """
    floor_total = sum(i.nbytes for i in floor)
    host = transfer.host if transfer is not None else 0.0
    room = [sum(i.nbytes for i in floor if i.offloadable)]  # offloadable bytes per prefix
    for c in chain.order:
        cand = candidates[c]
        room.append(room[-1] + (cand.nbytes if cand.offloadable else 0))
    # Each feasible prefix with the least time it could have (its bytes over the budget
    # offloaded exactly); the items picked may overshoot by part of one, so the best few
    # are picked for real, in order of that bound, until the bound cannot win.
    bounds: list[tuple[float, int, int]] = []
    for k in range(len(chain.order) + 1):
        excess = floor_total + chain.nbytes[k] - budget
        if excess <= 0:
            bounds.append((chain.cost[k], -k, 0))
        elif transfer is not None and excess <= min(host, room[k]):
            bounds.append((chain.cost[k] + transfer.exposed(excess), -k, excess))
    bounds.sort(key=lambda b: (b[0], b[2], b[1]))
    best: tuple[tuple[float, int, int], int, tuple[frozenset[int], frozenset[int], int, int]] | None = None
    for bound, neg_k, want in bounds:
        if best is not None and bound > best[0][0]:
            break
        picked = _pick(chain, candidates, floor, -neg_k, want, host)
        if picked[2] < want:
            continue  # the host room cannot take enough of them (K6 [ kept values may be offloaded ])
        exposed = transfer.exposed(picked[2]) if transfer is not None and picked[2] else 0.0
        key = (chain.cost[-neg_k] + exposed, picked[2], neg_k)
        if best is None or key < best[0]:
            best = (key, -neg_k, picked)
    below = best is None
    if best is None:  # K5 [ below the floor only free values ]: as close as possible
        k = chain.prefix(0)
        want = int(min(host, room[k])) if transfer is not None else 0
        picked = _pick(chain, candidates, floor, k, want, host)
    else:
        _, k, picked = best
    off_floor, off_cands, moved, held = picked
    device = floor_total + chain.nbytes[k] - moved
    exposed = transfer.exposed(moved) if transfer is not None and moved else 0.0
    return Decision(k, off_cands, off_floor, device, held, chain.cost[k], exposed, below or device > max(budget, 0))


def _pick(
    chain: Chain, candidates: Sequence[Item], floor: Sequence[Item], k: int, want: int, host: float
) -> tuple[frozenset[int], frozenset[int], int, int]:
    """K7 [ the prefix of least predicted time ]: the earliest offloadable items in forward order,
    until ``want`` device bytes,
    whose host bytes fit in ``host``: ``(floor items, candidates, device bytes, host bytes)``."""
    if want <= 0:
        return frozenset(), frozenset(), 0, 0
    pool = [(item.position, 0, i, item) for i, item in enumerate(floor) if item.offloadable and item.nbytes]
    for c in chain.order[:k]:
        cand = candidates[c]
        if cand.offloadable and cand.nbytes:
            pool.append((cand.position, 1, c, cand))
    pool.sort(key=lambda p: p[:3])
    taken = [set(), set()]  # type: list[set[int]]
    moved = held = 0
    for _, kind, i, item in pool:
        if moved >= want:
            break
        if held + item.host_bytes <= host:
            taken[kind].add(i)
            moved += item.nbytes
            held += item.host_bytes
    return frozenset(taken[0]), frozenset(taken[1]), moved, held
