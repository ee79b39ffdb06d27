"""Agent sagas on every journal: an agent run's tool calls, registered before they run, undone in
reverse when the run fails, is cancelled, rejected or abandoned; kept when it completes.

The "world" is a list of what each tool and undo did; time is the injected clock (an abandon
deadline passes by advancing it). Crashes are simulated here with a BaseException; a real SIGKILL
is in ``tests/test_agent_saga_crash.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import tenacity
from _holders import dead_holder
from _sagajournals import JOURNALS, JournalFactory, factory_for
from conftest import FakeClock

from sagaguard.idempotency import Guard, holder
from sagaguard.idempotency.codec import decode_error
from sagaguard.idempotency.effect import Retry
from sagaguard.saga import CancelOutcome, SagaRegistry, SagaState, StepState, cancel, recover, retry
from sagaguard.saga.agent import (
    AgentRunCancelled,
    AgentRunEnded,
    AgentRunner,
    AgentSaga,
    OnFailure,
    UndoRegistry,
    UnknownUndo,
    resume_signal,
)
from sagaguard.saga.journal import SagaJournal
from sagaguard.saga.records import Phase, SagaRecord, SagaSnapshot, StepKind

pytestmark = pytest.mark.timeout(60)

LEASE = 30.0
ABANDON = 600.0
TWICE = Retry(stop=tenacity.stop_after_attempt(2), wait=tenacity.wait_none())


class Crash(BaseException):
    """The process dies here."""


class ToolFailed(Exception):
    """A later tool fails: the run fails."""


class World:
    """What the outside world saw, in order."""

    def __init__(self) -> None:
        self.log: list[tuple[str, Any]] = []
        self.undos = UndoRegistry()
        self.failing: set[str] = set()

        @self.undos.register
        def cancel_booking(arguments: Any, result: Any) -> None:
            if "cancel_booking" in self.failing:
                raise RuntimeError("hotel unreachable")
            self.log.append(("cancel_booking", (arguments["hotel"], result)))

        @self.undos.register
        def refund(arguments: Any, result: Any) -> None:
            self.log.append(("refund", (arguments["amount"], result)))

    def book(self, hotel: str) -> dict[str, str]:
        self.log.append(("book", hotel))
        return {"booking": f"bk-{hotel}"}

    def charge(self, amount: int) -> dict[str, Any]:
        self.log.append(("charge", amount))
        return {"charge": "ch-1", "amount": amount}

    def sign(self) -> str:
        self.log.append(("sign", None))
        return "contract-1"

    def did(self, what: str) -> list[Any]:
        return [detail for name, detail in self.log if name == what]


@pytest.fixture(params=JOURNALS)
def journal_factory(
    request: pytest.FixtureRequest, clock: FakeClock, tmp_path: Path
) -> Iterator[JournalFactory]:
    yield from factory_for(request.param, clock, tmp_path)


@pytest.fixture
def journal(journal_factory: JournalFactory) -> SagaJournal:
    return journal_factory.open()


@pytest.fixture
def guard(journal_factory: JournalFactory) -> Guard:
    return journal_factory.guard()


@pytest.fixture
def world() -> World:
    return World()


@pytest.fixture
def agent(world: World) -> AgentSaga:
    return AgentSaga("trip_agent", world.undos, abandon_after=ABANDON, compensation_retry=TWICE)


@pytest.fixture
def runner(journal: SagaJournal, guard: Guard) -> Iterator[AgentRunner]:
    made = AgentRunner(journal, guard, lease=LEASE, sleep=lambda _s: None)
    yield made
    made.close()


def book(world: World, runner: AgentRunner, hotel: str = "ritz") -> Any:
    from sagaguard.saga.agent import current_run

    return current_run().call(
        "book_hotel", lambda: world.book(hotel), {"hotel": hotel}, undo="cancel_booking"
    )


def charge(world: World, amount: int = 120) -> Any:
    from sagaguard.saga.agent import current_run

    return current_run().call("charge", lambda: world.charge(amount), {"amount": amount}, undo="refund")


def sweep(journal: SagaJournal, guard: Guard, agent: AgentSaga) -> Any:
    return recover(journal, guard, SagaRegistry(agent), sleep=lambda _s: None)


def load(journal: SagaJournal, run_id: str) -> SagaSnapshot:
    found = journal.load(run_id)
    assert found is not None
    return found


# --------------------------------------------------------------------------- the run's saga


def test_a_failing_run_undoes_its_calls_in_reverse_once(
    journal: SagaJournal, runner: AgentRunner, agent: AgentSaga, world: World
) -> None:
    with pytest.raises(ToolFailed), runner.run(agent, "thread-1"):
        book(world, runner)
        charge(world)
        raise ToolFailed("the flight tool failed")
    assert [name for name, _ in world.log] == ["book", "charge", "refund", "cancel_booking"]
    assert world.did("refund") == [(120, {"charge": "ch-1", "amount": 120})]
    assert world.did("cancel_booking") == [("ritz", {"booking": "bk-ritz"})]
    snapshot = load(journal, "thread-1")
    assert snapshot.saga.state is SagaState.COMPENSATED
    assert snapshot.saga.name == "trip_agent"
    assert [(r.name, r.state) for r in snapshot.steps] == [
        ("tool.book_hotel.0", StepState.COMPENSATED),
        ("tool.charge.1", StepState.COMPENSATED),
        ("agent.run.2", StepState.FAILED),
    ]
    assert decode_error(snapshot.saga.error or "").message == "the flight tool failed"


def test_a_completed_run_keeps_its_effects(
    journal: SagaJournal, runner: AgentRunner, agent: AgentSaga, world: World
) -> None:
    with runner.run(agent, "thread-1") as run:
        book(world, runner)
        assert run.call("search", lambda: "3 hotels", {"q": "paris"}) == "3 hotels"  # not journaled
    snapshot = load(journal, "thread-1")
    assert snapshot.saga.state is SagaState.COMPLETED
    assert [r.name for r in snapshot.steps] == ["tool.book_hotel.0"]
    assert world.did("cancel_booking") == []


def test_a_completed_run_re_opened_replays_its_calls_and_takes_no_new_one(
    journal: SagaJournal, runner: AgentRunner, agent: AgentSaga, world: World
) -> None:
    """A crash between the run's completion and the program saving its answer: the restarted
    program opens the run again and gets its answer (on main: ``AgentRunEnded`` at the open)."""
    with runner.run(agent, "thread-1"):
        book(world, runner)
    with runner.run(agent, "thread-1") as again:
        assert again.outcome is not None and again.outcome.state is SagaState.COMPLETED
        assert again.outcome.replayed
        assert book(world, runner) == {"booking": "bk-ritz"}  # replayed by the guard
        with pytest.raises(AgentRunEnded, match="completed"):
            charge(world)
    assert world.did("book") == ["ritz"] and world.did("charge") == []
    snapshot = load(journal, "thread-1")
    assert snapshot.saga.state is SagaState.COMPLETED
    assert [r.name for r in snapshot.steps] == ["tool.book_hotel.0"]


def test_a_call_made_again_after_a_resume_replays_and_keeps_its_row(
    journal: SagaJournal, runner: AgentRunner, agent: AgentSaga, world: World
) -> None:
    with pytest.raises(Crash), runner.run(agent, "thread-1"):
        book(world, runner)
        raise Crash
    with runner.run(agent, "thread-1"):  # resumed at once: the framework replays the same calls
        assert book(world, runner) == {"booking": "bk-ritz"}
        charge(world)
    assert world.did("book") == ["ritz"]
    assert [r.name for r in load(journal, "thread-1").steps] == ["tool.book_hotel.0", "tool.charge.1"]


def test_leave_for_an_operator_parks_the_run_and_retry_compensates_it(
    journal: SagaJournal, guard: Guard, runner: AgentRunner, world: World
) -> None:
    agent = AgentSaga("trip_agent", world.undos, on_failure=OnFailure.LEAVE)
    with pytest.raises(ToolFailed), runner.run(agent, "thread-1"):
        book(world, runner)
        raise ToolFailed("no flights")
    assert load(journal, "thread-1").saga.state is SagaState.NEEDS_ATTENTION
    assert world.did("cancel_booking") == []
    retry(journal, "thread-1")
    report = sweep(journal, guard, agent)
    assert report.outcomes["thread-1"].state is SagaState.COMPENSATED
    assert world.did("cancel_booking") == [("ritz", {"booking": "bk-ritz"})]


def test_a_pivot_that_ran_stops_compensation_there(
    journal: SagaJournal, runner: AgentRunner, agent: AgentSaga, world: World
) -> None:
    with pytest.raises(ToolFailed), runner.run(agent, "thread-1") as run:
        book(world, runner)
        run.call("sign_contract", world.sign, {"party": "acme"}, pivot=True)
        charge(world)
        raise ToolFailed("later")
    assert world.did("refund") == [(120, {"charge": "ch-1", "amount": 120})]
    assert world.did("cancel_booking") == []  # before the pivot: forward only
    states = [r.state for r in load(journal, "thread-1").steps]
    assert states == [StepState.SUCCEEDED, StepState.SUCCEEDED, StepState.COMPENSATED, StepState.FAILED]


def test_an_undo_that_keeps_failing_parks_the_run_with_its_cause(
    journal: SagaJournal, guard: Guard, runner: AgentRunner, agent: AgentSaga, world: World
) -> None:
    world.failing.add("cancel_booking")
    with pytest.raises(ToolFailed), runner.run(agent, "thread-1"):
        book(world, runner)
        charge(world)
        raise ToolFailed("later")
    snapshot = load(journal, "thread-1")
    assert snapshot.saga.state is SagaState.NEEDS_ATTENTION
    assert decode_error(snapshot.saga.error or "").message == "hotel unreachable"
    assert snapshot.steps[0].state is StepState.COMPENSATION_FAILED
    assert snapshot.steps[0].compensation_attempts == 2
    assert world.did("refund") == [(120, {"charge": "ch-1", "amount": 120})]
    world.failing.clear()
    retry(journal, "thread-1")
    assert sweep(journal, guard, agent).outcomes["thread-1"].state is SagaState.COMPENSATED
    assert world.did("cancel_booking") == [("ritz", {"booking": "bk-ritz"})]
    assert len(world.did("refund")) == 1


def test_with_the_defaults_an_undo_that_keeps_failing_is_needs_attention_after_about_three_minutes(
    journal: SagaJournal, guard: Guard, world: World, clock: FakeClock
) -> None:
    """docs/agent_sagas.md, "How long a run stays compensating": the default ``compensation_retry``
    (FORWARD_RETRY) makes 10 attempts, pausing 0.5 s doubling to 60 s plus up to 1 s of jitter
    (183.5 to 192.5 s in all); the pauses within 2 s run in the agent's process, the rest in
    whatever takes the parked run over when it is due (here: sweeps). Time is the injected clock."""
    world.failing.add("cancel_booking")
    defaults = AgentSaga("trip_agent", world.undos)  # the shortest declaration
    runner = AgentRunner(journal, guard, sleep=clock.advance)
    failed_at = clock.now
    with pytest.raises(ToolFailed), runner.run(defaults, "thread-1"):
        book(world, runner)
        raise ToolFailed("later")
    runner.close()
    for _ in range(20):  # each pass runs the attempts that are due
        snapshot = load(journal, "thread-1")
        if snapshot.saga.state is not SagaState.COMPENSATING:
            break
        clock.set(max(clock.now, snapshot.saga.lease_until))
        recover(journal, guard, SagaRegistry(defaults), sleep=clock.advance)
    assert snapshot.saga.state is SagaState.NEEDS_ATTENTION
    assert snapshot.steps[0].compensation_attempts == 10
    assert 183.5 <= clock.now - failed_at <= 192.5  # "about 3 minutes of pauses in all"
    assert world.did("cancel_booking") == []


def test_an_undo_the_registry_lacks_is_refused_at_the_call(
    runner: AgentRunner, agent: AgentSaga, world: World
) -> None:
    with pytest.raises(UnknownUndo), runner.run(agent, "thread-1") as run:
        run.call("book_car", lambda: world.book("car"), {"hotel": "car"}, undo="return_car")
    assert world.did("book") == []


def test_a_worker_without_the_undo_parks_the_run_for_an_operator(
    *,
    journal: SagaJournal,
    guard: Guard,
    runner: AgentRunner,
    agent: AgentSaga,
    world: World,
    clock: FakeClock,
) -> None:
    with pytest.raises(Crash), runner.run(agent, "thread-1"):
        book(world, runner)
        raise Crash
    cancel(journal, "thread-1")
    clock.advance(LEASE + 1)
    bare = AgentSaga("trip_agent", UndoRegistry())
    report = sweep(journal, guard, bare)
    assert report.outcomes["thread-1"].state is SagaState.NEEDS_ATTENTION
    assert "cancel_booking" in (report.outcomes["thread-1"].error or decode_error("{}")).message
    assert world.did("cancel_booking") == []


# ------------------------------------------------------------------------------- triggers


def test_a_human_rejection_undoes_the_run(
    journal: SagaJournal, runner: AgentRunner, agent: AgentSaga, world: World
) -> None:
    with runner.run(agent, "thread-1") as run:
        book(world, runner)
        charge(world)
        run.pause()  # the graph stopped at an approval
    outcome = runner.reject(agent, "thread-1", "the manager said no")
    assert outcome.state is SagaState.COMPENSATED
    assert outcome.error is not None and outcome.error.message == "the manager said no"
    assert [name for name, _ in world.log][-2:] == ["refund", "cancel_booking"]


def test_a_cancellation_stops_a_live_run_at_its_next_tool_call(
    journal: SagaJournal, runner: AgentRunner, agent: AgentSaga, world: World
) -> None:
    with pytest.raises(AgentRunCancelled), runner.run(agent, "thread-1"):
        book(world, runner)
        cancel(journal, "thread-1", reason="customer withdrew")
        charge(world)
    assert world.did("charge") == []  # registered, never claimed, never run
    snapshot = load(journal, "thread-1")
    assert snapshot.saga.state is SagaState.COMPENSATED
    assert [(r.state, r.not_applied) for r in snapshot.steps[:2]] == [
        (StepState.COMPENSATED, False),
        (StepState.FAILED, True),
    ]
    assert world.did("cancel_booking") == [("ritz", {"booking": "bk-ritz"})]
    assert world.did("refund") == []


def test_a_cancellation_during_the_last_tool_call_undoes_the_run_rather_than_completing_it(
    journal: SagaJournal, runner: AgentRunner, agent: AgentSaga, world: World
) -> None:
    """The cancel comes while the run's last tool call runs (answered REQUESTED), and the block
    then returns: no tool call is left to see it, and the journal refuses the completion (the run
    stays RUNNING, in the same commit), so leaving the block undoes every call, the last first."""
    from sagaguard.saga.agent import current_run

    seen: list[Any] = []

    def charging() -> dict[str, Any]:
        seen.append(cancel(journal, "thread-1", reason="customer withdrew"))
        return world.charge(120)

    with runner.run(agent, "thread-1") as run:
        book(world, runner)
        current_run().call("charge", charging, {"amount": 120}, undo="refund")
    assert seen == [CancelOutcome.REQUESTED]
    assert run.outcome is not None and run.outcome.state is SagaState.COMPENSATED
    snapshot = load(journal, "thread-1")
    assert snapshot.saga.state is SagaState.COMPENSATED
    assert snapshot.saga.error is not None and "customer withdrew" in snapshot.saga.error
    assert [name for name, _ in world.log] == ["book", "charge", "refund", "cancel_booking"]
    assert world.did("refund") == [(120, {"charge": "ch-1", "amount": 120})]
    assert cancel(journal, "thread-1") is CancelOutcome.TOO_LATE


def test_a_cancellation_during_the_last_tool_call_after_the_pivot_is_too_late(
    journal: SagaJournal, runner: AgentRunner, agent: AgentSaga, world: World
) -> None:
    """Past the pivot a run only goes forward: a cancel during its last call is TOO_LATE, from
    the journal itself, records nothing, and the run completes."""
    from sagaguard.saga.agent import current_run

    seen: list[Any] = []

    def charging() -> dict[str, Any]:
        seen.append(journal.cancel("thread-1", '{"why":"raced the pivot"}'))
        return world.charge(120)

    with runner.run(agent, "thread-1") as run:
        book(world, runner)
        current_run().call("sign", world.sign, {}, pivot=True)
        current_run().call("charge", charging, {"amount": 120}, undo="refund")
    assert seen == [CancelOutcome.TOO_LATE]
    assert run.outcome is not None and run.outcome.state is SagaState.COMPLETED
    saga = load(journal, "thread-1").saga
    assert saga.state is SagaState.COMPLETED and not saga.cancel_requested
    assert world.did("refund") == [] and world.did("cancel_booking") == []


class _CancelBeforeThePivot:
    """A journal on which an operator's cancel lands just before the commit that registers a pivot
    (after the run's own look at the saga, before its write): the cancel answers REQUESTED."""

    def __init__(self, journal: SagaJournal) -> None:
        self._journal = journal
        self.answers: list[CancelOutcome] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._journal, name)

    def commit(self, saga_id: str, token: int, phase: Phase) -> SagaRecord:
        if not self.answers and any(row.kind is StepKind.PIVOT for row in phase.steps):
            self.answers.append(cancel(self._journal, saga_id, reason="customer withdrew"))
        return self._journal.commit(saga_id, token, phase)


