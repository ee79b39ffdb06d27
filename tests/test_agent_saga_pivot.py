"""An agent run's pivot under a real SIGKILL, counted at the fake API (another process).

The agent (``tests/_agentpivotchild.py``) books a hotel, charges a card, then sends the
confirmation email, its pivot. Killed right after the API accepted the email, before its result was
recorded, the restarted agent finds the email's record in doubt: the run needs attention (nothing
undone, nothing sent again) and, once an operator settled the record, ``sagaguard sagas retry``
makes it resumable: the re-opened run replays the email and completes.
"""

from __future__ import annotations

import json
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from _sagajournals import JournalFactory, factory_for
from conftest import FakeClock
from test_agent_saga_crash import _applied, _cli, _env, _run

from sagaguard.connectors.testing.http_server import LocalIdempotentApi
from sagaguard.idempotency import Guard, OutcomeUnknown, open_store
from sagaguard.idempotency.keys import derive_explicit_key
from sagaguard.idempotency.records import State
from sagaguard.saga import SagaState, StepState, retry
from sagaguard.saga.agent import AgentRunner, AgentSaga, UndoRegistry
from sagaguard.saga.journals import open_journal
from sagaguard.saga.records import SagaSnapshot, StepKind, StepRecord

pytestmark = pytest.mark.timeout(240)  # several fresh processes each, on a shared machine

CHILD = Path(__file__).resolve().parent / "_agentpivotchild.py"
RUN = "trip-p"


@pytest.fixture
def api() -> Iterator[LocalIdempotentApi]:
    with LocalIdempotentApi() as server:
        yield server


def _email_key(db: str) -> str:
    store = open_store(db)
    try:
        return derive_explicit_key(Guard(store).namespace, f"{RUN}/call-3", "agent.tool.send_confirmation")
    finally:
        store.close()


def _state(db: str) -> SagaState:
    journal = open_journal(db)
    try:
        found = journal.load(RUN)
        assert found is not None
        return found.saga.state
    finally:
        journal.close()


