"""The package as a user gets it: this checkout's wheel and sdist, the wheel in a fresh virtualenv.

``python -m build`` builds the sdist from a copy of the checkout, then the wheel from the sdist (in its
isolated build environment, as a release would; nothing is written into the checkout); a new
virtualenv gets the wheel and its core dependencies from the package index (pip's cache), nothing
from this checkout. From a directory outside the checkout, so nothing here is importable, the
README's example runs twice (the second run replays), ``sagaguard --version`` prints the
distribution's version, and ``sagaguard demo`` without the ``demo`` extra says which extra to install.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

# Half a minute or more (builds, installs a wheel): runs with the long sweeps (-m slow, `make slow`, CI),
# not in `make test`, which must stay well under its 15-minute budget.
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif("'slow' not in config.getoption('markexpr')", reason="runs with -m slow"),
]


ROOT = Path(__file__).resolve().parent.parent
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["version"]


def _run(*args: str | Path, cwd: Path | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    argv = [str(a) for a in args]
    done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=240, check=False)
    if check and done.returncode != 0:
        raise AssertionError(f"{args} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
    return done


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out, source = tmp_path_factory.mktemp("dist"), tmp_path_factory.mktemp("source") / "sagaguard"
    skip = shutil.ignore_patterns(
        ".git", ".venv*", "build", "site", "*.egg-info", "__pycache__", ".*_cache", ".hypothesis", "*.db"
    )
    shutil.copytree(ROOT, source, ignore=skip)
    _run(sys.executable, "-m", "build", "--outdir", out, source)  # the sdist, then the wheel from it
    return out


@pytest.fixture(scope="module")
def venv(dist: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A fresh virtualenv (no pip of its own) with the wheel and its core dependencies installed."""
    env = tmp_path_factory.mktemp("venv")
    _run(sys.executable, "-m", "venv", "--without-pip", env)
    (wheel,) = dist.glob("*.whl")
    _run(sys.executable, "-m", "pip", "--python", env / "bin" / "python", "install", "-q", wheel)
    yield env


def test_wheel_and_sdist_carry_the_metadata(dist: Path) -> None:
    (wheel,) = dist.glob(f"sagaguard-{VERSION}-py3-none-any.whl")
    (sdist,) = dist.glob(f"sagaguard-{VERSION}.tar.gz")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        meta = zf.read(f"sagaguard-{VERSION}.dist-info/METADATA").decode()
    assert f"sagaguard-{VERSION}.dist-info/licenses/LICENSE" in names
    for package in ("sagaguard", "sagaguard/idempotency", "sagaguard/saga", "sagaguard/connectors"):
        assert f"{package}/__init__.py" in names and f"{package}/py.typed" in names, package
    # Nothing installs under a top-level name another distribution may own (`idempotency`, `connectors`).
    assert {n.split("/")[0] for n in names} == {"sagaguard", f"sagaguard-{VERSION}.dist-info"}
    assert not [n for n in names if n.startswith(("tests/", "docs/", "bench/"))]
    assert "License-Expression: Apache-2.0" in meta
    assert "Project-URL: Documentation, https://" in meta
    assert "Provides-Extra: demo" in meta and "Provides-Extra: ui" in meta
    # The console's templates and stylesheet travel with it (package data, not packages).
    assert "sagaguard/saga/console/templates/base.html" in names
    assert "sagaguard/saga/console/static/console.css" in names
    assert "Classifier: Typing :: Typed" in meta
    # The README is the package's description on the index: no link may be relative there.
    assert not re.findall(r"\]\((?!https?://|#)[^)]+\)", meta)
    with tarfile.open(sdist) as tf:
        assert f"sagaguard-{VERSION}/LICENSE" in tf.getnames()


def test_installed_wheel_runs_the_readme_quickstart(venv: Path, tmp_path: Path) -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    found = re.search(r"<!-- example: readme.py -->\n```python\n(.*?)```", readme, re.S)
    assert found is not None
    (tmp_path / "quickstart.py").write_text(found.group(1), encoding="utf-8")
    python = venv / "bin" / "python"
    probe = (
        "import importlib.util, sagaguard, sagaguard.idempotency; "
        "print(sagaguard.__version__, sagaguard.idempotency.__file__, "
        "[n for n in ('idempotency', 'saga', 'connectors') if importlib.util.find_spec(n)])"
    )
    where = _run(python, "-c", probe, cwd=tmp_path).stdout.split(maxsplit=2)
    assert where[0] == VERSION
    assert Path(where[1]).is_relative_to(venv), where  # the installed copy, not this checkout
    assert where[2].strip() == "[]"  # no top-level package of ours
    first = _run(python, "quickstart.py", cwd=tmp_path).stdout
    second = _run(python, "quickstart.py", cwd=tmp_path).stdout
    assert first.strip().startswith("Receipt(charge_id='ch_")
    assert second == first  # the second run replays the recorded receipt


def test_installed_wheel_cli(venv: Path, tmp_path: Path) -> None:
    command = venv / "bin" / "sagaguard"
    assert _run(command, "--version", cwd=tmp_path).stdout.strip() == f"sagaguard {VERSION}"
    demo = _run(command, "demo", cwd=tmp_path, check=False)
    assert demo.returncode == 2
    assert "Traceback" not in demo.stderr
    assert demo.stderr.count("\n") == 1 and "pip install 'sagaguard[demo]'" in demo.stderr
    small = _run(command, "demo", "--small", cwd=tmp_path, check=False)
    assert small.returncode == 0, small.stderr  # the small demo needs no extra
