"""The docs' recipes run as written and print what the docs show."""

import contextlib
import io
import os
import re

from support import ROOT


def _section(page: str, heading: str) -> str:
    with open(os.path.join(ROOT, "docs", page), encoding="utf-8") as f:
        text = f.read()
    start = text.index(f"## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else len(text)]


def test_selective_recompute_by_module_path_size_and_name():
    section = _section("recipes.md", "Selective recompute by module path, size and name")
    code = re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)
    shown = re.search(r"```text\n(.*?)```", section, re.DOTALL).group(1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "docs/recipes.md", "exec"), {"__name__": "recipe"})
    assert out.getvalue() == shown
