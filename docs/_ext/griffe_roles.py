"""A griffe extension for the reference site: the reStructuredText habits of the docstrings in Markdown.

subquad's docstrings name other objects the Sphinx way (``:func:`attention```,
``:class:`~subquad.Plan```). Markdown has no such roles, so mkdocstrings would print them
verbatim. This rewrites each into a mkdocs-autorefs cross-reference to the object, resolved like
Python names (the object's own scope first, then its module's); the reference is optional, so a
target the site does not render (torch's functions, private modules) shows as plain code. It
also drops the ``::`` that introduces a literal block (the indented block is already code in
Markdown) and reStructuredText's backslash-space escape.
"""

from __future__ import annotations

import html
import re
from typing import Any, Iterator, Optional

import griffe

_LITERAL = re.compile(r"(\S)::$|^[ \t]*::$", re.MULTILINE)  # "Equal to::" -> "Equal to:"; a lone "::" goes
_ROLE = re.compile(r":(?:py:)?(?:func|class|mod|data|meth|attr|exc|obj):`(~?)\.?([\w.]+)(?:\(\))?`")


def _objects(obj: griffe.Object) -> Iterator[griffe.Object]:
    yield obj
    for member in obj.members.values():
        if not member.is_alias:
            yield from _objects(member)


def _lookup(collection: Any, path: str) -> Optional[str]:
    try:
        found = collection[path]
        return found.final_target.path if found.is_alias else found.path
    except Exception:  # not loaded, or an alias to something outside the package
        return None


def _target(collection: Any, obj: griffe.Object, name: str) -> Optional[str]:
    scope: Optional[griffe.Object] = obj
    while scope is not None:
        found = _lookup(collection, f"{scope.path}.{name}")
        if found:
            return found
        scope = scope.parent
    return _lookup(collection, name)


class SphinxRoles(griffe.Extension):
    """Rewrite every docstring of the package once it is loaded (see the module docstring)."""

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        collection = loader.modules_collection
        for obj in _objects(pkg):
            if obj.docstring is None:
                continue

            def link(match: "re.Match[str]", obj: griffe.Object = obj) -> str:
                short, name = match.group(1), match.group(2)
                shown = html.escape(name.rsplit(".", 1)[-1] if short else name)
                target = _target(collection, obj, name)
                if target is None:
                    return f"<code>{shown}</code>"
                return f'<autoref identifier="{html.escape(target)}" optional><code>{shown}</code></autoref>'

            text = _LITERAL.sub(lambda m: f"{m.group(1)}:" if m.group(1) else "", obj.docstring.value)
            obj.docstring.value = _ROLE.sub(link, text.replace("\\ ", ""))
