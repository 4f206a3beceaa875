"""The Hugging Face model job (benchmarks/models.py) end to end at the tiny size: the CPU
run with its depth sweep, the GPU suite's code path on CPU, the per-model time limit and
the torch.profiler summary."""

import json

import pytest
import torch

pytest.importorskip("transformers")

from benchmarks import models as bm


def _main(args):
    threads = torch.get_num_threads()
    try:
        with torch.random.fork_rng():
            # one thread: tiny ops on a busy 2-core machine are several times slower with two
            return bm.main([*args, "--size", "tiny", "--no-charts", "--threads", "1"])
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-models")
    return _main(["--models", "gpt2", "--rounds", "1", "--depths", "1", "2", "--out", str(out)]), out


def test_writes_json_and_markdown(results):
    res, out = results
    with open(out / "results.json") as f:
        data = json.load(f)
    assert list(data["models"]) == ["gpt2"]
    assert data["machine"]["transformers"]
    md = (out / "results.md").read_text()
    assert "## Targets" in md and "## gpt2" in md and "## Depth sweep" in md


def test_every_strategy_measured(results):
    res, _ = results
    s = res["models"]["gpt2"]["strategies"]
    assert list(s) == bm.STRATEGIES
    for name, v in s.items():
        assert "error" not in v, (name, v.get("error"))
        assert 0 < v["held"] <= v["peak"], name
        assert len(v["times_s"]) == 1 and v["time_median_s"] > 0, name
        # forward and backward timed apart; on CPU the step is their sum
        assert v["fwd"]["time_median_s"] > 0 and v["bwd"]["time_median_s"] > 0, name
        assert v["time_median_s"] == pytest.approx(v["fwd"]["time_median_s"] + v["bwd"]["time_median_s"]), name
        assert len(v["losses"]) == 2, name
    # Recomputation keeps less after forward than plain autograd does.
    for name in ("checkpoint", "scope_layer", "scope_attn_mlp", "scope_layer_savemm"):
        assert s[name]["held"] < s["plain"]["held"], name
    assert s["plain_again"]["held"] == s["plain"]["held"]
    assert s["plain_again"]["peak"] == s["plain"]["peak"]
    # the scopes' counters of the profiled step: every layer's scope ran and replayed
    assert s["scope_layer"]["scopes"]["modules"] == 2 and s["scope_layer"]["scopes"]["replays"] >= 2
    assert "scopes" not in s["plain"] and "scopes" not in s["checkpoint"]
    assert res["models"]["gpt2"]["warnings"] == []


def test_scopes_agree_bitwise_with_plain(results):
    """Same weights, batch and seed: gradients, losses of every step and buffers are the
    plain program's, bit for bit (CPU, float32, dropout on)."""
    res, _ = results
    s = res["models"]["gpt2"]["strategies"]
    for name in ("scope_layer", "scope_attn_mlp", "scope_layer_savemm", "mode_layer", "plain_again"):
        for key in ("grads_vs_plain", "losses_vs_plain", "buffers_vs_plain"):
            assert s[name][key]["bitwise_equal"], (name, key, s[name][key])
            assert s[name][key]["max_abs_diff"] == 0.0


def test_depth_sweep_and_targets(results):
    res, _ = results
    sw = res["sweep"]
    assert sw["depths"] == [1, 2]
    for d in ("1", "2"):
        for name in bm.SWEEP_STRATEGIES:
            v = sw["results"][d][name]
            assert 0 < v["held"] <= v["peak"]
            assert v["grads_vs_plain"]["bitwise_equal"]
    # more layers, more memory held by plain autograd
    assert sw["results"]["2"]["plain"]["held"] > sw["results"]["1"]["plain"]["held"]
    assert len(sw["excess"]["scope_layer"]["peak"]["excess_bytes"]) == 2
    targets = {(t["target"], t["model"]) for t in res["targets"]}
    assert ("scope_layer peak <= checkpoint's", "gpt2") in targets
    assert ("scope_layer step time <= 1.00x checkpoint's", "gpt2") in targets
    assert any(t.startswith("depth sweep") for t, _ in targets)
    # no SAC and no budget in this run: no target about them
    assert not any("sac_matmul" in t or "budget" in t for t, _ in targets)
    assert all(t["met"] in (True, False, None) for t in res["targets"])


def test_gpu_suite_code_path_on_cpu(tmp_path):
    """--gpu-suite at the tiny size on CPU: the suite's strategies (SAC, budgets at 50% and
    25% of plain's held bytes), its targets, one compared step on copies that share the
    weights."""
    res = _main(
        ["--gpu-suite", "--models", "llama8b_stack", "--dtype", "float32", "--rounds", "2", "--out", str(tmp_path)]
    )
    r = res["models"]["llama8b_stack"]
    s = r["strategies"]
    assert list(s) == bm.GPU_STRATEGIES
    assert res["train_steps"] == 1 and res["sweep"] is None
    plain = s["plain"]["held"]
    for name, frac in (("budget50", 0.5), ("budget25", 0.25)):
        assert s[name]["budget_bytes"] == int(frac * plain)
        assert s[name]["held"] < plain
    for name, v in s.items():
        assert "error" not in v, (name, v["error"])
        assert len(v["times_s"]) == 2
        assert v["grads_vs_plain"]["bitwise_equal"], name
    targets = {t["target"]: t for t in res["targets"]}
    for t in (
        "scope_layer step time <= 1.00x checkpoint's",
        "budget50 step time <= 0.90x checkpoint's",
        "scope_layer_savemm step time <= sac_matmul's",
    ):
        assert targets[t]["met"] in (True, False), t
    md = (tmp_path / "results.md").read_text()
    assert "## llama8b_stack" in md and "budget50" in md


def test_phase_timeout_skips_and_keeps_what_was_measured(tmp_path):
    """A time limit already passed: plain still runs (one round), the rest is reported as skipped."""
    res = _main(
        [
            "--models",
            "llama",
            "--strategies",
            "plain",
            "scope_layer",
            "--rounds",
            "3",
            "--no-sweep",
            "--phase-timeout",
            "1e-9",
            "--out",
            str(tmp_path),
        ]
    )
    s = res["models"]["llama"]["strategies"]
    assert "held" in s["plain"] and len(s["plain"]["times_s"]) == 1
    assert s["scope_layer"]["error"].startswith("skipped")
    assert any(t["target"] == "every strategy runs" and t["met"] is False for t in res["targets"])


def test_profile_step_summary_on_cpu(tmp_path):
    res = _main(["--profile-cuda", "--models", "gpt2", "--strategies", "plain", "scope_layer", "--out", str(tmp_path)])
    for name in ("plain", "scope_layer"):
        p = res["profiles"]["gpt2"][name]
        assert p["host_fwd_ms"] > 0 and p["step_wall_ms"] >= p["host_fwd_ms"]
        assert "sync_calls" not in p  # CUDA only
    assert "synchronizing calls" in (tmp_path / "results.md").read_text()


def test_unknown_strategy_is_an_error():
    from benchmarks._harness.strategies import apply_strategy

    with pytest.raises(ValueError, match="unknown strategy"):
        apply_strategy(torch.nn.Linear(2, 2), "scope_everything", lambda m: False)
    with pytest.raises(ValueError, match="plain's held bytes"):
        apply_strategy(torch.nn.Linear(2, 2), "budget50", lambda m: False)
