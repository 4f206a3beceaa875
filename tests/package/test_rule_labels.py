"""Rule labels: every rule the package cites (``R7``, ``P4``, ...) is defined in a rule
block, and each block's range line (``RULES R1..R8: title``) names exactly the rules it
defines. See docs/internals.md for where each family lives."""

from __future__ import annotations

import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "gradient_scope"

# The greppable title of a rule block: "RULES R1..R8: what a recording keeps."
RANGE_LINE = re.compile(r"^RULES ([A-Z])1\.\.([A-Z])(\d+): \S", re.M)
DEFINITION = re.compile(r"^([A-Z])(\d+)\. \S", re.M)


def _sources() -> dict[str, str]:
    return {str(p.relative_to(PACKAGE)): p.read_text(encoding="utf-8") for p in sorted(PACKAGE.rglob("*.py"))}


def _families() -> dict[str, tuple[str, int]]:
    """Family letter -> (module defining it, number of rules in its range line)."""
    found: dict[str, tuple[str, int]] = {}
    for name, text in _sources().items():
        for m in RANGE_LINE.finditer(text):
            first, last, n = m.group(1), m.group(2), int(m.group(3))
            assert first == last, f"{name}: malformed range line {m.group(0)!r}"
            assert first not in found, f"rule family {first} defined in {found[first][0]} and {name}"
            found[first] = (name, n)
    return found


def test_rule_families_exist():
    assert set(_families()) >= {"I", "P", "R", "S"}


def test_range_lines_are_current():
    sources = _sources()
    for family, (name, n) in _families().items():
        defined = sorted(int(m.group(2)) for m in DEFINITION.finditer(sources[name]) if m.group(1) == family)
        assert defined == list(range(1, n + 1)), (
            f"{name}: the range line says {family}1..{family}{n}, the block defines {defined}"
        )


def test_every_cited_label_is_defined():
    families = _families()
    cite = re.compile(rf"(?<![\w.])([{''.join(families)}])(\d+)(?!\w)")
    undefined = []
    for name, text in _sources().items():
        for lineno, line in enumerate(text.splitlines(), 1):
            for m in cite.finditer(line):
                family, k = m.group(1), int(m.group(2))
                if not 1 <= k <= families[family][1]:
                    undefined.append(f"{name}:{lineno}: {m.group(0)}")
    assert not undefined, "rule labels cited but defined in no rule block:\n" + "\n".join(undefined)
