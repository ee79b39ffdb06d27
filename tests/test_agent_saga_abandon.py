"""A run's own abandon deadline (``AgentRunner.run(abandon_after=...)``, what ``CrewSaga`` declares
for every kickoff, issue 26 item 12): recorded with the run, so a worker whose saga type has no
deadline undoes the dead run once it has passed; the type's own deadline wins; bad values are
refused before anything is stored.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _sagajournals import JournalFactory, factory_for
from conftest import FakeClock

from sagaguard.idempotency import Guard
from sagaguard.idempotency.errors import ConfigurationError
from sagaguard.saga import SagaRegistry, SagaState, recover
from sagaguard.saga.agent import AgentRunner, AgentSaga, UndoRegistry

pytestmark = pytest.mark.timeout(60)


class Crash(BaseException):
    """The agent's process dies here."""


@pytest.fixture(params=("memory", "sqlite"))
def factory(request: pytest.FixtureRequest, clock: FakeClock, tmp_path: Path) -> Iterator[JournalFactory]:
    yield from factory_for(request.param, clock, tmp_path)


def _undos(undone: list[str]) -> UndoRegistry:
    undos = UndoRegistry()

    @undos.register
    def cancel_booking(arguments: Any, result: Any) -> None:
        undone.append(arguments["hotel"])

    return undos


def _dead_run(factory: JournalFactory, agent: AgentSaga, run_id: str, abandon_after: float | None) -> None:
    journal, guard = factory.open(), factory.guard()
    runner = AgentRunner(journal, guard, sleep=lambda _s: None)
    try:
        with pytest.raises(Crash), runner.run(agent, run_id, abandon_after=abandon_after) as run:
            run.call("book_hotel", lambda: "bk-1", {"hotel": "ritz"}, undo="cancel_booking", call_id="c1")
            raise Crash
    finally:
        runner.close()


def _sweep(factory: JournalFactory, agent: AgentSaga, run_id: str) -> SagaState:
    report = recover(factory.open(), Guard(factory.store()), SagaRegistry(agent), sleep=lambda _s: None)
    return report.outcomes[run_id].state


def test_a_runs_own_deadline_undoes_it_in_a_worker_that_has_none(
    factory: JournalFactory, clock: FakeClock
) -> None:
    undone: list[str] = []
    agent = AgentSaga("trip_agent", _undos(undone))  # no deadline on the type: the worker's too
    _dead_run(factory, agent, "trip-a", abandon_after=120)
    clock.advance(3600)  # the dead process's lease has run out
    assert _sweep(factory, agent, "trip-a") is SagaState.WAITING
    clock.advance(119)
    report = recover(factory.open(), Guard(factory.store()), SagaRegistry(agent), sleep=lambda _s: None)
    assert "trip-a" not in report.outcomes or report.outcomes["trip-a"].state is SagaState.WAITING
    assert undone == []
    clock.advance(2)
    assert _sweep(factory, agent, "trip-a") is SagaState.COMPENSATED
    assert undone == ["ritz"]


def test_the_types_deadline_wins_over_the_runs(factory: JournalFactory, clock: FakeClock) -> None:
    undone: list[str] = []
    agent = AgentSaga("trip_agent", _undos(undone), abandon_after=10)
    _dead_run(factory, agent, "trip-b", abandon_after=3600)
    clock.advance(3600)
    assert _sweep(factory, agent, "trip-b") is SagaState.WAITING
    clock.advance(11)
    assert _sweep(factory, agent, "trip-b") is SagaState.COMPENSATED
    assert undone == ["ritz"]


def test_a_bad_deadline_is_refused_before_anything_is_stored(factory: JournalFactory) -> None:
    agent = AgentSaga("trip_agent", _undos([]))
    runner = AgentRunner(factory.open(), factory.guard(), sleep=lambda _s: None)
    try:
        for bad in (-1.0, float("nan"), float("inf"), "60"):
            with pytest.raises(ConfigurationError):
                runner.run(agent, "trip-c", abandon_after=bad)  # type: ignore[arg-type]
        assert runner.journal.load("trip-c") is None
    finally:
        runner.close()
    assert agent.abandon_for('{"run": "x", "abandon_after": "nan"}') is None  # never undone on a guess
    assert agent.abandon_for("not json") is None
    assert agent.abandon_for('{"run": "x", "abandon_after": "90.0"}') == 90.0
