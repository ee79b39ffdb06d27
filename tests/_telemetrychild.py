"""Run one of everything sagaguard traces, in a fresh process with the OTel SDK's in-memory exporter and
metric reader (the global providers can be set once per process), and print what was emitted as JSON.

Used by tests/test_telemetry_docs.py: a guarded call (executed, replayed, failed), an agent's tool
call, a saga whose failed step is compensated (one compensation fails), an outbox enqueue (and a
deduplicated one) with a relay delivering, retrying and dead-lettering, a model call's metrics; then
the same with every identifier opted in.
"""

from __future__ import annotations

import contextlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa
import tenacity
from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from sqlalchemy.orm import Session

from sagaguard.connectors.telemetry import record_llm_call
from sagaguard.idempotency import Guard, MemoryStore, Retry, scope
from sagaguard.idempotency.outbox import Outbox, create_tables
from sagaguard.idempotency.telemetry import TOOL_CALL_ID, business_key, expose_identifiers
from sagaguard.saga import MemoryJournal, Saga, SagaRunner, StepContext

ONCE = Retry(stop=tenacity.stop_after_attempt(1), wait=tenacity.wait_none())


class Declined(Exception):
    """A permanent failure of the card."""


@dataclass
class Order:
    amount: int


def guarded(guard: Guard, tag: str) -> None:
    @guard.effect("pay.charge", permanent=(Declined,))
    def charge(amount: int) -> int:
        if amount < 0:
            raise Declined("declined")
        return amount

    with scope(f"order-{tag}"):
        charge(1)
    with scope(f"order-{tag}"):
        charge(1)  # replayed
    with scope(f"declined-{tag}"):
        with contextlib.suppress(Declined):
            charge(-1)
    token = TOOL_CALL_ID.set("call_1")
    try:
        with scope(f"agent-{tag}"):
            guard.run("tool.search", lambda: "found", tool=True)  # an adapter's tool call
    finally:
        TOOL_CALL_ID.reset(token)


def saga_run(guard: Guard, tag: str) -> None:
    trip: Saga[Order] = Saga(f"trip_{tag}", input=Order)

    def refund(ctx: StepContext, order: Order, charged: int | None) -> None:
        guard.run("stripe.refund", lambda: None)

    @trip.step(compensate=refund, retry=ONCE)
    def charge_card(ctx: StepContext, order: Order) -> int:
        return order.amount

    def release(ctx: StepContext, order: Order, seat: str | None) -> None:
        raise ConnectionError("seat desk down")

    @trip.step(compensate=release, retry=ONCE, compensation_retry=ONCE)
    def reserve_seat(ctx: StepContext, order: Order) -> str:
        return "12A"

    @trip.pivot(retry=ONCE, not_applied=(LookupError,))
    def book_hotel(ctx: StepContext, order: Order) -> str:
        raise LookupError("sold out")

    runner = SagaRunner(MemoryJournal(), guard, renewer=False, sleep=lambda _s: None)
    runner.run(trip, f"trip-{tag}", Order(5))


def outbox_run(tmp: Path, tag: str) -> None:
    engine = sa.create_engine(f"sqlite:///{tmp / f'outbox-{tag}.db'}")
    create_tables(engine)
    outbox = Outbox()
    outbox.register("email.ok", lambda m: None)

    def broken(message: Any) -> None:
        raise TimeoutError("smtp")

    outbox.register("email.broken", broken)
    with Session(engine) as session:
        outbox.enqueue(session, "email.ok", {"n": 1}, aggregate_id=f"a-{tag}", dedup_key=f"d-{tag}")
        outbox.enqueue(session, "email.ok", {"n": 1}, aggregate_id=f"a-{tag}", dedup_key=f"d-{tag}")
        outbox.enqueue(session, "email.broken", {}, aggregate_id=f"b-{tag}", max_attempts=2)
        outbox.enqueue(session, "email.broken", {}, aggregate_id=f"c-{tag}", max_attempts=1)
        session.commit()
    relay = outbox.relay(engine)
    relay.run_once()
    relay._maintain()  # what a running relay does now and then: feed the depth gauges
    engine.dispose()


def main(tmp: Path) -> None:
    exporter = InMemorySpanExporter()
    tracing = TracerProvider()
    tracing.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(tracing)
    reader = InMemoryMetricReader()
    metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))

    guard = Guard(MemoryStore())
    split = 0  # spans before it: no identifier opted in; from it on, all three
    for tag, identifiers in (("plain", ()), ("ids", ("saga_id", "scope", "business_key"))):
        expose_identifiers(*identifiers)
        with business_key(f"order-{tag}"):
            guarded(guard, tag)
            saga_run(guard, tag)
            outbox_run(tmp, tag)
        split = split or len(exporter.get_finished_spans())
    record_llm_call("llm.plan", paid=True, input_tokens=3, output_tokens=2)

    spans = [
        {
            "name": s.name,
            "kind": s.kind.name,
            "attributes": sorted((s.attributes or {}).keys()),
            "error": s.status.status_code.name == "ERROR",
            "error_type": (s.attributes or {}).get("error.type"),
        }
        for s in exporter.get_finished_spans()
    ]
    points = []
    data = reader.get_metrics_data()
    for resource in data.resource_metrics if data else []:
        for scoped in resource.scope_metrics:
            for metric in scoped.metrics:
                for point in metric.data.data_points:
                    points.append({"name": metric.name, "attributes": sorted(point.attributes or {})})
    print(json.dumps({"spans": spans, "metrics": points, "split": split}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