def test_a_cancellation_that_lands_just_before_the_pivot_is_registered_stops_the_pivot(
    journal: SagaJournal, guard: Guard, agent: AgentSaga, world: World
) -> None:
    """The cancel is recorded between the run's look at the saga and its commit of the pivot's row,
    so it answers REQUESTED: the commit returns it, the pivot never runs (its row is written not
    applied) and the calls before it are undone."""
    from sagaguard.saga.agent import current_run

    racing = _CancelBeforeThePivot(journal)
    runner = AgentRunner(racing, guard, lease=LEASE, sleep=lambda _s: None)  # type: ignore[arg-type]
    try:
        with pytest.raises(AgentRunCancelled), runner.run(agent, "thread-1"):
            book(world, runner)
            current_run().call("sign", world.sign, {}, pivot=True)
    finally:
        runner.close()
    assert racing.answers == [CancelOutcome.REQUESTED]
    assert world.did("sign") == []
    snapshot = load(journal, "thread-1")
    assert snapshot.saga.state is SagaState.COMPENSATED
    assert [(r.state, r.not_applied) for r in snapshot.steps[:2]] == [
        (StepState.COMPENSATED, False),
        (StepState.FAILED, True),
    ]
    assert world.did("cancel_booking") == [("ritz", {"booking": "bk-ritz"})]


