"""The memory-budget planner on hand-made blocks (``gradient_scope._budget.planner``, rules K1..K8).

No tensors here: each block is a small op graph written out by hand, so every expected
choice can be checked on paper.
"""

import random

import pytest

from gradient_scope._budget.planner import (
    BlockGraph,
    Candidate,
    Chain,
    Item,
    Transfer,
    build_chain,
    choose,
    decide,
    recompute_cost,
)


def graph(costs, reads, saved, cuttable=None, needs=None, label="b"):
    """One output per op: value i is made by op i."""
    n = len(costs)
    return BlockGraph(
        label,
        tuple(float(c) for c in costs),
        tuple(tuple(r) for r in reads),
        tuple(range(n)),
        tuple(cuttable if cuttable is not None else [True] * n),
        tuple(tuple(x) for x in (needs if needs is not None else [()] * n)),
        tuple(saved),
    )


# A transformer MLP in miniature: x -> mm (1000) -> gelu (10) -> mm (1000) -> out.
# Autograd saves the first mm's output (gelu's input) and gelu's output (second mm's input).
MLP = graph(costs=[1000, 10, 1000], reads=[(), (0,), (1,)], saved=[0, 1])


def test_cost_is_the_union_of_closures_each_op_once():
    # gelu's output needs mm1 and gelu; mm1's output needs mm1: mm1 counted once (P4)
    assert recompute_cost(MLP, set()) == 1010.0
    assert recompute_cost(MLP, {0}) == 10.0  # stored mm1 output ends gelu's closure
    assert recompute_cost(MLP, {1}) == 1000.0  # mm1's own output still needs mm1
    assert recompute_cost(MLP, {0, 1}) == 0.0


def test_greedy_by_ratio_prefers_recompute_spared_per_byte():
    # two blocks; block 1's matmul output spares 1000 for 100 bytes (10/byte), block 0's
    # elementwise output spares 10 for 5 bytes (2/byte): block 1's goes first
    a = graph(costs=[10], reads=[()], saved=[0], label="a")
    b = graph(costs=[1000], reads=[()], saved=[0], label="b")
    chain = build_chain([a, b], [Candidate(0, (0,), 5), Candidate(1, (0,), 100)])
    assert chain.order == (1, 0)
    assert chain.nbytes == (0, 100, 105)
    assert chain.cost == (1010.0, 10.0, 0.0)
    assert choose(chain, floor=0, budget=104) == (1, False)
    assert choose(chain, floor=0, budget=99) == (0, False)


def test_closure_aware_a_value_that_cuts_its_dependents_is_worth_more():
    # op0 (big) -> op1 (cheap) -> op2 (cheap); only op2's output is saved, but storing
    # op1's output (a value nothing asks for itself) cuts op0 from op2's replay
    g = graph(costs=[1000, 1, 1], reads=[(), (0,), (1,)], saved=[2])
    assert recompute_cost(g, {1}) == 1.0
    cands = [Candidate(0, (2,), 100), Candidate(0, (1,), 100)]
    chain = build_chain([g], cands)
    # both spare about the same per byte on their own; storing op2's output spares 1002,
    # op1's spares 1001: op2's first, after which op1's spares nothing
    assert chain.order[0] == 0 and chain.cost[1] == 0.0
    # with op2's output three times as large, the cut at op1 is the better buy
    chain = build_chain([g], [Candidate(0, (2,), 300), Candidate(0, (1,), 100)])
    assert chain.order[0] == 1 and chain.cost[1] == 1.0


def test_written_values_do_not_cut_replays():
    # value 1's storage is written by op 2 (in place): a stored copy of it cannot stand in
    # for it in op 3's replay, which needs ops 1 and 2 (and so op 0) again
    g = graph(
        costs=[100, 1, 1, 1],
        reads=[(), (0,), (1,), (1,)],
        saved=[3],
        cuttable=[True, False, True, True],
        needs=[(), (2,), (), ()],
    )
    assert recompute_cost(g, set()) == 103.0
    assert recompute_cost(g, {1}) == 103.0
    assert recompute_cost(g, {0}) == 3.0


