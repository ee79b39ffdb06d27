"""The web console's routes through Starlette's TestClient: pages and their JSON, the token, the
CSRF refusal, read-only mode, payloads hidden by default, and actions that go through the shared
operator API into the audit trail."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("starlette", reason="the console needs the ui extra")
from _consolekit import Psp, populate
from conftest import FakeClock
from starlette.testclient import TestClient

from sagaguard.idempotency.audit import AuditFilter, MemoryAudit, Outcome
from sagaguard.idempotency.records import State
from sagaguard.idempotency.stores import MemoryStore
from sagaguard.saga import MemoryJournal, SagaState
from sagaguard.saga.console.app import create_app
from sagaguard.saga.console.data import saga_page
from sagaguard.saga.console.settings import ConsoleSettings

pytestmark = pytest.mark.timeout(60)

TOKEN = "t0k3n-for-the-console-tests"
SHOWN_URL = "postgresql://ops:hunter2@db.internal/ledger"
JSON = {"accept": "application/json"}
BEARER = {"authorization": f"Bearer {TOKEN}", "x-sagaguard-actor": "script-7", **JSON}


@dataclass
class World:
    store: MemoryStore
    journal: MemoryJournal
    audit: MemoryAudit
    ids: dict[str, str]
    clock: FakeClock

    def client(self, **settings: object) -> TestClient:
        app = create_app(
            ConsoleSettings(SHOWN_URL, **settings),  # type: ignore[arg-type]
            store=self.store, journal=self.journal, audit=self.audit,
        )  # fmt: skip
        return TestClient(app, follow_redirects=False)


@pytest.fixture
def world(clock: FakeClock) -> Iterator[World]:
    store, journal = MemoryStore(clock=clock), MemoryJournal(clock=clock)
    yield World(store, journal, MemoryAudit(), populate(store, journal, Psp()), clock)


def _csrf(html: str) -> str:
    found = re.search(r'name="csrf" value="([^"]+)"', html)
    assert found, "every form carries the CSRF token"
    return found.group(1)


def _login(client: TestClient, name: str = "ana") -> str:
    csrf = _csrf(client.get("/login").text)
    response = client.post("/login", data={"csrf": csrf, "name": name, "token": TOKEN})
    assert response.status_code == 303, response.text
    return _csrf(client.get("/").text)


def test_home_counts_each_list_with_its_oldest_and_masks_the_url(world: World) -> None:
    client = world.client(token=TOKEN)
    page = client.get("/")
    assert page.status_code == 200
    assert "hunter2" not in page.text and "ops:***@db.internal" in page.text
    assert 'http-equiv="refresh"' in page.text
    data = client.get("/", headers=JSON).json()
    effects = {c["name"]: c for c in data["effects"]}
    sagas = {c["name"]: c for c in data["sagas"]}
    # The parked saga's refund failed ambiguously: it is in doubt too, and older than the charge.
    assert effects["in_doubt"]["count"] == 2 and effects["in_doubt"]["oldest_id"] != world.ids["doubt"]
    refund = world.store.get(effects["in_doubt"]["oldest_id"])
    assert refund is not None and refund.scope.startswith("refund-1/charge/")
    assert sagas["waiting"]["count"] == 2 and sagas["waiting"]["oldest_id"] == "trip-1"
    assert sagas["needs_attention"]["count"] == 1 and sagas["running_past_lease"]["count"] == 0
    assert "hunter2" not in str(data)


def test_lists_filter_and_page(world: World) -> None:
    client = world.client()
    waiting = client.get("/sagas?view=waiting", headers=JSON).json()
    assert [s["saga_id"] for s in waiting["items"]] == ["trip-1", "trip-2"]
    assert waiting["items"][0]["input"] is None and waiting["items"][0]["payloads_hidden"]
    assert [
        s["saga_id"] for s in client.get("/sagas?view=waiting&prefix=trip-2", headers=JSON).json()["items"]
    ] == ["trip-2"]
    assert client.get("/sagas?view=waiting&name=refund", headers=JSON).json()["items"] == []
    assert "trip-2" in client.get("/sagas?view=waiting&prefix=trip").text
    first = saga_page(world.journal, "waiting", size=1)
    assert [r.saga_id for r in first.items] == ["trip-1"] and first.next_after == "trip-1"
    second = saga_page(world.journal, "waiting", size=1, after=first.next_after)
    assert [r.saga_id for r in second.items] == ["trip-2"] and second.next_after is None
    effects = client.get("/effects?view=in_doubt&prefix=stripe.", headers=JSON).json()["items"]
    assert [e["key"] for e in effects] == [world.ids["doubt"]] and effects[0]["needs_resolution"]
    assert client.get("/effects?view=in_doubt&prefix=nope", headers=JSON).json()["items"] == []
    assert client.get("/sagas?view=bogus").status_code == 400


def test_the_saga_page_shows_steps_timeline_and_hides_payloads(world: World) -> None:
    client = world.client()
    page = client.get("/sagas/refund-1")
    assert page.status_code == 200
    assert "needs_attention" in page.text and "compensation_failed" in page.text
    assert "psp unreachable" in page.text  # the cause, in the timeline
    assert "ch_3" not in page.text and "--show-payloads" in page.text  # the step's result is hidden
    data = client.get("/sagas/refund-1", headers=JSON).json()
    assert [s["name"] for s in data["steps"]] == ["charge", "ship"]
    assert "result" not in data["steps"][0] and data["input"] is None
    assert any(e["what"] == "compensation failed" for e in data["timeline"])
    shown = world.client(show_payloads=True).get("/sagas/refund-1", headers=JSON).json()
    assert shown["steps"][0]["result"] == '"ch_3"' and '"3"' in shown["input"]
    assert client.get("/sagas/nope").status_code == 404


def test_read_only_refuses_every_action(world: World) -> None:
    for client in (world.client(), world.client(token=TOKEN, read_only=True)):
        confirm = client.get(f"/confirm/saga.cancel?target={world.ids['waiting']}")
        assert "read-only" in confirm.text
        response = client.post("/act/saga.cancel", data={"csrf": _csrf(confirm.text), "target": "trip-1"})
        assert response.status_code == 403 and "read-only" in response.text
        response = client.post("/act/saga.cancel", json={"target": "trip-1"}, headers=BEARER)
        assert response.status_code == 403 and response.json()["error"] == "Refused"
    assert world.journal.load("trip-1").saga.cancel_requested is False  # type: ignore[union-attr]
    assert world.audit.list() == []


def test_an_action_needs_the_token_and_the_csrf_token(world: World) -> None:
    client = world.client(token=TOKEN)
    csrf = _csrf(client.get("/login").text)
    # Not logged in: refused.
    response = client.post("/act/saga.cancel", data={"csrf": csrf, "target": "trip-1"})
    assert response.status_code == 401
    # A wrong token at login, then a wrong bearer token.
    assert client.post("/login", data={"csrf": csrf, "name": "eve", "token": "x" * 20}).status_code == 403
    wrong = {**BEARER, "authorization": "Bearer nope"}
    assert client.post("/act/saga.cancel", json={"target": "trip-1"}, headers=wrong).status_code == 403
    csrf = _login(client)
    # Logged in, but the form has no CSRF token, or another one: refused.
    response = client.post("/act/saga.cancel", data={"target": "trip-1"})
    assert response.status_code == 403 and "csrf" in response.text
    response = client.post("/act/saga.cancel", data={"target": "trip-1", "csrf": "forged"})
    assert response.status_code == 403
    assert world.journal.load("trip-1").saga.cancel_requested is False  # type: ignore[union-attr]
    # With it: done, and audited under the logged-in name.
    response = client.post("/act/saga.cancel", data={"target": "trip-1", "csrf": csrf, "reason": "withdrawn"})
    assert response.status_code == 303 and response.headers["location"] == "/sagas/trip-1"
    assert world.journal.load("trip-1").saga.cancel_requested is True  # type: ignore[union-attr]
    (entry,) = world.audit.list()
    assert (entry.actor, entry.source, entry.action, entry.args) == (
        "ana", "console", "saga.cancel", {"reason": "withdrawn"},
    )  # fmt: skip
    page = client.get("/sagas/trip-1")
    assert "cancel requested" in page.text and "saga.cancel" in page.text  # the audit on its page
    # ...and in its timeline, among the saga's own events.
    timeline = client.get("/sagas/trip-1", headers=JSON).json()["timeline"]
    assert [e["what"] for e in timeline if e["operator"]] == ["saga.cancel ok"]
    assert "operator ana (console)" in page.text
    assert "Cancel trip-1: requested" in page.text  # the flash


def test_the_json_api_acts_with_the_bearer_token(world: World) -> None:
    client = world.client(token=TOKEN)
    doubt = world.ids["doubt"]
    response = client.post(
        "/act/effect.resolve",
        json={"target": doubt, "verdict": "applied", "result": {"id": "pi_9"}},
        headers=BEARER,
    )
    assert response.status_code == 200, response.text
    assert response.json() == {"ok": True, "action": "effect.resolve", "target": doubt, "outcome": "applied"}
    record = world.store.get(doubt)
    assert record is not None and record.state is State.SUCCEEDED and record.result == '{"id":"pi_9"}'
    again = client.post(
        "/act/effect.resolve", json={"target": doubt, "verdict": "not_applied"}, headers=BEARER
    )
    assert again.status_code == 409 and again.json()["error"] == "NothingToResolve"
    # The parked saga: retry is refused once it is no longer parked; skip before that.
    skip = client.post("/act/saga.skip", json={"target": "refund-1", "step": "charge"}, headers=BEARER)
    assert skip.status_code == 200 and skip.json()["outcome"] == "compensating"
    retry = client.post("/act/saga.retry", json={"target": "refund-1"}, headers=BEARER)
    assert retry.status_code == 409 and retry.json()["error"] == "NotParked"
    reject = client.post("/act/saga.reject", json={"target": "trip-2"}, headers=BEARER)
    assert reject.json()["outcome"] == "requested"
    signal = client.post(
        "/act/saga.signal", json={"target": "trip-1", "name": "approval", "payload": {}}, headers=BEARER
    )
    assert signal.json()["outcome"] == "delivered"
    assert (
        client.post("/act/effect.resolve", json={"target": doubt, "verdict": "?"}, headers=BEARER).status_code
        == 400
    )
    assert client.post("/act/nope", json={"target": doubt}, headers=BEARER).status_code == 404
    assert client.post("/act/saga.cancel", json={"target": "ghost"}, headers=BEARER).status_code == 404
    entries = world.audit.list(AuditFilter(actor="script-7"))
    assert [(e.action, e.outcome) for e in reversed(entries)] == [
        ("effect.resolve", Outcome.OK), ("effect.resolve", Outcome.REFUSED), ("saga.skip", Outcome.OK),
        ("saga.retry", Outcome.REFUSED), ("saga.reject", Outcome.OK), ("saga.signal", Outcome.OK),
        ("saga.cancel", Outcome.REFUSED),
    ]  # fmt: skip
    assert "pi_9" not in str([e.to_json() for e in entries])
    assert world.journal.load("trip-2").saga.state is SagaState.WAITING  # type: ignore[union-attr]
    audit = client.get("/audit?actor=script-7", headers=JSON).json()["items"]
    assert len(audit) == 7 and audit[0]["time"].endswith("Z")


def test_settings_refuse_bad_input() -> None:
    from sagaguard.idempotency.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match="16"):
        ConsoleSettings("memory://", token="short")
    with pytest.raises(ConfigurationError, match="trace_id"):
        ConsoleSettings("memory://", trace_url="http://jaeger/trace/")
    settings = ConsoleSettings("memory://", trace_url="http://jaeger:16686/trace/{trace_id}")
    assert settings.trace_link("abc") == "http://jaeger:16686/trace/abc" and settings.trace_link(None) is None


def test_ui_command_refuses_a_ledger_that_does_not_exist(
    tmp_path: object, capsys: pytest.CaptureFixture[str]
) -> None:
    from sagaguard.idempotency.cli import main

    assert main(["ui", "--store", f"sqlite:///{tmp_path}/typo.db", "--port", "1"]) == 1
    assert "does not exist" in capsys.readouterr().err
    assert main(["ui", "--store", "memory://", "--token", "short"]) == 2
    assert "16 characters" in capsys.readouterr().err


def test_the_confirmation_page_posts_to_its_action(world: World) -> None:
    page = world.client(token=TOKEN).get("/confirm/saga.retry?target=refund-1&fresh=true")
    assert 'action="/act/saga.retry"' in page.text and 'value="refund-1"' in page.text
    assert "checked" in page.text  # fresh, as the link asked


def test_a_bulk_action_previews_its_count_and_acts_once_per_action_id(world: World) -> None:
    client = world.client(token=TOKEN)
    csrf = _login(client)
    page = client.get("/bulk/saga.cancel?view=waiting&prefix=trip-")
    assert page.status_code == 200 and "<strong>2</strong> items" in page.text
    action_id = re.search(r'name="action_id" value="([0-9a-f]{32})"', page.text)
    assert action_id
    # A saga that starts waiting after the preview is not touched: the form carries the ids.
    form = {"csrf": csrf, "action_id": action_id.group(1), "targets": ["trip-1", "trip-2"], "reason": "bulk"}
    response = client.post("/bulk/saga.cancel", data=form)
    assert response.status_code == 303
    assert "2 done, 0 refused" in client.get(response.headers["location"]).text
    for saga_id in ("trip-1", "trip-2"):
        assert world.journal.load(saga_id).saga.cancel_requested is True  # type: ignore[union-attr]
    # The same form again (a reload, a double click): nothing is done again.
    again = client.post("/bulk/saga.cancel", data=form)
    assert "already done, nothing done again" in client.get(again.headers["location"]).text
    cancels = world.audit.list(AuditFilter(action="saga.cancel"))
    assert len(cancels) == 2 and {e.args["reason"] for e in cancels} == {"bulk"}
    (bulk,) = world.audit.list(AuditFilter(action="bulk.saga.cancel"))
    assert (bulk.target, bulk.args, bulk.actor) == (action_id.group(1), {"count": 2}, "ana")


def test_the_bulk_json_api_and_its_refusals(world: World) -> None:
    client = world.client(token=TOKEN)
    preview = client.get("/bulk/effect.resolve?view=in_doubt&prefix=stripe.", headers=JSON).json()
    assert preview["count"] == 1 and preview["targets"] == [world.ids["doubt"]]
    body = {
        "action_id": preview["action_id"],
        "targets": [*preview["targets"], "f" * 64],
        "verdict": "applied",
    }
    done = client.post("/bulk/effect.resolve", json=body, headers=BEARER).json()
    # Bulk resolves are "not applied" whatever is sent; an unknown key is refused, the rest goes on.
    assert (done["done"], done["refused"], done["refusals"]) == (1, 1, {"f" * 64: "RecordNotFound"})
    assert world.store.get(world.ids["doubt"]) is None
    assert client.post("/bulk/effect.resolve", json=body, headers=BEARER).json()["repeated"] is True
    assert (
        client.post("/bulk/effect.resolve", json={**body, "action_id": "x"}, headers=BEARER).status_code
        == 400
    )
    assert client.post("/bulk/saga.skip", json=body, headers=BEARER).status_code == 400  # no bulk form
    assert client.get("/bulk/saga.retry?view=nope", headers=JSON).status_code == 400
    read_only = world.client()
    assert read_only.post("/bulk/saga.retry", json=body, headers=BEARER).status_code == 403


def test_the_outbox_page_replays_and_discards_dead_letters(world: World, tmp_path: Path) -> None:
    from sqlalchemy.orm import Session

    from sagaguard.idempotency.outbox import Outbox, Relay
    from sagaguard.idempotency.outbox.control import OutboxControl
    from sagaguard.idempotency.outbox.model import migrate
    from sagaguard.idempotency.stores.sql import make_engine

    engine = make_engine(f"sqlite:///{tmp_path}/outbox.db")
    migrate(engine)
    outbox = Outbox(max_attempts=1)
    delivered: list[Any] = []

    def send(message: Any) -> None:
        if message.payload["n"] < 2:
            raise RuntimeError("smtp down")
        delivered.append(message.payload)

    outbox.register("email", send)
    with Session(engine) as session:
        ids = [outbox.enqueue(session, "email", {"n": n}, aggregate_id=f"user-{n}") for n in range(3)]
        session.commit()
    relay = Relay(outbox, engine)
    try:
        relay.run_once()
        app = create_app(
            ConsoleSettings(SHOWN_URL, token=TOKEN), store=world.store, journal=world.journal,
            audit=world.audit, outbox=OutboxControl(engine),
        )  # fmt: skip
        client = TestClient(app, follow_redirects=False)
        home = client.get("/", headers=JSON).json()
        assert home["outbox"]["dead"] == 2
        page = client.get("/outbox")
        assert ids[0] in page.text and "RuntimeError: smtp down" in page.text and "Replay…" in page.text
        letters = client.get("/outbox", headers=JSON).json()["dead_letters"]
        assert {d["id"] for d in letters} == {ids[0], ids[1]}
        assert client.post("/act/outbox.discard", json={"target": ids[1]}, headers=BEARER).json()["ok"]
        assert client.post("/act/outbox.discard", json={"target": ids[1]}, headers=BEARER).status_code == 409
        preview = client.get("/bulk/outbox.replay?view=dead", headers=JSON).json()
        assert preview["targets"] == [ids[0]]
        body = {"action_id": preview["action_id"], "targets": preview["targets"]}
        assert client.post("/bulk/outbox.replay", json=body, headers=BEARER).json()["done"] == 1
        assert client.get("/", headers=JSON).json()["outbox"]["dead"] == 0
        entries = [
            (e.action, e.target, e.outcome) for e in reversed(world.audit.list(AuditFilter(action="outbox.")))
        ]
        assert entries == [
            ("outbox.discard", ids[1], Outcome.OK), ("outbox.discard", ids[1], Outcome.REFUSED),
            ("outbox.replay", ids[0], Outcome.OK),
        ]  # fmt: skip
    finally:
        relay.close()
        engine.dispose()
    # A console without an outbox says so, and refuses its actions.
    assert "no outbox table" in world.client().get("/outbox").text
    refused = world.client(token=TOKEN).post("/act/outbox.replay", json={"target": ids[0]}, headers=BEARER)
    assert refused.status_code == 400


def test_lists_filter_by_age(world: World) -> None:
    client = world.client()
    assert client.get("/sagas?view=waiting&older=1h", headers=JSON).json()["items"] == []
    world.clock.advance(7200.0)
    older = client.get("/sagas?view=waiting&older=1h", headers=JSON).json()["items"]
    assert [s["saga_id"] for s in older] == ["trip-1", "trip-2"]
    assert client.get("/sagas?view=waiting&newer=90m", headers=JSON).json()["items"] == []
    effects = client.get("/effects?view=in_doubt&older=3600&newer=1d", headers=JSON).json()["items"]
    assert world.ids["doubt"] in [e["key"] for e in effects]
    page = client.get("/sagas?view=waiting&older=1h")
    assert 'value="1h"' in page.text
    assert client.get("/sagas?view=waiting&older=soon").status_code == 400
    assert client.get("/effects?view=in_doubt&newer=-5").status_code == 400


def test_trace_ids_link_to_the_trace_viewer(world: World) -> None:
    from _consolekit import Order, sagas
    from _guardutil import span_exporter

    from sagaguard.idempotency import Guard
    from sagaguard.saga import SagaRunner

    if span_exporter() is None:
        pytest.skip("another test set a non-SDK tracer provider")
    trip, _ = sagas(Psp())
    runner = SagaRunner(world.journal, Guard(world.store), lease=30, wait=0)
    try:
        runner.run(trip, "trip-traced", Order("9"))
    finally:
        runner.close()
    steps = world.client().get("/sagas/trip-traced", headers=JSON).json()["steps"]
    trace_id = steps[0]["trace_id"]
    assert trace_id and len(trace_id) == 32
    page = world.client(trace_url="http://traces.example/trace/{trace_id}").get("/sagas/trip-traced")
    assert f'href="http://traces.example/trace/{trace_id}"' in page.text
    assert "traces.example" not in world.client().get("/sagas/trip-traced").text


def test_the_effects_held_by_a_dead_process(world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    from _holders import dead_holder

    from sagaguard.idempotency import holder
    from sagaguard.idempotency.keys import EffectIdentity

    gone = dead_holder()  # a real process on this host, SIGKILLed and reaped

    def claim(scope: str, who: str | None) -> str:
        identity = EffectIdentity.of("default", scope, "mail.send", 0)
        with monkeypatch.context() as patched:
            if who is not None:
                patched.setattr(holder, "current", lambda: who)
            return world.store.claim(identity, "fp", 300.0).record.key

    orphan, alive = claim("held-by-the-dead", gone), claim("held-by-me", None)
    client = world.client()
    everything = client.get("/effects?view=in_progress", headers=JSON).json()["items"]
    assert {orphan, alive} <= {e["key"] for e in everything}
    dead = client.get("/effects?view=in_progress&holder=dead", headers=JSON).json()["items"]
    assert [(e["key"], e["holder"], e["holder_dead"]) for e in dead] == [(orphan, gone, True)]
    assert dead[0]["needs_resolution"]  # an operator settles it without forcing
    page = client.get("/effects?view=in_progress&holder=dead")
    assert orphan[:16] in page.text and alive[:16] not in page.text
    assert 'data-holder="dead"' in page.text and 'value="dead" checked' in page.text
    assert client.get("/effects?view=in_progress&holder=alive").status_code == 400
    world.clock.advance(301.0)  # the lease ran out: nobody holds it any more
    assert client.get("/effects?view=in_progress&holder=dead", headers=JSON).json()["items"] == []


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_the_outbox_lists_the_messages_blocked_behind_a_dead_letter(
    world: World, tmp_path: Path, backend: str
) -> None:
    from sqlalchemy.orm import Session
    from test_schema_upgrade import fresh_database

    from sagaguard.idempotency.outbox import Outbox, Relay
    from sagaguard.idempotency.outbox.control import OutboxControl
    from sagaguard.idempotency.outbox.model import migrate
    from sagaguard.idempotency.stores.sql import make_engine

    database = fresh_database(backend, tmp_path, fixture=False)
    engine = make_engine(next(database))
    migrate(engine)
    outbox = Outbox(max_attempts=1)
    outbox.register("email", lambda message: None)
    outbox.register("poison", lambda message: (_ for _ in ()).throw(RuntimeError("bad address")))
    with Session(engine) as session:
        user = {"aggregate_type": "user"}
        poison = outbox.enqueue(session, "poison", {}, aggregate_id="u1", **user)
        later = [outbox.enqueue(session, "email", {"n": n}, aggregate_id="u1", **user) for n in range(2)]
        other = outbox.enqueue(session, "email", {"n": 9}, aggregate_id="u2", **user)
        session.commit()
    relay = Relay(outbox, engine)
    try:
        relay.run_once()
        relay.run_once()  # the dead letter's aggregate stays blocked; the other one drains
        app = create_app(
            ConsoleSettings(SHOWN_URL, token=TOKEN), store=world.store, journal=world.journal,
            audit=world.audit, outbox=OutboxControl(engine),
        )  # fmt: skip
        client = TestClient(app, follow_redirects=False)
        data = client.get("/outbox", headers=JSON).json()
        blocked = [(b["id"], b["aggregateid"], b["blocked_by"]) for b in data["blocked_messages"]]
        assert blocked == [(later[0], "u1", poison), (later[1], "u1", poison)]
        assert other not in str(blocked) and data["status"]["blocked"] == 2
        page = client.get("/outbox")
        assert "Blocked behind a dead letter" in page.text and later[1] in page.text
        paged = OutboxControl(engine).blocked_messages(limit=1, after=later[0])
        assert [b.id for b in paged] == [later[1]]
        assert client.get("/outbox?blocked_after=nope", headers=JSON).status_code == 400
        assert client.post("/act/outbox.discard", json={"target": poison}, headers=BEARER).json()["ok"]
        assert client.get("/outbox", headers=JSON).json()["blocked_messages"] == []
    finally:
        relay.close()
        engine.dispose()
        database.close()


def test_two_consoles_racing_on_one_bulk_action_id_act_once(world: World, tmp_path: Path) -> None:
    """Two console processes share the ledger, not a lock: the action id is claimed in the audit
    table (each console with its own connections), so one acts and the other finds it done."""
    import threading

    from sagaguard.idempotency.audit.sql import SqlAudit
    from sagaguard.saga.console.actions import Context
    from sagaguard.saga.console.bulk import BulkResult, new_action_id, run_bulk

    url = f"sqlite:///{tmp_path}/ledger.db"
    logs = [SqlAudit(url), SqlAudit(url, create=False)]
    action_id, barrier = new_action_id(), threading.Barrier(2)
    results: list[BulkResult] = []

    def console(log: SqlAudit, actor: str) -> None:
        ctx = Context(world.store, world.journal, log, actor)
        barrier.wait()
        results.append(run_bulk(ctx, "saga.cancel", action_id, ["trip-1", "trip-2"], {"reason": "race"}))

    pairs = zip(logs, ("ana", "bob"), strict=True)
    threads = [threading.Thread(target=console, args=pair) for pair in pairs]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert sorted((r.repeated, len(r.outcomes)) for r in results) == [(False, 2), (True, 0)]
        assert len(logs[0].list(AuditFilter(action="saga.cancel"))) == 2  # each saga cancelled once
    finally:
        for log in logs:
            log.close()