def test_a_cancellation_of_a_run_whose_process_is_gone_is_carried_out_by_the_worker(
    *,
    journal: SagaJournal,
    guard: Guard,
    runner: AgentRunner,
    agent: AgentSaga,
    world: World,
    clock: FakeClock,
) -> None:
    with pytest.raises(Crash), runner.run(agent, "thread-1"):
        book(world, runner)
        charge(world)
        raise Crash
    cancel(journal, "thread-1", reason="operator")
    assert sweep(journal, guard, agent).outcomes == {}  # its lease still runs
    clock.advance(LEASE + 1)
    assert sweep(journal, guard, agent).outcomes["thread-1"].state is SagaState.COMPENSATED
    assert [name for name, _ in world.log][-2:] == ["refund", "cancel_booking"]


def test_a_crashed_run_waits_for_its_agent_then_is_abandoned_at_its_deadline(
    *,
    journal: SagaJournal,
    guard: Guard,
    runner: AgentRunner,
    agent: AgentSaga,
    world: World,
    clock: FakeClock,
) -> None:
    with pytest.raises(Crash), runner.run(agent, "thread-1"):
        book(world, runner)
        raise Crash
    clock.advance(LEASE + 1)
    parked = sweep(journal, guard, agent).outcomes["thread-1"]
    assert parked.state is SagaState.WAITING
    assert parked.waiting_for == resume_signal(1)
    assert world.did("cancel_booking") == []
    clock.advance(ABANDON - 1)
    assert sweep(journal, guard, agent).outcomes == {}
    clock.advance(2)
    outcome = sweep(journal, guard, agent).outcomes["thread-1"]
    assert outcome.state is SagaState.COMPENSATED
    assert outcome.error is not None and outcome.error.type_name.endswith("AgentRunAbandoned")
    assert world.did("cancel_booking") == [("ritz", {"booking": "bk-ritz"})]


