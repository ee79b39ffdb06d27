"""The operator's commands piped to a reader that goes away (``| head``) end quietly,
``sagas worker --once`` on a database without the schema creates nothing, and an argument that is
not UTF-8 is a one-line error.

Before: ``sagas``, ``llm`` and ``outbox`` commands ended in a ``BrokenPipeError`` traceback (only
``effects`` stopped quietly), and ``sagas worker --once`` created the journal's tables. The pipe is
closed before the command starts, so its first write fails, whatever the timing.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import sqlalchemy as sa

from sagaguard.idempotency.cli import main
from sagaguard.idempotency.stores.sql import SqlStore
from sagaguard.saga.journals.sql import SqlJournal

COMMANDS = [
    ["effects", "list", "--store"],
    ["sagas", "list", "--store"],
    ["llm", "savings", "--store"],
    ["outbox", "status", "--db"],
]


@pytest.fixture
def url(tmp_path: Path) -> str:
    """A SQLite store with every table the commands read."""
    url = f"sqlite:///{tmp_path}/store.db"
    SqlStore(url).close()
    SqlJournal(url).close()
    assert main(["outbox", "migrate", "--db", url]) == 0
    return url


# Each subcommand module also runs on its own (python -m MODULE ...).
ON_THEIR_OWN = [
    ["sagaguard.saga.cli", "sagas", "list", "--store"],
    ["sagaguard.connectors.cli", "llm", "savings", "--store"],
    ["sagaguard.idempotency.outbox.cli", "outbox", "status", "--db"],
]


@pytest.mark.parametrize(
    "command",
    [["sagaguard.idempotency", *c] for c in COMMANDS] + ON_THEIR_OWN,
    ids=[" ".join(c[:2]) for c in COMMANDS] + [c[0] for c in ON_THEIR_OWN],
)
def test_a_command_whose_reader_went_away_ends_quietly(command: list[str], url: str) -> None:
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first line is written
    try:
        done = subprocess.run(
            [sys.executable, "-m", *command, url],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
            check=False,
        )
    finally:
        os.close(write)
    assert "Traceback" not in done.stderr and "BrokenPipeError" not in done.stderr, done.stderr
    assert done.stderr == ""
    assert done.returncode == 1


APP = """
from sagaguard.saga import Saga

trip: Saga[int] = Saga("trip", version=1, input=int)


@trip.step(compensate=None)
def book(ctx, n: int) -> int:
    return n
"""


def test_worker_once_on_a_database_without_the_schema_creates_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "pipes_app.py").write_text(APP)
    monkeypatch.syspath_prepend(str(tmp_path))
    path = tmp_path / "other.db"
    engine = sa.create_engine(f"sqlite:///{path}")
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE unrelated (id INTEGER)"))
    try:
        code = main(["sagas", "worker", "--once", "--app", "pipes_app:trip", "--store", f"sqlite:///{path}"])
        err = capsys.readouterr().err
        assert code == 1 and "no table" in err, err
        assert sa.inspect(engine).get_table_names() == ["unrelated"]
    finally:
        engine.dispose()
    missing = tmp_path / "missing.db"
    assert (
        main(["sagas", "worker", "--once", "--app", "pipes_app:trip", "--store", f"sqlite:///{missing}"]) == 1
    )
    assert "does not exist" in capsys.readouterr().err
    assert not missing.exists()


@pytest.mark.parametrize("command", [["sagas", "show"], ["effects", "show"]], ids=" ".join)
def test_an_argument_that_is_not_utf8_is_a_one_line_error(
    command: list[str], url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A byte that is not UTF-8 reaches Python as a lone surrogate (``$'\\xff'`` in a shell):
    before, ``sagas show`` and ``effects show`` ended in a UnicodeEncodeError traceback."""
    assert main([*command, "\udcff", "--store", url]) == 2
    err = capsys.readouterr().err
    assert err.startswith("sagaguard: ") and "not valid unicode" in err and "Traceback" not in err
