"""Batches padded per batch: a steady function gets one graph for every length (D7 [ a dynamic
graph has a template per size ] in ``gradient_scope/_adapters/steady/run.py``), a template per
length, and the plain program's values and gradients at each."""

from __future__ import annotations

import torch
import transformers
from torch import nn

import gradient_scope
from gradient_scope import apply_recompute
from gradient_scope._adapters.steady import run as steady

from support import steady_graphs
from support.hf_models import VOCAB, tiny_llama


def _step(model, **batch):
    torch.manual_seed(1)
    loss = model(**batch).loss
    loss.backward()
    out = (loss.detach(), [p.grad.clone() for p in model.parameters()])
    model.zero_grad(set_to_none=True)
    return out


def _same(a, b):
    return torch.equal(a[0], b[0]) and all(torch.equal(x, y) for x, y in zip(a[1], b[1]))


def _is_layer(m):
    return isinstance(m, transformers.models.llama.modeling_llama.LlamaDecoderLayer)


def test_twelve_padded_lengths_are_two_graphs_and_plains_gradients(fast, monkeypatch):
    """12 lengths, then the same 12 again, through four Llama layers: dynamo captures the first
    length and, at the second, a graph with the length symbolic; no other capture. Every step
    is plain's, bitwise. A third pass runs every layer steady (a template per length; in the
    second, the first length reaches the symbolic graph for the first time)."""
    graphs = steady_graphs(monkeypatch)
    model, plain = apply_recompute(tiny_llama(4, use_cache=False), _is_layer), tiny_llama(4, use_cache=False)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(3, VOCAB, (2, n), generator=g) for n in range(4, 16)]
    for ids in batches:
        assert _same(_step(model, input_ids=ids, labels=ids), _step(plain, input_ids=ids, labels=ids)), ids.shape
    assert len(graphs) == 2 and [g.dynamic for g in graphs] == [False, True], graphs
    for ids in batches:
        assert _same(_step(model, input_ids=ids, labels=ids), _step(plain, input_ids=ids, labels=ids)), ids.shape
    before = gradient_scope.model_stats(model)
    assert "dynamo could not capture" not in before.recorded_why, before.recorded_why
    for ids in batches:
        assert _same(_step(model, input_ids=ids, labels=ids), _step(plain, input_ids=ids, labels=ids)), ids.shape
    stats = gradient_scope.model_stats(model) - before
    assert stats.calls_steady == 4 * 12 and stats.calls_recorded == 0, (stats.calls_recorded, stats.recorded_why)
    assert len(graphs) == 2


class _Reshaping(nn.Module):
    """A layer whose ops take its input's sizes as arguments (a view, a slice by an int)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, keep: int) -> torch.Tensor:
        b, n, d = x.shape
        heads = self.proj(x).view(b, n, 2, d // 2).transpose(1, 2)
        mixed = (heads.softmax(-1) * heads).transpose(1, 2).reshape(b, n, d)
        return mixed[:, :keep].tanh()


def test_ops_that_take_sizes_are_bound_at_each_length(fast, monkeypatch):
    """A dynamic graph's ops take the sizes as arguments (a view's shape, a slice's end: an
    int argument dynamo made symbolic): a run at one length must not be bound from a template
    of another. Seven lengths and ints, each twice, two layers: bitwise plain's, with
    fewer graphs than pairs."""
    graphs = steady_graphs(monkeypatch)
    torch.manual_seed(0)
    layers = [_Reshaping() for _ in range(2)]
    plain = [_Reshaping() for _ in range(2)]
    for a, b in zip(layers, plain):
        b.load_state_dict(a.state_dict())

    def run(calls, mods, x, keep):
        x = x.clone().requires_grad_()
        y = x
        for m in calls:
            y = m(y, keep)
            keep = y.shape[1]
        (y * y).sum().backward()
        out = [x.grad, *(p.grad.clone() for m in mods for p in m.parameters())]
        for m in mods:
            m.zero_grad(set_to_none=True)
        return out

    scoped = [gradient_scope.recompute(m.forward) for m in layers]
    for n, keep in [(3, 2), (5, 4), (6, 3), (9, 9), (4, 1), (7, 6), (8, 2)] * 2:
        x = torch.randn(2, n, 8)
        got, want = run(scoped, layers, x, keep), run(plain, plain, x, keep)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), (n, keep)
    # fewer graphs than pairs (dynamo specialises a few: an int of 1, a slice to the end)
    assert any(g.dynamic for g in graphs) and len(graphs) < 7, [g.dynamic for g in graphs]
    assert fast, "no run was steady"


def test_a_graph_keeps_a_bounded_number_of_templates(fast, monkeypatch):
    """Past ``TEMPLATES_KEPT`` lengths the oldest template goes; a length seen again after is
    recorded once more (its first run) and is plain's."""
    monkeypatch.setattr(steady, "TEMPLATES_KEPT", 3)
    graphs = steady_graphs(monkeypatch)
    model, plain = apply_recompute(tiny_llama(3, use_cache=False), _is_layer), tiny_llama(3, use_cache=False)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(3, VOCAB, (1, n), generator=g) for n in (5, 6, 7, 8, 9, 5)]
    for ids in batches:
        assert _same(_step(model, input_ids=ids, labels=ids), _step(plain, input_ids=ids, labels=ids)), ids.shape
    dynamic = [g for g in graphs if g.dynamic]
    assert len(dynamic) == 1 and len(dynamic[0].templates) <= 3 and len(dynamic[0].unverified) <= 3
    before = gradient_scope.model_stats(model)
    ids = batches[1]  # length 6: its template was dropped
    assert _same(_step(model, input_ids=ids, labels=ids), _step(plain, input_ids=ids, labels=ids))
    stats = gradient_scope.model_stats(model) - before
    assert stats.recorded_why.get("first run of a graph") == 1, stats


