"""The suite's fixtures (helpers and model builders are in ``tests/support``: tests import
them with ``from support import ...``, never from this file).

* ``device``: runs a test once on ``"cpu"`` and once on ``"cuda"``; the CUDA run is
  skipped where ``torch.cuda.is_available()`` is false.
* ``global_state_as_found`` (autouse): after every test, ``support.global_state()`` and
  ``support.patchable()`` are as the test found them (put back if not, and the test
  fails), and the RNG states are restored.
* ``fast``: ``GRADIENT_SCOPE_FAST=1`` (the steady state) with no graph of an earlier test.
* ``fresh_dynamo``: dynamo's caches reset around the test, the compile configuration
  checked unchanged after it (the compile tests take it with ``usefixtures``).

The hooks at the end serve ``.ci/run``: with ``GS_TESTS_REACH`` the tests that can see
``GRADIENT_SCOPE_FAST`` are listed, with ``GS_TESTS_SKIP_UNREACHED`` the others are deselected
(``support.reach``).
"""

import contextlib
import gc
import logging

import pytest
import torch

from support import _BASELINE, _BASELINE_PATCHED, DEVICES, _put_back, global_state, patchable
from support.reach import (  # noqa: F401  (.ci/run's hooks: which tests GRADIENT_SCOPE_FAST can change)
    pytest_collection_modifyitems,
    pytest_configure,
    pytest_fixture_setup,
    pytest_runtest_logreport,
    pytest_runtest_protocol,
    pytest_sessionfinish,
)

# torchao (the test extra, for the QLoRA test) logs at import through transformers and peft:
# its wheel's CUDA kernels fail to load on a CPU torch, and torch 2.13 deprecates the pytree
# registration of its Enums. Neither concerns the tests (docs/huggingface.md).
logging.getLogger("torchao").setLevel(logging.ERROR)
logging.getLogger("torch.utils._pytree").addFilter(lambda record: "is an Enum subclass" not in record.getMessage())


@pytest.fixture(params=DEVICES)
def device(request):
    """The device a contract test runs on: ``"cpu"``, and ``"cuda"`` where a GPU is there
    (skipped otherwise).  Every tensor of the test is made on it (``device=device``,
    ``module.to(device)``)."""
    return request.param


@pytest.fixture(autouse=True)
def global_state_as_found():
    """Global state as found, for every test: whatever a test does, ``global_state()`` and
    ``patchable()`` are as before afterwards (once its locals are gone; gc is allowed here, the strict no-gc
    checks are the tests' own ``assert_interception_gone()`` / ``assert_stacks_clean()``), and the RNG states are put
    back.  A test that leaves state behind fails, and the state is put back so that the
    failure does not spread to the following tests."""
    before = global_state()
    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    _BASELINE.clear()
    _BASELINE.update(before)
    _BASELINE_PATCHED[:] = [patchable()]
    yield
    torch.set_rng_state(rng)
    if cuda_rng is not None:
        torch.cuda.set_rng_state_all(cuda_rng)
    after = global_state()
    patched = patchable()
    if after != before or patched != _BASELINE_PATCHED[0]:  # give reference cycles a chance
        gc.collect()  # (only then: a collection costs ~0.3 s in a full run)
        after = global_state()
        patched = patchable()
    if after != before:
        _put_back(before)
        pytest.fail(f"test left global state changed:\nbefore={before}\nafter={after}", pytrace=False)
    if patched != _BASELINE_PATCHED[0]:
        with contextlib.suppress(Exception):  # (so that the failure does not spread)
            from gradient_scope._save import interception as _interception

            _interception.sweep()
        pytest.fail(
            f"test left PyTorch functions patched:\nbefore={_BASELINE_PATCHED[0]}\nafter={patched}", pytrace=False
        )


@pytest.fixture
def fast(monkeypatch):
    """GRADIENT_SCOPE_FAST=1 (the steady state, ``gradient_scope._adapters.steady``), and a
    list with an entry per run bound from a template. No graph or given-up function of an
    earlier test is seen."""
    from gradient_scope._adapters.steady import run as steady

    monkeypatch.setenv("GRADIENT_SCOPE_FAST", "1")
    torch._dynamo.reset()  # graphs (and their templates) of earlier tests are gone
    monkeypatch.setattr(steady, "_failed", type(steady._failed)())
    monkeypatch.setattr(steady, "_failures", type(steady._failures)())
    monkeypatch.setattr(steady, "_eager", type(steady._eager)())  # D6: no eager run seen yet
    monkeypatch.setattr(steady, "_takes", type(steady._takes)())  # T6: no template took from a graph yet
    calls = []
    real = steady._steady

    def counting(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(steady, "_steady", counting)
    yield calls
    # What dynamo compiled for this test is dropped now, with its reference cycles, not
    # during a later test that counts what the garbage collector frees.
    torch._dynamo.reset()
    gc.collect()


def _compile_state():
    """What a compiled scope changes while it compiles, and must put back."""
    handler = torch._dynamo.callback_handler
    return (
        getattr(torch._functorch.config, "joint_custom_pass", None),
        handler.end_callbacks,
        list(handler.end_callbacks),
        torch._functorch.config.enable_autograd_cache,
        torch._inductor.config.fx_graph_cache,
    )


@pytest.fixture
def fresh_dynamo():
    """Each test compiles afresh (dynamo's caches reset before and after it), and leaves the
    compile configuration as it found it: the joint-graph pass, dynamo's end callbacks,
    the cache switches, no frame callback left set in this thread, no compile session of
    gradient_scope open."""
    import gradient_scope._adapters.compile.graph as gs_compile

    torch._dynamo.reset()
    before = _compile_state()
    yield
    torch._dynamo.reset()
    after = _compile_state()
    assert after[0] is before[0], "joint_custom_pass not restored"
    assert after[1] is before[1] and after[2] == before[2], "dynamo end callbacks changed"
    assert after[3:] == before[3:], "cache configuration changed"
    assert torch._C._dynamo.eval_frame.set_eval_frame(None) is None, "a dynamo frame callback was left set"
    assert gs_compile._session is None, "a compile session of gradient_scope was left open"

