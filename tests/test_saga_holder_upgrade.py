"""Saga rows written before lease holders were recorded keep working: an SQL sagas table made by
schema 3 (no ``holder`` column) gets the column when a journal opens it, and a Redis saga hash with
no ``holder`` field reads as unknown. An unknown holder is never judged dead: such a saga waits for
its lease as before, then is claimed as usual."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import sqlalchemy as sa
from conftest import FakeClock, require_postgres, require_redis

from sagaguard.idempotency import holder
from sagaguard.idempotency.stores.sql import make_engine
from sagaguard.saga import SagaJournal, StartOutcome
from sagaguard.saga.journals.redis import RedisJournal
from sagaguard.saga.journals.sql import SqlJournal

pytestmark = pytest.mark.timeout(60)


def _start(journal: SagaJournal) -> None:
    started = journal.start("s-1", name="trip", version=1, input="{}", fingerprint="fp", lease=30)
    assert started.outcome is StartOutcome.CREATED


def _holderless_saga_waits_for_its_lease(journal: SagaJournal, clock: FakeClock) -> None:
    found = journal.load("s-1")
    assert found is not None and found.saga.holder is None and found.saga.token == 1
    again = journal.start("s-1", name="trip", version=1, input="{}", fingerprint="fp", lease=30)
    assert again.outcome is StartOutcome.EXISTING  # unknown holder: not taken over
    assert journal.claim("s-1", lease=30) is None and journal.due() == []
    clock.advance(31)
    claimed = journal.claim("s-1", lease=30)
    assert claimed is not None and claimed.saga.holder == holder.current()


@pytest.fixture(params=["sqlite", "postgres"])
def engine(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[sa.Engine]:
    url = f"sqlite:///{tmp_path}/old.db" if request.param == "sqlite" else require_postgres()
    engine = make_engine(url)
    yield engine
    engine.dispose()


def test_an_old_sagas_table_gets_the_holder_column_at_open(engine: sa.Engine, clock: FakeClock) -> None:
    prefix = f"sg_old_{uuid.uuid4().hex[:8]}_"
    journal = SqlJournal(engine, clock=clock, table_prefix=prefix)
    _start(journal)
    table = f"{prefix}sagas"
    with engine.begin() as conn:  # back to schema 3: the column and what it held are gone
        conn.exec_driver_sql(f"ALTER TABLE {table} DROP COLUMN holder")
        conn.exec_driver_sql(f"DROP TABLE {prefix}journal_version")  # made before versioned schemas
    try:
        reopened = SqlJournal(engine, clock=clock, table_prefix=prefix, create=True)
        SqlJournal(engine, clock=clock, table_prefix=prefix, create=True)  # a second open adds nothing
        with engine.connect() as conn:
            names = [c["name"] for c in sa.inspect(conn).get_columns(table)]
        assert names.count("holder") == 1
        _holderless_saga_waits_for_its_lease(reopened, clock)
    finally:
        with engine.begin() as conn:
            for name in ("saga_signals", "saga_steps", "sagas", "journal_version"):
                conn.exec_driver_sql(f"DROP TABLE IF EXISTS {prefix}{name}")


def test_a_redis_saga_hash_without_holder_reads_as_unknown(clock: FakeClock) -> None:
    url = require_redis()
    prefix = f"sgj-old-{uuid.uuid4().hex[:8]}"
    journal = RedisJournal(url, clock=clock, prefix=prefix)
    client = redis.Redis.from_url(url)
    try:
        _start(journal)
        client.hdel(f"{prefix}:{{s-1}}", "holder")  # as written before holders were recorded
        _holderless_saga_waits_for_its_lease(journal, clock)
    finally:
        keys = list(client.scan_iter(match=f"{prefix}:*"))
        if keys:
            client.delete(*keys)
        client.close()
        journal.close()