def test_without_an_abandon_deadline_a_crashed_run_waits_for_ever(
    journal: SagaJournal, guard: Guard, runner: AgentRunner, world: World, clock: FakeClock
) -> None:
    agent = AgentSaga("trip_agent", world.undos)
    with pytest.raises(Crash), runner.run(agent, "thread-1"):
        book(world, runner)
        raise Crash
    clock.advance(LEASE + 1)
    assert sweep(journal, guard, agent).outcomes["thread-1"].state is SagaState.WAITING
    clock.advance(365 * 86400.0)
    assert sweep(journal, guard, agent).outcomes == {}
    assert world.did("cancel_booking") == []


def test_a_resumed_agent_takes_its_parked_run_back_and_completes_it(
    *,
    journal: SagaJournal,
    guard: Guard,
    runner: AgentRunner,
    agent: AgentSaga,
    world: World,
    clock: FakeClock,
) -> None:
    with pytest.raises(Crash), runner.run(agent, "thread-1"):
        book(world, runner)
        raise Crash
    clock.advance(LEASE + 1)
    assert sweep(journal, guard, agent).outcomes["thread-1"].state is SagaState.WAITING
    with runner.run(agent, "thread-1"):
        book(world, runner)
        charge(world)
    with pytest.raises(Crash), runner.run(agent, "thread-2"):
        raise Crash
    snapshot = load(journal, "thread-1")
    assert snapshot.saga.state is SagaState.COMPLETED
    assert [r.name for r in snapshot.steps] == ["tool.book_hotel.0", "agent.run.1", "tool.charge.2"]
    assert world.did("book") == ["ritz"] and world.did("cancel_booking") == []
    clock.advance(ABANDON * 3)
    sweep(journal, guard, agent)
    sweep(journal, guard, agent)
    assert load(journal, "thread-1").saga.state is SagaState.COMPLETED


