"""The relay's semantics on SQLite and Postgres, on an injected clock (nothing sleeps).

Per-aggregate order, backoff timing, poison messages and dead letters (replay, discard), purge,
lease loss (a relay whose claim was taken over cannot ack), lease renewal, graceful shutdown,
async handlers, and parallel delivery.
"""

from __future__ import annotations

import asyncio
import threading
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import tenacity
from _outboxkit import BACKENDS, Recorder, World, open_world
from conftest import FakeClock
from sqlalchemy.orm import Session

from sagaguard.idempotency.audit import AuditFilter, Outcome, TargetKind, open_audit
from sagaguard.idempotency.errors import ConfigurationError, NotApplied
from sagaguard.idempotency.outbox import (
    Message,
    MessageNotFound,
    NotDead,
    Outbox,
    RelaySettings,
    current_message,
)
from sagaguard.idempotency.outbox.claims import Claimed, Settle
from sagaguard.idempotency.outbox.operator import ALL, discard_dead, replay_all_dead
from sagaguard.idempotency.outbox.policy import failure_outcome

FIXED = tenacity.wait_fixed(10)


@pytest.fixture(params=BACKENDS)
def outbox_world(request: pytest.FixtureRequest, tmp_path: Path, clock: FakeClock) -> Iterator[World]:
    """A world on SQLite and on Postgres."""
    yield from open_world(request.param, tmp_path, clock)


class Boom(Exception):
    pass


def _enqueue(world: World, items: list[tuple[str, Any]], type: str = "t", **options: Any) -> list[str]:
    """Enqueue (aggregate, payload) pairs in one transaction; returns the ids."""
    with Session(world.engine) as session:
        ids = [
            world.outbox.enqueue(session, type, payload, aggregate_type="agg", aggregate_id=agg, **options)
            for agg, payload in items
        ]
        session.commit()
    return ids


def _drain(relay: Any, rounds: int = 100) -> int:
    total = 0
    for _ in range(rounds):
        claimed = relay.run_once()
        if not claimed:
            return total
        total += claimed
    raise AssertionError("the relay kept claiming")


def test_messages_are_delivered_once_each_in_aggregate_order(outbox_world: World) -> None:
    world = outbox_world
    recorder = Recorder()
    world.outbox.register("t", recorder)
    items = [(f"a{i % 7}", {"agg": f"a{i % 7}", "n": i}) for i in range(140)]
    ids = _enqueue(world, items)
    assert _drain(world.relay(batch_size=25)) == 140
    assert sorted(m.id for m in recorder.seen) == sorted(ids)
    by_aggregate: dict[str, list[int]] = defaultdict(list)
    for message in recorder.seen:
        by_aggregate[message.aggregateid].append(message.payload["n"])
    assert all(ns == sorted(ns) for ns in by_aggregate.values())
    assert world.control().status().depth == 0
    assert {row["status"] for row in world.rows()} == {"delivered"}
    assert {row["attempts"] for row in world.rows()} == {1}


def test_the_handler_gets_the_message_and_its_provider_key(outbox_world: World) -> None:
    world = outbox_world
    got: list[tuple[Message, Message]] = []
    world.outbox.register("t", lambda m: got.append((m, current_message())))
    [message_id] = _enqueue(world, [("x", {"a": 1})], headers={"tenant": "t1"}, provider_key="pk-1")
    world.relay().run_once()
    [(message, current)] = got
    assert message is current
    assert (message.id, message.type, message.aggregatetype, message.aggregateid) == (
        message_id,
        "t",
        "agg",
        "x",
    )
    assert message.payload == {"a": 1} and message.json() == '{"a":1}'
    assert message.headers == {"tenant": "t1"} and message.provider_key == "pk-1"
    assert message.attempt == 1 and message.created_at == world.clock.now
    with pytest.raises(ConfigurationError):
        current_message()


def test_default_provider_key_is_stable_per_message(outbox_world: World) -> None:
    world = outbox_world
    keys: list[str] = []
    world.outbox.register("t", lambda m: keys.append(m.provider_key))
    _enqueue(world, [("x", 1), ("y", 2)])
    world.relay().run_once()
    rows = world.rows()
    assert sorted(keys) == sorted(row["provider_key"] for row in rows) and len(set(keys)) == 2


