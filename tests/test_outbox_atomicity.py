"""A business row and its outbox message commit together or roll back together (SQLite, Postgres).

Also: the table is created only when asked (and versioned), and bad input to ``enqueue`` is a typed
error before anything is written.
"""

from __future__ import annotations

import asyncio
import math
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from _outboxkit import BACKENDS, World, make_world, open_world
from conftest import FakeClock
from sqlalchemy.orm import Session

from sagaguard.idempotency.errors import CodecError, ConfigurationError, SchemaVersionMismatch
from sagaguard.idempotency.outbox import (
    SCHEMA_VERSION,
    check_schema,
    create_tables,
    enqueue,
    migrate,
    schema_version,
    uuid7,
)


@pytest.fixture(params=BACKENDS)
def outbox_world(request: pytest.FixtureRequest, tmp_path: Path, clock: FakeClock) -> Iterator[World]:
    """A world on SQLite and on Postgres."""
    yield from open_world(request.param, tmp_path, clock)


def _order(world: World, order_id: str, total: int) -> sa.Insert:
    return world.orders.insert().values(id=order_id, total=total)


def test_commit_writes_the_business_row_and_the_message(outbox_world: World) -> None:
    world = outbox_world
    with Session(world.engine) as session:
        session.execute(_order(world, "o1", 100))
        message_id = world.outbox.enqueue(
            session, "order.paid", {"order": "o1"}, aggregate_type="order", aggregate_id="o1"
        )
        assert world.rows() == []  # not visible before the commit
        session.commit()
    assert world.count_orders() == 1
    [row] = world.rows()
    assert str(row["id"] if isinstance(row["id"], uuid.UUID) else uuid.UUID(hex=row["id"])) == message_id
    assert (row["aggregatetype"], row["aggregateid"], row["type"]) == ("order", "o1", "order.paid")
    assert row["payload"] == '{"order":"o1"}'
    assert row["status"] == "pending" and row["attempts"] == 0
    assert row["created_at"] == row["available_at"] == world.clock.now
    assert row["provider_key"].startswith("sg1p_")


def test_rollback_drops_both(outbox_world: World) -> None:
    world = outbox_world
    with Session(world.engine) as session:
        session.execute(_order(world, "o1", 100))
        world.outbox.enqueue(session, "order.paid", {"order": "o1"})
        session.rollback()
    assert world.count_orders() == 0
    assert world.rows() == []


def test_an_exception_in_the_transaction_drops_both(outbox_world: World) -> None:
    world = outbox_world
    with pytest.raises(RuntimeError), Session(world.engine) as session, session.begin():
        session.execute(_order(world, "o1", 100))
        world.outbox.enqueue(session, "order.paid", {"order": "o1"})
        raise RuntimeError("the business logic failed after enqueue")
    assert world.count_orders() == 0 and world.rows() == []


def test_a_failing_business_write_after_enqueue_drops_the_message(outbox_world: World) -> None:
    world = outbox_world
    with Session(world.engine) as session:
        session.execute(_order(world, "o1", 100))
        session.commit()
    with pytest.raises(sa.exc.IntegrityError), Session(world.engine) as session, session.begin():
        world.outbox.enqueue(session, "order.paid", {"order": "o1"})
        session.execute(_order(world, "o1", 200))  # duplicate key: the transaction fails
    assert world.rows() == []


def test_a_rolled_back_savepoint_drops_its_message_only(outbox_world: World) -> None:
    world = outbox_world
    with Session(world.engine) as session:
        session.execute(_order(world, "o1", 100))
        world.outbox.enqueue(session, "kept", {})
        nested = session.begin_nested()
        world.outbox.enqueue(session, "dropped", {})
        nested.rollback()
        session.commit()
    assert [row["type"] for row in world.rows()] == ["kept"]


def test_enqueue_on_a_connection_joins_its_transaction(outbox_world: World) -> None:
    world = outbox_world
    with world.engine.connect() as conn:
        with conn.begin() as tx:
            conn.execute(_order(world, "o1", 1))
            world.outbox.enqueue(conn, "t", {"n": 1})
            tx.rollback()
        with conn.begin():
            conn.execute(_order(world, "o2", 2))
            world.outbox.enqueue(conn, "t", {"n": 2})
    assert [row["payload"] for row in world.rows()] == ['{"n":2}']
    assert world.count_orders() == 1


def test_module_level_enqueue_uses_the_database_clock(outbox_world: World) -> None:
    world = outbox_world
    with Session(world.engine) as session:
        enqueue(session, "t", [1, 2], table_name=world.table, delay=60)
        session.commit()
    [row] = world.rows()
    assert abs(row["available_at"] - row["created_at"] - 60) < 1.0
    assert row["aggregateid"] == str(uuid.UUID(hex=row["id"]) if isinstance(row["id"], str) else row["id"])


def test_sqlmodel_session_works(outbox_world: World) -> None:
    from sqlmodel import Session as SqlModelSession

    world = outbox_world
    with SqlModelSession(world.engine) as session:
        session.execute(_order(world, "o1", 100))
        world.outbox.enqueue(session, "t", {})
        session.commit()
    assert len(world.rows()) == 1


