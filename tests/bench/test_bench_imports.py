"""Every benchmark module imports (a renamed helper breaks the slow ones, which CI does not run)."""

import importlib
import os

import pytest

from support import ROOT

BENCH_DIR = os.path.join(ROOT, "benchmarks")
# Every module under benchmarks/, the harness package's included ("_harness.memory", ...).
MODULES = sorted(
    os.path.relpath(os.path.join(d, f), BENCH_DIR)[:-3].replace(os.sep, ".")
    for d, _, files in os.walk(BENCH_DIR)
    for f in files
    if f.endswith(".py") and f != "__init__.py"
)


@pytest.mark.parametrize("name", MODULES)
def test_benchmark_module_imports(name):
    importlib.import_module(f"benchmarks.{name}")
