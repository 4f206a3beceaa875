"""Packaging: the torch floor check, the single version source, the license metadata."""

import importlib.metadata
import os
import re
import subprocess
import sys
import types

import pytest
import torch

import gradient_scope
from gradient_scope._base import torch_floor as _torch_floor

from support import ROOT

FLOOR = "{}.{}".format(*_torch_floor.TORCH_FLOOR)


def _read(name: str) -> str:
    with open(os.path.join(ROOT, name), encoding="utf-8") as f:
        return f.read()


def _pyproject() -> str:
    return _read("pyproject.toml")


def test_pyproject_floor_is_the_checked_floor():
    # The dependency users install against and the floor the import checks are the same.
    found = re.findall(r'"torch>=([0-9.]+)"', _pyproject())
    assert found == [FLOOR]


def test_installed_torch_meets_the_floor():
    assert _torch_floor._major_minor(torch.__version__) >= _torch_floor.TORCH_FLOOR
    assert hasattr(torch._C._autograd, _torch_floor.REQUIRED_API)


@pytest.mark.parametrize(
    ("version", "parsed"),
    [
        ("2.8.0", (2, 8)),
        ("2.8.0+cu128", (2, 8)),
        ("2.13.0+cpu", (2, 13)),
        ("2.15.0a0+git1234abc", (2, 15)),
        ("10.0", (10, 0)),
        ("2.7.1", (2, 7)),
        ("unknown", None),
        ("", None),
    ],
)
def test_version_parsing(version, parsed):
    assert _torch_floor._major_minor(version) == parsed


@pytest.mark.parametrize("version", ["2.7.1", "2.4.0", "1.13.1+cu117", "2.7.0a0+gitdeadbee"])
def test_check_rejects_torch_below_the_floor(version):
    with pytest.raises(ImportError) as info:
        _torch_floor.check_torch(version)
    message = str(info.value)
    assert f"torch>={FLOOR}" in message
    assert f"torch {version} is installed" in message


@pytest.mark.parametrize("version", [FLOOR + ".0", "2.13.0+cpu", "3.0.0", "not-a-version"])
def test_check_accepts_the_floor_and_later(version):
    _torch_floor.check_torch(version)  # this torch has the API, so nothing raises
    _torch_floor.check_torch()  # and the installed torch passes


def test_check_rejects_torch_without_the_api():
    # A build that calls itself new enough but lacks the private API the library uses.
    without_api = types.SimpleNamespace()
    with pytest.raises(ImportError, match=_torch_floor.REQUIRED_API) as info:
        _torch_floor.check_torch("2.99.0", without_api)
    assert f"torch>={FLOOR}" in str(info.value)
    assert "torch 2.99.0 lacks" in str(info.value)
    with_api = types.SimpleNamespace(**{_torch_floor.REQUIRED_API: lambda *a: None})
    _torch_floor.check_torch("2.99.0", with_api)


def _import_with_torch_version(version: str) -> subprocess.CompletedProcess:
    # A fresh interpreter, so that `import gradient_scope` really runs the package's import.
    code = (
        "import torch\n"
        f"torch.__version__ = {version!r}\n"
        "try:\n"
        "    import gradient_scope\n"
        "except ImportError as e:\n"
        "    print('ImportError:', e)\n"
        "    raise SystemExit(3)\n"
        "print('imported', gradient_scope.__version__)\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )


@pytest.mark.fast_independent("its processes only import the package")
def test_import_raises_below_the_floor_and_works_at_it():
    old = _import_with_torch_version("2.7.1")
    assert old.returncode == 3, old.stdout + old.stderr
    assert f"gradient_scope requires torch>={FLOOR}, but torch 2.7.1 is installed" in old.stdout
    ok = _import_with_torch_version(FLOOR + ".0")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert f"imported {gradient_scope.__version__}" in ok.stdout


def test_version_has_one_source():
    from gradient_scope._base.version import __version__

    assert gradient_scope.__version__ == __version__
    assert re.fullmatch(r"\d+\.\d+\.\d+", __version__)
    text = _pyproject()
    assert 'dynamic = ["version"]' in text
    assert 'version = { attr = "gradient_scope._base.version.__version__" }' in text
    project_table = text.split("\n[project]\n", 1)[1].split("\n[", 1)[0]
    assert not re.search(r"^version\s*=", project_table, re.MULTILINE), "a literal version in [project]"


def test_installed_metadata():
    # The installed distribution (the README's `pip install -e`) carries the package's
    # version and license.
    meta = importlib.metadata.metadata("gradient_scope")
    assert meta["Version"] == gradient_scope.__version__, "reinstall: pip install -e '.[test]'"
    assert meta["License-Expression"] == "BSD-3-Clause"
    assert "torch>=" + FLOOR in meta.get_all("Requires-Dist")
    license_text = _read("LICENSE")
    assert license_text.startswith("BSD 3-Clause License")
    assert "the gradient_scope authors" in license_text


def test_api_reference_lists_every_public_name():
    # docs/api.md is written by hand (grouped by topic): it must name exactly __all__.
    entries = re.findall(r"^::: gradient_scope\.(\w+)\s*$", _read("docs/api.md"), re.MULTILINE)
    assert sorted(entries) == sorted(gradient_scope.__all__)


def test_readme_is_an_entrance():
    # The README opens with the two commands (install + quickstart, install + tests; .ci/run
    # checks the second verbatim) and stays short: the manual lives in docs/.
    readme = _read("README.md")
    blocks = re.findall(r"^```(\w*)\n(.*?)^```", readme, re.MULTILINE | re.DOTALL)
    assert [lang for lang, _ in blocks[:2]] == ["sh", "sh"]
    assert blocks[0][1].strip().endswith("pip install -e . && python examples/quickstart.py")
    assert blocks[1][1].strip().endswith("pip install -e '.[test]' && python -m pytest -q -n auto --maxprocesses 4")
    assert len(readme.splitlines()) <= 250


def test_docs_state_no_counts_of_tests():
    # Counts of tests ("1103 passed", "the 13 tests that need CUDA") go stale with every
    # test added: the docs say how to get them (pytest -rs) instead of stating them.
    count = re.compile(r"\b\d[\d,]* (?:passed|skipped|failed|tests?\b(?! of))", re.IGNORECASE)
    pages = sorted(f for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md"))
    found = {page: count.findall(_read(os.path.join("docs", page))) for page in pages}
    assert {page: hits for page, hits in found.items() if hits} == {}
