"""The size limits of the package's code: no module over 400 code lines, no class over
150, no function over 60. Blank lines, comments and docstrings do not count."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "gradient_scope"
LIMITS = {"module": 400, "class": 150, "function": 60}


def _code_lines(tree: ast.Module, lines: list[str]) -> set[int]:
    """Line numbers (1-based) holding code: not blank, not a comment, not a docstring."""
    code = {i for i, text in enumerate(lines, 1) if text.strip() and not text.strip().startswith("#")}
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                code -= set(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    return code


def _sizes(path: Path, name: str) -> list[tuple[str, str, int]]:
    """(kind, name, code lines) of the module ``name`` at ``path`` and of every class
    and function in it."""
    text = path.read_text(encoding="utf-8")
    tree = ast.parse(text)
    code = _code_lines(tree, text.splitlines())
    out = [("module", name, len(code))]
    for node in ast.walk(tree):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            kind = "class" if isinstance(node, ast.ClassDef) else "function"
            span = set(range(node.lineno, (node.end_lineno or node.lineno) + 1))
            out.append((kind, f"{name}:{node.lineno} {node.name}", len(span & code)))
    return out


def test_counting_ignores_blank_lines_comments_and_docstrings(tmp_path):
    f = tmp_path / "m.py"
    f.write_text('"""Doc."""\n\n# comment\ndef g():\n    """Doc\n    more."""\n\n    return 1  # trailing\n')
    sizes = {kind: n for kind, _, n in _sizes(f, "m.py")}
    assert sizes == {"module": 2, "function": 2}


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_module_class_and_function_sizes(path):
    sizes = _sizes(path, str(path.relative_to(PACKAGE.parent)))
    over = [f"{kind} {name}: {n} code lines (limit {LIMITS[kind]})" for kind, name, n in sizes if n > LIMITS[kind]]
    assert not over, "\n".join(over)


def test_the_top_of_the_package_holds_at_most_twelve_entries():
    # One room per stage (docs/internals.md): a new module goes into the room of its stage.
    entries = sorted(p.name for p in PACKAGE.iterdir() if p.name != "__pycache__")
    assert len(entries) <= 12, entries


def test_each_package_docstring_names_its_modules():
    for init in sorted(PACKAGE.rglob("__init__.py")):
        if init.parent == PACKAGE:
            continue
        doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))) or ""
        modules = sorted(p.stem for p in init.parent.iterdir() if p.suffix == ".py" and p.stem != "__init__")
        modules += sorted(p.name for p in init.parent.iterdir() if (p / "__init__.py").exists())
        missing = [m for m in modules if f"``{m}``" not in doc]
        assert not missing, f"{init.relative_to(PACKAGE.parent)}: the docstring does not name {missing}"
