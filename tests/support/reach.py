"""Which tests ``GRADIENT_SCOPE_FAST=1`` can change: ``.ci/run``'s second pass runs only those.

``GRADIENT_SCOPE_FAST`` is read at one place in the package: a function-form scope's
decision whether a call runs steady (``_adapters/steady/run.py``, ``switch(FAST_VAR, ...)``,
the first thing every such call does). A test that never reaches that read runs the same
code whatever the variable says, unless work runs in another process (which reads its own
environment). So, as pytest hooks (``tests/conftest.py`` imports them; ``-p support.reach``
elsewhere):

* with ``GS_TESTS_REACH=<file>`` (the plain pass), every test whose phases all passed is
  written to ``<file>`` with whether it *reached* the variable: its setup, call or teardown
  read it or started a process, or it takes a fixture whose setup did either (a module
  fixture runs in the first test's setup and serves the others). A read made while the
  test itself has set the variable to another value than the run's (the ``fast`` fixture,
  ``monkeypatch.setenv``) is not a reach: that test runs the same code in both passes; nor
  is anything a test marked ``@pytest.mark.fast_independent("why")`` does (a test that
  starts processes whose environment it sets itself, or that only imports the package);
* with ``GS_TESTS_SKIP_UNREACHED=<file>`` (the ``GRADIENT_SCOPE_FAST=1`` pass), the tests that
  ``<file>`` lists as passed without reaching it are deselected. Every other test runs: one
  that failed or was skipped in the first pass, one added since.

The list is written and read by one run of ``.ci/run`` on one tree, so it cannot go stale.
Under pytest-xdist each worker writes its own part (``<file>.gw0``, ...), read together.
Without the variables the hooks do nothing.
"""

from __future__ import annotations

import glob
import json
import multiprocessing.process
import os
import sys
from collections.abc import Generator
from typing import Any

import pytest

REACH_VAR = "GS_TESTS_REACH"
SKIP_VAR = "GS_TESTS_SKIP_UNREACHED"
_PROCESS_EVENTS = {"subprocess.Popen", "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.system", "os.exec"}

#: Set when the running test or fixture reads GRADIENT_SCOPE_FAST or starts a process.
_flag = [False]
_installed = [False]
_outer: list[str | None] = [None]  # the run's GRADIENT_SCOPE_FAST, as the session started
_reached: dict[str, bool] = {}  # nodeid -> whether the test itself reached it
_fixtures_of: dict[str, tuple[str, ...]] = {}
_reaching_fixtures: set[str] = set()
_not_passed: set[str] = set()
_independent: set[str] = set()  # marked fast_independent: never a reach, fixtures included


def _watching() -> bool:
    return bool(os.environ.get(REACH_VAR))


def _audit(event: str, args: Any) -> None:
    if event in _PROCESS_EVENTS:
        _flag[0] = True


def _install() -> None:
    """Watch the read of ``GRADIENT_SCOPE_FAST`` and process starts (once per process)."""
    if _installed[0]:
        return
    _installed[0] = True
    from gradient_scope._adapters.steady import run as steady_run

    real_switch = steady_run.switch
    _outer[0] = os.environ.get(steady_run.FAST_VAR)

    def switch(name: str, what: str) -> bool | None:
        if name == steady_run.FAST_VAR and os.environ.get(name) == _outer[0]:
            _flag[0] = True  # (a value the test set itself is the same in both passes)
        return real_switch(name, what)

    steady_run.switch = switch  # the module global the steady decision calls by name
    sys.addaudithook(_audit)  # (an audit hook stays for the process: it only sets the flag)
    start = multiprocessing.process.BaseProcess.start

    def started(self: Any) -> None:  # multiprocessing's spawn raises no audit event
        _flag[0] = True
        start(self)

    multiprocessing.process.BaseProcess.start = started  # type: ignore[method-assign]


def _take() -> bool:
    """The flag, cleared."""
    was = _flag[0]
    _flag[0] = False
    return was


def _parts(path: str) -> list[str]:
    return [p for p in [path, *glob.glob(glob.escape(path) + ".gw*")] if os.path.exists(p)]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "fast_independent(why): the test runs the same code whatever GRADIENT_SCOPE_FAST says "
        "(it sets the variable for the processes it starts, or starts none that read it); "
        ".ci/run's second pass leaves it out",
    )
    if not _watching():
        return
    _install()
    if not hasattr(config, "workerinput"):  # the main process: an earlier run's parts go
        for part in _parts(os.environ[REACH_VAR]):
            os.remove(part)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    path = os.environ.get(SKIP_VAR)
    if not path:
        return
    skip: set[str] = set()
    for part in _parts(path):
        with open(part) as f:
            skip |= {nodeid for nodeid, reached in json.load(f).items() if not reached}
    deselected = [item for item in items if item.nodeid in skip]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [item for item in items if item.nodeid not in skip]


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef: Any, request: Any) -> Generator[None, None, None]:
    if not _watching():
        yield
        return
    outer = _take()
    yield
    if _take():
        _reaching_fixtures.add(fixturedef.argname)
        outer = True
    _flag[0] = outer


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:
    if not _watching():
        yield
        return
    _take()
    yield
    _reached[item.nodeid] = _take()
    if item.get_closest_marker("fast_independent") is not None:
        _independent.add(item.nodeid)
    _fixtures_of[item.nodeid] = tuple(getattr(item, "fixturenames", ()))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if _watching() and (report.failed or report.skipped):
        _not_passed.add(report.nodeid)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    path = os.environ.get(REACH_VAR)
    if not path:
        return
    worker = getattr(session.config, "workerinput", None)
    if worker is not None:
        path = f"{path}.{worker['workerid']}"
    elif not _reached:  # the main process of an xdist run: the workers ran the tests
        return
    listed = {
        nodeid: nodeid not in _independent
        and (reached or any(name in _reaching_fixtures for name in _fixtures_of[nodeid]))
        for nodeid, reached in _reached.items()
        if nodeid not in _not_passed
    }
    with open(path, "w") as f:
        json.dump(listed, f, indent=0, sort_keys=True)