def test_a_failure_backs_off_by_the_wait_strategy_then_delivers(outbox_world: World) -> None:
    world = outbox_world
    attempts: list[int] = []

    def flaky(message: Message) -> None:
        attempts.append(message.attempt)
        if message.attempt < 3:
            raise Boom(f"attempt {message.attempt}")

    world.outbox.register("t", flaky)
    _enqueue(world, [("x", 1)])
    wait = tenacity.wait_exponential(multiplier=2, max=100) + tenacity.wait_random(0, 1)
    relay = world.relay(backoff=wait)
    start = world.clock.now
    assert relay.run_once() == 1
    [row] = world.rows()
    assert row["status"] == "pending" and row["last_error"] == "Boom: attempt 1"
    delay = row["available_at"] - start
    assert 2 <= delay <= 3  # 2 * 2**0, plus up to 1 s of jitter
    world.clock.advance(delay - 0.01)
    assert relay.run_once() == 0  # still backing off
    world.clock.advance(0.02)
    assert relay.run_once() == 1
    [row] = world.rows()
    second = row["available_at"] - world.clock.now
    assert 4 <= second <= 5  # 2 * 2**1 + jitter
    world.clock.advance(second)
    assert relay.run_once() == 1
    assert attempts == [1, 2, 3]
    [row] = world.rows()
    assert row["status"] == "delivered" and row["attempts"] == 3 and row["delivered_at"] == world.clock.now
    stats = relay.stats()
    assert (stats.delivered, stats.failed, stats.dead) == (1, 2, 0)


def test_a_poison_message_is_dead_lettered_without_blocking_other_aggregates(outbox_world: World) -> None:
    world = outbox_world
    recorder = Recorder(lambda m: Boom("always") if m.payload == "poison" else None)
    world.outbox.register("t", recorder)
    _enqueue(
        world, [("bad", "poison"), ("bad", "after-poison"), ("good", "g1"), ("good", "g2")], max_attempts=3
    )
    relay = world.relay(backoff=FIXED)
    for _ in range(3):
        relay.run_once()
        relay.run_once()
        world.clock.advance(10)
    assert [p for p in recorder.payloads() if p != "poison"] == ["g1", "g2"]
    assert recorder.payloads().count("poison") == 3
    [dead] = world.control().dead_letters()
    assert (dead.aggregateid, dead.attempts, dead.max_attempts) == ("bad", 3, 3)
    assert dead.last_error == "Boom: always"
    # Its aggregate is held back (the default), until an operator discards it.
    assert _drain(relay) == 0
    status = world.control().status()
    # The message behind it is counted apart, not as pending: it drains only after an operator acts.
    assert (status.pending, status.blocked, status.dead, status.in_flight) == (0, 1, 1, 0)
    world.control().discard(dead.id)
    assert _drain(relay) == 1
    assert recorder.payloads()[-1] == "after-poison"
    assert world.control().dead_letters() == []


def test_a_poison_message_can_let_its_aggregate_go_on(outbox_world: World) -> None:
    world = outbox_world
    recorder = Recorder(lambda m: Boom() if m.payload == "poison" else None)
    world.outbox.register("t", recorder)
    _enqueue(world, [("a", "poison"), ("a", "next")], max_attempts=1)
    relay = world.relay(poison_blocks_aggregate=False)
    _drain(relay)
    assert recorder.payloads() == ["poison", "next"]
    assert world.control().status().dead == 1


def test_permanent_errors_dead_letter_at_once(outbox_world: World) -> None:
    world = outbox_world

    class Declined(Exception):
        pass

    errors = iter([NotApplied("card declined"), Declined("no"), NotApplied("later", retryable=True)])
    world.outbox.register("t", lambda m: (_ for _ in ()).throw(next(errors)))
    _enqueue(world, [("a", 1), ("b", 2), ("c", 3)])
    world.relay(permanent=(Declined,)).run_once()
    statuses = {row["aggregateid"]: (row["status"], row["attempts"]) for row in world.rows()}
    assert statuses == {"a": ("dead", 1), "b": ("dead", 1), "c": ("pending", 1)}


