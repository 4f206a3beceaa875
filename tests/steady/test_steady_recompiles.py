"""The steady state's captures have a recompile budget of their own (Q4 in
``gradient_scope/_adapters/dynamo.py``): Hugging Face layers with the KV cache on (a graph per
layer) and batches padded to their longest row run steady with the plain program's gradients,
and the user's own ``torch.compile`` of the same layer keeps its own limit."""

from __future__ import annotations

import torch
import transformers

import gradient_scope
from gradient_scope import apply_recompute

from support.hf_models import VOCAB, tiny_llama, users_compile


def _layers(model):
    return apply_recompute(model, lambda m: isinstance(m, transformers.models.llama.modeling_llama.LlamaDecoderLayer))


def _step(model, ids):
    torch.manual_seed(1)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    out = (loss.detach(), [p.grad.clone() for p in model.parameters()])
    model.zero_grad(set_to_none=True)
    return out


def _assert_same(model, plain, lengths, batch=2):
    g = torch.Generator().manual_seed(0)
    for length in lengths:
        ids = torch.randint(3, VOCAB, (batch, length), generator=g)
        (loss, grads), (loss_p, grads_p) = _step(model, ids), _step(plain, ids)
        assert torch.equal(loss, loss_p), length
        assert all(torch.equal(a, b) for a, b in zip(grads, grads_p)), length


def test_ten_layers_with_the_kv_cache_on_all_run_steady(fast):
    """use_cache=True (the config's default) through apply_recompute: the model writes every
    layer's keys and values into its cache, so dynamo makes a graph per layer (each indexes its
    own slot); ten graphs fit our captures' own budget (dynamo's default limit is 8), and
    once captured every layer runs steady, with plain's gradients."""
    model, plain = _layers(tiny_llama(10)), tiny_llama(10)
    _assert_same(model, plain, [9, 9, 9])
    before = gradient_scope.model_stats(model)
    assert "dynamo could not capture" not in before.recorded_why, before.recorded_why
    _assert_same(model, plain, [9])
    stats = gradient_scope.model_stats(model) - before
    assert stats.calls_steady == 10, stats


def test_users_compile_keeps_its_budget_after_our_captures_at_twelve_lengths(fast, capfd):
    """After 4 layers x 12 lengths of steady runs (graphs of the layers' code in our own
    region: one static, one with the length symbolic), every length runs steady from its third
    layer on, and the user's own compile of a function, and of one of the layers, compiles
    within its own limit of 8; dynamo's configuration is as it was."""
    config = torch._dynamo.config.get_config_copy()
    model = _layers(tiny_llama(4, use_cache=False))
    g = torch.Generator().manual_seed(0)
    for length in range(4, 16):
        ids = torch.randint(3, VOCAB, (2, length), generator=g)
        model(input_ids=ids, labels=ids).loss.backward()
    stats = gradient_scope.model_stats(model)
    assert stats.calls_steady >= 2 * 12 and "dynamo could not capture" not in stats.recorded_why, stats
    assert torch._dynamo.config.get_config_copy() == config

    graphs, backend = users_compile(8)  # eight shapes: eight graphs, at the recompile limit of 8
    assert len(graphs) == 8
    layer = model.model.layers[0]
    compiled_layer = torch.compile(layer, backend=backend, dynamic=False, fullgraph=True)
    position = torch.arange(5)[None]
    rotary = model.model.rotary_emb(torch.ones(1, 5, 32), position)
    out = compiled_layer(torch.randn(1, 5, 32), position_embeddings=rotary, position_ids=position)
    assert len(graphs) == 9 and out.shape == (1, 5, 32)
    assert "recompile" not in capfd.readouterr().err