def test_values_in_memory_anyway_are_free_and_stored_first():
    g = graph(costs=[1000, 50], reads=[(), (0,)], saved=[0, 1])
    chain = build_chain([g], [Candidate(0, (0,), 4000), Candidate(0, (1,), 0)])
    assert chain.order[0] == 1 and chain.nbytes[1] == 0
    # below the floor only free storages are stored, and the caller is told
    assert choose(chain, floor=1000, budget=10) == (1, True)
    assert choose(chain, floor=1000, budget=1000) == (1, False)
    assert choose(chain, floor=1000, budget=5000) == (2, False)


def test_a_free_value_that_spares_nothing_is_left_for_the_end():
    g = graph(costs=[1000, 50], reads=[(), (0,)], saved=[0, 1])
    # value 1 is free, but a second candidate for the same value 0 spares all
    chain = build_chain([g], [Candidate(0, (0,), 10), Candidate(0, (1,), 0), Candidate(0, (0,), 0)])
    assert chain.order[0] == 1 or chain.order[0] == 2
    assert chain.cost[-1] == 0.0


def test_the_chain_ends_with_nothing_recomputed():
    # op1 has two saved outputs modelled as one value pair through a shared read: storing
    # one alone spares nothing (op0 is still needed for the other): the chain still goes on
    g = graph(costs=[500, 5, 5], reads=[(), (0,), (0,)], saved=[1, 2])
    chain = build_chain([g], [Candidate(0, (1,), 10), Candidate(0, (2,), 10)])
    assert chain.cost[-1] == 0.0 and len(chain.order) == 2


def _random_block(rng, label):
    n = rng.randint(2, 12)
    costs = [rng.choice([1, 5, 50, 1000]) for _ in range(n)]
    reads = [tuple(sorted(rng.sample(range(i), k=min(i, rng.randint(0, 2))))) for i in range(n)]
    saved = sorted(rng.sample(range(n), k=rng.randint(1, n)))
    cuttable = [rng.random() > 0.1 for _ in range(n)]
    return graph(costs, reads, saved, cuttable=cuttable, label=label)


@pytest.mark.parametrize("seed", range(20))
def test_recompute_never_grows_with_the_budget_and_stored_sets_are_nested(seed):
    rng = random.Random(seed)
    blocks = [_random_block(rng, f"b{i}") for i in range(rng.randint(1, 4))]
    cands = [Candidate(b, (v,), rng.choice([0, 8, 64, 512])) for b, g in enumerate(blocks) for v in g.saved]
    chain = build_chain(blocks, cands)
    assert chain.cost[-1] == 0.0  # everything stored: nothing recomputed
    floor = 100
    prev_cost, prev_set = float("inf"), set()
    for budget in range(0, floor + chain.nbytes[-1] + 64, 16):
        k, below = choose(chain, floor, budget)
        assert below == (budget < floor)
        assert chain.nbytes[k] <= max(budget - floor, 0)
        stored = set(chain.order[:k])
        assert chain.cost[k] <= prev_cost and prev_set <= stored
        # the chain's cost is what K1 says for the stored set
        per_block = [set() for _ in blocks]
        for c in stored:
            per_block[cands[c].block] |= set(cands[c].values)
        assert chain.cost[k] == sum(recompute_cost(g, s) for g, s in zip(blocks, per_block))
        prev_cost, prev_set = chain.cost[k], stored


def test_prefix_takes_the_longest_fitting_prefix():
    chain = Chain(order=(0, 1, 2), nbytes=(0, 10, 10, 40), cost=(9.0, 5.0, 4.0, 0.0))
    assert chain.prefix(9) == 0
    assert chain.prefix(10) == 2
    assert chain.prefix(39) == 2
    assert chain.prefix(40) == 3


# ---------------------------------------------------------------- offload (K6..K8)

FAST = Transfer(to_host=1e9, to_device=1e9, forward=1.0, backward=2.0, host=float("inf"))


