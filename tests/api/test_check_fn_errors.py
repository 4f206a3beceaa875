"""check_fn given wrong: a module instance instead of its class, a misspelled class
name beside valid items in a tuple (issue 37, item 7)."""

import warnings

import pytest
import torch
import torch.nn as nn

from gradient_scope import apply_recompute, remove_recompute


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return torch.tanh(self.fc(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _scoped(model):
    return [n for n, m in model.named_modules() if "forward" in vars(m)]


def test_a_module_instance_is_a_type_error_naming_check_fn_before_any_module_runs():
    model = Net()
    calls = []
    model.head.register_forward_pre_hook(lambda m, a: calls.append(a))
    with pytest.raises(TypeError, match=r"check_fn is a module instance \(Linear\).*check_fn=Linear"):
        apply_recompute(model, check_fn=model.head)
    assert calls == [] and _scoped(model) == []
    # In a tuple, too: named as an instance, not as "an item of type Linear".
    with pytest.raises(TypeError, match=r"check_fn holds a module instance \(Linear\).*check_fn=Linear"):
        apply_recompute(model, check_fn=(Block, model.head))
    assert calls == [] and _scoped(model) == []


def test_a_misspelled_name_beside_a_valid_item_is_reported_as_a_lone_one_is():
    model = Net()
    with pytest.warns(UserWarning, match="check_fn .*'Blcok'.* matched no module of Net.*Did you mean 'Block'") as w:
        apply_recompute(model, check_fn=(nn.Tanh, "Blcok", "Block"))
    assert w[0].filename == __file__
    assert _scoped(model) == ["blocks.0", "blocks.1"]  # the valid item still applies

    remove_recompute(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # A name near no class of Net is not a misspelling (a tuple shared by several models).
        apply_recompute(model, check_fn=("Block", "MistralDecoderLayer"))
    assert _scoped(model) == ["blocks.0", "blocks.1"]
