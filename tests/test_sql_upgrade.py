"""An effects table made by an earlier version (schema 1, no ``holder`` column) keeps working: the
store adds the column when it opens the table, once, and reads the old rows back."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from conftest import require_postgres

from sagaguard.idempotency import Guard, holder, scope
from sagaguard.idempotency.keys import EffectIdentity
from sagaguard.idempotency.records import ClaimOutcome, State
from sagaguard.idempotency.stores.sql import SqlStore, make_engine

SCHEMA_1 = """CREATE TABLE {t} (
    key VARCHAR(80) PRIMARY KEY, namespace TEXT NOT NULL, scope TEXT NOT NULL, name TEXT NOT NULL,
    ordinal INTEGER NOT NULL, fingerprint VARCHAR(80) NOT NULL, state VARCHAR(16) NOT NULL,
    token BIGINT NOT NULL, lease_until DOUBLE PRECISION NOT NULL, attempts INTEGER NOT NULL,
    created_at DOUBLE PRECISION NOT NULL, updated_at DOUBLE PRECISION NOT NULL,
    expires_at DOUBLE PRECISION, result TEXT, error TEXT)"""


@pytest.fixture(params=["sqlite", "postgres"])
def old_table(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[sa.Engine, str]]:
    url = f"sqlite:///{tmp_path}/old.db" if request.param == "sqlite" else require_postgres()
    engine = make_engine(url)
    table = f"sg_old_{uuid.uuid4().hex[:10]}"
    with engine.begin() as conn:
        conn.exec_driver_sql(SCHEMA_1.format(t=table))
        conn.exec_driver_sql(
            f"INSERT INTO {table} VALUES ('k-old', 'ns', 'run-1', 'charge', 0, 'fp', 'succeeded', 7, 0, 1, "
            "100, 100, 1e12, '42', NULL)"
        )
    yield engine, table
    with engine.begin() as conn:
        for dropped in (table, f"{table}_version"):
            conn.exec_driver_sql(f'DROP TABLE IF EXISTS "{dropped}"')
    engine.dispose()


def columns(engine: sa.Engine, table: str) -> list[str]:
    return [c["name"] for c in sa.inspect(engine).get_columns(table)]


def test_opening_an_old_table_adds_the_holder_column_once(old_table: tuple[sa.Engine, str]) -> None:
    engine, table = old_table
    assert "holder" not in columns(engine, table)
    stores = [SqlStore(engine, table_name=table, create=True) for _ in range(2)]  # the second finds it there
    assert columns(engine, table).count("holder") == 1

    store = stores[0]
    old = store.get("k-old")
    assert old is not None
    assert (old.state, old.token, old.result, old.holder) == (State.SUCCEEDED, 7, "42", None)
    claimed = store.claim(EffectIdentity.of("ns", "run-2", "charge", 0), "fp", 5.0)
    assert claimed.outcome is ClaimOutcome.CLAIMED
    assert claimed.record.holder == holder.current()
    guard = Guard(stores[1])
    try:

        @guard.effect("add")
        def add(a: int) -> int:
            return a + 1

        with scope("run-3"):
            assert add(1) == 2
        with scope("run-3"):
            assert add(1) == 2
    finally:
        guard.close()
    for each in stores:
        each.close()


def test_stores_racing_to_upgrade_one_table_all_open(old_table: tuple[sa.Engine, str]) -> None:
    engine, table = old_table
    errors: list[BaseException] = []
    barrier = threading.Barrier(4, timeout=30)

    def open_one() -> None:
        try:
            barrier.wait()
            url = str(engine.url.render_as_string(hide_password=False))
            SqlStore(url, table_name=table, create=True).close()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=open_one) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    assert columns(engine, table).count("holder") == 1
