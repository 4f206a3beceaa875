"""Helpers shared by the interop/robustness test files (public API only, plus hygiene).

* ``run_both_clean``: ``support.run_both`` whose failure is re-raised as a plain message
  (no traceback object), so a failing test does not keep block-created tensors alive
  through pytest's stored traceback, which would keep the scope's interception needed
  and spill into the following tests.
* ``expect_clean_failure``: runs a function and returns its exception's message (or
  None), dropping the traceback for the same reason.

Global state as found (hook stack, dispatch modes, patched functions, ...) is checked by
the conftest fixture ``global_state_as_found`` and, mid-test without gc, by
``support.assert_interception_gone()``.
"""

import gc
import traceback

import pytest

from support import run_both


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
