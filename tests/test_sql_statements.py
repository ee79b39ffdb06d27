"""The statements a guarded call sends: on SQLite as SQLite itself saw them (its trace hook), on
Postgres as the hot path's cursor sent them.

A new key costs two commits and nothing else: the claim is one plain ``INSERT`` and the record one
``UPDATE``, each its own transaction (autocommit), with no ``BEGIN IMMEDIATE`` or ``COMMIT`` around
them (on Postgres one round trip each). Only when a record is in the way does the claim go on to
the upsert: on SQLite the upsert and the read of that record are one ``BEGIN IMMEDIATE``
transaction; on Postgres the upsert is one statement that also returns a record it leaves in place.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event

from sagaguard.idempotency import Guard, scope
from sagaguard.idempotency.keys import EffectIdentity
from sagaguard.idempotency.records import ClaimOutcome, State
from sagaguard.idempotency.stores.sql import SqlStore, make_engine


@pytest.fixture
def traced(tmp_path: Path) -> Iterator[tuple[SqlStore, list[str]]]:
    """A store on a SQLite file, and the statements each of its connections runs from now on."""
    engine = make_engine(f"sqlite:///{tmp_path}/statements.db")
    statements: list[str] = []

    def trace(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.set_trace_callback(statements.append)

    event.listen(engine, "connect", trace)
    store = SqlStore(engine)
    statements.clear()  # the table's creation
    yield store, statements
    store.close()
    engine.dispose()


def _verbs(statements: list[str]) -> list[str]:
    """Each statement's first words: ``INSERT ... DO NOTHING``, ``INSERT ... DO UPDATE``, ``UPDATE``."""
    verbs = []
    for sql in statements:
        words = sql.split()
        verb = " ".join(words[:2]) if words[0] == "BEGIN" else words[0]
        if verb == "INSERT":
            verb += " DO NOTHING" if "DO NOTHING" in sql else " DO UPDATE"
        verbs.append(verb)
    return verbs


def test_a_new_guarded_call_is_one_insert_and_one_update_each_its_own_transaction(
    traced: tuple[SqlStore, list[str]],
) -> None:
    store, statements = traced
    charge = Guard(store).effect("pay.charge")(lambda amount: amount)
    with scope("run-1"):
        assert charge(5) == 5
    assert _verbs(statements) == ["INSERT DO NOTHING", "UPDATE"]


def test_a_replay_reads_the_record_in_the_way_in_one_immediate_transaction(
    traced: tuple[SqlStore, list[str]],
) -> None:
    store, statements = traced
    charge = Guard(store).effect("pay.charge")(lambda amount: amount)
    with scope("run-1"):
        charge(5)
    statements.clear()
    with scope("run-1"):
        assert charge(5) == 5
    assert _verbs(statements) == [
        "INSERT DO NOTHING", "BEGIN IMMEDIATE", "INSERT DO UPDATE", "SELECT", "COMMIT",
    ]  # fmt: skip


def test_a_live_claim_in_the_way_is_read_and_nothing_is_written(
    traced: tuple[SqlStore, list[str]],
) -> None:
    store, statements = traced
    identity = EffectIdentity.of("default", "run-1", "pay.charge", 0)
    first = store.claim(identity, "f1_a", 60.0)
    assert first.outcome is ClaimOutcome.CLAIMED
    statements.clear()
    again = store.claim(identity, "f1_a", 60.0)
    assert again.outcome is ClaimOutcome.EXISTING and again.record.token == first.record.token
    assert _verbs(statements) == [
        "INSERT DO NOTHING", "BEGIN IMMEDIATE", "INSERT DO UPDATE", "SELECT", "COMMIT",
    ]  # fmt: skip
    assert store.get(identity.key) == again.record


# ------------------------------------------------------------------------------ Postgres


@pytest.fixture(params=["database clock", "injected clock"])
def pg_traced(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[SqlStore, list[tuple[str, bool]]]]:
    """A store on Postgres, on the database's clock or an injected one (the claim's insert is
    another statement for each), and each statement its connections send from now on, with whether
    it was its own transaction (autocommit, outside ``BEGIN``): one round trip and one commit each."""
    import uuid

    import psycopg
    import sqlalchemy as sa
    from conftest import require_postgres

    sent: list[tuple[str, bool]] = []

    from sagaguard.idempotency.backends import sql_driver
    from sagaguard.idempotency.backends.sql_pq import PqCursor

    class Tracing(PqCursor):
        def execute(self, query: str, params: Any = None, *, prepare: bool | None = None) -> None:
            conn = self.connection
            alone = conn.autocommit and conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
            sent.append((query, alone))
            super().execute(query, params, prepare=prepare)

    monkeypatch.setattr(sql_driver, "raw_cursor", Tracing)  # the hot path's cursors
    engine = make_engine(require_postgres())
    table = f"sg_stmts_{uuid.uuid4().hex[:10]}"
    store = SqlStore(engine, table_name=table, clock=time.time if request.param == "injected clock" else None)
    sent.clear()  # the table's creation
    yield store, sent
    store.close()
    with engine.begin() as conn:
        for dropped in (table, f"{table}_version"):
            conn.execute(sa.text(f'DROP TABLE IF EXISTS "{dropped}"'))
    engine.dispose()


