"""The GPT job (benchmarks/run.py) and the budget sweep (benchmarks/budget.py) at a tiny size,
and the harness pieces they share."""

import time

import pytest
import torch

from benchmarks._harness.report import Targets, md_table
from benchmarks._harness.strategies import compare_tensors
from benchmarks._harness.timing import interleaved_rounds, time_fwd_bwd
from benchmarks.gpt import GPTConfig

TINY = ["--layers", "2", "--d-model", "32", "--heads", "2", "--seq", "16", "--batch", "2", "--vocab", "64"]


def test_run_tiny(tmp_path):
    from benchmarks import run

    with torch.random.fork_rng():
        res = run.main(
            ["--quick", "--rounds", "1", "--no-overhead", "--no-scaling", "--no-charts", "--out", str(tmp_path), *TINY]
        )
    s = res["main"]["strategies"]
    assert list(s) == [*run.STRATEGIES, "plain_again"]
    for name, v in s.items():
        assert "error" not in v, (name, v.get("error"))
        assert v["grads_vs_plain"]["bitwise_equal"], name
    # regions hold less than plain, a scope per layer about what checkpoint holds
    assert s["scope_act"]["held"] < s["scope_mlp"]["held"] < s["plain"]["held"]
    for name in run.SCOPE_STRATEGIES:
        assert "ideal" in s[name] and s[name]["scopes"]["tensors_packed"] > 0, name
    targets = {t["target"]: t for t in res["targets"]}
    assert targets["gradients bitwise equal to plain (all strategies)"]["met"] is True
    assert targets["scope_layer held within 1% + 64 KiB of ideal"]["met"] is True
    assert "### Ideal memory" in (tmp_path / "results.md").read_text()


def test_budget_case_tiny():
    """The sweep on a tiny GPT: budgets bound what is held, the hand policies are placed, the
    budget's own time is measured through the public Budget class."""
    from benchmarks import budget
    from benchmarks.gpt import case

    c = case(GPTConfig(vocab=64, seq=16, d_model=32, n_head=2, n_layer=2, batch=2))
    # The sweep runs budgets below the floor on purpose (from Budget(0) up): each warns once.
    with torch.random.fork_rng(), pytest.warns(UserWarning, match="is below the floor") as caught:
        res = budget.run_case(c, rounds=1, points=1, log=lambda m: None, hand=["scope_layer", "checkpoint"])
    ours = [str(w.message) for w in caught if str(w.message).startswith("gradient_scope")]
    assert ours and all("is below the floor of these scopes" in m for m in ours), ours
    S = res["strategies"]
    assert {"plain", "plain_again", "scope_layer", "checkpoint"} <= set(S)
    budgets = [v for v in S.values() if "budget" in v]
    assert len(budgets) >= 3 and all(0 < v["fraction"] < 1 for v in budgets)
    t = {x["target"]: x for x in res["targets"]}
    assert t["held <= budget + unscoped (budget >= floor)"]["met"]
    assert t["at scope_layer's held bytes, recompute <= scope_layer's"]["met"]
    assert t["gradients bitwise equal to plain"]["met"]


def test_interleaved_rounds_rotate_and_stop_at_the_deadline():
    order = []
    steps = {k: (lambda k=k: order.append(k) or len(order)) for k in "abc"}
    out = interleaved_rounds(steps, 3)
    assert order == list("abcbcacab") and out["a"] == [1, 6, 8]
    order.clear()
    out = interleaved_rounds(steps, 5, deadline=time.perf_counter() - 1)
    assert order == list("abc") and out["c"] == [3]  # one round always runs


def test_time_fwd_bwd_phases():
    x = torch.randn(64, 64, requires_grad=True)
    t = time_fwd_bwd(lambda: (x @ x).sum(), lambda loss: loss.backward())
    assert set(t) == {"step", "fwd", "bwd", "host_fwd"}
    assert t["step"] == pytest.approx(t["fwd"] + t["bwd"]) and t["host_fwd"] == t["fwd"]
    assert x.grad is not None


def test_compare_tensors_and_targets_table():
    a = {"w": torch.zeros(3), "n": torch.tensor(1)}
    b = {"w": torch.tensor([0.0, 0.5, 0.0]), "n": torch.tensor(2)}
    c = compare_tensors(a, b)
    assert not c["bitwise_equal"] and c["max_abs_diff"] == 1.0 and c["max_rel_diff"] == 1.0
    assert sorted(c["differing"]) == ["n", "w"]
    assert compare_tensors(a, {k: v.clone() for k, v in a.items()})["bitwise_equal"]
    assert not compare_tensors(a, {"w": a["w"]})["bitwise_equal"]
    bf = {"w": torch.ones(2, dtype=torch.bfloat16)}
    assert compare_tensors(bf, {"w": torch.tensor([1.0, 1.0078125], dtype=torch.bfloat16)})["max_abs_diff"] == 0.0078125
    T = Targets()
    T.add("x <= y", "1 vs 2", met=True)
    T.add("z", "n/a", met=None, note="why")
    assert (
        Targets.from_rows(list(T)).markdown()
        == T.markdown()
        == md_table(
            ["target", "measured", "met?", "note"], [["x <= y", "1 vs 2", "met", ""], ["z", "n/a", "n/a", "why"]]
        )
    )
