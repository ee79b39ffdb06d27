"""The runnable examples under docs/examples/ run, and the docs show them as they are.

Each example runs in a fresh interpreter in a temporary directory, once on a memory store and once on
a SQLite file (``$SAGAGUARD_STORE``), and must exit 0. A page that shows an example marks the code
block with ``<!-- example: NAME.py -->`` on the line before it; the block must equal the file, so the
docs cannot drift from code that is tested.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "docs" / "examples"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
MARKER = re.compile(r"<!-- example: (?P<name>[\w.-]+\.py) -->\n```python\n(?P<code>.*?)```", re.S)

EXAMPLE_FILES = sorted(p.name for p in EXAMPLES.glob("*.py"))


def run_example(name: str, cwd: Path, store_url: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SAGAGUARD_STORE": store_url, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, str(EXAMPLES / name)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_there_are_examples() -> None:
    assert "quickstart.py" in EXAMPLE_FILES
    assert "readme.py" in EXAMPLE_FILES


@pytest.mark.parametrize("backend", ["memory", "sqlite"])
@pytest.mark.parametrize("name", EXAMPLE_FILES)
def test_example_runs(name: str, backend: str, tmp_path: Path) -> None:
    url = "memory://" if backend == "memory" else f"sqlite:///{tmp_path / 'examples.db'}"
    done = run_example(name, tmp_path, url)
    assert done.returncode == 0, f"{name} failed:\n{done.stdout}\n{done.stderr}"
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("name", "second_run"),
    [
        ("quickstart.py", "charges made by this process: 0"),
        ("explicit_run.py", "invoices sent by this process: 0"),
        ("async_effects.py", "emails sent by this process: 0"),
        ("in_doubt.py", "charges at the provider from this process: 0"),
    ],
)
def test_example_run_again_on_the_same_file_does_nothing_twice(
    name: str, second_run: str, tmp_path: Path
) -> None:
    """The point of the library, across processes: the second run replays what the first did."""
    url = f"sqlite:///{tmp_path / 'again.db'}"
    first = run_example(name, tmp_path, url)
    assert first.returncode == 0, first.stderr
    assert second_run not in first.stdout
    again = run_example(name, tmp_path, url)
    assert again.returncode == 0, again.stderr
    assert second_run in again.stdout


def test_pages_show_examples_as_they_are() -> None:
    shown: set[str] = set()
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for match in MARKER.finditer(text):
            name = match["name"]
            source = EXAMPLES / name
            assert source.exists(), f"{page.name} shows {name}, which is not in docs/examples/"
            assert match["code"] == source.read_text(encoding="utf-8"), (
                f"{page.name} shows {name} differently from docs/examples/{name}"
            )
            shown.add(name)
        assert text.count("<!-- example:") == len(MARKER.findall(text)), (
            f"{page.name}: an example marker is not followed by a ```python block"
        )
    assert shown == set(EXAMPLE_FILES), f"examples no page shows: {set(EXAMPLE_FILES) - shown}"


TEST_REFERENCE = re.compile(r"tests/(?P<file>test_\w+\.py)::(?P<name>test_\w+)")


def test_docs_name_tests_that_exist() -> None:
    """Every ``tests/FILE.py::test_name`` the docs cite (guarantees.md) is a test function there."""
    cited = 0
    for page in PAGES:
        for match in TEST_REFERENCE.finditer(page.read_text(encoding="utf-8")):
            source = ROOT / "tests" / match["file"]
            assert source.exists(), f"{page.name} cites {match[0]}, but {match['file']} does not exist"
            defined = re.search(rf"^(async )?def {match['name']}\(", source.read_text(encoding="utf-8"), re.M)
            assert defined, f"{page.name} cites {match[0]}, which is not a test function"
            cited += 1
    assert cited >= 20