def test_an_agent_killed_inside_its_pivot_needs_attention_then_resumes_once_the_record_is_settled(
    api: LocalIdempotentApi, tmp_path: Path
) -> None:
    db = f"sqlite:///{tmp_path}/agent.db"
    agent = _run([sys.executable, str(CHILD)], _env(api, db, tmp_path, "in_email"))
    assert agent.returncode == -signal.SIGKILL, agent.stderr
    trip = {"/bookings": 1, "/charges": 1, "/emails": 1}
    assert _applied(api) == trip
    # Restarted at once: the email's record is in doubt (at most once); the run is parked for an
    # operator, not ended `failed`, and nothing is undone or sent again.
    again = _run([sys.executable, str(CHILD)], _env(api, db, tmp_path))
    assert again.returncode == 0, again.stdout + again.stderr
    assert json.loads(again.stdout) == {"state": "needs_attention"}
    assert _state(db) is SagaState.NEEDS_ATTENTION
    assert _applied(api) == trip
    # A retry before the record is settled sends nothing: the re-opened run parks again.
    env = _env(api, db, tmp_path)
    retried = _run(_cli("sagas", "retry", RUN, "--store", db), env)
    assert retried.returncode == 0, retried.stdout + retried.stderr
    again = _run([sys.executable, str(CHILD)], env)
    assert json.loads(again.stdout) == {"state": "needs_attention"}, again.stderr
    assert _applied(api) == trip
    # The operator settles the email (it was sent), retries, and the agent finishes the run.
    result = json.dumps({"id": "email-1"})
    resolve = _cli("effects", "resolve", _email_key(db), "--applied", "--result", result, "--store", db)
    settled = _run(resolve, env)
    assert settled.returncode == 0, settled.stdout + settled.stderr
    retried = _run(_cli("sagas", "retry", RUN, "--store", db), env)
    assert retried.returncode == 0, retried.stdout + retried.stderr
    done = _run([sys.executable, str(CHILD)], env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads(done.stdout) == {"state": "completed"}
    assert _applied(api) == trip  # the email once, under its one identity; nothing undone


class Refused(Exception):
    """The mail server refused the email: it was not sent."""


class Boom(Exception):
    """The mail server's connection dropped: the email may have been sent."""


@pytest.fixture(params=("memory", "sqlite"))
def factory(request: pytest.FixtureRequest, clock: FakeClock, tmp_path: Path) -> Iterator[JournalFactory]:
    yield from factory_for(request.param, clock, tmp_path)


def _trip(
    factory: JournalFactory, email: Exception, raised: type[Exception], on_failure: str = "compensate"
) -> tuple[SagaSnapshot, list[str]]:
    """Book, charge, then a pivot email failing with ``email``; returns the journal and the world."""
    world: list[str] = []
    undos = UndoRegistry()
    undos.add("cancel_booking", lambda _a, _r: world.append("cancel_booking"))
    undos.add("refund", lambda _a, _r: world.append("refund"))
    agent = AgentSaga("pivot_agent", undos, on_failure=on_failure)
    journal = factory.open()
    runner = AgentRunner(journal, factory.guard(), sleep=lambda _s: None)

    def send() -> None:
        world.append("email")
        raise email

    try:
        with pytest.raises(raised), runner.run(agent, RUN) as run:
            run.call("book_hotel", lambda: world.append("book"), {"hotel": "ritz"}, undo="cancel_booking")
            run.call("charge", lambda: world.append("charge"), {"amount": 1}, undo="refund")
            run.call("send_confirmation", send, {"to": "ana"}, pivot=True, options={"permanent": (Refused,)})
    finally:
        runner.close()
    found = journal.load(RUN)
    assert found is not None
    return found, world


def test_a_pivot_refused_not_applied_undoes_the_calls_before_it(factory: JournalFactory) -> None:
    """On main the pivot's STARTED row stopped the compensation: the run ended `failed` with the
    trip booked and charged although the email never went out."""
    snapshot, world = _trip(factory, Refused("mailbox full"), Refused)
    assert snapshot.saga.state is SagaState.COMPENSATED
    assert world == ["book", "charge", "email", "refund", "cancel_booking"]
    assert snapshot.steps[2].state is StepState.FAILED and snapshot.steps[2].not_applied


@pytest.mark.parametrize("on_failure", ["compensate", "leave"])
def test_a_pivot_that_may_have_applied_parks_the_run_and_undoes_nothing(
    factory: JournalFactory, on_failure: str
) -> None:
    snapshot, world = _trip(factory, Boom("connection reset"), OutcomeUnknown, on_failure)
    assert snapshot.saga.state is SagaState.NEEDS_ATTENTION
    assert world == ["book", "charge", "email"]
    pivot = snapshot.steps[2]
    assert (pivot.state, pivot.not_applied) == (StepState.FAILED, False)
    assert len(snapshot.steps) == 3  # no run row: `sagas retry` goes forward at the pivot
    journal = factory.open()
    assert retry(journal, RUN).state is SagaState.RUNNING


@pytest.mark.parametrize(
    ("row", "ledger", "live", "expected"),
    [
        (StepState.STARTED, None, False, "not started"),
        (StepState.STARTED, State.IN_PROGRESS, True, "in flight"),
        (StepState.STARTED, State.IN_PROGRESS, False, "in doubt"),
        (StepState.STARTED, State.IN_DOUBT, False, "in doubt"),
        (StepState.STARTED, State.FAILED, False, "failed"),
        (StepState.SUCCEEDED, State.SUCCEEDED, False, "succeeded"),
        (StepState.COMPENSATED, State.IN_DOUBT, False, "undone"),
        (StepState.COMPENSATED, State.SUCCEEDED, False, "undone"),
    ],
)
def test_call_outcome(row: StepState, ledger: State | None, live: bool, expected: str) -> None:
    from sagaguard.saga.decisions import call_outcome

    record = StepRecord(0, "tool.x.0", StepKind.PIVOT, row)
    assert call_outcome(record, ledger, lease_live=live).value == expected


@pytest.mark.parametrize(
    ("outcome", "state"),
    [
        ("not started", SagaState.COMPENSATING),
        ("failed", SagaState.COMPENSATING),
        ("succeeded", SagaState.COMPENSATING),
        ("in doubt", SagaState.NEEDS_ATTENTION),
        ("in flight", SagaState.NEEDS_ATTENTION),
    ],
)
def test_pivot_failure(outcome: str, state: SagaState) -> None:
    from sagaguard.saga.decisions import CallOutcome, pivot_failure

    assert pivot_failure(CallOutcome(outcome)) is state
