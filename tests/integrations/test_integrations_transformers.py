"""gradient_scope.integrations.transformers: enable/disable on Hugging Face models.

Tiny GPT-2, Llama and BERT built from configs with random weights (dropout on, no
downloads). Ground truth is the same model without scopes, same seeds: gradients
and trained weights bitwise equal. Double work is counted directly: transformers'
checkpointing re-runs each layer's Python forward in backward, so a submodule's
forward hook fires twice per step; with scopes it fires once.
"""

import logging
import warnings

import pytest
import torch
import transformers
from transformers.modeling_layers import GradientCheckpointingLayer

import gradient_scope
import gradient_scope.integrations.transformers as gs_hf
from gradient_scope import apply_recompute, remove_recompute

from support import ROOT, hf_models
from support.hf_models import SEQ, VOCAB


def make_model(kind, seed=0):
    return hf_models.make_model(kind, layers=3, seed=seed)


def layers_of(model):
    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


IDS = torch.randint(3, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))


def grads_after_step(model):
    model.train()
    torch.manual_seed(2)  # dropout masks
    loss = model(input_ids=IDS, labels=IDS).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def assert_same(a, b):
    (la, ga), (lb, gb) = a, b
    assert torch.equal(la, lb)
    assert ga.keys() == gb.keys()
    for name, g in ga.items():
        assert g is not None and gb[name] is not None, name
        assert torch.equal(g, gb[name]), name


def count_layer_forwards(model):
    """Forward calls of each layer's first child (run through __call__, also when
    transformers' checkpoint re-runs the layer's forward in backward)."""
    calls = []
    for layer in layers_of(model):
        child = next(layer.children())
        child.register_forward_hook(lambda *_: calls.append(1))
    return calls


@pytest.mark.parametrize("kind", ["gpt2", "llama", "bert"])
@pytest.mark.parametrize("every", [1, 2])
def test_enable_gives_plain_gradients(kind, every):
    plain = grads_after_step(make_model(kind))
    model = gs_hf.enable(make_model(kind), every_n_layers=every)
    scoped_layers = [m for m in layers_of(model) if "forward" in vars(m)]
    assert scoped_layers == layers_of(model)[::every]
    calls = count_layer_forwards(model)
    assert_same(grads_after_step(model), plain)
    assert len(calls) == 3  # each layer ran once: nothing recomputed twice


def test_scopes_recompute_the_layers(monkeypatch):
    model = gs_hf.enable(make_model("llama"))
    stats = []
    enter = gradient_scope.recompute_scope.__enter__

    def spy(self):
        stats.append(self.stats)
        return enter(self)

    monkeypatch.setattr(gradient_scope.recompute_scope, "__enter__", spy)
    grads_after_step(model)
    assert len(stats) == 3
    assert all(s.tensors_packed > 0 and s.replays > 0 for s in stats)


def test_scope_options_pass_through():
    model = gs_hf.enable(make_model("llama"), save=gradient_scope.save_matmuls, debug=True)
    assert_same(grads_after_step(model), grads_after_step(make_model("llama")))
    with pytest.raises(TypeError, match="'no_such_option'"):
        gs_hf.enable(make_model("llama"), no_such_option=1)
    fresh = make_model("llama")
    with pytest.raises(TypeError, match="enabled must be a bool"):
        gs_hf.enable(fresh, enabled="yes")
    assert not any("forward" in vars(m) for m in fresh.modules())  # nothing changed
    assert fresh not in gs_hf._ENABLED


def test_bad_arguments():
    with pytest.raises(ValueError, match="no transformers GradientCheckpointingLayer"):
        gs_hf.enable(torch.nn.Linear(2, 2))
    for n in (0, -1, 1.0, True):
        with pytest.raises(ValueError, match="every_n_layers"):
            gs_hf.enable(make_model("gpt2"), every_n_layers=n)
    with pytest.raises(ValueError, match="was not called"):
        gs_hf.disable(make_model("gpt2"))


@pytest.mark.parametrize("order", ["hf_first", "scopes_first"])
@pytest.mark.parametrize("switch", ["activation_checkpointing_enable", "gradient_checkpointing_enable"])
def test_hf_checkpointing_too_warns_once_and_scopes_win(order, switch):
    plain = grads_after_step(make_model("llama"))
    model = make_model("llama")
    calls = count_layer_forwards(model)

    def hf_on():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # gradient_checkpointing_enable is deprecated
            getattr(model, switch)()
        assert model.is_activation_checkpointing

    if order == "hf_first":
        hf_on()
        gs_hf.enable(model)
    else:
        gs_hf.enable(model)
        hf_on()
    with pytest.warns(UserWarning, match="own activation checkpointing was on") as caught:
        got = grads_after_step(model)
    [warned] = [w for w in caught if "activation checkpointing" in str(w.message)]
    assert warned.filename == __file__  # the user's line (the model's call), not torch's
    assert not model.is_activation_checkpointing
    assert len(calls) == 3  # no layer ran twice
    assert_same(got, plain)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the next steps: no warning
        model.zero_grad()
        assert_same(grads_after_step(model), plain)


def test_guard_waits_for_a_training_forward():
    model = gs_hf.enable(make_model("gpt2"))
    model.activation_checkpointing_enable()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.eval()
        model(input_ids=IDS)
        model.train()
        with torch.no_grad():
            model(input_ids=IDS)
    assert model.is_activation_checkpointing
    with pytest.warns(UserWarning, match="own activation checkpointing"):
        model(input_ids=IDS)
    assert not model.is_activation_checkpointing


