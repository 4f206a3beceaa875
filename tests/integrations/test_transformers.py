"""Hugging Face transformers models (tiny configs, random weights, dropout on).

The one-liners the README documents:

* ``apply_recompute(model, check_fn=GradientCheckpointingLayer)``: a scope per
  decoder/encoder layer (every transformers layer derives from that class);
* ``model._set_gradient_checkpointing(True, gradient_checkpointing_func=gradient_scope.checkpoint)``:
  transformers' own gradient-checkpointing switch, running each layer through
  ``gradient_scope.checkpoint``.

Each gives gradients bitwise equal to the plain model (same seeds) and holds less
memory after forward (the validated CPU probe of ``benchmarks/_harness/memory.py``).
"""

import gc
import re

import pytest
import torch
from transformers.modeling_layers import GradientCheckpointingLayer

import gradient_scope
from benchmarks._harness.memory import profile_cpu_memory
from gradient_scope import apply_recompute, remove_recompute, saved_tensors_report

from support import hf_models
from support.hf_models import SEQ, VOCAB


def make_model(kind):
    return hf_models.make_model(kind, layers=2)


MODELS = ["gpt2", "llama", "bert"]


def step(kind, setup=None, report=False):
    """Forward + backward of a fresh model (train mode) under the memory probe.

    Returns dict(loss, grads, held, report)."""
    torch.manual_seed(0)
    model = make_model(kind)
    model.train()
    if setup is not None:
        setup(model)
    ids = torch.randint(3, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    box = {}

    def forward():
        torch.manual_seed(2)  # dropout masks
        if report:
            with saved_tensors_report() as box["report"]:
                return model(input_ids=ids, labels=ids).loss
        return model(input_ids=ids, labels=ids).loss

    gc.collect()  # (earlier tests' garbage, collected during the forward, would count as freed)
    loss, held, _ = profile_cpu_memory(forward, lambda loss: loss.backward())
    grads = {name: p.grad for name, p in model.named_parameters()}
    return dict(loss=loss.detach(), grads=grads, held=held, report=box.get("report"), model=model)


def assert_same_gradients(a, b):
    assert torch.equal(a["loss"], b["loss"])
    assert a["grads"].keys() == b["grads"].keys()
    for name, g in b["grads"].items():
        assert g is not None, name
        assert torch.equal(a["grads"][name], g), f"{name}: max |diff| {(a['grads'][name] - g).abs().max().item()}"


@pytest.mark.parametrize("kind", MODELS)
def test_layers_share_gradient_checkpointing_layer(kind):
    model = make_model(kind)
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    assert len(layers) == 2


@pytest.mark.parametrize("kind", MODELS)
def test_apply_recompute_per_layer(kind):
    plain = step(kind)
    scoped = step(kind, lambda m: apply_recompute(m, check_fn=GradientCheckpointingLayer))
    assert_same_gradients(scoped, plain)
    assert scoped["held"] < 0.6 * plain["held"], (scoped["held"], plain["held"])
    wrapped = [m for m in scoped["model"].modules() if "forward" in vars(m)]
    assert len(wrapped) == 2 and all(isinstance(m, GradientCheckpointingLayer) for m in wrapped)
    remove_recompute(scoped["model"])
    assert not any("forward" in vars(m) for m in scoped["model"].modules())


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_transformers_checkpointing_switch_with_gradient_scope_checkpoint(kind):
    plain = step(kind)
    calls = []

    def counting(function, *args, **kwargs):
        calls.append(function)
        return gradient_scope.checkpoint(function, *args, **kwargs)

    scoped = step(kind, lambda m: m._set_gradient_checkpointing(True, gradient_checkpointing_func=counting))
    assert len(calls) == 2  # one per layer
    assert_same_gradients(scoped, plain)
    assert scoped["held"] < 0.6 * plain["held"], (scoped["held"], plain["held"])


def test_report_on_gpt2_shows_what_the_scopes_removed():
    plain = step("gpt2", report=True)
    scoped = step("gpt2", lambda m: apply_recompute(m, check_fn=GradientCheckpointingLayer), report=True)
    assert_same_gradients(scoped, plain)
    p, s = plain["report"], scoped["report"]
    modules = {r.module for r in p.rows}
    assert {"transformer.h.0.attn", "transformer.h.1.mlp.act", "transformer.h.0.attn.c_attn", "lm_head"} <= modules
    assert p.recomputable_bytes == 0 and s.recomputable_bytes > 0
    # Every storage the plain model stores is either stored or a handle with scopes.
    assert p.stored_bytes == s.stored_bytes + s.recomputable_bytes
    assert s.stored_bytes < 0.7 * p.stored_bytes
    # Both reports see every save: the same count per (module, op).
    assert {(r.module, r.op): r.count for r in p.rows} == {(r.module, r.op): r.count for r in s.rows}
    # Handles come from the layers' tensors: saved inside the layers, and the last
    # layer's output saved by the final LayerNorm.
    outside = {r.module for r in s.rows if r.recomputable_bytes and not r.module.startswith("transformer.h.")}
    assert outside == {"transformer.ln_f"}


@pytest.mark.parametrize("recipe", ["plain", "per_layer", "per_layer_save_matmuls"])
def test_report_on_llama_activations_are_what_forward_holds(recipe):
    """activation_bytes (+ what scopes hold) is what forward holds; parameters,
    saved as well, are apart and at the bottom of the table."""
    setup = {
        "plain": None,
        "per_layer": lambda m: apply_recompute(m, check_fn=GradientCheckpointingLayer),
        "per_layer_save_matmuls": lambda m: apply_recompute(
            m, check_fn=GradientCheckpointingLayer, save=gradient_scope.save_matmuls
        ),
    }[recipe]
    run = step("llama", setup, report=True)
    report = run["report"]
    # Held after forward: the activations autograd keeps, what scopes keep for replay
    # (outside tensors their blocks read, RNG states of dropout), and the loss scalar.
    assert report.activation_bytes + report.held_by_scopes_bytes == run["held"] - 4
    assert (report.held_by_scopes_bytes == 0) == (recipe == "plain")
    saved_params = {p.untyped_storage()._cdata: p.nbytes for p in run["model"].parameters()}
    assert 0 < report.param_bytes <= sum(saved_params.values()) + 2 * SEQ * 8  # weights, input_ids
    # Rows rank by what scoping can change; rows that save only parameters come last.
    rows = report.rows
    only_params = [i for i, r in enumerate(rows) if r.activation_bytes + r.recomputable_bytes == 0]
    assert only_params and only_params == list(range(len(rows) - len(only_params), len(rows)))
    assert all(re.fullmatch(r"\w+\.py:\d+", r.largest_source) for r in rows[:5])
