"""One store URL for every ``sagaguard`` command, and read commands that never run DDL.

Before: ``sagaguard --store postgresql://.../shop sagas list`` ignored ``--store`` (the sagas
commands read ``--journal``), created ``./sagaguard.db`` and printed ``no sagas`` with exit 0; on a
fresh Postgres database ``effects list`` and ``sagas list`` created four tables and printed "no
records". Run through the real CLI (``main([...])``) on SQLite and on Postgres.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from conftest import require_postgres

from sagaguard.idempotency.cli import main
from sagaguard.idempotency.stores.sql import SqlStore
from sagaguard.saga.journals.sql import SqlJournal


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture(autouse=True)
def in_empty_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each test runs in an empty folder with no store in the environment, as a new user would."""
    folder = tmp_path / "cwd"
    folder.mkdir()
    monkeypatch.chdir(folder)
    for name in ("SAGAGUARD_STORE", "SAGAGUARD_JOURNAL", "SAGAGUARD_OUTBOX_DB"):
        monkeypatch.delenv(name, raising=False)
    return folder


def _start_saga(url: str, saga_id: str) -> None:
    journal = SqlJournal(url)
    try:
        journal.start(saga_id, name="shop", version=1, input="{}", fingerprint="f", lease=30)
    finally:
        journal.close()


# -- SQLite --------------------------------------------------------------------------------------


READS = [["effects", "list"], ["sagas", "list"], ["sagas", "show", "s-1"], ["llm", "savings"]]


@pytest.mark.parametrize("command", READS, ids=[" ".join(c) for c in READS])
def test_a_missing_sqlite_file_is_an_error_and_nothing_is_created(
    command: list[str], tmp_path: Path, in_empty_folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "shop.db"
    code, out, err = run(capsys, "--store", f"sqlite:///{missing}", *command)
    assert code == 1, (out, err)
    assert "does not exist" in err and str(missing) in err
    assert not missing.exists()
    assert list(in_empty_folder.iterdir()) == []  # no ./sagaguard.db either


def test_sagas_commands_use_store_before_or_after_and_from_the_environment(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, in_empty_folder: Path
) -> None:
    url = f"sqlite:///{tmp_path / 'shop.db'}"
    _start_saga(url, "order-7")
    for argv in (["--store", url, "sagas", "list"], ["sagas", "list", "--store", url]):
        code, out, err = run(capsys, *argv)
        assert code == 0, err
        assert "order-7" in out
    monkeypatch.setenv("SAGAGUARD_STORE", url)
    code, out, err = run(capsys, "sagas", "show", "order-7")
    assert code == 0, err
    assert "order-7" in out
    assert list(in_empty_folder.iterdir()) == []


def test_journal_is_a_deprecated_alias_of_store(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"sqlite:///{tmp_path / 'shop.db'}"
    _start_saga(url, "order-8")
    code, out, err = run(capsys, "sagas", "list", "--journal", url)
    assert code == 0 and "order-8" in out
    assert "--journal is deprecated" in err
    other = f"sqlite:///{tmp_path / 'other.db'}"
    code, _, err = run(capsys, "--store", other, "sagas", "list", "--journal", url)
    assert code == 2 and "different URLs" in err


def test_a_sqlite_file_without_the_tables_is_an_error_and_stays_empty(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "other.db"
    engine = sa.create_engine(f"sqlite:///{path}")
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE unrelated (id INTEGER)"))
    for command in (["effects", "list"], ["sagas", "list"]):
        code, _, err = run(capsys, "--store", f"sqlite:///{path}", *command)
        assert code == 1 and "no table" in err
    assert sa.inspect(engine).get_table_names() == ["unrelated"]
    engine.dispose()


# -- Postgres ------------------------------------------------------------------------------------


@pytest.fixture
def fresh_schema() -> Iterator[str]:
    """A URL on a fresh, empty Postgres schema (as a new database would be), with a password."""
    base = require_postgres()
    schema = f"sg_cli_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(base.replace("postgresql://", "postgresql+psycopg://", 1))
    with admin.begin() as conn:
        conn.execute(sa.text(f"CREATE SCHEMA {schema}"))
    url = sa.make_url(base).set(password="s3cret", query={"options": f"-csearch_path={schema}"})
    try:
        yield url.render_as_string(hide_password=False)
    finally:
        with admin.begin() as conn:
            conn.execute(sa.text(f"DROP SCHEMA {schema} CASCADE"))
        admin.dispose()


def _tables(url: str) -> list[str]:
    engine = sa.create_engine(url.replace("postgresql://", "postgresql+psycopg://", 1))
    try:
        with engine.connect() as conn:
            return sorted(sa.inspect(conn).get_table_names())
    finally:
        engine.dispose()


@pytest.mark.parametrize("command", READS, ids=[" ".join(c) for c in READS])
def test_read_commands_on_a_fresh_postgres_database_run_no_ddl(
    command: list[str], fresh_schema: str, capsys: pytest.CaptureFixture[str], in_empty_folder: Path
) -> None:
    code, out, err = run(capsys, "--store", fresh_schema, *command)
    assert code == 1, (out, err)
    assert "no table" in err and "127.0.0.1" in err  # the URL is named ...
    assert "s3cret" not in err and "***" in err  # ... with its password masked
    assert _tables(fresh_schema) == []  # nothing was created
    assert list(in_empty_folder.iterdir()) == []


def test_once_the_application_created_the_schema_the_commands_read_it(
    fresh_schema: str, capsys: pytest.CaptureFixture[str]
) -> None:
    SqlStore(fresh_schema).close()
    _start_saga(fresh_schema, "order-9")
    created = _tables(fresh_schema)
    code, out, err = run(capsys, "--store", fresh_schema, "effects", "list")
    assert code == 0 and "no effect records" in out, err
    code, out, err = run(capsys, "--store", fresh_schema, "sagas", "list")
    assert code == 0 and "order-9" in out, err
    assert _tables(fresh_schema) == created
