"""``.ci/run``'s second pass (``GRADIENT_SCOPE_FAST=1``) leaves out only the tests that cannot
see the variable (``support.reach``): a function-form scope's call, a process started, or a
fixture that did either marks a test as reaching it, unless the test set the variable itself;
a failed test is never left out.

The tests run pytest on a small file in fresh processes (about 10 s each run); they set those
processes' environment, so they are the same in both of ``.ci/run``'s passes."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from support import ROOT

PROGRAMS = textwrap.dedent(
    """
    import multiprocessing
    import subprocess
    import sys

    import pytest
    import torch

    import gradient_scope as gs


    def layer(x):
        return (x * 2).sin()


    @pytest.fixture(scope="module")
    def stepped():
        x = torch.ones(3, requires_grad=True)
        gs.checkpoint(layer, x).sum().backward()
        return x.grad


    def test_function_form():
        x = torch.ones(3, requires_grad=True)
        gs.checkpoint(layer, x).sum().backward()


    def test_context_manager():
        x = torch.ones(3, requires_grad=True)
        with gs.recompute_scope():
            y = layer(x)
        y.sum().backward()


    def test_subprocess():
        subprocess.run([sys.executable, "-c", "pass"], check=True)


    def test_spawned_process():
        p = multiprocessing.get_context("spawn").Process(target=print)
        p.start()
        p.join()


    def test_fixture_first(stepped):
        assert stepped is not None


    def test_fixture_second(stepped):
        assert stepped is not None


    def test_sets_the_variable_itself(monkeypatch):
        monkeypatch.setenv("GRADIENT_SCOPE_FAST", "1")
        x = torch.ones(3, requires_grad=True)
        gs.checkpoint(layer, x).sum().backward()


    @pytest.mark.fast_independent("its process is given its own environment")
    def test_marked_independent():
        subprocess.run([sys.executable, "-c", "pass"], check=True, env={})


    def test_plain_torch():
        assert torch.ones(2).sum() == 2


    def test_fails():
        assert False
    """
)


def _pytest(tmp_path, **env):
    (tmp_path / "test_programs.py").write_text(PROGRAMS)
    run_env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}", **env}
    for name in ("GS_TESTS_REACH", "GS_TESTS_SKIP_UNREACHED", "GRADIENT_SCOPE_FAST"):
        if name not in env:
            run_env.pop(name, None)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "support.reach", "test_programs.py"]
    return subprocess.run(cmd, cwd=tmp_path, env=run_env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def plain_pass(tmp_path_factory):
    """The first pass over ``PROGRAMS``: its folder, listing and output."""
    tmp_path = tmp_path_factory.mktemp("reach")
    listing = tmp_path / "reach.json"
    return tmp_path, listing, _pytest(tmp_path, GS_TESTS_REACH=str(listing))


_INDEPENDENT = pytest.mark.fast_independent("sets the environment of the pytest runs it starts")


@_INDEPENDENT
def test_the_plain_pass_lists_which_tests_reach_the_steady_switch(plain_pass):
    _, listing, out = plain_pass
    assert "1 failed, 9 passed" in out.stdout, out.stdout + out.stderr
    reached = {nodeid.split("::")[1]: r for nodeid, r in json.loads(listing.read_text()).items()}
    assert reached == {
        "test_function_form": True,
        "test_context_manager": False,  # recompute_scope has no steady state
        "test_subprocess": True,
        "test_spawned_process": True,
        "test_fixture_first": True,  # the module fixture ran in its setup
        "test_fixture_second": True,  # ... and serves this one
        "test_sets_the_variable_itself": False,  # runs steady in both passes
        "test_marked_independent": False,
        "test_plain_torch": False,
    }  # test_fails is not listed: it runs in the second pass


@_INDEPENDENT
def test_the_fast_pass_runs_all_but_the_unreached(plain_pass):
    tmp_path, listing, _ = plain_pass
    out = _pytest(tmp_path, GS_TESTS_SKIP_UNREACHED=str(listing), GRADIENT_SCOPE_FAST="1")
    assert "1 failed, 5 passed, 4 deselected" in out.stdout, out.stdout + out.stderr


def test_ci_runs_the_second_pass_on_the_listing_of_the_first():
    ci = (ROOT / ".ci" / "run").read_text()
    assert 'GS_TESTS_REACH="$tmp/reach.json"' in ci
    assert 'GRADIENT_SCOPE_FAST=1 GS_TESTS_SKIP_UNREACHED="$tmp/reach.json" python -m pytest -q -n auto' in ci
