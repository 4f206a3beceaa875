"""accelerate: a custom training loop through ``Accelerator`` (``prepare``,
``accelerator.backward``) with a model whose layers run in scopes, on the CPU. accelerate is
in the test extra; without it this module skips, saying so."""

import pytest
import torch

import gradient_scope.integrations.transformers as gs_hf

from support import hf_models
from support.hf_models import SEQ, VOCAB

accelerate = pytest.importorskip("accelerate", reason="needs accelerate (pip install -e '.[test]')")

IDS = torch.randint(3, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(1))


def train(scoped, steps=2):
    """Losses and final parameters of ``steps`` steps of an accelerate loop that keeps the
    outputs alive through backward (as ``run_clm_no_trainer`` does)."""
    model = hf_models.make_model("llama", layers=3, seed=0).train()
    if scoped:
        gs_hf.enable(model)
    accelerator = accelerate.Accelerator(cpu=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = accelerator.prepare(model, opt)
    losses = []
    for step in range(steps):
        torch.manual_seed(step)  # dropout masks
        outputs = model(input_ids=IDS, labels=IDS)
        accelerator.backward(outputs.loss)
        opt.step()
        opt.zero_grad()
        losses.append(outputs.loss.detach())
        assert outputs.cache is None or not scoped
    return losses, [p.detach().clone() for p in accelerator.unwrap_model(model).parameters()]


def test_an_accelerate_loop_trains_as_without_scopes():
    plain_losses, plain_params = train(scoped=False)
    losses, params = train(scoped=True)
    assert all(torch.equal(a, b) for a, b in zip(losses, plain_losses))
    assert all(torch.equal(a, b) for a, b in zip(params, plain_params))