def _random_plan(rng):
    blocks = [_random_block(rng, f"b{i}") for i in range(rng.randint(1, 4))]
    cands = [Candidate(b, (v,), rng.choice([0, 8, 64, 512])) for b, g in enumerate(blocks) for v in g.saved]
    chain = build_chain(blocks, cands)
    items = [Item(c.nbytes, 10 * c.block + i, rng.random() > 0.2) for i, c in enumerate(cands)]
    floor = [Item(rng.choice([8, 64, 256]), 10 * i, rng.random() > 0.2) for i in range(rng.randint(0, 4))]
    return chain, items, floor


@pytest.mark.parametrize("seed", range(10))
def test_without_a_host_budget_decide_is_the_prefix_choice(seed):
    chain, items, floor = _random_plan(random.Random(seed))
    total_floor = sum(i.nbytes for i in floor)
    for budget in range(0, total_floor + chain.nbytes[-1] + 32, 8):
        d = decide(chain, items, floor, budget, None)
        k, below = choose(chain, total_floor, budget)
        assert (d.kept, d.below) == (k, below)
        assert not d.offloaded_floor and not d.offloaded_candidates and d.host == 0 and d.transfer == 0.0


@pytest.mark.parametrize("seed", range(10))
def test_with_offload_time_never_grows_with_the_budget_and_device_bytes_fit(seed):
    rng = random.Random(seed)
    chain, items, floor = _random_plan(rng)
    slow = Transfer(to_host=100.0, to_device=100.0, forward=0.5, backward=1.0, host=float(rng.choice([64, 512, 1e9])))
    total = sum(i.nbytes for i in floor) + chain.nbytes[-1]
    for transfer in (FAST, slow):
        prev = float("inf")
        for budget in range(0, total + 32, 8):
            d = decide(chain, items, floor, budget, transfer)
            time = d.recompute + d.transfer
            assert time <= prev + 1e-12  # K8
            prev = time
            if not d.below:
                assert d.device <= budget
            assert d.host <= transfer.host
            off = sum(floor[i].nbytes for i in d.offloaded_floor) + sum(items[c].nbytes for c in d.offloaded_candidates)
            assert off == d.host
            assert all(floor[i].offloadable for i in d.offloaded_floor)
            assert all(items[c].offloadable and c in chain.order[: d.kept] for c in d.offloaded_candidates)
            assert d.device == sum(i.nbytes for i in floor) + chain.nbytes[d.kept] - d.host


def test_offload_beats_recompute_when_copies_hide_behind_compute_and_not_when_they_cannot():
    # one block: a matmul output (100 bytes) that spares 1 s of recompute
    g = graph(costs=[1.0], reads=[()], saved=[0])
    chain = build_chain([g], [Candidate(0, (0,), 100)])
    items = [Item(100, 0)]
    hidden = Transfer(to_host=1e4, to_device=1e4, forward=0.5, backward=1.0, host=1e9)
    d = decide(chain, items, [], 0, hidden)
    assert (d.kept, d.offloaded_candidates, d.device, d.recompute, d.transfer) == (1, frozenset({0}), 0, 0.0, 0.0)
    # copies that take 10 s each way: recomputing (1 s) is cheaper
    exposed = Transfer(to_host=10.0, to_device=10.0, forward=0.5, backward=1.0, host=1e9)
    d = decide(chain, items, [], 0, exposed)
    assert (d.kept, d.host, d.recompute) == (0, 0, 1.0)
    # no host room: recompute
    d = decide(chain, items, [], 0, Transfer(1e4, 1e4, 0.5, 1.0, host=50))
    assert (d.kept, d.host) == (0, 0)


def test_the_floor_is_offloaded_earliest_first_and_only_as_much_as_needed():
    chain = Chain(order=(), nbytes=(0,), cost=(0.0,))
    floor = [Item(100, 2), Item(100, 0), Item(100, 1), Item(100, 3, offloadable=False)]
    d = decide(chain, [], floor, 250, FAST)
    assert d.offloaded_floor == frozenset({1, 2}) and d.device == 200 and d.host == 200
    d = decide(chain, [], floor, 50, FAST)  # below what offloading can reach: all it can
    assert d.below and d.offloaded_floor == frozenset({0, 1, 2}) and d.device == 100