def test_a_new_guarded_call_on_postgres_is_two_statements_each_its_own_commit(
    pg_traced: tuple[SqlStore, list[tuple[str, bool]]],
) -> None:
    store, sent = pg_traced
    charge = Guard(store).effect("pay.charge")(lambda amount: amount)
    with scope("run-1"):
        assert charge(5) == 5
    assert _pg_verbs(sent) == [("INSERT DO NOTHING", True), ("UPDATE", True)]
    sent.clear()
    with scope("run-1"):
        assert charge(5) == 5  # a replay: the insert finds the record, the claim returns it
    assert _pg_verbs(sent) == [("INSERT DO NOTHING", True), ("WITH", True)]


def _pg_verbs(sent: list[tuple[str, bool]]) -> list[tuple[str, bool]]:
    """Each statement's first word (``INSERT DO NOTHING`` for the claim's insert), and whether it
    was its own transaction."""
    verbs = []
    for sql, alone in sent:
        verb = sql.split()[0]
        if verb == "INSERT":
            verb += " DO NOTHING" if "DO NOTHING" in sql else " DO UPDATE"
        verbs.append((verb, alone))
    return verbs


def _row_version(store: SqlStore, key: str) -> Any:
    """Postgres: the record's row version (``xmin``, ``ctid``): another one after any write of the row."""
    import sqlalchemy as sa

    version = sa.text(f'SELECT xmin::text, ctid::text FROM "{store._table.name}" WHERE key = :k')
    with store._engine.connect() as conn:
        return conn.execute(version, {"k": key}).one()


def test_each_claim_decision_on_postgres_costs_what_its_path_says(
    pg_traced: tuple[SqlStore, list[tuple[str, bool]]],
) -> None:
    """A new key is claimed by the insert alone; a live record in the way is replayed as it is (the
    insert and the claim, nothing written); an expired finished record is replaced and a live one
    whose lease ran out taken over (the insert finds it, the claim's upsert writes)."""
    store, sent = pg_traced
    new = EffectIdentity.of("default", "run-1", "pay.charge", 0)
    first = store.claim(new, "f1_a", 60.0)
    assert first.outcome is ClaimOutcome.CLAIMED and first.record.attempts == 1
    assert first.record.lease_until == first.record.created_at + 60.0
    assert store.get(new.key) == first.record  # what the insert wrote is the record handed out
    assert _pg_verbs(sent) == [("INSERT DO NOTHING", True), ("SELECT", True)]
    sent.clear()

    before = _row_version(store, new.key)
    again = store.claim(new, "f1_a", 60.0)  # live, lease running: replayed
    assert again.outcome is ClaimOutcome.EXISTING and again.record == first.record
    assert _pg_verbs(sent) == [("INSERT DO NOTHING", True), ("WITH", True)]
    assert _row_version(store, new.key) == before  # nothing written
    sent.clear()

    done = store.complete(new.key, first.record.token, '"ok"', 0.0)  # expires at once
    sent.clear()
    replaced = store.claim(new, "f1_b", 60.0)
    assert replaced.outcome is ClaimOutcome.CLAIMED and replaced.record.token == done.token + 1
    assert replaced.record.fingerprint == "f1_b" and replaced.record.result is None
    assert _pg_verbs(sent) == [("INSERT DO NOTHING", True), ("WITH", True)]
    assert store.get(new.key) == replaced.record
    sent.clear()

    dead = EffectIdentity.of("default", "run-2", "pay.charge", 0)
    held = store.claim(dead, "f1_c", 0.0)  # a lease already run out
    sent.clear()
    taken = store.claim(dead, "f1_c", 60.0)
    assert taken.outcome is ClaimOutcome.TOOK_OVER and taken.record.token == held.record.token + 1
    assert taken.record.state is State.IN_DOUBT and taken.record.attempts == 2
    assert _pg_verbs(sent) == [("INSERT DO NOTHING", True), ("WITH", True)]


def test_each_claim_decision_on_sqlite_costs_what_its_path_says(
    traced: tuple[SqlStore, list[str]],
) -> None:
    """The same decisions on SQLite: a new key by the insert alone, the others by the insert and
    then the upsert (and the read of a record it leaves) in one ``BEGIN IMMEDIATE`` transaction."""
    store, statements = traced
    new = EffectIdentity.of("default", "run-1", "pay.charge", 0)
    first = store.claim(new, "f1_a", 60.0)
    assert first.outcome is ClaimOutcome.CLAIMED and store.get(new.key) == first.record
    assert _verbs(statements) == ["INSERT DO NOTHING", "SELECT"]
    statements.clear()

    done = store.complete(new.key, first.record.token, '"ok"', 0.0)
    statements.clear()
    replaced = store.claim(new, "f1_b", 60.0)
    assert replaced.outcome is ClaimOutcome.CLAIMED and replaced.record.token == done.token + 1
    assert _verbs(statements) == ["INSERT DO NOTHING", "BEGIN IMMEDIATE", "INSERT DO UPDATE", "COMMIT"]
    statements.clear()

    dead = EffectIdentity.of("default", "run-2", "pay.charge", 0)
    held = store.claim(dead, "f1_c", 0.0)
    statements.clear()
    taken = store.claim(dead, "f1_c", 60.0)
    assert taken.outcome is ClaimOutcome.TOOK_OVER and taken.record.token == held.record.token + 1
    assert _verbs(statements) == ["INSERT DO NOTHING", "BEGIN IMMEDIATE", "INSERT DO UPDATE", "COMMIT"]