def test_an_unknown_type_or_undecodable_payload_fails_as_expected(outbox_world: World) -> None:
    world = outbox_world
    _enqueue(world, [("a", 1)], type="nobody.handles.this")
    relay = world.relay()
    relay.run_once()
    [row] = world.rows()
    assert row["status"] == "pending" and "no handler is registered" in row["last_error"]
    with world.engine.begin() as conn:
        conn.exec_driver_sql(f"UPDATE {world.table} SET payload = 'not json', available_at = 0")
    world.outbox.register("nobody.handles.this", lambda m: None)
    relay.run_once()
    [row] = world.rows()
    assert row["status"] == "dead" and "does not decode" in row["last_error"]


def test_replay_gives_dead_letters_back_with_fresh_attempts(outbox_world: World) -> None:
    world = outbox_world
    healthy = {"on": False}
    world.outbox.register("t", lambda m: None if healthy["on"] else (_ for _ in ()).throw(Boom("down")))
    ids = _enqueue(world, [("a", 1), ("b", 2), ("c", 3)], max_attempts=1)
    relay = world.relay()
    relay.run_once()
    control = world.control()
    assert [d.id for d in control.dead_letters()] == ids
    assert [d.id for d in control.dead_letters(limit=1, after=ids[0])] == [ids[1]]
    healthy["on"] = True
    control.replay(ids[0])
    with pytest.raises(NotDead):
        control.replay(ids[0])
    relay.run_once()
    assert control.replay_all() == 2
    relay.run_once()
    assert {(row["status"], row["attempts"]) for row in world.rows()} == {("delivered", 1)}
    with pytest.raises(NotDead):
        control.discard(ids[1])
    with pytest.raises(MessageNotFound):
        control.replay("0190b8a4-0000-7000-8000-000000000000")
    with pytest.raises(ConfigurationError):
        control.discard("not-an-id")
    info = control.get(ids[2])
    assert info["id"] == ids[2] and info["status"] == "delivered" and info["last_error"] == "Boom: down"


def test_the_operator_api_replays_every_dead_letter_and_audits_it(outbox_world: World) -> None:
    """``replay_all_dead`` (the scripts' way out of a pile of dead letters) and ``discard_dead``:
    each acts through the control and leaves one audit entry, the payload never in it."""
    world = outbox_world
    healthy = {"on": False}
    world.outbox.register("t", lambda m: None if healthy["on"] else (_ for _ in ()).throw(Boom("down")))
    ids = _enqueue(world, [("a", 1), ("b", 2), ("c", 3)], max_attempts=1)
    relay = world.relay()
    relay.run_once()
    control = world.control()
    log = open_audit("memory://")
    discard_dead(control, ids[0], actor="ana", audit=log)
    healthy["on"] = True
    assert replay_all_dead(control, actor="ana", audit=log) == 2
    assert replay_all_dead(control, actor="ana", audit=log) == 0  # nothing dead is left: a no-op
    relay.run_once()
    assert {row["aggregateid"]: row["status"] for row in world.rows()} == {
        "a": "discarded", "b": "delivered", "c": "delivered"
    }  # fmt: skip
    entries = log.list(AuditFilter())
    assert [(e.action, e.target, e.outcome) for e in reversed(entries)] == [
        ("outbox.discard", ids[0], Outcome.OK),
        ("outbox.replay_all", ALL, Outcome.OK),
        ("outbox.replay_all", ALL, Outcome.OK),
    ]
    assert all(e.actor == "ana" and e.kind is TargetKind.MESSAGE and e.args == {} for e in entries)


