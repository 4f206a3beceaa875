"""QLoRA: torchao's NF4 weight (a wrapper subclass), frozen, read by a block that trains a
LoRA adapter on it. torchao is in the ``qlora`` extra, not the ``test`` one: it prints
lines at every import of transformers on a CPU torch (docs/compatibility.md). Without it
this module skips, saying so."""

import gc

import pytest
import torch
import torch.nn.functional as F

from support import PlainScopes, Scopes, assert_all_same, assert_interception_gone, grads

# --- torchao NF4 (QLoRA: a frozen quantised base weight, a trained LoRA adapter) ------

nf4 = pytest.importorskip(
    "torchao.quantization.quantize_.workflows.nf4.nf4_tensor", reason="needs torchao (pip install -e '.[qlora]')"
)


class QLoRALinear(torch.nn.Module):
    def __init__(self, d_in, d_out, rank):
        super().__init__()
        base = torch.randn(d_out, d_in)
        self.weight = torch.nn.Parameter(nf4.to_nf4(base), requires_grad=False)
        self.lora_a = torch.nn.Parameter(torch.randn(rank, d_in) * 0.1)
        self.lora_b = torch.nn.Parameter(torch.randn(d_out, rank) * 0.1)

    def forward(self, x):
        return nf4.linear_nf4(x, self.weight) + F.linear(F.linear(x, self.lora_a), self.lora_b) * 0.5


def _qlora_program(scope):
    layers = torch.nn.ModuleList([QLoRALinear(128, 128, 4) for _ in range(2)])
    x = torch.randn(3, 5, 128, requires_grad=True)

    def fwd():
        h = x
        for layer in layers:
            with scope():
                h = F.gelu(layer(h)) + h
        return h.pow(2).mean()

    fwd().backward()
    out = grads({"x": x})
    for i, layer in enumerate(layers):
        out[f"{i}.lora_a"] = layer.lora_a.grad
        out[f"{i}.lora_b"] = layer.lora_b.grad
    return out


def test_nf4_qlora_bitwise():
    torch.manual_seed(0)
    expected = _qlora_program(PlainScopes())
    torch.manual_seed(0)
    scopes = Scopes()
    actual = _qlora_program(scopes)
    assert_all_same(actual, expected)
    assert sum(s.stats.tensors_packed for s in scopes.created) > 0  # recomputation happened
    gc.collect()
    assert_interception_gone()
