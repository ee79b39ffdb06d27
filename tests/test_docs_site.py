"""The docs site's configuration, and what the repository's text may point to.

``mkdocs build --strict`` itself runs in CI (.ci/run, which also fails on a script, stylesheet or font
loaded from another host); these checks are the cheap ones, run with the suite.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
OUTSIDE = ("DESIGN" + ".md", "REFERENCES" + ".md")  # split, so this file does not name them itself


def test_no_text_points_to_a_file_outside_the_repository() -> None:
    tracked = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split("\0")
    found = []
    for name in filter(None, tracked):
        path = ROOT / name
        if path.suffix not in {".py", ".md", ".yml", ".toml", ".txt", ""} or not path.is_file():
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        found += [f"{name}: {ref}" for ref in OUTSIDE if ref in text]
    assert found == []


def test_the_site_is_self_contained_and_highlighted_at_build_time() -> None:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    assert config["theme"]["name"] == "material"
    assert config["theme"]["font"] is False  # no Google Fonts
    extensions = {next(iter(e)) if isinstance(e, dict) else e: e for e in config["markdown_extensions"]}
    assert extensions["pymdownx.highlight"]["pymdownx.highlight"]["use_pygments"] is True
    assert "pymdownx.superfences" in extensions
    plugins = [next(iter(p)) if isinstance(p, dict) else p for p in config["plugins"]]
    assert "mkdocstrings" in plugins
    for page in ("sagaguard", "idempotency", "stores", "outbox", "saga", "connectors"):
        assert (ROOT / "docs" / "api" / f"{page}.md").is_file()


def test_sphinx_roles_in_docstrings_become_cross_references() -> None:
    """The API pages' Griffe extension (docs/_griffe_roles.py): each role is resolved as Python would
    read the name, through re-exports, into an optional cross-reference; what is not loaded stays
    code."""
    import sys

    import griffe

    sys.path.insert(0, str(ROOT / "docs"))
    try:
        from _griffe_roles import SphinxRoles
    finally:
        sys.path.remove(str(ROOT / "docs"))
    modules = {
        "__init__.py": "from pkg.a import Guard\n",
        "a.py": (
            "class Guard:\n"
            '    """:meth:`run`, :class:`~pkg.a.Guard`, :func:`len`, :meth:`the run <pkg.Guard.run>`."""\n'
            "    def run(self) -> None:\n"
            '        """Back to :class:`Guard`."""\n'
        ),
    }
    with griffe.temporary_pypackage("pkg", modules) as tmp:
        pkg = griffe.load("pkg", search_paths=[tmp.tmpdir], extensions=griffe.load_extensions(SphinxRoles))
        assert isinstance(pkg, griffe.Module)
        guard, run = pkg["a.Guard"].docstring, pkg["a.Guard.run"].docstring
    link = '<autoref identifier="pkg.a.{}" optional><code>{}</code></autoref>'
    assert guard is not None and guard.value == (
        f"{link.format('Guard.run', 'run')}, {link.format('Guard', 'Guard')}, <code>len</code>, "
        f"{link.format('Guard.run', 'the run')}."
    )
    assert run is not None and run.value == f"Back to {link.format('Guard', 'Guard')}."
