"""The steady state (``GRADIENT_SCOPE_FAST=1``) is quiet (issue 35): nothing dynamo says while it
captures a function for us reaches the user's stderr, logging or warnings, and the user's own
``torch.compile`` finds dynamo as it was: its configuration, its ``warn_once``, a recompile
budget of its own."""

from __future__ import annotations

import functools
import logging
import warnings

import torch

import gradient_scope
import gradient_scope.integrations.transformers as gs_hf

from support.hf_models import VOCAB, tiny_llama, users_compile


def test_a_llama_with_the_cache_on_and_many_lengths_is_quiet(fast, capfd, caplog, monkeypatch):
    """use_cache=True (the config's default), many lengths: dynamo makes a graph for the first
    length and a dynamic one at the second, past the recompile limit of our captures (Q4, set to
    1 here); none of it is printed or logged, and the user's compile after compiles within its
    own budget."""
    from gradient_scope._adapters import dynamo
    from gradient_scope._adapters.steady import run

    monkeypatch.setattr(dynamo, "RECOMPILE_LIMIT", 1)
    monkeypatch.setattr(dynamo, "_entries", {})
    monkeypatch.setattr(run, "_entry", dynamo.entry(run._backend))  # a trampoline with that limit
    model = gs_hf.enable(tiny_llama(4))
    assert model.config.use_cache
    config = torch._dynamo.config.get_config_copy()
    warn_once = torch._dynamo.utils.warn_once
    capfd.readouterr()
    with caplog.at_level(logging.DEBUG), warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        for length in range(4, 16):
            ids = torch.randint(0, VOCAB, (2, length))
            model(input_ids=ids, labels=ids).loss.backward()
    out, err = capfd.readouterr()
    assert "dynamo" not in err and "recompile" not in err and "dynamo" not in out, err[-2000:]
    assert not [r for r in caplog.records if r.name.startswith("torch")]
    assert not [w for w in warned if "dynamo" in str(w.message).lower() or "torch/_dynamo" in w.filename]
    assert torch._dynamo.config.get_config_copy() == config
    assert torch._dynamo.utils.warn_once is warn_once
    stats = gradient_scope.model_stats(model)
    assert stats.calls_steady + stats.calls_recorded == 4 * 12
    assert stats.recorded_why.get("dynamo could not capture", 0) > 0  # past the recompile limit

    graphs, _ = users_compile(6)  # six shapes: six graphs, under the recompile limit of 8
    assert len(graphs) == 6
    out, err = capfd.readouterr()
    assert "recompile" not in err


def test_a_warn_once_of_traced_code_is_not_shown_but_the_users_compile_gets_it(fast):
    """Dynamo's warn_once for an lru_cache in traced code (transformers' is_torch_less_or_equal
    in its MoE code): the user's program does not warn, so the library does not; the quiet is
    ours only: the user's own compile still gets dynamo's warning."""

    @functools.lru_cache
    def factor(n):
        return float(n) + 1.0

    def f(y):
        return y * factor(1)

    x = torch.randn(4, requires_grad=True)
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        for _ in range(4):
            gradient_scope.checkpoint(f, x).sum().backward()
    assert fast
    assert not warned, [str(w.message)[:200] for w in warned]
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        torch.compile(lambda y: y * factor(3) + 1, backend="eager")(x)
    assert any("lru_cache" in str(w.message) for w in warned)