def _async_url(world: World) -> str:
    if world.postgres:
        return world.url.replace("postgresql://", "postgresql+psycopg://", 1)
    pytest.importorskip("aiosqlite", reason="an async SQLite session needs aiosqlite")
    return world.url.replace("sqlite://", "sqlite+aiosqlite://", 1)


def test_async_session_commits_and_rolls_back_with_the_business_row(outbox_world: World) -> None:
    from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

    world = outbox_world
    url = _async_url(world)

    async def scenario() -> None:
        engine = create_async_engine(url)
        try:
            async with AsyncSession(engine) as session:
                await session.execute(_order(world, "o1", 1))
                world.outbox.enqueue(session, "async.kept", {"n": 1}, delay=5)
                await session.commit()
            async with AsyncSession(engine) as session:
                await session.execute(_order(world, "o2", 2))
                world.outbox.enqueue(session, "async.dropped", {"n": 2})
                await session.rollback()
        finally:
            await engine.dispose()

    asyncio.run(scenario())
    [row] = world.rows()
    assert row["type"] == "async.kept" and row["available_at"] == world.clock.now + 5
    assert world.count_orders() == 1


# ------------------------------------------------------------------------------- the schema


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_tables_are_created_only_when_asked_and_versioned(
    backend: str, tmp_path: Path, clock: FakeClock
) -> None:
    world = make_world(backend, tmp_path, clock, create=False)
    try:
        assert schema_version(world.engine, world.table) is None
        with pytest.raises(SchemaVersionMismatch, match=r"sagaguard db upgrade --store .* --outbox-table"):
            check_schema(world.engine, world.table)
        with pytest.raises(ConfigurationError, match="do not exist"):
            world.relay().run_once()
        assert migrate(world.engine, world.table) == SCHEMA_VERSION
        assert create_tables(world.engine, world.table) == SCHEMA_VERSION  # idempotent
        check_schema(world.engine, world.table)
        assert schema_version(world.engine, world.table) == SCHEMA_VERSION
        with world.engine.begin() as conn:
            conn.execute(sa.text(f"UPDATE {world.table}_version SET version_num = 'outbox_9999'"))
        with pytest.raises(SchemaVersionMismatch, match="newer than this"):
            migrate(world.engine, world.table)
        with pytest.raises(SchemaVersionMismatch, match="outbox_9999") as refused:
            check_schema(world.engine, world.table)
        assert refused.value.state == "ahead" and refused.value.command is None
    finally:
        world.close()


def test_the_outbox_tables_stay_out_of_the_application_metadata() -> None:
    from sqlmodel import SQLModel

    from sagaguard.idempotency.outbox import METADATA

    assert "sagaguard_outbox" in METADATA.tables
    assert "sagaguard_outbox" not in SQLModel.metadata.tables


# ------------------------------------------------------------------------------- bad input


def test_bad_input_is_a_typed_error_and_writes_nothing(outbox_world: World) -> None:
    world = outbox_world
    with Session(world.engine) as session:
        with pytest.raises(CodecError):
            world.outbox.enqueue(session, "t", {"x": math.nan})
        with pytest.raises(CodecError):
            world.outbox.enqueue(session, "t", {"x": object()})
        with pytest.raises(CodecError, match="over"):
            enqueue(session, "t", "x" * 2000, table_name=world.table, max_payload_bytes=1000)
        with pytest.raises(ConfigurationError):
            world.outbox.enqueue(session, "", {})
        with pytest.raises(ConfigurationError):
            world.outbox.enqueue(session, "t", {}, headers={"a": 1})  # type: ignore[dict-item]
        with pytest.raises(ConfigurationError):
            world.outbox.enqueue(session, "t", {}, max_attempts=0)
        with pytest.raises(ConfigurationError):
            world.outbox.enqueue(session, "t", {}, delay=-1)
        with pytest.raises(ConfigurationError):
            world.outbox.enqueue(object(), "t", {})
        with pytest.raises(ConfigurationError, match="UUIDv7"):
            world.outbox.enqueue(session, "t", {}, message_id=uuid.uuid4())
        session.commit()
    assert world.rows() == []
    with pytest.raises(ConfigurationError):
        world.outbox.__class__("bad name; drop table")


def test_payloads_of_rich_types_are_written_as_json(outbox_world: World) -> None:
    import dataclasses
    import datetime
    from decimal import Decimal

    @dataclasses.dataclass
    class Line:
        sku: str
        price: Decimal

    world = outbox_world
    when = datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.UTC)
    with Session(world.engine) as session:
        world.outbox.enqueue(session, "t", {"line": Line("a", Decimal("1.50")), "at": when})
        session.commit()
    assert world.rows()[0]["payload"] == '{"line":{"sku":"a","price":"1.50"},"at":"2026-01-02T03:04:05Z"}'


def test_uuid7_ids_are_version_7_and_strictly_increasing() -> None:
    ids = [uuid7() for _ in range(5000)]
    assert all(i.version == 7 and i.variant == uuid.RFC_4122 for i in ids)
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    assert [i.hex for i in ids] == sorted(i.hex for i in ids)  # SQLite stores the hex text
