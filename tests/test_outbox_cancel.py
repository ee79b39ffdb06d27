"""``OutboxControl.cancel``: a message no relay has claimed is withdrawn and never delivered; one a
relay holds (maybe on its way) is left alone. Real SQLite and Postgres outbox tables, a real relay.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from _outboxkit import BACKENDS, Recorder, World, open_world
from conftest import FakeClock
from sqlalchemy.orm import Session

from sagaguard.idempotency.errors import NotApplied
from sagaguard.idempotency.outbox import Message, MessageNotFound, uuid7

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(params=BACKENDS)
def outbox_world(request: pytest.FixtureRequest, tmp_path: Path, clock: FakeClock) -> Iterator[World]:
    yield from open_world(request.param, tmp_path, clock)


def _enqueue(world: World, n: int, aggregate: str | None = None) -> list[str]:
    with Session(world.engine) as session:
        ids = [world.outbox.enqueue(session, "t", {"i": i}, aggregate_id=aggregate) for i in range(n)]
        session.commit()
    return ids


def _status(world: World, message_id: str) -> str:
    return str(world.control().get(message_id)["status"])


def test_a_cancelled_message_is_never_delivered_and_its_followers_are(outbox_world: World) -> None:
    world = outbox_world
    seen = Recorder()
    world.outbox.register("t", seen)
    first, second = _enqueue(world, 2, aggregate="order-1")
    assert world.control().cancel(first) is True
    assert world.control().cancel(first) is False  # already withdrawn
    world.relay().run(until_idle=True)
    assert seen.payloads() == [{"i": 1}]  # the follower was not held back by the cancelled head
    assert (_status(world, first), _status(world, second)) == ("discarded", "delivered")
    assert world.control().status().pending == 0


def test_a_message_a_relay_holds_is_not_cancelled_and_is_delivered(outbox_world: World) -> None:
    world = outbox_world
    seen = Recorder()
    world.outbox.register("t", seen)
    (held,) = _enqueue(world, 1)
    db = world.db()
    claimed = db.claim("relay-a", 10, 30.0)  # in flight: it may be on its way right now
    assert [c.id for c in claimed] == [held]
    assert world.control().cancel(held) is False
    assert _status(world, held) == "pending"
    world.clock.advance(31.0)  # relay-a died: its lease runs out and another relay delivers it
    world.relay().run(until_idle=True)
    assert seen.payloads() == [{"i": 0}]
    assert world.control().cancel(held) is False  # delivered


def test_cancel_leaves_dead_letters_alone_and_names_a_missing_message(outbox_world: World) -> None:
    world = outbox_world

    def refuse(message: Message) -> None:
        raise NotApplied("address rejected", retryable=False)

    world.outbox.register("t", refuse)
    (dead,) = _enqueue(world, 1)
    world.relay().run(until_idle=True)
    assert _status(world, dead) == "dead"
    assert world.control().cancel(dead) is False  # an operator's to replay or discard
    assert _status(world, dead) == "dead"
    with pytest.raises(MessageNotFound):
        world.control().cancel(str(uuid7()))


def test_cancel_racing_a_relay_withdraws_each_message_or_lets_it_be_delivered(outbox_world: World) -> None:
    world = outbox_world
    seen = Recorder()
    world.outbox.register("t", seen)
    ids = _enqueue(world, 60)
    cancelled: list[str] = []
    start = threading.Barrier(2)

    def cancel_all() -> None:
        control = world.control()
        start.wait()
        cancelled.extend(m for m in reversed(ids) if control.cancel(m))

    canceller = threading.Thread(target=cancel_all)
    canceller.start()
    relay = world.relay(batch_size=5)
    start.wait()
    relay.run(until_idle=True)
    canceller.join()
    relay.run(until_idle=True)
    delivered = {m.id for m in seen.seen}
    assert delivered.isdisjoint(cancelled)
    assert delivered | set(cancelled) == set(ids)
    assert len(seen.seen) == len(delivered)  # each delivered once
    for message_id in cancelled:
        assert _status(world, message_id) == "discarded"