def test_purge_deletes_old_delivered_and_discarded_rows_in_pages(outbox_world: World) -> None:
    world = outbox_world
    world.outbox.register("t", lambda m: None if m.payload != "dead" else (_ for _ in ()).throw(Boom()))
    _enqueue(world, [(f"a{i}", i) for i in range(25)] + [("z", "dead"), ("y", "dead")], max_attempts=1)
    _enqueue(world, [("late", "pending")], delay=10_000)
    relay = world.relay(batch_size=100)
    relay.run_once()
    control = world.control()
    discarded = control.dead_letters()[0]
    control.discard(discarded.id)
    assert control.purge(retention=60) == 0  # too young
    world.clock.advance(61)
    assert control.purge(retention=60, page=10, max_pages=1) == 10
    assert control.purge(retention=60, page=10) == 16  # 15 delivered + 1 discarded
    statuses = sorted(row["status"] for row in world.rows())
    assert statuses == ["dead", "pending"]
    with pytest.raises(ConfigurationError):
        control.purge(retention=-1)


def test_the_relay_purges_on_its_own(outbox_world: World) -> None:
    world = outbox_world
    world.outbox.register("t", lambda m: None)
    _enqueue(world, [("a", 1)])
    relay = world.relay(purge_every=0.001, retention=0.0)
    relay.run(until_idle=True)  # delivers, then the next round's maintenance purges
    relay.run(until_idle=True)
    assert world.rows() == []


def test_a_relay_whose_claim_was_taken_over_cannot_ack(outbox_world: World) -> None:
    world = outbox_world
    _enqueue(world, [("a", 1)])
    first, second = world.db(), world.db()
    [mine] = first.claim("relay-1", 10, lease=30)
    assert second.claim("relay-2", 10, lease=30) == []  # the lease is live
    world.clock.advance(31)  # relay-1 stalled past its lease
    [theirs] = second.claim("relay-2", 10, lease=30)
    assert theirs.attempts == 2
    assert mine.token.startswith("relay-1/") and theirs.token.startswith("relay-2/")
    done = Settle(mine.ref, mine.attempts, "delivered")
    assert first.settle(mine.token, [done]) == [mine.ref]  # refused: the claim is relay-2's
    assert first.extend(mine.token, [mine], 30) == [mine.ref]
    [row] = world.rows()
    assert (row["status"], row["worker_id"], row["attempts"]) == ("pending", theirs.token, 2)
    assert second.settle(theirs.token, [Settle(theirs.ref, theirs.attempts, "delivered")]) == []
    assert world.rows()[0]["status"] == "delivered"


def test_an_ack_after_the_lease_ran_out_is_taken_if_nobody_took_over(outbox_world: World) -> None:
    world = outbox_world
    _enqueue(world, [("a", 1)])
    db = world.db()
    [mine] = db.claim("relay-1", 10, lease=5)
    world.clock.advance(60)
    assert db.settle(mine.token, [Settle(mine.ref, mine.attempts, "delivered")]) == []


def test_the_relay_counts_lost_claims(outbox_world: World) -> None:
    world = outbox_world
    other = world.db()

    def slow(message: Message) -> None:
        world.clock.advance(100)  # the handler outlives the lease ...
        assert other.claim("thief", 10, lease=30)  # ... and another relay takes the message over

    world.outbox.register("t", slow)
    _enqueue(world, [("a", 1)])
    relay = world.relay(lease=30)
    relay.run_once()
    assert (relay.stats().delivered, relay.stats().lost) == (0, 1)
    assert world.rows()[0]["worker_id"].startswith("thief/")


def test_a_long_batch_renews_its_leases(outbox_world: World) -> None:
    world = outbox_world
    other = world.db()
    stolen: list[Any] = []

    def slow(message: Message) -> None:
        world.clock.advance(20)  # 3 messages x 20 s > the 30 s lease
        stolen.extend(other.claim("thief", 10, lease=30))

    world.outbox.register("t", slow)
    _enqueue(world, [("a", 1), ("a", 2), ("a", 3)] if not world.postgres else [("a", 1), ("b", 2), ("c", 3)])
    relay = world.relay(lease=30)
    assert relay.run_once() == 3
    assert stolen == [] and relay.stats().delivered == 3


