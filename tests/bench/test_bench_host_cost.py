"""The host-cost job (benchmarks/host_cost.py) at the tiny size: per-layer extras, op counts, targets."""

import json
import warnings

import pytest
import torch

pytest.importorskip("transformers")

from benchmarks import host_cost as hc


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-host")
    threads = torch.get_num_threads()
    try:
        with torch.random.fork_rng(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            res = hc.main(["--quick", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    # The library's one warning here: Mixtral's experts in float32 branch on
    # torch.compiler.is_compiling(), so its layers' steady state turns itself off (rule D6).
    ours = {str(w.message) for w in caught if str(w.message).startswith("gradient_scope")}
    assert all("MixtralDecoderLayer.forward runs other ops when dynamo traces it" in m for m in ours), ours
    return res, out


def test_per_layer_extras_and_targets(results):
    res, out = results
    assert list(res["models"]) == hc.MODELS
    for m, r in res["models"].items():
        assert r["layers"] == 2
        s = r["strategies"]
        assert list(s) == hc.STRATEGIES
        for name in hc.STRATEGIES[1:]:
            h = r["host"][name]
            # the extra per layer is the per-round difference to plain over the layers
            first = (s[name]["times_s"][0] - s["plain"]["times_s"][0]) * 1e6 / r["layers"]
            assert h["step"]["per_round"][0] == pytest.approx(first)
            assert len(h["fwd"]["per_round"]) == res["rounds"]
            assert s[name]["grads_vs_plain"]["bitwise_equal"], (m, name)
        assert s["budget50"]["budget_bytes"] == int(0.5 * s["plain"]["held"])
        targets = {t["target"] for t in res["targets"] if t["model"] == m}
        assert targets == {
            "scope_layer fwd+bwd host cost per layer <= checkpoint's",
            "scope_layer+fast fwd+bwd host cost per layer <= checkpoint's",
            "budget50 fwd+bwd host cost per layer <= scope_layer's",
            "budget50+fast fwd+bwd host cost per layer <= scope_layer+fast's",
        }
    assert all(t["met"] in (True, False) and t["note"].startswith("A/A") for t in res["targets"])
    with open(out / "results.json") as f:
        assert json.load(f)["inner"] == 1
    md = (out / "results.md").read_text()
    assert "## Targets" in md and "## llama" in md and "## mixtral" in md


def test_op_counts(results):
    """A layer runs dozens of aten ops forward and more backward; the model has more than
    its layers (embedding, norm, head, loss)."""
    res, _ = results
    for r in res["models"].values():
        ops = r["ops"]
        assert 20 < ops["fwd_ops_per_layer"] < ops["bwd_ops_per_layer"]
        assert ops["fwd_ops"] > r["layers"] * ops["fwd_ops_per_layer"]


def test_whole_runs_are_interleaved_and_paired(tmp_path):
    """``--lengths``: every strategy's run in one fresh process, a time per step each; the
    paired seen-step ratio is checkpoint's own 1.0, and the targets are written."""
    res = hc.main(["--lengths", "2", "--steps", "5", "--layers", "2", "--rounds", "1", "--out", str(tmp_path)])
    runs = res["runs"]
    assert len(runs["lengths"]) == 5 and len(set(runs["lengths"])) == 2
    strategies = runs["strategies"]
    assert set(strategies) == set(hc.RUN_STRATEGIES)
    assert strategies["checkpoint"]["seen_vs_checkpoint"] == 1.0
    assert all(v["whole_s"] > 0 and v["seen_vs_checkpoint"] > 0 for v in strategies.values())
    md = (tmp_path / "results.md").read_text()
    assert "steady state vs checkpoint (the same step, paired)" in md and "| scope_layer+fast |" in md
    assert json.loads((tmp_path / "results.json").read_text())["runs"]["rounds"] == 1
