"""``outbox status`` shows the messages blocked behind a dead letter apart from the pending ones.

Before: they were counted as pending, so the depth never drained while a dead letter held its
aggregate back. Real SQLite and Postgres outbox tables; through the API and the real CLI.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from _outboxkit import BACKENDS, World, open_world
from conftest import FakeClock
from sqlalchemy.orm import Session

from sagaguard.idempotency.cli import main as cli_main
from sagaguard.idempotency.errors import NotApplied
from sagaguard.idempotency.outbox import BlockedAggregate, Message, OutboxControl, OutboxDb


@pytest.fixture(params=BACKENDS)
def outbox_world(request: pytest.FixtureRequest, tmp_path: Path, clock: FakeClock) -> Iterator[World]:
    yield from open_world(request.param, tmp_path, clock)


def _enqueue(world: World, items: list[tuple[str, str]]) -> None:
    with Session(world.engine) as session:
        for agg, kind in items:
            world.outbox.enqueue(session, kind, {"agg": agg}, aggregate_type="order", aggregate_id=agg)
        session.commit()


def _refuse(message: Message) -> None:
    raise NotApplied("address rejected", retryable=False)  # dead at once


@pytest.fixture
def blocked_world(outbox_world: World) -> World:
    """Aggregate a: a dead letter, then two messages behind it; b delivered; c pending."""
    world = outbox_world
    world.outbox.register("ok", lambda message: None)
    world.outbox.register("bad", _refuse)
    _enqueue(world, [("a", "bad"), ("a", "ok"), ("a", "ok"), ("b", "ok")])
    relay = world.relay()
    while relay.run_once():
        pass
    _enqueue(world, [("c", "ok")])
    return world


def test_status_counts_blocked_messages_apart_per_aggregate(blocked_world: World) -> None:
    status = blocked_world.control().status()
    assert (status.dead, status.blocked, status.pending, status.in_flight) == (1, 2, 1, 0)
    assert status.depth == 1  # what relays can still drain
    assert status.blocked_aggregates == (BlockedAggregate("order", "a", 2),)


def test_discarding_the_dead_letter_unblocks_its_aggregate(blocked_world: World) -> None:
    control = blocked_world.control()
    [dead] = control.dead_letters()
    control.discard(dead.id)
    status = control.status()
    assert (status.dead, status.blocked, status.pending) == (0, 0, 3)
    assert status.blocked_aggregates == ()


def test_when_dead_letters_do_not_block_nothing_is_counted_blocked(blocked_world: World) -> None:
    world = blocked_world
    db = OutboxDb(world.engine, world.table, clock=world.clock, poison_blocks_aggregate=False)
    control = OutboxControl(db)
    status = control.status()
    assert (status.dead, status.blocked, status.pending) == (1, 0, 3)


def test_the_cli_shows_blocked_messages_apart(
    blocked_world: World, capsys: pytest.CaptureFixture[str]
) -> None:
    world = blocked_world
    where = ["--db", world.url, "--table", world.table]
    assert cli_main(["outbox", "status", *where]) == 0
    out = capsys.readouterr().out
    lines = {line.split("  ", 1)[0].strip(): line for line in out.splitlines()}
    assert lines["depth"].split()[-1] == "1" and lines["pending"].split()[-1] == "1"
    assert "blocked behind a dead letter: 2" in out
    assert "order/a: 2" in out
    assert cli_main(["outbox", "status", *where, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["depth"], data["pending"], data["blocked"], data["dead"]) == (1, 1, 2, 1)
    assert data["blocked_aggregates"] == [{"aggregatetype": "order", "aggregateid": "a", "blocked": 2}]
