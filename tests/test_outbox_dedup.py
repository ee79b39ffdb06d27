"""Enqueue once per key: ``dedup_key=`` and deferred effects (SQLite and Postgres).

A message enqueued under a dedup key is enqueued once: enqueueing it again, in the same transaction
or a later one, through a Session, a Connection or an AsyncSession, inserts nothing and returns the
message already there; another type or payload under the key is a ``KeyConflict``. A deferred
effect's dedup key is its effect key, so a unit of work that runs again defers nothing twice. The
schema step that adds the key (version 1 -> 2) is here too. What the world sees when a step is
SIGKILLed between its enqueue's commit and its record is test_outbox_dedup_crash.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from _outboxkit import BACKENDS, World, make_world, open_world
from conftest import FakeClock
from sqlalchemy.orm import Session

from sagaguard.idempotency import Guard, KeyConflict, MemoryStore, scope
from sagaguard.idempotency.errors import ConfigurationError, SchemaVersionMismatch
from sagaguard.idempotency.keys import EffectIdentity
from sagaguard.idempotency.outbox import SCHEMA_VERSION, check_schema, enqueue, migrate, schema_version


@pytest.fixture(params=BACKENDS)
def outbox_world(request: pytest.FixtureRequest, tmp_path: Path, clock: FakeClock) -> Iterator[World]:
    yield from open_world(request.param, tmp_path, clock)


def _ids(world: World) -> list[str]:
    return [str(row["id"]).replace("-", "") for row in world.rows()]


def _hex(message_id: str) -> str:
    return message_id.replace("-", "")


# ---------------------------------------------------------------------------------- enqueue


def test_a_second_enqueue_under_the_key_in_a_later_transaction_returns_the_first(outbox_world: World) -> None:
    world = outbox_world
    with Session(world.engine) as session:
        first = world.outbox.enqueue(session, "receipt", {"order": "o1", "total": 5}, dedup_key="o1/receipt")
        session.commit()
    with Session(world.engine) as session:  # the unit of work runs again: same payload, key order aside
        again = world.outbox.enqueue(session, "receipt", {"total": 5, "order": "o1"}, dedup_key="o1/receipt")
        other = world.outbox.enqueue(session, "receipt", {"order": "o2", "total": 5}, dedup_key="o2/receipt")
        session.commit()

    assert again == first and other != first
    assert _ids(world) == [_hex(first), _hex(other)]
    assert [row["dedup_key"] for row in world.rows()] == ["o1/receipt", "o2/receipt"]


def test_twice_in_one_transaction_and_on_a_connection(outbox_world: World) -> None:
    world = outbox_world
    with Session(world.engine) as session:
        first = world.outbox.enqueue(session, "t", {"n": 1}, dedup_key="k")
        assert world.outbox.enqueue(session, "t", {"n": 1}, dedup_key="k") == first
        session.commit()
    with world.engine.begin() as conn:
        assert enqueue(conn, "t", {"n": 1}, dedup_key="k", table_name=world.table) == first
    assert _ids(world) == [_hex(first)]


def test_another_type_or_payload_under_the_key_is_a_conflict_and_writes_nothing(outbox_world: World) -> None:
    world = outbox_world
    with Session(world.engine) as session:
        first = world.outbox.enqueue(session, "t", {"n": 1}, dedup_key="k")
        session.commit()
    with Session(world.engine) as session:
        with pytest.raises(KeyConflict) as conflict:
            world.outbox.enqueue(session, "t", {"n": 2}, dedup_key="k")
        assert conflict.value.key == "k"
        with pytest.raises(KeyConflict):
            world.outbox.enqueue(session, "other", {"n": 1}, dedup_key="k")
        session.commit()
    assert _ids(world) == [_hex(first)]


def test_a_rolled_back_enqueue_leaves_the_key_free(outbox_world: World) -> None:
    world = outbox_world
    with Session(world.engine) as session:
        world.outbox.enqueue(session, "t", {"n": 1}, dedup_key="k")
        session.rollback()
    with Session(world.engine) as session:
        kept = world.outbox.enqueue(session, "t", {"n": 1}, dedup_key="k")
        session.commit()
    assert _ids(world) == [_hex(kept)]


def test_messages_without_a_key_are_never_deduplicated(outbox_world: World) -> None:
    world = outbox_world
    with Session(world.engine) as session:
        world.outbox.enqueue(session, "t", {"n": 1})
        world.outbox.enqueue(session, "t", {"n": 1})
        session.commit()
    assert len(world.rows()) == 2 and all(row["dedup_key"] is None for row in world.rows())


def _async_url(world: World) -> str:
    if world.postgres:
        return world.url.replace("postgresql://", "postgresql+psycopg://", 1)
    pytest.importorskip("aiosqlite", reason="an async SQLite session needs aiosqlite")
    return world.url.replace("sqlite://", "sqlite+aiosqlite://", 1)


def test_aenqueue_in_an_async_session_is_once_per_key_and_in_its_transaction(outbox_world: World) -> None:
    from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

    world = outbox_world

    async def scenario() -> tuple[str, str]:
        engine = create_async_engine(_async_url(world))
        try:
            async with AsyncSession(engine) as session:
                await world.outbox.aenqueue(session, "t", {"n": 0}, dedup_key="dropped")
                await session.rollback()
            async with AsyncSession(engine) as session:
                first = await world.outbox.aenqueue(session, "t", {"n": 1}, dedup_key="k", delay=5)
                await session.commit()
            async with AsyncSession(engine) as session:
                again = await world.outbox.aenqueue(session, "t", {"n": 1}, dedup_key="k")
                with pytest.raises(ConfigurationError, match="aenqueue"):
                    world.outbox.enqueue(session, "t", {"n": 1}, dedup_key="k")
                with pytest.raises(KeyConflict):
                    await world.outbox.aenqueue(session, "t", {"n": 2}, dedup_key="k")
                await session.commit()
            return first, again
        finally:
            await engine.dispose()

    first, again = asyncio.run(scenario())
    assert again == first
    [row] = world.rows()
    assert row["dedup_key"] == "k" and row["available_at"] == world.clock.now + 5


# --------------------------------------------------------------------------- deferred effects


@dataclasses.dataclass
class Refund:
    charge: str
    amount: int


def test_a_deferred_effect_rerun_in_its_scope_enqueues_once(outbox_world: World) -> None:
    """The step defers, commits, and dies before its record; its re-run defers again."""
    world = outbox_world
    guard = Guard(MemoryStore(clock=world.clock))
    calls: list[Refund] = []

    @world.outbox.effect(guard, "payments.refund")
    def refund(order: Refund) -> str:
        calls.append(order)
        return f"re_{order.charge}"

    ids = []
    for _ in range(2):  # the run, then the re-run of the same unit of work
        with scope("saga-1/refund"), Session(world.engine) as session:
            ids.append(refund.defer(session, Refund("ch_1", 500)))
            ids.append(refund.defer(session, Refund("ch_2", 100)))  # the effect's second call: its own
            session.commit()

    assert ids[2:] == ids[:2] and ids[0] != ids[1]
    rows = world.rows()
    keys = [EffectIdentity.of("default", "saga-1/refund", "payments.refund", n).key for n in (0, 1)]
    assert [row["dedup_key"] for row in rows] == keys
    assert [row["aggregateid"] for row in rows] == ["saga-1/refund"] * 2
    world.relay().run(until_idle=True)
    assert calls == [Refund("ch_1", 500), Refund("ch_2", 100)]

    with scope("saga-1/refund"), Session(world.engine) as session, pytest.raises(KeyConflict):
        refund.defer(session, Refund("ch_1", 999))  # the same effect with other arguments
    with Session(world.engine) as session:  # outside any scope: no identity, a new message each time
        refund.defer(session, Refund("ch_3", 1))
        refund.defer(session, Refund("ch_3", 1))
        session.commit()
    assert len(world.rows()) == 4
    guard.close()


def test_adefer_in_an_async_session(outbox_world: World) -> None:
    from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

    world = outbox_world
    guard = Guard(MemoryStore(clock=world.clock))

    @world.outbox.effect(guard, "mail.send")
    async def send(to: str) -> None: ...

    async def scenario() -> list[str]:
        engine = create_async_engine(_async_url(world))
        ids = []
        try:
            for _ in range(2):
                with scope("order-7"):
                    async with AsyncSession(engine) as session:
                        ids.append(await send.adefer(session, "ada@example.com"))
                        await session.commit()
            with scope("order-7"):
                async with AsyncSession(engine) as session:
                    with pytest.raises(ConfigurationError, match="aenqueue"):
                        send.defer(session, "ada@example.com")
        finally:
            await engine.dispose()
        return ids

    first, again = asyncio.run(scenario())
    assert first == again and len(world.rows()) == 1
    guard.close()


def test_the_email_connector_sends_through_an_async_session_once_per_step(outbox_world: World) -> None:
    from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

    from sagaguard.connectors.email import Email, EmailEffects, SmtpSettings

    world = outbox_world
    guard = Guard(MemoryStore(clock=world.clock))
    mail = EmailEffects(guard, SmtpSettings("127.0.0.1", 25), outbox=world.outbox)
    note = Email(to=["ada@example.com"], subject="Booked", text="See you")

    async def scenario() -> list[str]:
        engine = create_async_engine(_async_url(world))
        try:
            ids = []
            for _ in range(2):  # the step, then its re-run
                with scope("trip-1/email"):
                    async with AsyncSession(engine) as session:
                        ids.append(await mail.asend(session, note))
                        await session.commit()
            return ids
        finally:
            await engine.dispose()

    first, again = asyncio.run(scenario())
    [row] = world.rows()
    assert first == again and row["type"] == "email.send" and row["aggregateid"] == "trip-1/email"
    guard.close()


# ------------------------------------------------------------------------------- the schema


@pytest.mark.parametrize("backend", BACKENDS)
def test_migrate_adds_the_dedup_key_to_a_version_1_table_and_keeps_its_rows(
    backend: str, tmp_path: Path, clock: FakeClock
) -> None:
    world = make_world(backend, tmp_path, clock)
    try:
        with Session(world.engine) as session:
            old = world.outbox.enqueue(session, "t", {"n": 1})
            session.commit()
        with world.engine.begin() as conn:  # back to the version 1 layout
            conn.execute(sa.text(f"DROP INDEX ux_{world.table}_dedup"))
            conn.execute(sa.text(f"ALTER TABLE {world.table} DROP COLUMN dedup_key"))
            conn.execute(sa.text(f"DROP TABLE {world.table}_version"))  # as releases before 0.2 left it
        with pytest.raises(SchemaVersionMismatch, match="before versioned schemas"):
            check_schema(world.engine, world.table)
        with pytest.raises(SchemaVersionMismatch, match="sagaguard db upgrade"):
            world.relay().run_once()

        assert migrate(world.engine, world.table) == SCHEMA_VERSION == 2
        assert migrate(world.engine, world.table) == 2  # again: nothing to do

        check_schema(world.engine, world.table)
        assert schema_version(world.engine, world.table) == 2
        with Session(world.engine) as session:
            first = world.outbox.enqueue(session, "t", {"n": 2}, dedup_key="k")
            assert world.outbox.enqueue(session, "t", {"n": 2}, dedup_key="k") == first
            session.commit()
        assert _ids(world) == [_hex(old), _hex(first)]
        assert [row["dedup_key"] for row in world.rows()] == [None, "k"]
    finally:
        world.close()


def test_the_relay_hands_over_the_payload_unchanged(outbox_world: World) -> None:
    """The dedup key is bookkeeping: the message a handler gets is what was enqueued."""
    world = outbox_world
    seen: list[Any] = []
    world.outbox.register("t", seen.append)
    with Session(world.engine) as session:
        message_id = world.outbox.enqueue(session, "t", {"n": 1}, dedup_key="k", aggregate_id="a")
        session.commit()
    world.relay().run_once()
    [message] = seen
    assert (message.id, message.payload, message.aggregateid) == (message_id, {"n": 1}, "a")
    assert json.loads(message.json()) == {"n": 1}
    shown = world.control().get(message_id)  # what `sagaguard outbox show` prints
    assert (shown["dedup_key"], shown["status"]) == ("k", "delivered")


def test_a_deduplicated_enqueue_is_marked_on_its_create_span(outbox_world: World) -> None:
    """A replayed enqueue is never reported as a new message: its span names the existing one."""
    from _guardutil import span_exporter

    exporter = span_exporter()
    if exporter is None:
        pytest.skip("another OpenTelemetry provider is installed")
    exporter.clear()
    world = outbox_world
    with Session(world.engine) as session:
        first = world.outbox.enqueue(session, "t", {"n": 1}, dedup_key="secret-key")
        session.commit()
    with Session(world.engine) as session:
        assert world.outbox.enqueue(session, "t", {"n": 1}, dedup_key="secret-key") == first
        session.commit()

    created = [dict(s.attributes or {}) for s in exporter.get_finished_spans() if s.name == "create t"]
    assert [a["messaging.message.id"] for a in created] == [first, first]
    assert [a.get("sagaguard.outbox.deduplicated", False) for a in created] == [False, True]
    assert "secret-key" not in json.dumps(created)