def test_disable_restores_exactly():
    model = make_model("llama")
    layers = layers_of(model)
    apply_recompute(layers[1].mlp, check_fn=type(layers[1].mlp))  # the user's own scope: stays
    own_forward = layers[2].forward
    layers[2].forward = own_forward  # an instance attribute of the user's: put back
    before = {id(m): vars(m).get("forward") for m in model.modules()}
    hooks_before = len(model._forward_pre_hooks)
    gs_hf.enable(model, every_n_layers=1)
    gs_hf.enable(model, every_n_layers=2)  # again: replaces, does not stack
    assert [m for m in layers if isinstance(vars(m).get("forward"), type(vars(layers[1].mlp)["forward"]))] == [
        layers[0],
        layers[2],
    ]
    gs_hf.disable(model)
    assert {id(m): vars(m).get("forward") for m in model.modules()} == before
    assert vars(layers[2])["forward"] is own_forward
    assert len(model._forward_pre_hooks) == hooks_before
    # The guard is gone: transformers' checkpointing runs unchallenged (each layer twice).
    calls = count_layer_forwards(model)
    model.activation_checkpointing_enable()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        grads_after_step(model)
    assert len(calls) == 6
    remove_recompute(model)
    model.activation_checkpointing_disable()
    model.zero_grad()
    assert_same(grads_after_step(model), grads_after_step(make_model("llama")))


def _dataset(n=4):
    g = torch.Generator().manual_seed(3)
    rows = []
    for _ in range(n):
        ids = torch.randint(3, VOCAB, (SEQ,), generator=g)
        rows.append({"input_ids": ids, "labels": ids.clone()})
    return rows


def _train(model, tmp_path, **args):
    targs = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=2,
        per_device_train_batch_size=2,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        seed=0,
        **args,
    )
    transformers.Trainer(model=model, args=targs, train_dataset=_dataset()).train()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("activation_checkpointing", [False, True])
def test_trainer_two_steps(tmp_path, activation_checkpointing):
    plain = _train(make_model("llama"), tmp_path)
    model = gs_hf.enable(make_model("llama"))
    calls = count_layer_forwards(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scoped = _train(model, tmp_path, activation_checkpointing=activation_checkpointing)
    ours = [w for w in caught if "gradient_scope" in str(w.message)]
    assert len(ours) == (1 if activation_checkpointing else 0), [str(w.message) for w in ours]
    assert len(calls) == 2 * 3  # two steps, each layer once
    assert scoped.keys() == plain.keys()
    for name, p in plain.items():
        assert torch.equal(scoped[name], p), name


def _lora(model):
    peft = pytest.importorskip("peft", reason="peft (the test extra) is not installed")
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.1,
                          init_lora_weights=False)  # fmt: skip
    return peft.get_peft_model(model, cfg)


def test_peft_lora_adapter():
    plain = grads_after_step(_lora(make_model("llama")))
    model = gs_hf.enable(_lora(make_model("llama")))
    assert [m for m in layers_of(model) if "forward" in vars(m)] == layers_of(model)
    got = grads_after_step(model)
    assert {n for n in got[1]} == {n for n in plain[1]} and all("lora_" in n for n in got[1])
    assert_same(got, plain)
    gs_hf.disable(model)
    assert not any("forward" in vars(m) for m in model.modules())


def test_enable_on_the_base_model_before_get_peft_model():
    pytest.importorskip("peft", reason="peft (the test extra) is not installed")
    plain = grads_after_step(_lora(make_model("llama")))
    model = _lora(gs_hf.enable(make_model("llama")))
    assert_same(grads_after_step(model), plain)


def test_recompute_error_names_the_layer_path():
    model = gs_hf.enable(make_model("llama"))
    model.train()
    loss = model(input_ids=IDS, labels=IDS).loss
    weight = model.model.layers[1].mlp.gate_proj.weight
    weight.data = torch.randn_like(weight)  # new weights loaded before backward
    with pytest.raises(gradient_scope.RecomputeError) as info:
        loss.backward()
    msg = str(info.value)
    assert "The block: model.layers.1 (LlamaDecoderLayer), scoped by apply_recompute." in msg
    assert "was given another storage after the block" in msg


def test_docs_recipes_run(tmp_path, monkeypatch):
    """Every Python block of docs/huggingface.md runs as written."""
    import re

    page = ROOT / "docs" / "huggingface.md"
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)
    assert len(blocks) == 4
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    for code in blocks:
        exec(compile(code, str(page), "exec"), {"__name__": "__docs__"})


def test_enable_logs_the_layers_it_scoped(caplog):
    model = make_model("llama")
    with caplog.at_level(logging.INFO, logger="gradient_scope"):
        gs_hf.enable(model, every_n_layers=2, save=gradient_scope.save_matmuls)
    [record] = [r for r in caplog.records if r.name == "gradient_scope"]
    assert record.levelno == logging.INFO
    assert record.getMessage() == (
        "enable: scoped 2 of 3 layers (model.layers.0, model.layers.2) of LlamaForCausalLM "
        "with every_n_layers=2, save=save_matmuls"
    )
    gs_hf.disable(model)
