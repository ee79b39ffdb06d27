"""On SQLite, the statements a guarded call sends, as SQLite itself saw them (its trace hook).

A new key costs two commits and nothing else: the claim is one plain ``INSERT`` and the record one
``UPDATE``, each its own transaction (autocommit), with no ``BEGIN IMMEDIATE`` or ``COMMIT`` around
them. Only when a record is in the way does the claim go on to the upsert, and then the upsert and
the read of that record are one ``BEGIN IMMEDIATE`` transaction.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event

from sagaguard.idempotency import Guard, scope
from sagaguard.idempotency.keys import EffectIdentity
from sagaguard.idempotency.records import ClaimOutcome
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


@pytest.fixture
def pg_traced(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[SqlStore, list[tuple[str, bool]]]]:
    """A store on Postgres, and each statement its connections send from now on, with whether it
    was its own transaction (autocommit, outside ``BEGIN``): one round trip and one commit each."""
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
    store = SqlStore(engine, table_name=table)
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
    assert [(sql.split()[0], alone) for sql, alone in sent] == [("WITH", True), ("UPDATE", True)]
    sent.clear()
    with scope("run-1"):
        assert charge(5) == 5  # a replay: the claim alone, which finds the record
    assert [(sql.split()[0], alone) for sql, alone in sent] == [("WITH", True)]
