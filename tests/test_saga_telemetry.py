"""OpenTelemetry for sagas: a span per run, step and compensation; the compensation is a child of the
saga span and links to the span of the step it undoes, through the journal, even after a crash.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import tenacity
from _guardutil import span_exporter
from conftest import FakeClock

from sagaguard.idempotency import Guard
from sagaguard.idempotency.effect import Retry
from sagaguard.idempotency.stores.memory import MemoryStore
from sagaguard.saga import MemoryJournal, Saga, SagaRunner, SagaState, StepContext, recover
from sagaguard.saga import telemetry as saga_telemetry
from sagaguard.saga.journals.sql import SqlJournal

pytestmark = pytest.mark.timeout(60)

ONCE = Retry(stop=tenacity.stop_after_attempt(1), wait=tenacity.wait_none())
SECRET = "card-4242-secret"


@dataclass
class Order:
    card: str
    amount: int


class Crash(BaseException):
    """The process dies here."""


class Counter:
    def __init__(self) -> None:
        self.added: list[dict[str, Any]] = []

    def add(self, amount: int, attributes: dict[str, Any] | None = None) -> None:
        self.added.append(dict(attributes or {}))


@pytest.fixture
def exporter() -> Iterator[Any]:
    found = span_exporter()
    if found is None:
        pytest.skip("a non-SDK tracer provider is installed")
    found.clear()
    yield found
    found.clear()


@pytest.fixture
def counters(monkeypatch: pytest.MonkeyPatch) -> tuple[Counter, Counter]:
    sagas, compensations = Counter(), Counter()
    monkeypatch.setattr(saga_telemetry, "saga_counter", sagas)
    monkeypatch.setattr(saga_telemetry, "compensation_counter", compensations)
    return sagas, compensations


def build(name: str, behaviour: dict[str, Any]) -> Saga[Order]:
    """charge_card -> reserve_seat -> book_hotel (pivot); ``behaviour['hotel']``: ok, fail or crash."""
    trip: Saga[Order] = Saga(name, input=Order)

    def refund(ctx: StepContext, order: Order, charged: int | None) -> None:
        behaviour.setdefault("undone", []).append("refund")

    @trip.step(compensate=refund, retry=ONCE)
    def charge_card(ctx: StepContext, order: Order) -> int:
        return order.amount

    def release(ctx: StepContext, order: Order, seat: str | None) -> None:
        behaviour.setdefault("undone", []).append("release")
        if behaviour.get("release") == "fail":
            raise ConnectionError("seat desk down")

    @trip.step(compensate=release, retry=ONCE)
    def reserve_seat(ctx: StepContext, order: Order) -> str:
        return "12A"

    @trip.pivot(retry=ONCE, not_applied=(LookupError,))
    def book_hotel(ctx: StepContext, order: Order) -> str:
        if behaviour["hotel"] == "crash":
            raise Crash
        if behaviour["hotel"] == "fail":
            raise LookupError("hotel full")
        return "H-7"

    return trip


def _spans(exporter: Any) -> dict[str, Any]:
    return {span.name: span for span in exporter.get_finished_spans()}


def test_run_step_and_compensation_spans(exporter: Any, counters: tuple[Counter, Counter]) -> None:
    behaviour: dict[str, Any] = {"hotel": "fail"}
    trip = build("trip_tel", behaviour)
    journal = MemoryJournal()
    runner = SagaRunner(journal, Guard(MemoryStore()), renewer=False)
    outcome = runner.run(trip, "t-1", Order(SECRET, 420))
    assert outcome.state is SagaState.COMPENSATED

    spans = _spans(exporter)
    run = spans["saga trip_tel"]
    assert run.parent is None
    assert run.attributes["sagaguard.saga.state"] == "compensated"
    for step in ("charge_card", "reserve_seat", "book_hotel"):
        assert spans[f"saga.step {step}"].parent.span_id == run.context.span_id
    assert spans["saga.step book_hotel"].attributes["sagaguard.step.state"] == "failed"
    assert spans["saga.step charge_card"].attributes["sagaguard.step.state"] == "succeeded"
    for step in ("charge_card", "reserve_seat"):
        undo = spans[f"saga.compensate {step}"]
        assert undo.parent.span_id == run.context.span_id  # a child of the saga span
        (linked,) = undo.links
        assert linked.context.span_id == spans[f"saga.step {step}"].context.span_id  # linked to its step
        assert linked.context.trace_id == spans[f"saga.step {step}"].context.trace_id
        assert undo.attributes["sagaguard.compensation.result"] == "succeeded"

    # The step's span context is what the journal keeps.
    snapshot = journal.load("t-1")
    assert snapshot is not None
    charge = spans["saga.step charge_card"].context
    flags = int(charge.trace_flags)
    assert snapshot.steps[0].trace == f"00-{charge.trace_id:032x}-{charge.span_id:016x}-{flags:02x}"

    # No raw inputs or results on any span.
    for span in exporter.get_finished_spans():
        for value in (span.attributes or {}).values():
            assert SECRET not in str(value)
            assert value not in {"t-1", "12A"}

    sagas, compensations = counters
    assert sagas.added == [{"sagaguard.saga.name": "trip_tel", "sagaguard.saga.outcome": "compensated"}]
    assert [c["sagaguard.compensation.result"] for c in compensations.added] == ["succeeded", "succeeded"]


def test_failed_compensation_is_counted_and_marked(exporter: Any, counters: tuple[Counter, Counter]) -> None:
    behaviour: dict[str, Any] = {"hotel": "fail", "release": "fail"}
    trip = build("trip_tel_fail", behaviour)
    trip_retry = Retry(stop=tenacity.stop_after_attempt(1), wait=tenacity.wait_none())
    trip.steps[1].compensation_retry = trip_retry
    runner = SagaRunner(MemoryJournal(), Guard(MemoryStore()), renewer=False, sleep=lambda _s: None)
    assert runner.run(trip, "t-2", Order(SECRET, 1)).state is SagaState.NEEDS_ATTENTION
    undo = _spans(exporter)["saga.compensate reserve_seat"]
    assert undo.attributes["sagaguard.compensation.result"] == "failed"
    assert undo.attributes["error.type"] == "ConnectionError"
    sagas, compensations = counters
    assert sagas.added[-1]["sagaguard.saga.outcome"] == "needs_attention"
    assert compensations.added[-1]["sagaguard.compensation.result"] == "failed"


def test_compensation_after_a_crash_links_to_the_original_step_span(
    exporter: Any, clock: FakeClock, tmp_path: Path
) -> None:
    url = f"sqlite:///{tmp_path}/tel.db"
    behaviour: dict[str, Any] = {"hotel": "crash"}
    store = MemoryStore(clock=clock)
    first = SqlJournal(url, clock=clock)
    runner = SagaRunner(first, Guard(store), lease=30, renewer=False)
    with pytest.raises(Crash):
        runner.run(build("trip_crash", behaviour), "t-3", Order(SECRET, 7))
    before = _spans(exporter)
    original = {step: before[f"saga.step {step}"].context for step in ("charge_card", "reserve_seat")}
    first.close()
    exporter.clear()

    # Another "process": a new journal object and runner; only the journal remembers the spans.
    behaviour["hotel"] = "fail"
    clock.advance(31)
    second = SqlJournal(url, clock=clock)
    try:
        report = recover(second, Guard(store), build("trip_crash", behaviour), lease=30)
    finally:
        second.close()
    assert report.outcomes["t-3"].state is SagaState.COMPENSATED
    after = _spans(exporter)
    run = after["saga trip_crash"]
    for step, context in original.items():
        undo = after[f"saga.compensate {step}"]
        assert undo.parent.span_id == run.context.span_id
        (linked,) = undo.links
        assert (linked.context.trace_id, linked.context.span_id) == (context.trace_id, context.span_id)
        assert linked.context.trace_id != run.context.trace_id  # a new trace, linked to the old one
    assert after["saga.step book_hotel"].attributes["sagaguard.step.resumed"] is True
