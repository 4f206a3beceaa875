"""Helpers shared by the interop/robustness test files (public API only, plus hygiene).

* ``run_both_clean``: ``conftest.run_both`` whose failure is re-raised as a plain message
  (no traceback object), so a failing test does not keep block-created tensors alive
  through pytest's stored traceback, which would keep the scope's interception needed
  and spill into the following tests.
* ``repair_hook_stack``: an autouse fixture (import it into a test module) that fails a
  test leaving foreign pairs on the saved-tensor hook stack and pops them, so the next
  tests start clean.
* ``clean_stacks``: returns a check that the hook stack and dispatch stack are back to
  what they were when the test started (called by the test after dropping its tensors,
  without gc).
* ``patchable``: the PyTorch functions the library may patch while a thread has its
  hook pair installed, as they are now (compare before and after).
"""

import gc
import traceback

import pytest
import torch

from conftest import dispatch_depth, run_both, top_hooks


def run_both_clean(program, seed=0, **options):
    msg = None
    try:
        return run_both(program, seed=seed, **options)
    except Exception:  # noqa: BLE001
        msg = traceback.format_exc(limit=-6)
    gc.collect()
    pytest.fail(msg, pytrace=False)


def expect_clean_failure(fn):
    """Run fn(); return the exception message (str) or None, dropping the traceback."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return None


@pytest.fixture(autouse=True)
def repair_hook_stack():
    before = top_hooks()
    yield
    gc.collect()
    if top_hooks() != before:
        # hygiene only (the test has failed already): let the library drop its own pair
        try:
            from gradient_scope import _interception

            _interception.sweep()
        except Exception:  # noqa: BLE001
            pass
    left = []
    while top_hooks() is not None and top_hooks() != before:
        left.append(top_hooks())
        torch._C._autograd._pop_saved_tensors_default_hooks()
    if left:
        pytest.fail(f"saved-tensor hook stack not restored after the test; popped {left}")


def patchable():
    return (
        torch.autograd.graph.saved_tensors_hooks.__enter__,
        torch.autograd.graph.saved_tensors_hooks.__exit__,
        torch.autograd.backward,
        torch.autograd.grad,
        torch._C._autograd._push_saved_tensors_default_hooks,
        torch._C._autograd._pop_saved_tensors_default_hooks,
    )


@pytest.fixture
def clean_stacks():
    hooks0, depth0, patch0 = top_hooks(), dispatch_depth(), patchable()

    def check():
        assert top_hooks() == hooks0, f"saved-tensor hooks left behind: {top_hooks()}"
        assert dispatch_depth() == depth0, "dispatch mode left on the stack"
        assert patchable() == patch0, (
            "PyTorch functions left patched (saved_tensors_hooks.__enter__/__exit__, "
            "autograd.backward/grad, _push/_pop_saved_tensors_default_hooks): "
            f"{patchable()} != {patch0}"
        )

    return check
