"""The per-op microbenchmark (benchmarks/overhead.py): recording and replay rows."""

from benchmarks.overhead import format_overhead, run_overhead


def test_replay_is_measured():
    res = run_overhead(n_ops=50, rounds=2, warmup=1)
    rp = res["replay"]
    # backward did replay the whole chain, so the replay rows measure replay
    assert rp["scope_ops_replayed_per_backward"] >= 50
    for region in ("scope", "checkpoint"):
        assert set(rp[region]) == {"recompute_us_per_op", "overhead_us_per_op", "ratio_vs_nop_mode"}
    for key in ("none/bwd", "scope/bwd", "checkpoint/bwd", "nop_mode/no_grad"):
        assert len(res["per_round_us_per_op"][key]) == 2 and res["us_per_op"][key] > 0
    text = format_overhead(res)
    assert "| scope |" in text and "| checkpoint |" in text
