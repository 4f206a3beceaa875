"""model_stats under torch.compile for the function form (issue 38, item 5).

``gradient_scope.checkpoint(module, ...)`` called in compiled code is part of the compiled
graph, which counts nothing per call; ``model_stats(model).compiled`` says, per module,
what the compiled graphs of its calls recompute, as it does for ``apply_recompute``
(tests/integrations/test_hf_habits.py). Reference: the same model scoped by
apply_recompute and compiled the same way.
"""

import functools

import pytest
import torch
import torch.nn as nn
import transformers

import gradient_scope
import gradient_scope._adapters.compile.graph as gs_compile
from gradient_scope import apply_recompute, model_stats

from support import ResidualFF

pytestmark = [
    pytest.mark.skipif(
        gs_compile._MISSING is not None,
        reason=f"torch {torch.__version__} lacks {gs_compile._MISSING}: compiled scopes run eagerly",
    ),
    pytest.mark.usefixtures("fresh_dynamo"),  # tests/conftest.py
]


CALLS = {
    "module": lambda block, x: gradient_scope.checkpoint(block, x, use_reentrant=False),
    "bound forward": lambda block, x: gradient_scope.checkpoint(block.forward, x),
    "bound __call__": lambda block, x: gradient_scope.checkpoint(block.__call__, x),
    # transformers' form: partial(layer.__call__, **kwargs)
    "partial": lambda block, x: gradient_scope.checkpoint(functools.partial(block.__call__), x),
    "apply_recompute": lambda block, x: block(x),
}


class Net(nn.Module):
    def __init__(self, call):
        super().__init__()
        self.call = call
        self.blocks = nn.ModuleList(ResidualFF() for _ in range(2))
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        for block in self.blocks:
            x = CALLS[self.call](block, x)
        return self.head(x)


def run(call, steps=2):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Net(call)
    if call == "apply_recompute":
        apply_recompute(model, check_fn=ResidualFF)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)  # (no graph break)
    x = torch.randn(8, 16, requires_grad=True)
    for _ in range(steps):  # compiled once: the figures are the graph's, not a count per call
        compiled(x).sum().backward()
    return model, [p.grad.clone() for p in model.parameters()]


def figures(stats):
    return {k: (s.ops_recorded, s.tensors_packed, s.bytes_packed) for k, s in stats.compiled.items()}


@pytest.mark.parametrize("call", ["module", "bound forward", "bound __call__", "partial"])
def test_checkpoint_in_compiled_code_shows_what_its_graphs_recompute(call):
    expected_model, expected_grads = run("apply_recompute")
    expected = model_stats(expected_model)
    model, grads = run(call)
    stats = model_stats(model, reset=True)
    # Per call nothing is counted (no Python runs per op in a graph) ...
    assert (stats.ops_recorded, stats.tensors_packed, stats.replays) == (0, 0, 0)
    # ... what the graphs recompute is there, per module, as apply_recompute's.
    assert figures(stats) == figures(expected)
    assert list(figures(stats)) == ["blocks.0", "blocks.1"]
    assert all(t > 0 and b > 0 for _, t, b in figures(stats).values())
    assert list(stats.modules) == ["blocks.0", "blocks.1"]
    assert "compiled: 2 scoped modules ran in torch.compile graphs" in str(stats)
    assert model_stats(model).compiled == stats.compiled  # reset keeps what the graphs hold
    for a, e in zip(grads, expected_grads):
        assert torch.equal(a, e)


def test_eager_then_compiled_calls_count_in_their_own_fields():
    torch.manual_seed(0)
    model = Net("module")
    x = torch.randn(8, 16, requires_grad=True)
    model(x).sum().backward()  # eager: counted per call
    eager = model_stats(model)
    assert eager.replays > 0 and not eager.compiled
    torch._dynamo.reset()
    torch.compile(model, backend="aot_eager")(x).sum().backward()
    both = model_stats(model)
    assert (both.ops_recorded, both.replays) == (eager.ops_recorded, eager.replays)
    assert list(both.compiled) == ["blocks.0", "blocks.1"]


def test_transformers_layers_compiled_through_gradient_checkpointing():
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=12,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).train()
    model.config.use_cache = False
    model._set_gradient_checkpointing(True, gradient_checkpointing_func=gradient_scope.checkpoint)
    ids = torch.randint(3, 64, (2, 12))
    torch.compile(model, backend="aot_eager")(input_ids=ids, labels=ids).loss.backward()
    stats = model_stats(model)
    assert list(stats.compiled) == ["model.layers.0", "model.layers.1"]
    assert all(s.ops_recorded > 0 and s.tensors_packed > 0 for s in stats.compiled.values())
    assert "compiled: 2 scoped modules ran in torch.compile graphs" in str(stats)


def test_a_function_compiled_once_serves_every_module_without_compiling_again():
    """What compiled code passes for the module is its first weight and their number, no
    guard on the module: one graph for three modules (as without model_stats), its
    figures shown for the module whose call compiled it."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    blocks = nn.ModuleList(ResidualFF() for _ in range(3))
    counters.clear()
    f = torch.compile(lambda block, x: gradient_scope.checkpoint(block, x), backend="aot_eager")
    for block in blocks:
        f(block, torch.randn(8, 16, requires_grad=True)).sum().backward()
    assert counters["stats"]["unique_graphs"] == 1
    assert list(model_stats(blocks).compiled) == ["0"]


class Wrapper(nn.Module):
    """A parent whose weights are all its child's (as torch's CheckpointWrapper)."""

    def __init__(self):
        super().__init__()
        self.inner = ResidualFF()

    def forward(self, x):
        return gradient_scope.checkpoint(self.inner, x)


def test_the_module_checkpoint_ran_gets_the_figures_not_its_parent():
    torch.manual_seed(0)
    model = nn.Sequential(Wrapper(), Wrapper())
    torch.compile(model, backend="aot_eager")(torch.randn(8, 16, requires_grad=True)).sum().backward()
    stats = model_stats(model)
    assert list(stats.compiled) == ["0.inner", "1.inner"]
    assert stats.compiled["0.inner"].tensors_packed > 0
