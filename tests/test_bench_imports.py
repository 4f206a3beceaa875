"""Every benchmark module imports (a renamed helper breaks the slow ones, which CI does not run)."""

import importlib
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BENCH_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
MODULES = sorted(f[:-3] for f in os.listdir(BENCH_DIR) if f.endswith(".py") and f != "__init__.py")


@pytest.mark.parametrize("name", MODULES)
def test_benchmark_module_imports(name):
    importlib.import_module(f"benchmarks.{name}")
