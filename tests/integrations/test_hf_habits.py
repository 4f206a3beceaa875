"""A Hugging Face fine-tuner's habits (issue 38): custom loops that keep the output through
backward, HF's own spelling of the options, and names that suggest the right one.

Memory is the benchmarks' validated probe (``benchmarks._harness.memory.measure``): bytes
allocated during the forward and still allocated when it returns.
"""

import gc
import logging
import warnings

import pytest
import torch
import transformers

import gradient_scope
import gradient_scope.integrations.transformers as gs_hf
from benchmarks._harness.memory import measure
from gradient_scope import Budget, apply_recompute

from support import hf_models, pinned_cpu_rates
from support.hf_models import SEQ, VOCAB

IDS = torch.randint(3, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(1))


def llama(seed=0):
    return hf_models.make_model("llama", layers=4, seed=seed).train()


def held_with_output_alive(model):
    """(bytes the forward left allocated, the loop's ``outputs``, the gradients) of one step
    of a run_clm_no_trainer-style loop: ``outputs = model(**batch)`` stays alive through
    backward."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(2)  # dropout masks
    gc.collect()
    outputs, held, _ = measure(lambda: model(input_ids=IDS, labels=IDS), lambda o: o.loss.backward())
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return held, outputs, grads


def returned_bytes(outputs):
    """What the forward returns to the caller: the loss and the logits."""
    return outputs.loss.untyped_storage().nbytes() + outputs.logits.untyped_storage().nbytes()


# -- 1. the KV cache in training


def test_enable_keeps_no_kv_cache_in_training_and_holds_no_more_than_hf_checkpointing(caplog):
    plain_held, plain_out, plain_grads = held_with_output_alive(llama())
    assert plain_out.cache is not None  # (what the plain model keeps: the cache)

    hf = llama()
    hf.activation_checkpointing_enable()
    hf_held, hf_out, _ = held_with_output_alive(hf)
    assert hf_out.cache is None

    model = gs_hf.enable(llama())
    with caplog.at_level(logging.INFO, logger="gradient_scope"):
        held, outputs, grads = held_with_output_alive(model)
        held_again, _, _ = held_with_output_alive(model)
        held_third, _, _ = held_with_output_alive(model)
    assert outputs.cache is None
    assert held <= hf_held < plain_held
    # Nothing grows from step to step. Under GRADIENT_SCOPE_FAST=1 the first step captures the
    # layers and 96 bytes it allocates stay alive for good (a one-off: every later step holds
    # the same): steps 2 and 3 are the ones to compare.
    assert held_third == held_again <= held
    assert grads.keys() == plain_grads.keys()
    for name, g in grads.items():
        assert torch.equal(g, plain_grads[name]), name
    # Said once (three steps), at WARNING as transformers says it for its own checkpointing.
    said = [r for r in caplog.records if r.name == "gradient_scope" and "use_cache=False" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING
    assert "LlamaForCausalLM" in said[0].getMessage()


def test_an_explicit_use_cache_true_is_turned_off_in_training_only():
    model = gs_hf.enable(llama())
    assert model(input_ids=IDS, use_cache=True).cache is None
    with torch.no_grad():  # generation: no backward, the cache stays
        assert model(input_ids=IDS, use_cache=True).cache is not None
    model.eval()
    assert model(input_ids=IDS).cache is not None
    gs_hf.disable(model)
    model.train()
    assert model(input_ids=IDS, use_cache=True).cache is not None  # disable removes the hooks


def test_a_cache_passed_to_a_scoped_layer_is_dropped_as_transformers_drops_it():
    model = gs_hf.enable(llama(), every_n_layers=2)
    layers = [m for m in model.modules() if isinstance(m, transformers.modeling_layers.GradientCheckpointingLayer)]
    cache = transformers.DynamicCache(config=model.config)
    model(input_ids=IDS, cache=cache, use_cache=True).logits.sum().backward()
    # Layers 0 and 2 run in scopes and got no cache; 1 and 3 (not scoped) filled theirs.
    assert [layer.keys is not None and layer.keys.numel() > 0 for layer in cache.layers] == [
        False,
        True,
        False,
        True,
    ]
    assert len(layers) == 4


def test_a_budget_counts_what_the_model_keeps_with_the_output_alive():
    """The held bytes are the plan's, to the byte: nothing the budget does not see (a cache)
    stays with the output."""
    model = llama()
    budget = Budget(200_000)
    gs_hf.enable(model, budget=budget)
    with pinned_cpu_rates(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the first step measures)
        steps = [held_with_output_alive(model) for _ in range(3)]
    for held, outputs, _ in steps[1:]:
        assert held - returned_bytes(outputs) == budget.planned_bytes <= budget.bytes


# -- 2. HF's own words, and the right name for a misspelled one


def grads_of(model):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(2)
    model(input_ids=IDS, labels=IDS).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_enable_takes_transformers_every_n_layers_and_offload():
    plain = grads_of(llama())
    model = llama()
    gs_hf.enable(model, every_n_layers=2, offload=True)
    scoped = [m for m in model.modules() if "forward" in m.__dict__]
    assert scoped == [model.model.layers[0], model.model.layers[2]]
    budget = scoped[0].forward.options["budget"]
    assert (budget.bytes, budget.offload) == (0, float("inf"))  # Budget(0, offload=True)
    # On the CPU there is nowhere to offload to: one warning says so; the floor does not
    # warn (offload=True asks for the least).
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = [grads_of(model) for _ in range(3)]
    assert [str(w.message) for w in caught if w.category is not FutureWarning] == [
        "gradient_scope: Budget(offload=...) changes nothing here: the tensors are on the cpu, which has no "
        "host memory to offload to. The budget keeps or recomputes."
    ]
    assert budget.planned_bytes == budget.floor_bytes
    for g in got:
        for name, value in g.items():
            assert torch.equal(value, plain[name]), name


def test_enable_offload_with_a_budget():
    model = gs_hf.enable(llama(), offload=True, budget="1MiB")
    budget = model.model.layers[0].forward.options["budget"]
    assert (budget.bytes, budget.offload) == (2**20, float("inf"))
    with pytest.raises(ValueError, match=r"budget=Budget\(1000, offload=True\) instead"):
        gs_hf.enable(llama(), offload=True, budget=Budget(1000))
    with pytest.raises(TypeError, match="offload must be a bool"):
        gs_hf.enable(llama(), offload="yes")


@pytest.mark.parametrize(
    "call, meant",
    [
        (lambda: gs_hf.enable(llama(), every_n_layer=2), "every_n_layers"),
        (lambda: gs_hf.enable(llama(), ofload=True), "offload"),
        (lambda: apply_recompute(torch.nn.Sequential(torch.nn.Linear(2, 2)), every_n_layer=2), "every_n_layers"),
        (lambda: apply_recompute(torch.nn.Sequential(torch.nn.Linear(2, 2)), check_fns=len), "check_fn"),
        (lambda: Budget("8GiB", offlod=True), "offload"),
        (lambda: Budget("8GiB", budgte=1), "budget"),
    ],
)
def test_a_misspelled_option_names_the_one_meant(call, meant):
    with pytest.raises(TypeError, match=f"did you mean '{meant}'"):
        call()


def test_budget_signature_shows_the_real_options():
    import inspect

    assert list(inspect.signature(Budget).parameters) == ["budget", "offload"]


@pytest.mark.parametrize("size", ["-1GiB", -1, "-0.5 MB", " - 2 KiB"])
def test_a_negative_budget_says_it_is_negative(size):
    with pytest.raises(ValueError, match="is negative"):
        Budget(size)
    with pytest.raises(ValueError, match="offload: .* is negative"):
        Budget("1GiB", offload=size)


# -- 5. Is it on? model_stats under torch.compile


def test_model_stats_says_what_compiled_scopes_recompute():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        *[torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16)) for _ in range(2)]
    )
    apply_recompute(model, check_fn=lambda m: m in list(model))
    x = torch.randn(8, 16, requires_grad=True)
    try:
        compiled = torch.compile(model, backend="aot_eager")
        for _ in range(2):  # compiled once: the figures are the graph's, not a count per call
            compiled(x).sum().backward()
        stats = gradient_scope.model_stats(model, reset=True)
    finally:
        torch._dynamo.reset()
    # Per call, compiled scopes count nothing (no Python runs per op in a graph) ...
    assert (stats.ops_recorded, stats.tensors_packed, stats.replays) == (0, 0, 0)
    # ... and what their graphs recompute is there, per module: each block's hidden
    # (8 x 64 float32: the linear's output and the GELU's), and block 0's output, which
    # block 1's first linear saves (8 x 16 float32).
    hidden, out = 8 * 64 * 4, 8 * 16 * 4
    assert {k: (s.ops_recorded, s.tensors_packed, s.bytes_packed) for k, s in stats.compiled.items()} == {
        "0": (5, 3, 2 * hidden + out),
        "1": (5, 2, 2 * hidden),
    }
    text = str(stats)
    assert "compiled: 2 scoped modules ran in torch.compile graphs" in text
    assert f"recompute 5 tensors ({4 * hidden + out} bytes) of 10 block ops" in text
    assert "compiled=" in repr(stats)
    assert gradient_scope.model_stats(model).compiled == stats.compiled  # reset keeps what the graphs hold


# -- 4. Plans you can read


def test_stored_ops_name_the_module_the_line_and_why(monkeypatch):
    # The recorded path: a plan measured in a steady run names the captured graph, not the
    # module inside the layer (docs/limitations.md).
    monkeypatch.setenv("GRADIENT_SCOPE_FAST", "0")
    model = hf_models.make_model("llama", layers=2, seed=0).train()
    budget = Budget(100_000)
    gs_hf.enable(model, budget=budget)
    with pinned_cpu_rates(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(3):  # measured, then planned twice: the plan keeps what was measured
            model(input_ids=IDS, labels=IDS).loss.backward()
    rows = budget.stored_ops()
    assert {r.how for r in rows} == {"kept", "recomputed"}
    # The report's words for where a save ran: the module inside the layer, the source line.
    report_modules = {name for name, _ in model.named_modules()}
    assert all(r.module in report_modules and r.line.endswith(tuple(f":{n}" for n in range(1, 10000))) for r in rows)
    q_proj = [r for r in rows if r.module == "model.layers.0.self_attn.q_proj"]
    assert q_proj and all(r.line.startswith("modeling_llama.py:") for r in q_proj)
    for r in rows:
        assert r.why.startswith(f"{r.how}:" if r.nbytes else "in memory anyway"), r
        if r.nbytes and r.how == "kept":
            assert "among the most per byte that fit the budget" in r.why
    # Kept rows spare more recompute per byte than recomputed ones (the plan's order, K3).
    table = budget.stored_table()
    lines = table.splitlines()
    assert lines[0].split() == ["module", "kept", "offloaded", "recomputed"]
    assert {line.split()[0] for line in lines[2:]} == {r.module for r in rows}
    assert "modeling_llama.py:244" in budget.stored_table(by="op")
    with pytest.raises(ValueError, match="by must be one of"):
        budget.stored_table(by="layer")