# ------------------------------------------------------ registered before the call, durably


def test_a_crash_between_registering_and_claiming_skips_the_undo(
    *,
    journal: SagaJournal,
    guard: Guard,
    runner: AgentRunner,
    agent: AgentSaga,
    world: World,
    clock: FakeClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.raises(Crash), runner.run(agent, "thread-1"):
        book(world, runner)

        def die(*_args: Any, **_kwargs: Any) -> Any:
            raise Crash  # the process dies after the commit, before the guard's claim

        monkeypatch.setattr(guard, "run", die)
        charge(world)
    monkeypatch.undo()
    assert load(journal, "thread-1").steps[1].state is StepState.STARTED  # the undo is registered
    cancel(journal, "thread-1")
    clock.advance(LEASE + 1)
    outcome = sweep(journal, guard, agent).outcomes["thread-1"]
    assert outcome.state is SagaState.COMPENSATED
    row = load(journal, "thread-1").steps[1]
    assert (row.state, row.not_applied) == (StepState.FAILED, True)
    assert decode_error(row.error or "").type_name.endswith("NothingToUndo")
    assert world.did("refund") == []  # no claim, no undo
    assert world.did("cancel_booking") == [("ritz", {"booking": "bk-ritz"})]


def test_a_crash_after_the_effect_undoes_it_with_no_result(
    *,
    journal: SagaJournal,
    guard: Guard,
    runner: AgentRunner,
    agent: AgentSaga,
    world: World,
    clock: FakeClock,
) -> None:
    from sagaguard.saga.agent import current_run

    def charge_then_die() -> Any:
        world.charge(120)
        raise Crash  # the charge happened; its result was never recorded

    with pytest.raises(Crash), runner.run(agent, "thread-1"):
        current_run().call("charge", charge_then_die, {"amount": 120}, undo="refund")
    cancel(journal, "thread-1")
    clock.advance(LEASE + 1)
    assert sweep(journal, guard, agent).outcomes["thread-1"].state is SagaState.COMPENSATED
    assert world.did("refund") == [(120, None)]


def test_an_undo_knows_the_call_it_undoes_even_with_no_result(
    *,
    journal: SagaJournal,
    guard: Guard,
    runner: AgentRunner,
    agent: AgentSaga,
    world: World,
    clock: FakeClock,
) -> None:
    from sagaguard.saga.agent import current_run, undoing

    seen: list[tuple[str, str, str, Any]] = []

    @agent.undos.register
    def refund_by_key(arguments: Any, result: Any) -> None:
        call = undoing()  # how an undo with no result finds the effect (its key, the body's scope)
        seen.append((call.tool, call.effect, call.key, result))

    def charge_then_die() -> Any:
        world.charge(120)
        raise Crash

    with pytest.raises(Crash), runner.run(agent, "thread-1"):
        current_run().call("charge", charge_then_die, {"amount": 120}, undo="refund_by_key", call_id="call_7")
    cancel(journal, "thread-1")
    clock.advance(LEASE + 1)
    assert sweep(journal, guard, agent).outcomes["thread-1"].state is SagaState.COMPENSATED
    assert seen == [("charge", "agent.tool.charge", "thread-1/call_7", None)]
    with pytest.raises(LookupError):
        undoing()


@pytest.mark.parametrize("how", ["lease ran out", "holder died"])
def test_an_agent_resumed_after_dying_mid_compensation_finishes_the_undo_and_never_runs_forward(
    *,
    journal: SagaJournal,
    runner: AgentRunner,
    agent: AgentSaga,
    world: World,
    clock: FakeClock,
    monkeypatch: pytest.MonkeyPatch,
    how: str,
) -> None:
    from sagaguard.saga.agent import current_run

    dying = [True]

    @agent.undos.register
    def cancel_or_die(arguments: Any, result: Any) -> None:
        if dying[0]:
            raise Crash  # the process undoing the run dies here, after the refund
        world.log.append(("cancel_booking", (arguments["hotel"], result)))

    with monkeypatch.context() as patched:
        if how == "holder died":  # the run and its claims are written as a dead process's
            gone = dead_holder()
            patched.setattr(holder, "current", lambda: gone)
        with pytest.raises(Crash), runner.run(agent, "thread-1"):
            current_run().call(
                "book_hotel", lambda: world.book("ritz"), {"hotel": "ritz"}, undo="cancel_or_die"
            )
            charge(world)
            raise ToolFailed("no flight")
    assert load(journal, "thread-1").saga.state is SagaState.COMPENSATING
    dying[0] = False
    if how == "lease ran out":
        clock.advance(LEASE + 1)  # the dead process's lease ran out; the agent is started again
    # else: started again at once, its lease live: taken over because its holder is dead

    ran_forward = []
    with pytest.raises(AgentRunEnded) as ended, runner.run(agent, "thread-1"):
        ran_forward.append(True)
    assert ended.value.state == SagaState.COMPENSATED.value
    assert ran_forward == []  # the agent never ran forward on a run being undone
    assert world.did("refund") == [(120, {"charge": "ch-1", "amount": 120})]
    assert world.did("cancel_booking") == [("ritz", {"booking": "bk-ritz"})]
    assert load(journal, "thread-1").saga.state is SagaState.COMPENSATED


# ------------------------------------------------------------------- decisions, table-tested

S, OK, F, C = StepState.STARTED, StepState.SUCCEEDED, StepState.FAILED, StepState.COMPENSATED


def _rows(shape: list[tuple[str, StepState]]) -> tuple[Any, ...]:
    from sagaguard.saga.agent import ToolCall
    from sagaguard.saga.records import StepKind, StepRecord

    rows = []
    for index, (kind, state) in enumerate(shape):
        if kind == "run":
            rows.append(StepRecord(index, f"agent.run.{index}", StepKind.COMPENSATABLE, state))
            continue
        call = ToolCall.of(kind, f"r/{index}", {"hotel": "x"}).encode()
        step_kind = StepKind.PIVOT if kind == "pivot" else StepKind.COMPENSATABLE
        undo = None if kind == "pivot" else "cancel_booking"
        name = f"tool.{kind}.{index}"
        rows.append(StepRecord(index, name, step_kind, state, compensation=undo, result=call))
    return tuple(rows)


@pytest.mark.parametrize(
    ("state", "shape", "expected"),
    [
        # going forward the worker only waits for the agent: at the run's own next step...
        ("running", [("book", OK)], "start 1"),
        ("running", [], "start 0"),
        # ...or at a call in flight when the process died; it never completes a run
        ("running", [("book", OK), ("book", S)], "run 1"),
        ("running", [("book", OK), ("run", OK)], "start 2"),
        # backward: reverse journal order, skipping rows with nothing to undo
        ("compensating", [("book", OK), ("book", OK), ("run", F)], "undo 1"),
        ("compensating", [("book", OK), ("book", C), ("run", F)], "undo 0"),
        ("compensating", [("book", S), ("run", F)], "undo 0"),
        # a pivot that ran, or may have, stops compensation there
        ("compensating", [("book", OK), ("pivot", OK), ("book", OK), ("run", F)], "undo 2"),
        ("compensating", [("book", OK), ("pivot", OK), ("book", C), ("run", F)], "compensated"),
        ("compensating", [("book", OK), ("pivot", S), ("run", F)], "failed"),
        # a call that never claimed its effect was marked not applied: nothing left to undo
        ("compensating", [("book", C), ("book", F), ("run", F)], "compensated"),
    ],
)
def test_decide_on_agent_runs(state: str, shape: list[tuple[str, StepState]], expected: str) -> None:
    from sagaguard.idempotency.stores.memory import MemoryStore
    from sagaguard.saga.decisions import Compensate, RunStep, SetState, StartStep, decide
    from sagaguard.saga.records import SagaRecord

    rows = _rows(shape)
    rows = tuple(
        r.evolve(not_applied=True) if r.state is F and r.name.startswith("tool.") else r for r in rows
    )
    record = SagaRecord("r", "trip_agent", 1, "f", '{"run":"r"}', SagaState(state), 1, 0.0, 0.0, 0.0)
    snapshot = SagaSnapshot(record, rows)
    agent = AgentSaga("trip_agent", World().undos)
    move = decide(agent.for_run(snapshot, Guard(MemoryStore())), snapshot)
    verb, _, arg = expected.partition(" ")
    found = {
        "start": StartStep(int(arg or 0)),
        "run": RunStep(int(arg or 0)),
        "undo": Compensate(int(arg or 0)),
        "compensated": SetState(SagaState.COMPENSATED),
        "failed": SetState(SagaState.FAILED),
    }[verb]
    assert move == found


def test_for_run_refuses_rows_it_did_not_write() -> None:
    from sagaguard.idempotency.stores.memory import MemoryStore
    from sagaguard.saga import DefinitionMismatch
    from sagaguard.saga.records import SagaRecord, StepKind, StepRecord

    record = SagaRecord("r", "trip_agent", 1, "f", '{"run":"r"}', SagaState.RUNNING, 1, 0.0, 0.0, 0.0)
    foreign = StepRecord(0, "charge", StepKind.COMPENSATABLE, StepState.SUCCEEDED, compensation="x")
    agent = AgentSaga("trip_agent", World().undos)
    with pytest.raises(DefinitionMismatch):
        agent.for_run(SagaSnapshot(record, (foreign,)), Guard(MemoryStore()))


def test_a_paused_run_waits_with_no_process_held_until_its_abandon_deadline(
    *,
    journal: SagaJournal,
    guard: Guard,
    runner: AgentRunner,
    agent: AgentSaga,
    world: World,
    clock: FakeClock,
) -> None:
    with runner.run(agent, "thread-1") as run:
        book(world, runner)
        run.pause()
    record = load(journal, "thread-1").saga
    assert (record.state, record.waiting_for, record.recoveries) == (SagaState.WAITING, resume_signal(1), 0)
    clock.advance(ABANDON - 1)
    assert sweep(journal, guard, agent).outcomes == {}
    clock.advance(2)
    assert sweep(journal, guard, agent).outcomes["thread-1"].state is SagaState.COMPENSATED
    assert world.did("cancel_booking") == [("ritz", {"booking": "bk-ritz"})]


def test_a_paused_run_cancelled_is_undone_by_the_worker_at_once(
    *, journal: SagaJournal, guard: Guard, runner: AgentRunner, agent: AgentSaga, world: World
) -> None:
    with runner.run(agent, "thread-1") as run:
        book(world, runner)
        run.pause()
    cancel(journal, "thread-1")
    assert sweep(journal, guard, agent).outcomes["thread-1"].state is SagaState.COMPENSATED
    assert world.did("cancel_booking") == [("ritz", {"booking": "bk-ritz"})]


def test_a_paused_run_resumes_pauses_again_and_completes(
    *, journal: SagaJournal, guard: Guard, runner: AgentRunner, agent: AgentSaga, world: World
) -> None:
    for _ in range(7):  # more approvals than the recovery cap: pauses are not recoveries
        with runner.run(agent, "thread-1") as run:
            book(world, runner)
            run.pause()
    with runner.run(agent, "thread-1"):
        charge(world)
    snapshot = load(journal, "thread-1")
    assert snapshot.saga.state is SagaState.COMPLETED
    assert snapshot.saga.recoveries == 0
    assert world.did("book") == ["ritz"]
    assert sweep(journal, guard, agent).outcomes == {}


def test_exported_members() -> None:
    import sagaguard.saga.agent

    assert sorted(sagaguard.saga.agent.__all__) == sorted(set(sagaguard.saga.agent.__all__))
    for name in sagaguard.saga.agent.__all__:
        assert hasattr(sagaguard.saga.agent, name), name


# --------------------------------------------------------------------------- the body's run


def test_a_calls_body_sees_its_run_whatever_context_the_adapter_calls_it_in(
    journal: SagaJournal, runner: AgentRunner, agent: AgentSaga, world: World
) -> None:
    # An adapter that holds its run outside a `with` block (CrewAI's kickoff, the MCP proxy's
    # connections) calls run.call from a context where no run is open: the body still finds it.
    import asyncio
    import contextvars

    from sagaguard.saga.agent import NoOpenRun, current_run

    seen: list[str] = []

    def body() -> dict[str, str]:
        seen.append(current_run().run_id)
        return world.book("ritz")

    async def abody() -> dict[str, Any]:
        seen.append(current_run().run_id)
        return world.charge(120)

    with runner.run(agent, "thread-ctx") as run:
        blank = contextvars.Context()  # no run open in it
        with pytest.raises(NoOpenRun):
            blank.run(current_run)
        blank.run(lambda: run.call("book_hotel", body, {"hotel": "ritz"}, undo="cancel_booking"))
        blank.run(lambda: run.call("read", lambda: seen.append(current_run().run_id), {}))
        blank.run(lambda: asyncio.run(run.acall("charge", abody, {"amount": 120}, undo="refund")))
        with pytest.raises(NoOpenRun):
            blank.run(current_run)  # set for the body only
    assert seen == ["thread-ctx"] * 3
    assert load(journal, "thread-ctx").saga.state is SagaState.COMPLETED
