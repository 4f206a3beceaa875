"""What a memory budget stores: a pure planner on plain data (no tensors, no torch).

The planner sees one training step's scoped blocks as :class:`BlockGraph` objects
(measured by ``_budget.budget`` from the records of an unplanned step) and a list of
:class:`Candidate` storages that could be kept instead of recomputed.

RULES K1..K5: what a budget's plan stores.

K1. The recompute cost of a block under a set of stored values is the summed cost of
    the ops in the union of the replay closures of its saved values that are not
    stored: a replay runs each op at most once per backward pass (``_restore.handles`` P4),
    and a stored value whose storage group is never written (``cuttable``) ends the
    closure of everything that reads it (closure-aware).
K2. A candidate is one storage of a block: storing it keeps every saved value of
    that block living in it. Its bytes count once; a storage that is in memory anyway
    after forward (an outside tensor another block of the step keeps for replay)
    costs 0 bytes.
K3. The plan is a chain: starting from nothing stored, repeatedly add the candidate
    that spares the most recompute per byte (free candidates first), recomputing the
    gains of the block that changed (K1 is not additive: storing a value changes what
    its neighbours spare). When no candidate spares anything, the smallest is added,
    so the chain ends with everything stored (nothing recomputed).
K4. A budget takes the longest prefix of the chain that fits. Prefixes are nested
    sets, so the predicted recompute never grows with the budget and the stored set
    of a smaller budget is a subset of a larger one's.
K5. A budget below the floor (the bytes kept when nothing is stored) is met as
    closely as possible: only what costs no bytes is stored.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["BlockGraph", "Candidate", "Chain", "recompute_cost", "build_chain", "choose"]


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
    """A storage of block ``block`` that may be stored: ``values`` live in it (K2)."""

    block: int
    values: tuple[int, ...]
    nbytes: int


def recompute_cost(g: BlockGraph, stored: frozenset[int] | set[int]) -> float:
    """K1: the cost of replaying what backward asks of ``g`` when ``stored`` are kept.

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
    """K3's chain. ``order[k]`` is the candidate added at step ``k``; after it, the
    stored candidates cost ``nbytes[k + 1]`` bytes and leave ``cost[k + 1]`` to
    recompute (``nbytes[0] == 0`` and ``cost[0]``: nothing stored)."""

    order: tuple[int, ...]
    nbytes: tuple[int, ...]
    cost: tuple[float, ...]

    def prefix(self, room: int) -> int:
        """K4: the length of the longest prefix whose bytes fit in ``room``.

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
    """K3: the greedy chain over ``candidates`` of ``blocks``.

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
        if gains[best] <= 0:  # nothing spares anything now: the smallest goes next (K3)
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
    """K4, K5: ``(prefix length, below floor)`` for ``budget`` bytes, ``floor`` of
    which are kept whatever is stored.

    Example::

        >>> chain = Chain(order=(0, 1, 2), nbytes=(0, 0, 10, 30), cost=(9.0, 7.0, 4.0, 0.0))
        >>> choose(chain, floor=100, budget=115), choose(chain, floor=100, budget=50)
        ((2, False), (1, True))
    """
    below = budget < floor
    return chain.prefix(max(budget - floor, 0)), below
