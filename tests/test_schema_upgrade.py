"""A database written by the previous release (8bd923d, before versioned schemas) is upgraded by
``sagaguard db upgrade`` with nothing recorded lost or changed in meaning.

The fixtures in ``tests/fixtures/release_8bd923d.*.sql`` were made by running that release's own
code once (effect records in progress, in doubt, succeeded and failed; sagas running, compensating,
needing attention and completed, with their steps and a signal; outbox messages pending, delayed
and dead-lettered) and dumping the database (``sqlite3 .dump``, ``pg_dump --inserts``). Each test
loads one into a fresh SQLite file or a Postgres schema of its own (dropped afterwards).
"""

from __future__ import annotations

import sqlite3
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from conftest import require_postgres

from sagaguard.idempotency.audit import open_audit
from sagaguard.idempotency.cli import main as cli_main
from sagaguard.idempotency.errors import SchemaVersionMismatch
from sagaguard.idempotency.outbox import OutboxControl, check_schema
from sagaguard.idempotency.records import State
from sagaguard.idempotency.stores.sql import SqlStore, make_engine
from sagaguard.saga.journals.sql import SqlJournal
from sagaguard.saga.records import SagaState, StepState

FIXTURES = Path(__file__).parent / "fixtures"
TABLES = ("sagaguard_effects", "sagaguard_sagas", "sagaguard_saga_steps", "sagaguard_saga_signals",
          "sagaguard_outbox")  # fmt: skip


def fresh_database(backend: str, tmp_path: Path, fixture: bool) -> Iterator[str]:
    """A new database's URL: a SQLite file, or a Postgres schema of its own (dropped after);
    loaded with the previous release's fixture if ``fixture``."""
    if backend == "sqlite":
        path = tmp_path / f"{uuid.uuid4().hex[:8]}.db"
        if fixture:
            with sqlite3.connect(path) as conn:
                conn.executescript((FIXTURES / "release_8bd923d.sqlite.sql").read_text(encoding="utf-8"))
        yield f"sqlite:///{path}"
        return
    import psycopg

    base = require_postgres()
    # A schema of its own in the shared database, first on the search path of every connection
    # the URL makes (a database of its own costs seconds to drop).
    schema = f"sg_schema_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(base, autocommit=True) as admin:
        admin.execute(f'CREATE SCHEMA "{schema}"')
    url = sa.make_url(base).update_query_dict({"options": f"-csearch_path={schema}"})
    try:
        if fixture:
            dump = (FIXTURES / "release_8bd923d.postgres.sql").read_text(encoding="utf-8")
            with psycopg.connect(base, autocommit=True) as conn:
                conn.execute(dump.replace("public.", f"{schema}."))
        yield url.render_as_string(hide_password=False)
    finally:
        with psycopg.connect(base, autocommit=True) as admin:
            admin.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