def test_a_function_that_changes_at_every_call_stops_capturing(fast, monkeypatch, caplog):
    """D8 [ captures must be reused ]: a layer that reads a constant changed at every call (dynamo
    guards on it: a new graph each time) gets ``CAPTURES_FREE`` captures, then its calls are
    recorded without starting one; with no graph ever run again it is recorded for good, said
    once at INFO. Every call computes plain's values."""
    from gradient_scope._adapters.steady import reuse

    monkeypatch.setattr(reuse, "HELD_MAX", 6)
    graphs = steady_graphs(monkeypatch)
    lin = nn.Linear(4, 4)
    state = {"scale": 1.0}

    def layer(x):
        return torch.tanh(lin(x) * state["scale"])

    scoped = gradient_scope.recompute(layer)
    with caplog.at_level("INFO", logger="gradient_scope"):
        for k in range(20):
            state["scale"] = 1.0 + k / 8
            x = torch.randn(3, 4, requires_grad=True)
            y = scoped(x)
            y.sum().backward()
            gx = x.grad.clone()
            x.grad = None
            with torch.no_grad():
                want = torch.tanh(lin(x) * state["scale"])
            assert torch.equal(y.detach(), want), k
            x2 = x.detach().clone().requires_grad_()
            torch.tanh(lin(x2) * state["scale"]).sum().backward()
            assert torch.equal(gx, x2.grad), k
    assert len(graphs) == reuse.CAPTURES_FREE, len(graphs)
    lines = [r.getMessage() for r in caplog.records if "recorded from now on" in r.getMessage()]
    assert len(lines) == 1 and "none is run again" in lines[0], lines


def test_a_kv_cache_at_a_new_length_runs_steady_from_its_second_step(fast):
    """With the cache on (``use_cache=True``, a config's default), each layer's graph writes the
    KV cache: tensors the block makes and the cache keeps, which steady runs take from the graph's
    values (T6 [ kept ops' outputs taken from the graph ]). A new length's first step records each
    layer's template and finds those values in the same run: at the length's second step every
    layer runs steady but the one whose graph is checked against an eager run (D6), and every step
    is plain's, bitwise."""
    model, plain = apply_recompute(tiny_llama(4), _is_layer), tiny_llama(4)
    assert model.config.use_cache
    g = torch.Generator().manual_seed(0)
    first, second = (torch.randint(3, VOCAB, (2, n), generator=g) for n in (6, 9))
    for ids in (first, first, first, second):
        assert _same(_step(model, input_ids=ids, labels=ids), _step(plain, input_ids=ids, labels=ids)), ids.shape
    before = gradient_scope.model_stats(model)
    assert _same(_step(model, input_ids=second, labels=second), _step(plain, input_ids=second, labels=second))
    stats = gradient_scope.model_stats(model) - before
    assert (stats.calls_steady, stats.recorded_why) == (3, {"graph checked against an eager run": 1}), stats