def test_graceful_stop_finishes_the_message_in_hand_and_releases_the_rest(outbox_world: World) -> None:
    world = outbox_world
    delivered: list[int] = []
    relay = world.relay(batch_size=10)

    def handler(message: Message) -> None:
        delivered.append(message.payload)
        relay.request_stop()

    world.outbox.register("t", handler)
    _enqueue(world, [(f"a{i}", i) for i in range(5)])
    stats = relay.run()
    assert delivered == [0] and (stats.delivered, stats.released) == (1, 4)
    rows = world.rows()
    assert (
        sorted((row["status"], row["attempts"]) for row in rows) == [("delivered", 1)] + [("pending", 0)] * 4
    )
    assert all(row["worker_id"] is None for row in rows if row["status"] == "pending")


def test_a_keyboard_interrupt_keeps_the_message_in_hand_and_releases_the_rest(outbox_world: World) -> None:
    world = outbox_world

    def handler(message: Message) -> None:
        if message.payload == 1:
            raise KeyboardInterrupt

    world.outbox.register("t", handler)
    _enqueue(world, [("a", 0), ("b", 1), ("c", 2)])
    relay = world.relay()
    with pytest.raises(KeyboardInterrupt):
        relay.run_once()
    statuses = {
        row["payload"]: (row["status"], row["attempts"], (row["worker_id"] or "").split("/")[0])
        for row in world.rows()
    }
    held = relay.worker_id
    assert statuses == {"0": ("delivered", 1, held), "1": ("pending", 1, held), "2": ("pending", 0, "")}


def test_async_handlers_and_parallel_delivery(outbox_world: World) -> None:
    world = outbox_world
    threads: set[str] = set()
    seen: list[Any] = []
    lock = threading.Lock()

    async def handler(message: Message) -> None:
        await asyncio.sleep(0)
        assert current_message() is message
        with lock:
            seen.append((message.aggregateid, message.payload))

    def sync_handler(message: Message) -> None:
        with lock:
            threads.add(threading.current_thread().name)
            seen.append((message.aggregateid, message.payload))

    world.outbox.register("t", handler)
    world.outbox.register("s", sync_handler)
    _enqueue(world, [(f"a{i % 5}", i) for i in range(30)])
    _enqueue(world, [(f"s{i % 5}", i) for i in range(30)], type="s")
    relay = world.relay(concurrency=4, batch_size=50)
    _drain(relay)
    assert len(seen) == 60
    order: dict[str, list[int]] = defaultdict(list)
    for agg, n in seen:
        order[agg].append(n)
    assert all(ns == sorted(ns) for ns in order.values())
    assert any(name.startswith("sagaguard-relay") for name in threads)
    relay.close()


def test_handlers_are_registered_once_per_type() -> None:
    outbox = Outbox()
    outbox.register("t", lambda m: None)
    with pytest.raises(ConfigurationError):
        outbox.register("t", lambda m: None)
    with pytest.raises(ConfigurationError):
        outbox.register("u", "not callable")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError):
        RelaySettings(batch_size=0)
    with pytest.raises(ConfigurationError):
        RelaySettings(lease=-1)


@pytest.mark.parametrize(
    ("error", "attempts", "max_attempts", "status"),
    [
        (Boom(), 1, 3, "pending"),
        (Boom(), 3, 3, "dead"),
        (NotApplied("declined"), 1, 3, "dead"),
        (NotApplied("busy", retryable=True), 1, 3, "pending"),
        (ValueError(), 1, 3, "pending"),
    ],
)
def test_failure_outcome_is_a_pure_decision(
    error: BaseException, attempts: int, max_attempts: int, status: str
) -> None:
    claimed = Claimed(
        "ref", "id", "w/1", "agg", "a1", "t", "{}", None, None, None, "pk", attempts, max_attempts, 0.0
    )
    settings = RelaySettings(backoff=tenacity.wait_exponential(multiplier=1, max=60))
    outcome = failure_outcome(claimed, error, settings)
    assert outcome.status == status and outcome.attempts == attempts and not outcome.release
    if status == "pending":
        assert outcome.delay == 2 ** (attempts - 1)
    assert outcome.error is not None and outcome.error.startswith(type(error).__qualname__)