@pytest.fixture(params=["sqlite", "postgres"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def old_url(backend: str, tmp_path: Path) -> Iterator[str]:
    yield from fresh_database(backend, tmp_path, fixture=True)


@pytest.fixture
def new_url(backend: str, tmp_path: Path) -> Iterator[str]:
    yield from fresh_database(backend, tmp_path, fixture=False)


OLD_COLUMNS: dict[str, list[str]] = {}
"""The old tables' columns as the fixture made them (filled by the first :func:`rows`)."""


def rows(url: str) -> dict[str, list[tuple[object, ...]]]:
    """Every row of every old table, every column the old table had, in primary-key order."""
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            found = {}
            for table in TABLES:
                columns = OLD_COLUMNS.setdefault(
                    f"{url} {table}", [c["name"] for c in sa.inspect(conn).get_columns(table)]
                )
                listed = ", ".join(columns)
                found[table] = [tuple(r) for r in conn.exec_driver_sql(f"SELECT {listed} FROM {table}")]
                found[table].sort(key=repr)
            return found
    finally:
        engine.dispose()


def layout(url: str, tables: tuple[str, ...] = (*TABLES, "sagaguard_audit")) -> dict[str, tuple[object, ...]]:
    """Each sagaguard table's columns (name, type, nullable) and index names."""
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            inspector = sa.inspect(conn)
            return {
                table: (
                    sorted((c["name"], str(c["type"]), c["nullable"]) for c in inspector.get_columns(table)),
                    sorted(str(i["name"]) for i in inspector.get_indexes(table)),
                )
                for table in tables
            }
    finally:
        engine.dispose()


def test_the_previous_release_upgrades_with_nothing_lost(
    old_url: str, new_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    before = rows(old_url)
    assert sum(len(r) for r in before.values()) == 4 + 4 + 6 + 1 + 3  # the fixture is all there

    # The current code refuses the old tables until they are upgraded, naming the command.
    with pytest.raises(SchemaVersionMismatch, match="db upgrade --store") as refused:
        SqlStore(old_url, create=False)
    assert refused.value.state == "behind" and refused.value.current is None
    with pytest.raises(SchemaVersionMismatch, match="saga journal tables"):
        SqlJournal(old_url, create=False)
    with pytest.raises(SchemaVersionMismatch, match="before versioned schemas"):
        check_schema(sa.create_engine(old_url.replace("postgresql://", "postgresql+psycopg://")))
    with pytest.raises(SchemaVersionMismatch, match=r"audit trail tables .* do not exist") as missing:
        open_audit(old_url, create=False)  # that release had no audit table
    assert missing.value.state == "empty"

    for command in (["effects", "list"], ["sagas", "list"], ["outbox", "status"]):
        assert cli_main(["--store", old_url, *command]) == 2  # the operators' commands refuse too
    assert capsys.readouterr().err.count(f"run `sagaguard db upgrade --store {old_url}`") == 3
    assert cli_main(["db", "status", "--store", old_url]) == 3  # behind
    assert cli_main(["db", "upgrade", "--store", old_url]) == 0
    assert cli_main(["db", "upgrade", "--store", old_url]) == 0  # again: nothing to do
    assert cli_main(["db", "status", "--store", old_url]) == 0
    out = capsys.readouterr().out
    assert out.count("upgraded from unversioned") == 3 and out.count("already at") == 4
    assert "audit (sagaguard_audit): created at audit_0001" in out  # that release had no audit

    assert rows(old_url) == before  # every row, every column, as it was
    upgraded = make_engine(old_url)
    with upgraded.connect() as conn:  # a column added since is empty in the old records
        typed = "SELECT count(*) FROM sagaguard_effects WHERE result_type IS NOT NULL"
        assert conn.exec_driver_sql(typed).scalar() == 0
    upgraded.dispose()
    # The tables are now what a new database gets.
    assert cli_main(["db", "upgrade", "--store", new_url]) == 0
    assert layout(old_url) == layout(new_url)

    # Read back through the current API: the same records with the same meaning.
    store = SqlStore(old_url, create=False)
    fresh = SqlStore(new_url, create=False)
    try:
        # The upgraded ledger keeps the empty id: it derives the provider keys its records were sent
        # under (a record in doubt is re-sent under its first key); a new database draws its own.
        assert store.ledger_id() == "" and fresh.ledger_id() != ""
        by_name = {r.name: r for r in store.list(limit=100)}
        assert {n: r.state for n, r in by_name.items()} == {
            "charge.in_progress": State.IN_PROGRESS,
            "charge.in_doubt": State.IN_DOUBT,
            "charge.succeeded": State.SUCCEEDED,
            "charge.failed": State.FAILED,
        }
        assert by_name["charge.succeeded"].result == '{"id": "pi_123", "amount": 4200}'
        assert by_name["charge.failed"].error == '{"type": "CardDeclined", "message": "declined"}'
        assert by_name["charge.in_doubt"].error == '{"type": "TimeoutError", "message": "read timed out"}'
        assert [r.name for r in store.list(states=[State.IN_DOUBT])] == ["charge.in_doubt"]
    finally:
        store.close()
        fresh.close()

    journal = SqlJournal(old_url, create=False)
    try:
        states = {s.saga_id: s.state for s in journal.list(limit=100)}
        assert states == {
            "saga-running": SagaState.RUNNING,
            "saga-compensating": SagaState.COMPENSATING,
            "saga-needs-attention": SagaState.NEEDS_ATTENTION,
            "saga-completed": SagaState.COMPLETED,
        }
        running = journal.load("saga-running")
        assert running is not None and dict(running.signals) == {"approved": '{"by": "ops"}'}
        assert [s.state for s in running.steps] == [StepState.STARTED]
        compensating = journal.load("saga-compensating")
        assert compensating is not None
        assert [(s.state, s.not_applied) for s in compensating.steps] == [
            (StepState.SUCCEEDED, False),
            (StepState.FAILED, True),
        ]
        parked = journal.load("saga-needs-attention")
        assert parked is not None and parked.saga.error == "compensation of step0 failed"
        assert parked.steps[0].state is StepState.COMPENSATION_FAILED
        assert parked.steps[0].compensation_error == '{"type": "RefundRefused"}'
        assert parked.steps[0].compensation == '{"args": [0]}'
        done = journal.load("saga-completed")
        assert done is not None and [s.result for s in done.steps] == ['{"ok": 0}', '{"ok": 1}']
    finally:
        journal.close()

    audit = open_audit(old_url, create=False)  # created by the upgrade, at this revision, empty
    try:
        assert audit.list() == []
    finally:
        audit.close()

    engine = make_engine(old_url)
    try:
        check_schema(engine)
        control = OutboxControl(engine)
        status = control.status()
        assert (status.pending, status.dead) == (2, 1)
        (dead,) = control.dead_letters()
        assert dead.type == "mail.poison" and "bad address" in (dead.last_error or "")
        control.replay(dead.id)  # the dead letter can still be given back to the relays
        assert control.status().dead == 0
    finally:
        engine.dispose()
