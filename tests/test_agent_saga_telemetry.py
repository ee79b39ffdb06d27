"""Agent sagas' telemetry: each undo's ``saga.compensate`` span links to the ``saga.step`` span of
the tool call it undoes, in the same process and in the worker's, through the journal row."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _guardutil import span_exporter
from conftest import FakeClock

from sagaguard.idempotency import Guard
from sagaguard.idempotency.stores.sql import SqlStore
from sagaguard.saga import SagaRegistry, SagaState, cancel, recover
from sagaguard.saga.agent import AgentRunner, AgentSaga, UndoRegistry
from sagaguard.saga.journals.sql import SqlJournal

pytestmark = pytest.mark.timeout(60)

LEASE = 30.0


class Crash(BaseException):
    """The process dies here."""


@pytest.fixture
def exporter() -> Iterator[Any]:
    found = span_exporter()
    if found is None:
        pytest.skip("a non-SDK tracer provider is installed")
    found.clear()
    yield found
    found.clear()


def _agent(undone: list[str]) -> AgentSaga:
    undos = UndoRegistry()

    @undos.register
    def cancel_booking(arguments: Any, result: Any) -> None:
        undone.append(arguments["hotel"])

    return AgentSaga("trip_agent", undos)


def _links(exporter: Any) -> tuple[dict[str, Any], list[Any]]:
    spans = exporter.get_finished_spans()
    steps = {s.name: s for s in spans if s.name.startswith("saga.step tool.")}
    undos = [s for s in spans if s.name.startswith("saga.compensate ")]
    return steps, undos


def test_an_undo_links_to_its_tool_call_in_process(exporter: Any) -> None:
    from sagaguard.idempotency.stores.memory import MemoryStore
    from sagaguard.saga import MemoryJournal

    undone: list[str] = []
    agent = _agent(undone)
    runner = AgentRunner(MemoryJournal(), Guard(MemoryStore()), sleep=lambda _s: None)
    try:
        with pytest.raises(RuntimeError), runner.run(agent, "thread-1") as run:
            for hotel in ("ritz", "savoy"):
                run.call("book_hotel", functools.partial(str, hotel), {"hotel": hotel}, undo="cancel_booking")
            raise RuntimeError("later tool failed")
    finally:
        runner.close()
    assert undone == ["savoy", "ritz"]
    steps, undos = _links(exporter)
    assert len(steps) == 2 and len(undos) == 2
    for undo in undos:
        (linked,) = undo.links
        step = steps[undo.name.replace("saga.compensate ", "saga.step ")]
        assert (linked.context.trace_id, linked.context.span_id) == (
            step.context.trace_id,
            step.context.span_id,
        )


def test_an_undo_in_the_worker_links_to_the_tool_call_of_the_dead_process(
    exporter: Any, tmp_path: Path, clock: FakeClock
) -> None:
    url = f"sqlite:///{tmp_path}/agent.db"
    undone: list[str] = []
    agent = _agent(undone)
    journal = SqlJournal(url, clock=clock)
    runner = AgentRunner(journal, Guard(SqlStore(url, clock=clock)), lease=LEASE)
    try:
        with pytest.raises(Crash), runner.run(agent, "thread-1") as run:
            run.call("book_hotel", lambda: "bk", {"hotel": "ritz"}, undo="cancel_booking")
            raise Crash
    finally:
        runner.close()
    steps, _ = _links(exporter)
    (step,) = steps.values()
    exporter.clear()
    # Another "process": its own journal and store objects, only the rows in common.
    worker_journal = SqlJournal(url, clock=clock)
    cancel(worker_journal, "thread-1")
    clock.advance(LEASE + 1)
    report = recover(worker_journal, Guard(SqlStore(url, clock=clock)), SagaRegistry(agent))
    assert report.outcomes["thread-1"].state is SagaState.COMPENSATED
    assert undone == ["ritz"]
    _, undos = _links(exporter)
    (undo,) = undos
    (linked,) = undo.links
    assert (linked.context.trace_id, linked.context.span_id) == (step.context.trace_id, step.context.span_id)
