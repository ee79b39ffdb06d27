"""A relay renews its claims while a handler runs, on every path: a handler slower than the lease
keeps its message, and a second relay cannot take it over and deliver it again.

Before: the one-aggregate path (concurrency 1, or a batch holding one aggregate) renewed only
between messages, so a second relay took a slow message over, delivered it again and again, and it
ended dead-lettered although every delivery succeeded. Real SQLite and Postgres outbox tables.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _outboxkit import BACKENDS, World, open_world
from conftest import FakeClock
from sqlalchemy.orm import Session

from sagaguard.idempotency.outbox import Message
from sagaguard.idempotency.outbox.renewal import ClaimRenewer


@pytest.fixture(params=BACKENDS)
def outbox_world(request: pytest.FixtureRequest, tmp_path: Path, clock: FakeClock) -> Iterator[World]:
    yield from open_world(request.param, tmp_path, clock)


def _enqueue(world: World, aggregates: list[str]) -> None:
    with Session(world.engine) as session:
        for agg in aggregates:
            world.outbox.enqueue(session, "t", {"agg": agg}, aggregate_type="agg", aggregate_id=agg)
        session.commit()


def _wait_for(condition: Any, what: str) -> None:
    """Poll a condition another thread makes true (bounded; no assertion on how long it took)."""
    for _ in range(3000):
        if condition():
            return
        time.sleep(0.01)
    raise AssertionError(f"never happened: {what}")


@pytest.mark.parametrize(
    ("aggregates", "concurrency"),
    [(["a"], 1), (["a", "b"], 1), (["a"], 4), (["a", "b"], 2)],
    ids=["one-aggregate", "two-aggregates-serial", "one-aggregate-concurrency-4", "two-aggregates-pool"],
)
def test_a_handler_longer_than_the_lease_keeps_its_message(
    outbox_world: World, aggregates: list[str], concurrency: int
) -> None:
    world, clock = outbox_world, outbox_world.clock
    lease = 1.0
    calls: dict[str, int] = {}
    stolen: list[int] = []
    thief = world.relay(lease=lease, worker_id="thief")

    def lease_until(agg: str) -> float:
        [row] = [r for r in world.rows() if r["aggregateid"] == agg]
        return float(row["lease_until"])

    def slow(message: Message) -> None:
        agg = message.payload["agg"]
        calls[agg] = calls.get(agg, 0) + 1
        if agg != "a" or calls[agg] > 1:
            return
        # The handler runs past half its lease: the renewer must extend the claim while it runs.
        before = lease_until("a")
        clock.advance(0.6 * lease)
        _wait_for(lambda: lease_until("a") > before, "the claim renewed while the handler ran")
        clock.advance(0.6 * lease)  # past the first lease's end: without renewal it would be free
        stolen.append(thief.run_once())  # the second relay finds nothing it may take

    world.outbox.register("t", slow)
    _enqueue(world, aggregates)
    relay = world.relay(lease=lease, concurrency=concurrency, worker_id="first")
    assert relay.run_once() == len(aggregates)
    assert stolen == [0]
    assert calls == dict.fromkeys(aggregates, 1)  # each delivered exactly once
    rows = world.rows()
    assert [r["status"] for r in rows] == ["delivered"] * len(aggregates)
    assert all(r["attempts"] == 1 for r in rows)
    assert relay.stats().delivered == len(aggregates) and relay.stats().lost == 0


def test_two_relays_on_the_database_clock_deliver_a_slow_message_once(outbox_world: World) -> None:
    """The issue's case on real time: lease 1 s, a handler of 2.5 s, a second relay polling."""
    world = outbox_world
    ran = []
    done = threading.Event()

    def slow(message: Message) -> None:
        ran.append(message.id)
        done.wait(2.5)  # returns normally after outliving the lease

    world.outbox.register("t", slow)
    _enqueue(world, ["a"])
    first = world.relay(lease=1.0, clock=None, worker_id="first")
    second = world.relay(lease=1.0, clock=None, worker_id="second")
    worker = threading.Thread(target=first.run_once)
    worker.start()
    _wait_for(lambda: ran, "the first relay's handler started")
    taken = 0
    while worker.is_alive():
        taken += second.run_once()
        time.sleep(0.05)
    worker.join()
    assert taken == 0 and len(ran) == 1
    [row] = world.rows()
    assert (row["status"], row["attempts"]) == ("delivered", 1)


def test_the_renewer_stops_with_its_block() -> None:
    renewer = ClaimRenewer("test")
    calls: list[int] = []
    first = threading.Event()

    def renew() -> None:
        calls.append(1)
        first.set()

    with renewer.renewing(renew, 0.01):
        assert first.wait(30)
    count = len(calls)
    time.sleep(0.05)
    assert len(calls) == count  # nothing after the block ended
    renewer.close()
