"""Griffe extension: this package's docstrings, read as Markdown by mkdocstrings.

The docstrings are Google style (``Args:``, ``Returns:``, ``Raises:``) with two reST habits
that read well in ``help()`` and doctest: Sphinx roles (``:class:`recompute_scope```) and
examples introduced by ``Example::``. Here a role naming a public name becomes a
cross-reference to its API entry (any other role becomes inline code), and ``Example::``
becomes a Google ``Examples:`` section, whose ``>>>`` lines griffe renders as code.
"""

from __future__ import annotations

import re
from typing import Any

from griffe import Extension, Module, Object

_ROLE = re.compile(r":(?:class|func|meth|attr|data|exc|mod|obj):`(~?)([\w.]+)`")
_EXAMPLE = re.compile(r"^(\s*)Examples?::\s*$", re.MULTILINE)


class SphinxToMarkdown(Extension):
    def on_package(self, *, pkg: Module, **kwargs: Any) -> None:
        public = set(pkg.exports or ())

        def role(m: re.Match[str]) -> str:
            target = m.group(2)
            short = target.rsplit(".", 1)[-1]
            shown = short if m.group(1) or target.startswith(pkg.name + ".") else target
            if short in public:
                return f"[`{shown}`][{pkg.name}.{short}]"
            return f"`{shown}`"

        def visit(obj: Object) -> None:
            if obj.docstring is not None:
                text = _ROLE.sub(role, obj.docstring.value)
                obj.docstring.value = _EXAMPLE.sub(r"\1Examples:", text)
            for member in obj.members.values():
                if not member.is_alias:
                    visit(member)

        visit(pkg)
