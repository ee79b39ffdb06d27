"""An undo refused with a 4xx (*not applied*, permanent), retried after the fault is fixed.

A plain ``sagaguard sagas retry`` runs the undo under its own key again, so its guarded effects
replay what they recorded: the refusal too, and the run needs attention again. ``--fresh`` (the
operator's choice) runs it under a new attempt key: the refused effect is sent again and the run
ends compensated. Counted at the fake hotel API (what reached it), not in our code.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import tenacity
from _sagajournals import JournalFactory, factory_for
from conftest import FakeClock

from sagaguard.idempotency import Guard, open_store
from sagaguard.idempotency.cli import main
from sagaguard.idempotency.effect import Retry
from sagaguard.saga import SagaRegistry, SagaState, recover, retry
from sagaguard.saga.agent import AgentRunner, AgentSaga, UndoRegistry
from sagaguard.saga.journal import SagaJournal
from sagaguard.saga.journals import open_journal

pytestmark = pytest.mark.timeout(60)

RUN = "trip-f"


class Refused(Exception):
    """The hotel API answered 400: the cancellation was not made."""


class HotelApi:
    """What reached the hotel API: cancellations refused, then accepted once the fault is fixed."""

    def __init__(self) -> None:
        self.broken = True
        self.requests: list[str] = []

    def cancel(self, booking: str) -> None:
        self.requests.append(booking)
        if self.broken:
            raise Refused("400: the booking reference is malformed")


@pytest.fixture(params=("memory", "sqlite"))
def factory(request: pytest.FixtureRequest, clock: FakeClock, tmp_path: Path) -> Iterator[JournalFactory]:
    yield from factory_for(request.param, clock, tmp_path)


def _refused_run(journal: SagaJournal, guard: Guard, api: HotelApi) -> AgentSaga:
    undos = UndoRegistry()

    @undos.register
    def cancel_booking(arguments: Any, result: Any) -> None:
        # The undo's call to the API is a guarded effect (as a connector's is): refused with a 4xx,
        # it is recorded FAILED (not applied, permanent) under the undo's scope.
        guard.run("hotel.cancel", lambda: api.cancel(arguments["hotel"]), permanent=(Refused,))

    once = Retry(stop=tenacity.stop_after_attempt(1))
    agent = AgentSaga("trip_agent", undos, compensation_retry=once)
    runner = AgentRunner(journal, guard, sleep=lambda _s: None)
    try:
        with pytest.raises(ValueError), runner.run(agent, RUN) as run:
            run.call("book_hotel", lambda: "bk-1", {"hotel": "ritz"}, undo="cancel_booking")
            raise ValueError("the car tool failed")
    finally:
        runner.close()
    assert run.outcome is not None and run.outcome.state is SagaState.NEEDS_ATTENTION
    return agent


def _sweep(journal: SagaJournal, guard: Guard, agent: AgentSaga) -> SagaState:
    report = recover(journal, guard, SagaRegistry(agent), sleep=lambda _s: None)
    return report.outcomes[RUN].state


def test_a_refused_undo_retried_fresh_after_the_fix_is_sent_again_and_the_run_is_undone(
    factory: JournalFactory,
) -> None:
    api = HotelApi()
    journal, guard = factory.open(), factory.guard()
    agent = _refused_run(journal, guard, api)
    assert api.requests == ["ritz"]
    api.broken = False  # the operator fixed the fault
    retry(journal, RUN)  # the undo under its own key: the refusal is replayed, nothing sent
    assert _sweep(journal, guard, agent) is SagaState.NEEDS_ATTENTION
    assert api.requests == ["ritz"]
    retry(journal, RUN, fresh=True)  # under a new attempt key: sent again
    assert _sweep(journal, guard, agent) is SagaState.COMPENSATED
    assert api.requests == ["ritz", "ritz"]


def test_sagas_retry_fresh_from_the_cli(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/trip.db"
    journal, guard, api = open_journal(url), Guard(open_store(url)), HotelApi()
    try:
        agent = _refused_run(journal, guard, api)
        api.broken = False
        assert main(["sagas", "retry", RUN, "--fresh", "--store", url]) == 0
        assert _sweep(journal, guard, agent) is SagaState.COMPENSATED
        assert api.requests == ["ritz", "ritz"]
    finally:
        journal.close()


@pytest.mark.parametrize(
    ("signals", "index", "expected"),
    [
        ({}, 0, 0),
        ({"approval": "null"}, 0, 0),
        ({"sagaguard.undo.fresh.0.1": "null"}, 0, 1),
        ({"sagaguard.undo.fresh.0.1": "null"}, 1, 0),
        ({"sagaguard.undo.fresh.1.1": "null", "sagaguard.undo.fresh.1.2": "null"}, 1, 2),
        ({"sagaguard.undo.fresh.10.1": "null"}, 1, 0),
    ],
)
def test_undo_round(signals: dict[str, str], index: int, expected: int) -> None:
    from sagaguard.saga.decisions import fresh_undo_signal, undo_round
    from sagaguard.saga.runner import compensation_key

    assert undo_round(signals, index) == expected
    assert undo_round({**signals, fresh_undo_signal(index, expected + 1): "null"}, index) == expected + 1
    assert compensation_key("r", "s", 0) == "r/s/~compensate"  # the first round keeps the old key
    assert compensation_key("r", "s", expected + 1) == f"r/s/~compensate/{expected + 1}"
