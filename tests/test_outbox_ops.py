"""The outbox around the relay: LISTEN/NOTIFY wake-ups, running in a thread and stopping, guarded
effects deferred through the outbox, OpenTelemetry, the CLI, and the public names."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _guardutil import span_exporter
from _outboxkit import BACKENDS, World, open_world
from conftest import FakeClock
from sqlalchemy.orm import Session

import sagaguard.idempotency.outbox
from sagaguard.idempotency import Guard, current_effect, scope
from sagaguard.idempotency.outbox import SCHEMA_VERSION, Message, Outbox
from sagaguard.idempotency.outbox.cli import main as cli_main
from sagaguard.idempotency.outbox.cli import status_line
from sagaguard.idempotency.stores.memory import MemoryStore


@pytest.fixture(params=BACKENDS)
def outbox_world(request: pytest.FixtureRequest, tmp_path: Path, clock: FakeClock) -> Iterator[World]:
    """A world on SQLite and on Postgres."""
    yield from open_world(request.param, tmp_path, clock)


@pytest.fixture
def pg_world(tmp_path: Path, clock: FakeClock) -> Iterator[World]:
    """A world on Postgres only."""
    yield from open_world("postgres", tmp_path, clock)


def _wait_for(predicate: Any, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return False


# -------------------------------------------------------------------------- waking and stopping


def test_a_notify_wakes_an_idle_relay_long_before_its_poll(pg_world: World) -> None:
    world = pg_world
    world.outbox.clock = None  # real time on both sides
    delivered = threading.Event()
    world.outbox.register("t", lambda m: delivered.set())
    relay = world.relay(listen=True, poll_interval=60.0, clock=None)
    relay.start()
    try:
        assert _wait_for(lambda: relay.stats().batches == 0 and relay._waker.mode == "notify")
        time.sleep(0.2)  # let it fall asleep on the listener
        started = time.monotonic()
        with Session(world.engine) as session:
            world.outbox.enqueue(session, "t", {})
            session.commit()
        assert delivered.wait(10), "the NOTIFY did not wake the relay"
        assert time.monotonic() - started < 5.0  # far below the 60 s poll
        assert relay._waker.notified >= 1
    finally:
        relay.stop()


def test_without_notify_the_relay_polls(outbox_world: World) -> None:
    world = outbox_world
    world.outbox.clock = None
    delivered = threading.Event()
    world.outbox.register("t", lambda m: delivered.set())
    relay = world.relay(listen=False, poll_interval=0.05, clock=None)
    relay.start()
    try:
        time.sleep(0.1)
        with Session(world.engine) as session:
            world.outbox.enqueue(session, "t", {})
            session.commit()
        assert delivered.wait(10)
        assert relay.stats().wake_mode == "poll"
    finally:
        relay.stop()


def test_stop_from_another_thread_releases_what_the_relay_holds(outbox_world: World) -> None:
    world = outbox_world
    world.outbox.clock = None
    in_handler, proceed = threading.Event(), threading.Event()

    def handler(message: Message) -> None:
        in_handler.set()
        proceed.wait(10)

    world.outbox.register("t", handler)
    with Session(world.engine) as session:
        for i in range(5):
            world.outbox.enqueue(session, "t", i, aggregate_id=f"a{i}")
        session.commit()
    relay = world.relay(clock=None, batch_size=10, poll_interval=0.05)
    relay.start()
    assert in_handler.wait(10)
    stopper = threading.Thread(target=relay.stop)
    stopper.start()
    time.sleep(0.1)
    proceed.set()  # the message in hand finishes ...
    stopper.join(10)
    assert not stopper.is_alive()
    rows = world.rows()  # ... and the other four go back, their attempt not counted
    assert sorted((r["status"], r["attempts"]) for r in rows) == [("delivered", 1)] + [("pending", 0)] * 4


# ---------------------------------------------------------------------------- deferred effects


def test_a_deferred_effect_runs_once_after_commit_under_the_guard(outbox_world: World) -> None:
    world = outbox_world
    guard = Guard(MemoryStore(clock=world.clock))
    calls: list[tuple[str, int, str]] = []

    @world.outbox.effect(guard, "payments.refund", aggregate_id=lambda args: args["charge"])
    def refund(charge: str, amount: int) -> str:
        calls.append((charge, amount, current_effect().provider_key))
        return f"re_{charge}"

    with scope("inline"):
        assert refund("ch_0", 1) == "re_ch_0"  # still an ordinary guarded call
    with Session(world.engine) as session:
        message_id = refund.defer(session, "ch_1", amount=500)
        session.rollback()
    with Session(world.engine) as session:
        message_id = refund.defer(session, "ch_1", amount=500)
        session.commit()
    [row] = world.rows()
    assert (row["type"], row["aggregateid"]) == ("payments.refund", "ch_1")
    assert json.loads(row["payload"]) == {"charge": "ch_1", "amount": 500}
    relay = world.relay()
    relay.run_once()
    assert calls[1:] == [("ch_1", 500, row["provider_key"])]
    # Delivered again (its relay died before the ack): the guard replays, nothing runs twice.
    handler = world.outbox.handlers["payments.refund"]
    again = Message(message_id, "payments.refund", "x", "ch_1", {"charge": "ch_1", "amount": 500}, {},
                    row["provider_key"], 2, 10, 0.0)  # fmt: skip
    assert handler(again) == "re_ch_1"
    assert len(calls) == 2
    guard.close()


@dataclasses.dataclass
class Mail:
    to: str
    subject: str


def test_a_deferred_async_effect_and_its_default_aggregate(outbox_world: World) -> None:
    world = outbox_world
    guard = Guard(MemoryStore(clock=world.clock))
    sent: list[Mail] = []

    @world.outbox.effect(guard, "mail.send")
    async def send(mail: Mail) -> None:
        sent.append(mail)

    with Session(world.engine) as session, scope("order-9"):
        send.defer(session, Mail("a@example.com", "hi"))
        session.commit()
    assert world.rows()[0]["aggregateid"] == "order-9"  # the unit of work keeps its effects in order
    world.relay().run_once()
    assert sent == [Mail("a@example.com", "hi")]
    guard.close()


def test_a_deferred_effect_refuses_what_cannot_travel(outbox_world: World) -> None:
    from sagaguard.idempotency.errors import ConfigurationError

    world = outbox_world
    guard = Guard(MemoryStore())
    with pytest.raises(ConfigurationError):

        @world.outbox.effect(guard, "bad")
        def bad(*items: int) -> None: ...

    @world.outbox.effect(guard, "ok")
    def ok(n: int) -> None: ...

    with Session(world.engine) as session, pytest.raises(ConfigurationError):
        ok.defer(session, 1, 2)  # type: ignore[call-arg]
    guard.close()


# ---------------------------------------------------------------------------------- telemetry


def test_the_send_span_links_to_the_create_span_stored_on_the_row(outbox_world: World) -> None:
    from opentelemetry import trace

    exporter = span_exporter()
    if exporter is None:
        pytest.skip("another OpenTelemetry provider is installed")
    exporter.clear()
    world = outbox_world
    world.outbox.register("t", lambda m: None)
    tracer = trace.get_tracer("test")
    with tracer.start_as_current_span("checkout") as parent, Session(world.engine) as session:
        message_id = world.outbox.enqueue(session, "t", {"secret": "hunter2"}, aggregate_id="order-1")
        session.commit()
    [row] = world.rows()
    world.relay().run_once()
    spans = {span.name: span for span in exporter.get_finished_spans()}
    create, send = spans["create t"], spans["send t"]
    assert create.kind is trace.SpanKind.PRODUCER and send.kind is trace.SpanKind.PRODUCER
    assert create.parent is not None and create.parent.span_id == parent.get_span_context().span_id
    context = create.get_span_context()
    flags = int(context.trace_flags)
    assert row["traceparent"] == f"00-{context.trace_id:032x}-{context.span_id:016x}-{flags:02x}"
    assert [link.context.span_id for link in send.links] == [context.span_id]
    for span, operation in ((create, "create"), (send, "send")):
        attributes = dict(span.attributes or {})
        assert attributes["messaging.system"] == "sagaguard"
        assert attributes["messaging.operation.name"] == operation
        assert attributes["messaging.operation.type"] == operation
        assert attributes["messaging.destination.name"] == "t"
        assert attributes["messaging.message.id"] == message_id
        assert attributes["messaging.message.conversation_id"] == "order-1"
        assert "hunter2" not in json.dumps(attributes)  # no payload on spans


def test_a_failed_delivery_marks_its_span(outbox_world: World) -> None:
    exporter = span_exporter()
    if exporter is None:
        pytest.skip("another OpenTelemetry provider is installed")
    exporter.clear()
    world = outbox_world
    world.outbox.register("t", lambda m: (_ for _ in ()).throw(KeyError("secret")))
    with Session(world.engine) as session:
        world.outbox.enqueue(session, "t", {})
        session.commit()
    world.relay().run_once()
    [send] = [span for span in exporter.get_finished_spans() if span.name == "send t"]
    assert dict(send.attributes or {})["error.type"] == "KeyError"
    assert "secret" not in str(send.attributes)


# ------------------------------------------------------------------------------------- the CLI


def test_cli_operates_the_outbox(
    tmp_path: Path, clock: FakeClock, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    db = tmp_path / "cli.db"
    url = f"sqlite:///{db}"
    app = tmp_path / "cliapp.py"
    app.write_text(
        "from sagaguard.idempotency.outbox import Outbox\n"
        "outbox = Outbox()\n"
        "outbox.register('ok', lambda m: None)\n"
        "def fail(m):\n    raise RuntimeError('smtp down')\n"
        "outbox.register('bad', fail)\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SAGAGUARD_OUTBOX_DB", url)
    assert cli_main(["outbox", "status"]) == 2  # no database yet
    assert "no SQLite database" in capsys.readouterr().err
    db.touch()
    assert cli_main(["outbox", "status"]) == 2  # no table yet: told to migrate
    assert "sagaguard db upgrade" in capsys.readouterr().err
    assert cli_main(["outbox", "migrate"]) == 0
    assert f"schema version {SCHEMA_VERSION}" in capsys.readouterr().out
    from sagaguard.idempotency.stores.sql import make_engine

    engine = make_engine(url)
    outbox = Outbox(max_attempts=1)
    with Session(engine) as session:
        for i in range(3):
            outbox.enqueue(session, "ok", {"n": i})
        bad_id = outbox.enqueue(session, "bad", {})
        session.commit()
    assert cli_main(["outbox", "status", "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert (status["depth"], status["pending"], status["dead"]) == (4, 4, 0)
    assert cli_main(["relay", "--app", "cliapp:outbox", "--until-idle", "--quiet"]) == 0
    assert "delivered 3, failed 0, dead 1" in capsys.readouterr().out
    assert cli_main(["outbox", "dead"]) == 0
    out = capsys.readouterr().out
    assert bad_id in out and "RuntimeError: smtp down" in out
    assert cli_main(["outbox", "show", bad_id, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["status"] == "dead"
    assert cli_main(["outbox", "replay", bad_id]) == 0
    assert cli_main(["outbox", "replay", bad_id]) == 1  # not dead any more
    assert "not dead" in capsys.readouterr().err
    assert cli_main(["relay", "--app", "cliapp:outbox", "--until-idle", "--quiet"]) == 0  # dies again
    capsys.readouterr()
    assert cli_main(["outbox", "replay", "--all"]) == 2  # no terminal to confirm on
    assert "--yes" in capsys.readouterr().err
    assert cli_main(["outbox", "replay", "--all-dead", "--dry-run"]) == 0
    assert f"would replay 1 dead letters:\n  {bad_id}" in capsys.readouterr().out
    assert cli_main(["outbox", "replay", "--all-dead", "--yes"]) == 0
    assert "replayed 1 dead letters (0 refused)" in capsys.readouterr().out
    assert cli_main(["outbox", "dead", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == []
    assert cli_main(["relay", "--app", "cliapp:outbox", "--until-idle", "--quiet"]) == 0
    capsys.readouterr()
    assert cli_main(["outbox", "dead", "--json"]) == 0
    [letter] = json.loads(capsys.readouterr().out)
    assert letter["id"] == bad_id and letter["attempts"] == 1
    assert cli_main(["outbox", "discard", letter["id"]]) == 0
    time.sleep(0.01)
    assert cli_main(["outbox", "purge", "--retention", "0.001"]) == 0
    assert "purged 4 messages" in capsys.readouterr().out
    assert cli_main(["outbox", "discard", "nope"]) == 2
    capsys.readouterr()
    from sagaguard.idempotency.cli import main as sagaguard_main

    assert sagaguard_main(["audit", "--store", url, "--action", "outbox.", "--json"]) == 0
    audit = json.loads(capsys.readouterr().out)
    assert [(e["action"], e["target"], e["outcome"], e["error"]) for e in reversed(audit)] == [
        ("outbox.replay", bad_id, "ok", None),
        ("outbox.replay", bad_id, "refused", "NotDead"),
        ("outbox.replay", bad_id, "ok", None),  # by the bulk action, recorded apart:
        ("outbox.discard", bad_id, "ok", None),
        ("outbox.discard", "nope", "refused", "ConfigurationError"),
    ]
    assert sagaguard_main(["audit", "--store", url, "--action", "bulk.", "--json"]) == 0
    [bulk] = json.loads(capsys.readouterr().out)
    assert (bulk["action"], bulk["args"]["count"]) == ("bulk.outbox.replay", 1)
    assert cli_main(["relay", "--app", "nowhere:outbox", "--until-idle"]) == 2
    assert cli_main(["outbox", "status", "--db", "memory://"]) == 2
    engine.dispose()


def test_the_status_line_is_readable() -> None:
    from sagaguard.idempotency.outbox import RelayStats

    stats = RelayStats(worker_id="w1", delivered=12345, failed=2, dead=1, depth=40, oldest_age=75, lost=0)
    line = status_line(stats, 812.4)
    assert line == "relay w1 | delivered 12,345 (812/s) | failed 2 | dead 1 | depth 40 | oldest 1m15s | poll"


def test_public_names() -> None:
    assert sorted(sagaguard.idempotency.outbox.__all__) == sorted(
        [
            "DEFAULT_MAX_ATTEMPTS", "DEFAULT_RETENTION", "DEFAULT_TABLE", "MAX_PAYLOAD_BYTES", "METADATA",
            "SCHEMA_VERSION", "BlockedAggregate", "BlockedMessage", "DeadLetter", "DeferredEffect", "Message",
            "MessageNotFound", "MessageStatus", "NotDead", "Outbox", "OutboxControl", "OutboxDb",
            "OutboxError", "OutboxRow", "OutboxStatus", "Relay", "RelaySettings", "RelayStats",
            "aenqueue", "check_schema", "create_tables", "current_message", "default_backoff",
            "encode_payload", "enqueue", "migrate", "outbox_model", "schema_version", "uuid7",
        ]
    )  # fmt: skip
    for name in sagaguard.idempotency.outbox.__all__:
        assert getattr(sagaguard.idempotency.outbox, name) is not None


class _Counter:
    """Stands in for an OpenTelemetry counter (the global meter provider is not ours to set)."""

    def __init__(self) -> None:
        self.added: list[tuple[int, dict[str, str]]] = []

    def add(self, amount: int, attributes: dict[str, str]) -> None:
        self.added.append((amount, dict(attributes)))

    def total(self, table: str) -> int:
        return sum(amount for amount, attrs in self.added if attrs.get("sagaguard.outbox.table") == table)


def test_metrics_count_deliveries_failures_and_dead_letters_and_gauge_the_depth(
    outbox_world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    from opentelemetry.metrics import CallbackOptions

    import sagaguard.idempotency.outbox.relay as relay_module
    from sagaguard.idempotency.outbox import telemetry

    counters = {name: _Counter() for name in ("delivered", "failed", "dead")}
    for name, counter in counters.items():
        monkeypatch.setattr(relay_module, f"{name}_counter", counter)
    world = outbox_world
    world.outbox.register("ok", lambda m: None)
    world.outbox.register("bad", lambda m: (_ for _ in ()).throw(RuntimeError("down")))
    with Session(world.engine) as session:
        world.outbox.enqueue(session, "ok", {})
        world.outbox.enqueue(session, "bad", {}, max_attempts=1)
        world.outbox.enqueue(session, "bad", {}, max_attempts=5)
        session.commit()
    relay = world.relay(status_every=0.001)
    relay.run(until_idle=True)
    relay.run(until_idle=True)  # its maintenance reads the status again: one message backing off
    assert {name: c.total(world.table) for name, c in counters.items()} == {
        "delivered": 1,
        "failed": 1,
        "dead": 1,
    }
    gauges = {}
    for index, name in ((0, "depth"), (1, "oldest_age")):
        observed = [
            o
            for o in telemetry._observe(index)(CallbackOptions())
            if o.attributes == {"sagaguard.outbox.table": world.table}
        ]
        [gauges[name]] = [o.value for o in observed]
    assert gauges["depth"] == 1 and gauges["oldest_age"] >= 0
    instruments = (telemetry.delivered_counter, telemetry.failed_counter, telemetry.dead_counter)
    assert [getattr(i, "name", None) or getattr(i, "_name", None) for i in instruments] == [
        "sagaguard.outbox.delivered",
        "sagaguard.outbox.failed",
        "sagaguard.outbox.dead",
    ]
