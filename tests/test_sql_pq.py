"""The hot path's Postgres cursor (``sagaguard.idempotency.backends.sql_pq.PqCursor``) against a real server:
values both ways, the server's errors as psycopg's, a broken connection seen as one, and the
prepared statements psycopg deallocates under it (after a ROLLBACK) prepared again."""

from __future__ import annotations

import contextlib
import math
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from conftest import require_postgres

from sagaguard.idempotency import Guard, scope
from sagaguard.idempotency.backends.sql_pq import PqCursor
from sagaguard.idempotency.stores.sql import SqlStore, make_engine


@pytest.fixture
def conn() -> Iterator[Any]:
    import psycopg

    with psycopg.connect(require_postgres(), autocommit=True) as connection:
        yield connection


def names(conn: Any) -> set[str]:
    return {row[0] for row in conn.execute("SELECT name FROM pg_prepared_statements").fetchall()}


@contextlib.contextmanager
def guarded_on(engine: Any) -> Iterator[Callable[[int], int]]:
    """A guarded no-op charge on a store over ``engine`` (an engine of the caller's: one pooled
    connection for one thread); the table and the engine are gone afterwards."""
    import sqlalchemy as sa

    table = f"sg_pq_{uuid.uuid4().hex[:8]}"
    store = SqlStore(engine, table_name=table)
    try:
        yield Guard(store).effect("pay.charge")(lambda amount: amount)
    finally:
        store.close()
        with engine.begin() as connection:
            for dropped in (table, f"{table}_version"):
                connection.execute(sa.text(f'DROP TABLE IF EXISTS "{dropped}"'))
        engine.dispose()


def ours_prepared(engine: Any) -> bool:
    """Whether the pooled connection holds statements this cursor prepared (``sg_<n>``)."""
    fairy = engine.raw_connection()
    try:
        found = any(name.startswith("sg_") for name in names(fairy.driver_connection))
        fairy.driver_connection.rollback()
        return found
    finally:
        fairy.close()


def test_values_go_and_come_back_by_type(conn: Any) -> None:
    cursor = PqCursor(conn)
    query = "SELECT $1::bool, $2::int8, $3::float8, $4::float8, $5::text, $6::text, $7::uuid, $8::int4"
    ident = uuid.uuid4()
    cursor.execute(query, [True, 2**62, math.inf, 0.1, "żółw", None, str(ident), -7], prepare=True)
    assert cursor.fetchall() == [(True, 2**62, math.inf, 0.1, "żółw", None, ident, -7)]
    assert cursor.rowcount == 1
    assert cursor.description is not None and len(cursor.description) == 8
    cursor.execute("SET LOCAL statement_timeout = 0")  # no parameters: a simple query
    assert cursor.fetchall() == [] and cursor.description is None


def test_a_prepared_statement_is_prepared_once_per_connection(conn: Any) -> None:
    cursor = PqCursor(conn)
    before = names(conn)
    for n in range(3):
        cursor.execute("SELECT $1::int + 1", [n], prepare=True)
        assert cursor.fetchall() == [(n + 1,)]
    added = names(conn) - before
    assert len(added) == 1 and next(iter(added)).startswith("sg_")


def test_inside_a_transaction_a_statement_is_sent_unnamed(conn: Any) -> None:
    cursor = PqCursor(conn)
    before = names(conn)
    cursor.execute("BEGIN")
    cursor.execute("SELECT $1::int * 2", [21], prepare=True)
    assert cursor.fetchall() == [(42,)]
    conn.commit()
    assert names(conn) == before


def test_the_servers_error_is_psycopgs_by_its_sqlstate(conn: Any) -> None:
    import psycopg

    table = f"sg_pq_{uuid.uuid4().hex[:8]}"
    conn.execute(f'CREATE TABLE "{table}" (k text PRIMARY KEY)')
    try:
        cursor = PqCursor(conn)
        cursor.execute(f'INSERT INTO "{table}" (k) VALUES ($1)', ["a"], prepare=True)
        assert cursor.rowcount == 1
        with pytest.raises(psycopg.errors.UniqueViolation, match="duplicate key"):
            cursor.execute(f'INSERT INTO "{table}" (k) VALUES ($1)', ["a"], prepare=True)
        assert not cursor.closed
    finally:
        conn.execute(f'DROP TABLE "{table}"')


def test_a_broken_connection_raises_operational_error_and_reads_closed(conn: Any) -> None:
    import psycopg

    with psycopg.connect(require_postgres(), autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", (conn.info.backend_pid,))
    cursor = PqCursor(conn)
    with pytest.raises(psycopg.OperationalError):
        cursor.execute("SELECT $1::int", [1], prepare=True)
    assert cursor.closed  # what SQLAlchemy's dialect reads as a disconnect


def test_statements_psycopg_deallocated_are_prepared_again() -> None:
    """psycopg, once it has prepared statements of its own on a connection, sends DEALLOCATE ALL
    after a ROLLBACK: the store's statements on that pooled connection are gone too, and its next
    call prepares them again instead of failing."""
    engine = make_engine(require_postgres())
    with guarded_on(engine) as charge:
        with scope("run-1"):
            assert charge(1) == 1
        fairy = engine.raw_connection()
        try:
            conn: Any = fairy.driver_connection
            assert any(name.startswith("sg_") for name in names(conn))  # the store's session
            conn.execute("SELECT %s::int", (1,), prepare=True)  # one of psycopg's own
            conn.execute("SELECT 1")  # a transaction (the pool's connections are not autocommit)
            conn.rollback()  # psycopg: DEALLOCATE ALL
            assert not any(name.startswith("sg_") for name in names(conn))
            conn.rollback()
        finally:
            fairy.close()
        with scope("run-2"):
            assert charge(2) == 2
        with scope("run-2"):
            assert charge(2) == 2  # a replay, read through the statements prepared again
        assert ours_prepared(engine)


def test_enum_and_uuid_parameters_go_as_their_values_and_bytes_are_refused(conn: Any) -> None:
    import enum

    class Colour(str, enum.Enum):  # noqa: UP042  # the mixin, whose str() is not its value
        RED = "red"

    class Level(enum.IntEnum):
        HIGH = 3

    cursor = PqCursor(conn)
    ident = uuid.uuid4()
    cursor.execute("SELECT $1::text, $2::int8, $3::uuid", [Colour.RED, Level.HIGH, ident], prepare=True)
    assert cursor.fetchall() == [("red", 3, ident)]
    with pytest.raises(TypeError, match="bytes"):
        cursor.execute("SELECT $1::bytea", [b"\x00"], prepare=True)


def test_with_prepare_threshold_none_nothing_is_prepared() -> None:
    """As behind an old PgBouncer: the engine's connections say ``prepare_threshold=None``, and the
    store's statements are sent unnamed, each call."""
    import sqlalchemy as sa

    engine = sa.create_engine(
        require_postgres().replace("postgresql://", "postgresql+psycopg://", 1),
        connect_args={"prepare_threshold": None},
    )
    with guarded_on(engine) as charge:
        for run in ("run-1", "run-2", "run-1"):
            with scope(run):
                assert charge(3) == 3
        assert not ours_prepared(engine)
