"""Versioned schemas: ``sagaguard db status`` / ``db upgrade`` and their exit codes, stores that
refuse tables at another revision (naming the command), ``create=True`` creating and stamping, and
concurrent upgraders on Postgres."""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from conftest import require_postgres
from test_schema_upgrade import fresh_database

from sagaguard.idempotency.cli import main as cli_main
from sagaguard.idempotency.errors import ConfigurationError, SchemaVersionMismatch, StoreError
from sagaguard.idempotency.migrations import (
    SchemaState,
    alembic_config,
    schema_status,
    table_sets,
    upgrade_schema,
)
from sagaguard.idempotency.migrations.cli import EXIT_AHEAD, EXIT_BEHIND
from sagaguard.idempotency.stores.sql import SqlStore, make_engine
from sagaguard.saga.journals.sql import SqlJournal


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path}/db.sqlite"


@pytest.fixture
def pg_url(tmp_path: Path) -> Iterator[str]:
    yield from fresh_database("postgres", tmp_path, fixture=False)


def test_each_table_set_is_registered_with_its_head_and_branch_label() -> None:
    from alembic.script import ScriptDirectory

    sets = {ts.name: ts for ts in table_sets()}
    assert sorted(sets) == ["audit", "effects", "journal", "outbox"]  # the journal from the saga side
    for ts in sets.values():
        script = ScriptDirectory.from_config(alembic_config(ts, ts.default))
        assert script.get_heads() == [ts.head]
        assert ts.name in script.get_revision(ts.head).branch_labels


