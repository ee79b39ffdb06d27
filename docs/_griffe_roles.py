"""Cross-references in the API pages: the docstrings' Sphinx roles rendered as links.

The docstrings say ``:class:`Guard```, ``:meth:`~sagaguard.saga.runner.SagaRunner.run``` or
``:func:`text <target>```, as Python's own tools read them; mkdocstrings renders Markdown, where such a
role would show as literal text. This Griffe extension, loaded by mkdocs.yml, rewrites each role
once the package is loaded: the target is resolved the way Python would (the object's own scope, then
its parents' and their imports), followed through re-exports to the object that is documented, and
written as an optional cross-reference. mkdocs-autorefs turns it into a link where the target has a
page, and into plain code where it has none (a private helper, a builtin), without a warning.
"""

from __future__ import annotations

import html
import re
from typing import Any

from griffe import Extension, Module, Object

ROLE = re.compile(
    r":(?:py:)?(?:class|func|meth|mod|data|attr|exc|obj|const):`(?P<tilde>~?)(?P<body>[^`]+)`"
)
"""A Sphinx role: ``:kind:`target```, ``:kind:`~target``` or ``:kind:`text <target>```."""

EXPLICIT = re.compile(r"^(?P<text>.+?)\s*<(?P<target>[^<>]+)>$", re.S)


class SphinxRoles(Extension):
    """Rewrites the Sphinx roles of every docstring of a loaded package into cross-references."""

    def on_package(self, *, pkg: Module, **kwargs: Any) -> None:
        """Rewrite the docstrings of ``pkg`` and of everything it defines."""
        seen: set[int] = set()
        stack: list[Object] = [pkg]
        while stack:
            obj = stack.pop()
            if id(obj) in seen:
                continue
            seen.add(id(obj))
            if obj.docstring is not None:
                obj.docstring.value = ROLE.sub(lambda m, o=obj: _reference(o, m), obj.docstring.value)
            stack.extend(m for m in obj.members.values() if not m.is_alias)


def _reference(obj: Object, match: re.Match[str]) -> str:
    body = " ".join(match["body"].split())
    explicit = EXPLICIT.match(body)
    target = explicit["target"] if explicit else body
    if explicit:
        shown = explicit["text"]
    elif match["tilde"]:
        shown = target.rsplit(".", 1)[-1]
    else:
        shown = target
    path = _resolve(obj, target.strip().rstrip("()"))
    code = f"<code>{html.escape(shown)}</code>"
    if path is None:
        return code
    return f'<autoref identifier="{html.escape(path)}" optional>{code}</autoref>'


def _resolve(obj: Object, target: str) -> str | None:
    """The documented object's path for ``target`` read in ``obj``'s scope, or None."""
    found = _documented(obj, target)  # a full path
    if found is not None:
        return found
    head, _, rest = target.lstrip(".").partition(".")
    scope: Object | None = obj
    while scope is not None:
        try:
            path = scope.resolve(head)
        except Exception:  # griffe's NameResolutionError: try the enclosing scope
            scope = scope.parent
            continue
        full = f"{path}.{rest}" if rest else path
        return _documented(obj, full) or full
    return None


def _documented(obj: Object, path: str) -> str | None:
    """The path of the object ``path`` names once re-exports are followed, or None where it is not
    loaded (another package, a builtin)."""
    try:
        found = obj.modules_collection[path]
        return str(found.final_target.path if found.is_alias else found.path)
    except Exception:  # KeyError, or an alias whose target is not loaded
        return None
