"""Rule citations cannot re-point silently. A rule is defined in its family's rule block
(``RULES S1..S6: what a save becomes``, see ``tests/package/test_rule_labels.py``) as
``S6. [ a region's saves go to its observer ] A tensor that ...``: its label, then its
short title between ``[ `` and `` ]``. Every citation of it anywhere in the package carries
both, in one format, ``S6 [ a region's saves go to its observer ]`` (as PyTorch's
checkpoint.py cites ``Rule 6: [ retain_graph is True ]``): a citation whose title is not
its definition's names a rule that moved. A range (``S1..S4``) names a block, not a rule.

And the steady state mirrors the recorder: every record-time rule (``R...``) has a line in
``_adapters/steady``'s docstring naming the steady rules (``D...``, ``T...``) that mirror it,
or saying why it does not apply."""

from __future__ import annotations

import ast
import re

from test_rule_labels import PACKAGE, _families, _sources

TITLED_DEFINITION = re.compile(r"^([A-Z])(\d+)\. \[ ([^\]\n]+?) \] \S", re.M)
STEADY = PACKAGE / "_adapters" / "steady" / "__init__.py"


def _citation(families: str) -> re.Pattern[str]:
    # A label not inside a word or a dotted name, not the left end of a range (S1..S4; the
    # right end is excluded by the look-behind), not a definition (``S6.`` at a line start).
    return re.compile(rf"(?<![\w.])([{families}])(\d+)(?!\w)(?!\.\.)(?!\. \[)( \[ ([^\]\n]*?) \])?")


def _titles() -> dict[str, str]:
    """Label -> title, from the rule blocks."""
    sources = _sources()
    titles: dict[str, str] = {}
    for family, (name, _) in _families().items():
        for m in TITLED_DEFINITION.finditer(sources[name]):
            if m.group(1) == family:
                titles[f"{family}{m.group(2)}"] = m.group(3)
    return titles


def _problems(text: str, titles: dict[str, str], families: str) -> list[str]:
    out = []
    for lineno, line in enumerate(text.splitlines(), 1):
        for m in _citation(families).finditer(line):
            label, title = m.group(1) + m.group(2), m.group(4)
            if label not in titles:
                out.append(f"{lineno}: {label} is defined in no rule block")
            elif title is None:
                out.append(f"{lineno}: {label} is cited without its title [ {titles[label]} ]")
            elif title != titles[label]:
                out.append(f"{lineno}: {label} [ {title} ] -- its definition says [ {titles[label]} ]")
    return out


def test_every_rule_has_a_title():
    families = _families()
    titles = _titles()
    untitled = [f"{f}{k}" for f, (_, n) in families.items() for k in range(1, n + 1) if f"{f}{k}" not in titles]
    assert not untitled, f"rules defined without a '[ title ]' after their label: {untitled}"


def test_the_check_catches_a_stale_a_wrong_and_an_untitled_citation():
    titles = {"S5": "a steady run's saves go to its sequencer", "S6": "a region's saves go to its observer"}
    text = (
        "seen outside the scopes (S5 [ a region's saves go to its observer ])\n"  # re-pointed
        "(S6 [ a region's saves go to its observer ]), S1..S6, ``S7``\n"  # a range; S7 undefined
        "as S6 says\n"
        "S6. [ a region's saves go to its observer ] the definition itself\n"
    )
    found = _problems(text, titles, "S")
    assert found == [
        "1: S5 [ a region's saves go to its observer ] -- its definition says "
        "[ a steady run's saves go to its sequencer ]",
        "2: S7 is defined in no rule block",
        "3: S6 is cited without its title [ a region's saves go to its observer ]",
    ], found


def test_every_citation_carries_its_definitions_title():
    titles = _titles()
    families = "".join(_families())
    wrong = [f"{name}:{p}" for name, text in _sources().items() for p in _problems(text, titles, families)]
    assert not wrong, "rule citations whose label and title disagree with the definitions:\n" + "\n".join(wrong)


MIRROR = re.compile(r"^- (R\d+) \[ [^\]\n]+ \] -- (.+)$")


def _mirror_table() -> dict[str, str]:
    """Record-time rule -> what its line in the steady package's docstring says."""
    doc = ast.get_docstring(ast.parse(STEADY.read_text(encoding="utf-8"))) or ""
    table: dict[str, str] = {}
    lines = doc.splitlines()
    for i, line in enumerate(lines):
        m = MIRROR.match(line)
        if m:
            assert m.group(1) not in table, f"{m.group(1)} has two lines in the steady table"
            rest = [m.group(2)]
            for more in lines[i + 1 :]:
                if not more.startswith("  ") or not more.strip():
                    break
                rest.append(more.strip())
            table[m.group(1)] = " ".join(rest)
    return table


def test_the_steady_state_mirrors_every_record_time_rule():
    n = _families()["R"][1]
    table = _mirror_table()
    assert sorted(table, key=lambda r: int(r[1:])) == [f"R{k}" for k in range(1, n + 1)], (
        f"the steady state's table (gradient_scope/_adapters/steady/__init__.py) lists {sorted(table)}, "
        f"the record-time rules are R1..R{n}: each needs a line"
    )
    steady = re.compile(r"(?<![\w.])[DT]\d+ \[ ")
    for rule, says in table.items():
        mirrored = bool(steady.search(says))
        excused = says.startswith("does not apply: ") and len(says.split()) > 6
        assert mirrored or excused, (
            f"{rule}: its line names no steady rule (D.., T..) that mirrors it and does not say why "
            f"it does not apply ('does not apply: <why>'): {says!r}"
        )