def test_db_status_and_upgrade_exit_codes(
    sqlite_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli_main(["db", "status", "--store", sqlite_url, "--json"]) == EXIT_BEHIND
    report = json.loads(capsys.readouterr().out)
    assert {(r["table_set"], r["state"], r["current"]) for r in report} == {
        ("audit", "empty", None), ("effects", "empty", None), ("journal", "empty", None),
        ("outbox", "empty", None),
    }  # fmt: skip
    assert not (tmp_path / "db.sqlite").exists()  # looking created nothing

    assert (
        cli_main(["db", "upgrade", "--store", sqlite_url, "--only", "effects", "--effects-table", "fx"]) == 0
    )
    assert "effects (fx): created at effects_0003" in capsys.readouterr().out
    assert (
        cli_main(["db", "status", "--store", sqlite_url, "--only", "effects", "--effects-table", "fx"]) == 0
    )
    assert "up to date" in capsys.readouterr().out
    assert cli_main(["db", "status", "--store", sqlite_url]) == EXIT_BEHIND  # the default names: empty

    engine = make_engine(sqlite_url)
    with engine.begin() as conn:  # as a newer sagaguard would leave it
        conn.exec_driver_sql("UPDATE fx_version SET version_num = 'effects_0099'")
    engine.dispose()
    args = ["--store", sqlite_url, "--only", "effects", "--effects-table", "fx"]
    assert cli_main(["db", "status", *args]) == EXIT_AHEAD
    assert "ahead" in capsys.readouterr().out
    assert cli_main(["db", "upgrade", *args]) == EXIT_AHEAD
    assert "newer than this sagaguard" in capsys.readouterr().err

    assert cli_main(["db", "status", "--store", sqlite_url, "--effects-table", "no-such name"]) == 2
    assert cli_main(["db", "upgrade", "--store", "redis://127.0.0.1:6379/0"]) == 2
    assert "SQLite and Postgres" in capsys.readouterr().err
    assert cli_main(["db", "upgrade", "--store", "postgresql://u:secret@127.0.0.1:1/none"]) == 1
    assert "secret" not in capsys.readouterr().err
    assert cli_main(["db"]) == 2


def test_the_environment_names_the_store(sqlite_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SAGAGUARD_STORE", sqlite_url)
    assert cli_main(["db", "upgrade"]) == 0
    assert cli_main(["db", "status"]) == 0


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_a_store_refuses_tables_at_another_revision_and_names_the_command(
    backend: str, tmp_path: Path
) -> None:
    gen = fresh_database(backend, tmp_path, fixture=False)
    url = next(gen)
    try:
        shown = url
        if backend == "postgres":  # a password in the URL never reaches a message
            shown = sa.make_url(url).set(password="secret").render_as_string(hide_password=False)
        with pytest.raises(SchemaVersionMismatch) as refused:
            SqlStore(shown, create=False)
        error = refused.value
        assert isinstance(error, ConfigurationError)
        assert (error.state, error.table_set, error.current, error.head) == (
            "empty",
            "effects",
            None,
            "effects_0003",
        )
        assert error.command is not None and error.command.startswith("sagaguard db upgrade --store ")
        assert "secret" not in str(error) and error.command in str(error)
        with pytest.raises(SchemaVersionMismatch, match="--journal-prefix app_"):
            SqlJournal(url, create=False, table_prefix="app_")

        SqlStore(url).close()  # create=True: created at this revision and stamped
        SqlJournal(url).close()
        engine = make_engine(url)
        try:
            states = {s.table_set: s.state for s in schema_status(engine, table_sets())}
            up = SchemaState.UP_TO_DATE
            empty = SchemaState.EMPTY
            assert states == {"audit": empty, "effects": up, "journal": up, "outbox": empty}
            SqlStore(url, create=False).close()
            with engine.begin() as conn:  # a newer sagaguard's revision
                conn.exec_driver_sql("UPDATE sagaguard_journal_version SET version_num = 'journal_0042'")
            for create in (False, True):  # refused either way: never downgraded
                with pytest.raises(SchemaVersionMismatch, match="journal_0042, newer than") as ahead:
                    SqlJournal(url, create=create)
                assert ahead.value.state == "ahead" and ahead.value.command is None
        finally:
            engine.dispose()
    finally:
        gen.close()


def test_the_default_refuses_an_older_table_and_create_true_upgrades_it(tmp_path: Path) -> None:
    """By default a store creates its tables on a new database but alters nothing at open: a table
    made before versioned schemas is refused, naming the command; ``create=True`` upgrades it, as
    the stores added columns at open before."""
    url = f"sqlite:///{tmp_path}/old.db"
    SqlStore(url).close()
    engine = make_engine(url)
    with engine.begin() as conn:  # back to the first layout, unversioned
        conn.exec_driver_sql("DROP TABLE sagaguard_effects_version")
        conn.exec_driver_sql("ALTER TABLE sagaguard_effects DROP COLUMN holder")
        conn.exec_driver_sql("ALTER TABLE sagaguard_effects DROP COLUMN result_type")
    with pytest.raises(SchemaVersionMismatch, match="sagaguard db upgrade --store"):
        SqlStore(url)
    with engine.connect() as conn:  # refused: nothing altered
        assert "holder" not in {c["name"] for c in sa.inspect(conn).get_columns("sagaguard_effects")}
    store = SqlStore(url, create=True)
    store.close()
    with engine.connect() as conn:
        assert {"holder", "result_type"} <= {
            c["name"] for c in sa.inspect(conn).get_columns("sagaguard_effects")
        }
    effects = [ts for ts in table_sets() if ts.name == "effects"]
    assert schema_status(engine, effects)[0].current == "effects_0003"
    with engine.begin() as conn:  # a table at effects_0002, the layout before result types
        conn.exec_driver_sql("ALTER TABLE sagaguard_effects DROP COLUMN result_type")
        conn.exec_driver_sql("UPDATE sagaguard_effects_version SET version_num = 'effects_0002'")
    for create in (False, None):  # refused by default too: nothing is altered at open
        with pytest.raises(SchemaVersionMismatch, match="effects_0002"):
            SqlStore(url, create=create)
    SqlStore(url, create=True).close()  # effects_0003 adds the column
    with engine.connect() as conn:
        assert "result_type" in {c["name"] for c in sa.inspect(conn).get_columns("sagaguard_effects")}
    assert schema_status(engine, effects)[0].current == "effects_0003"
    engine.dispose()


def test_concurrent_upgraders_on_postgres_one_creates_the_rest_find_it_done(pg_url: str) -> None:
    require_postgres()
    effects = next(ts for ts in table_sets() if ts.name == "effects")
    name = f"sg_race_{uuid.uuid4().hex[:8]}"
    engines = [make_engine(pg_url) for _ in range(6)]
    barrier = threading.Barrier(len(engines))
    outcomes: list[object] = []

    def upgrade(engine: sa.Engine) -> None:
        barrier.wait()
        try:
            outcomes.append(upgrade_schema(engine, effects, name).state)
        except Exception as exc:  # recorded: the assertion below shows it
            outcomes.append(exc)

    threads = [threading.Thread(target=upgrade, args=(e,)) for e in engines]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for engine in engines:
        engine.dispose()
    assert sorted(map(str, outcomes)) == sorted(["empty"] + ["up to date"] * 5)


def test_the_least_privilege_recipe_on_postgres(tmp_path: Path) -> None:
    """The owner runs ``db upgrade``; a role with DML only opens the store with ``create=False``,
    guards a call, and cannot change the schema (an older table makes it refuse, naming the
    command, instead of trying)."""
    import psycopg

    from sagaguard.idempotency import Guard, scope

    base = require_postgres()
    gen = fresh_database("postgres", tmp_path, fixture=False)
    owner_url = next(gen)
    schema = sa.make_url(owner_url).query["options"].split("=", 1)[1]  # type: ignore[union-attr]
    role = f"sg_app_{uuid.uuid4().hex[:8]}"
    try:
        assert cli_main(["db", "upgrade", "--store", owner_url, "--only", "effects"]) == 0
        with psycopg.connect(base, autocommit=True) as admin:
            admin.execute(f'CREATE ROLE "{role}" LOGIN')
            admin.execute(f'GRANT USAGE ON SCHEMA "{schema}" TO "{role}"')
            dml = "SELECT, INSERT, UPDATE, DELETE"
            admin.execute(f'GRANT {dml} ON ALL TABLES IN SCHEMA "{schema}" TO "{role}"')
        app_url = sa.make_url(owner_url).set(username=role).render_as_string(hide_password=False)

        store = SqlStore(app_url, create=False)
        try:
            with scope("order-1"):
                assert Guard(store).run("charge", lambda: 42) == 42
        finally:
            store.close()
        SqlStore(app_url).close()  # the default at this revision writes nothing: allowed too

        engine = make_engine(owner_url)
        with engine.begin() as conn:  # the owner's tables fall behind (a release before versions)
            conn.exec_driver_sql("DROP TABLE sagaguard_effects_version")
        engine.dispose()
        for create in (False, None):  # the default alters nothing at open: refused, naming the command
            with pytest.raises(SchemaVersionMismatch, match="sagaguard db upgrade --store"):
                SqlStore(app_url, create=create)
        with pytest.raises(StoreError, match=r"permission denied|must be owner"):
            SqlStore(app_url, create=True)  # create=True needs the owner's rights to upgrade
    finally:
        gen.close()
        with psycopg.connect(base, autocommit=True) as admin:
            admin.execute(f'DROP ROLE IF EXISTS "{role}"')


# Each `sagaguard` process spends seconds importing its command plugins: with the slow tests.
@pytest.mark.slow
@pytest.mark.skipif("'slow' not in config.getoption('markexpr')", reason="runs with -m slow")
def test_two_processes_run_db_upgrade_at_once_on_postgres(pg_url: str) -> None:
    """Two real ``sagaguard db upgrade`` processes on one new database: both exit 0, each table set
    is created once (the other finds it done), and the database is up to date."""
    import subprocess
    import sys

    command = [sys.executable, "-m", "sagaguard.idempotency", "db", "upgrade", "--store", pg_url]
    procs = [
        subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)
    ]
    results = [proc.communicate(timeout=120) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], results
    out = "".join(stdout for stdout, _ in results)
    assert out.count("created at") == 4 and out.count("already at") == 4
    assert cli_main(["db", "status", "--store", pg_url]) == 0
