"""The real-model benchmark (benchmarks/models.py) end to end on a tiny GPT-2, one round."""

import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytest.importorskip("transformers")

from benchmarks import models as bm
from benchmarks._harness.strategies import compare_tensors


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-models")
    threads = torch.get_num_threads()
    try:
        with torch.random.fork_rng():
            # one thread: tiny ops on a busy 2-core machine are several times slower with two
            res = bm.main(
                ["--size", "tiny", "--models", "gpt2", "--rounds", "1", "--depths", "1", "2",
                 "--no-charts", "--threads", "1", "--out", str(out)]
            )
    finally:
        torch.set_num_threads(threads)
    return res, out


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
        assert len(v["losses"]) == 2, name
    # Recomputation keeps less after forward than plain autograd does.
    for name in ("checkpoint", "scope_layer", "scope_attn_mlp", "scope_layer_savemm"):
        assert s[name]["held"] < s["plain"]["held"], name
    assert s["plain_again"]["held"] == s["plain"]["held"]
    assert s["plain_again"]["peak"] == s["plain"]["peak"]
    assert res["models"]["gpt2"]["warnings"] == []


def test_scopes_agree_bitwise_with_plain(results):
    """Same weights, batch and seed: gradients, losses of every step and buffers are the
    plain program's, bit for bit (CPU, float32, dropout on)."""
    res, _ = results
    s = res["models"]["gpt2"]["strategies"]
    for name in ("scope_layer", "scope_attn_mlp", "scope_layer_savemm", "plain_again"):
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
            assert v["grads_bitwise_equal"]
    # more layers, more memory held by plain autograd
    assert sw["results"]["2"]["plain"]["held"] > sw["results"]["1"]["plain"]["held"]
    assert len(sw["excess"]["scope_layer"]["peak"]["excess_bytes"]) == 2
    targets = {(t["target"], t["model"]) for t in res["targets"]}
    assert ("scope_layer peak <= checkpoint's", "gpt2") in targets
    assert ("scope_layer step time <= 1.00x checkpoint's", "gpt2") in targets
    assert any(t.startswith("depth sweep") for t, _ in targets)
    assert all(t["met"] in (True, False, None) for t in res["targets"])


def test_compare_reports_differences():
    a = {"w": torch.zeros(3), "n": torch.tensor(1)}
    b = {"w": torch.tensor([0.0, 0.5, 0.0]), "n": torch.tensor(2)}
    c = compare_tensors(a, b)
    assert not c["bitwise_equal"]
    assert c["max_abs_diff"] == 1.0
    assert sorted(c["differing"]) == ["n", "w"]
    assert compare_tensors(a, {k: v.clone() for k, v in a.items()})["bitwise_equal"]
    assert not compare_tensors(a, {"w": a["w"]})["bitwise_equal"]


def test_unknown_strategy_is_an_error():
    with pytest.raises(ValueError, match="unknown strategy"):
        bm.apply_strategy(torch.nn.Linear(2, 2), "scope_everything", lambda m: False, [])
