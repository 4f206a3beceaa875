"""Only ``_record/`` writes a block's record (``_record/types.py``): the recorder for a
recorded block, the binder (``_record/bind.py``) for a block run in its steady state.
Elsewhere a record is read. An AST scan of the package finds every write to a record's
fields -- a ``BlockRecord``'s ``ops``, ``signature``, ``registered``, ``renamed``, and an
``OpRecord``'s outputs (``outs``) and random state (``rng``), rebuilt by ``_replace`` --
outside ``_record/``."""

from __future__ import annotations

import ast

from support import ROOT

PACKAGE = ROOT / "gradient_scope"
RECORD_FIELDS = {"ops", "signature", "registered", "renamed"}
OP_FIELDS = {"outs", "rng"}  # an OpRecord is a NamedTuple: rebuilt with ``_replace``
MUTATORS = {"append", "extend", "insert", "pop", "remove", "clear", "update", "setdefault", "sort", "reverse"}


def _is_field(node: ast.AST) -> bool:
    """``x.ops`` (and the other fields) of an object other than ``self``: a class's own
    attribute of that name is not a record's (no record class lives outside ``_record/``)."""
    return (
        isinstance(node, ast.Attribute)
        and node.attr in RECORD_FIELDS
        and not (isinstance(node.value, ast.Name) and node.value.id == "self")
    )


def _writes(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, what) of every write to a record field in ``tree``: direct, or through a
    local name bound to a field (``ops = record.ops; ops[i] = ...``)."""
    found: list[tuple[int, str]] = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        aliases = {
            t.id
            for n in ast.walk(fn)
            if isinstance(n, ast.Assign) and _is_field(n.value)
            for t in n.targets
            if isinstance(t, ast.Name)
        }

        def held(node: ast.AST, aliases: set[str] = aliases) -> bool:
            return _is_field(node) or (isinstance(node, ast.Name) and node.id in aliases)

        for n in ast.walk(fn):
            targets: list[ast.AST] = []
            if isinstance(n, ast.Assign):
                targets = list(n.targets)
            elif isinstance(n, (ast.AugAssign, ast.AnnAssign)):
                targets = [n.target]
            elif isinstance(n, ast.Delete):
                targets = list(n.targets)
            for t in targets:
                for e in t.elts if isinstance(t, ast.Tuple) else [t]:
                    if _is_field(e) or (isinstance(e, ast.Subscript) and held(e.value)):
                        found.append((n.lineno, ast.unparse(e)))
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute):
                if n.func.attr in MUTATORS and held(n.func.value):
                    found.append((n.lineno, ast.unparse(n.func)))
                if n.func.attr == "_replace" and any(k.arg in OP_FIELDS for k in n.keywords):
                    found.append((n.lineno, ast.unparse(n.func)))
    return sorted(set(found))


def test_the_scan_sees_each_kind_of_write():
    src = (
        "def f(record, rec, i, v):\n"
        "    record.ops.extend([])\n"
        "    record.signature = None\n"
        "    record.renamed[1] = 0\n"
        "    ops = record.ops\n"
        "    ops[i] = rec._replace(outs=())\n"
        "    record.registered.append(v)\n"
        "    x = record.ops[0]\n"  # a read
        "    self.ops = []\n"  # an object's own attribute
    )
    lines = [line for line, _ in _writes(ast.parse(src))]
    assert lines == [2, 3, 4, 6, 6, 7], _writes(ast.parse(src))


def test_only_record_writes_a_record():
    outside = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if rel.parts[0] == "_record":
            continue
        for line, what in _writes(ast.parse(path.read_text(encoding="utf-8"))):
            outside.append(f"gradient_scope/{rel}:{line}: {what}")
    assert not outside, "a record's fields are written outside _record/:\n" + "\n".join(outside)
