"""The SagaJournal contract, one suite for every backend: memory, SQLite, Postgres, Redis (and, with
``-m cluster``, Redis Cluster).

Each primitive of :class:`sagaguard.saga.journal.SagaJournal` is held to its docstring here: what start,
claim, commit, signal and cancel write, what they refuse, and that the fenced ones let exactly one
of several racers through. Time is the injected ``clock``; nothing sleeps.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from _holders import dead_holder, live_holder
from _sagajournals import JOURNALS, JournalFactory, factory_for
from conftest import CLUSTER, FakeClock

from sagaguard.idempotency import holder
from sagaguard.saga import (
    CancelOutcome,
    LostSagaLease,
    Phase,
    SagaJournal,
    SagaNotFound,
    SagaState,
    SignalOutcome,
    StartOutcome,
    StepKind,
    StepRecord,
    StepState,
)
from sagaguard.saga.records import FOREVER, SagaRecord

T0 = FakeClock.START


pytestmark = pytest.mark.timeout(60)


@pytest.fixture(params=[*JOURNALS, CLUSTER])
def journal_factory(
    request: pytest.FixtureRequest, clock: FakeClock, tmp_path: Path
) -> Iterator[JournalFactory]:
    cluster = request.getfixturevalue("redis_cluster") if request.param == "cluster" else None
    yield from factory_for(request.param, clock, tmp_path, cluster)


@pytest.fixture
def journal(journal_factory: JournalFactory) -> SagaJournal:
    return journal_factory.open()


def _start(journal: SagaJournal, saga_id: str = "s-1", **changes: object) -> int:
    options: dict[str, object] = {
        "name": "trip",
        "version": 1,
        "input": '{"id":"o1"}',
        "fingerprint": "fp1",
        "lease": 30.0,
    }
    options.update(changes)
    started = journal.start(saga_id, **options)  # type: ignore[arg-type]
    return started.snapshot.saga.token


def _saga(journal: SagaJournal, saga_id: str = "s-1") -> SagaRecord:
    snapshot = journal.load(saga_id)
    assert snapshot is not None
    return snapshot.saga


def _row(index: int, state: StepState = StepState.STARTED, **changes: object) -> StepRecord:
    return StepRecord(index, f"step{index}", StepKind.COMPENSATABLE, state, compensation="undo").evolve(
        **changes
    )


def _park(journal: SagaJournal, saga_id: str, token: int, signal: str, wake_at: float) -> None:
    phase = Phase(
        state=SagaState.WAITING,
        waiting_for=signal,
        wait_until=wake_at if wake_at < FOREVER else 0.0,
        wake_at=wake_at,
    )
    journal.commit(saga_id, token, phase)


def test_now_is_the_injected_clock(journal: SagaJournal, clock: FakeClock) -> None:
    assert journal.now() == T0
    clock.advance(1.5)
    assert journal.now() == T0 + 1.5


def test_start_creates_once(journal: SagaJournal) -> None:
    started = journal.start("s-1", name="trip", version=2, input='{"id":"o1"}', fingerprint="fp1", lease=30)
    assert started.outcome is StartOutcome.CREATED
    saga = started.snapshot.saga
    assert (saga.name, saga.version, saga.input, saga.fingerprint) == ("trip", 2, '{"id":"o1"}', "fp1")
    assert saga.state is SagaState.RUNNING and saga.token == 1 and saga.recoveries == 0
    assert saga.lease_until == T0 + 30 and saga.created_at == T0 == saga.updated_at
    assert (
        saga.deadline == 0 and saga.waiting_for is None and not saga.cancel_requested and saga.error is None
    )
    assert started.snapshot.steps == () and dict(started.snapshot.signals) == {}
    again = journal.start("s-1", name="trip", version=2, input='{"id":"o1"}', fingerprint="fp1", lease=30)
    assert again.outcome is StartOutcome.EXISTING and again.snapshot.saga == saga


def test_every_start_and_commit_answers_what_a_load_reads_back(
    journal: SagaJournal, clock: FakeClock
) -> None:
    """The record a start or a commit answers with is the one the journal now holds, field for
    field, whatever the phase: a start with its first step and a deadline, a commit that only
    renews the lease, one that moves the state with an error, one that clears it, one that parks
    the saga waiting, one that completes it. A journal may build its answer from what it wrote
    instead of reading it back (the Redis scripts do), so this is what keeps the two the same."""
    started = journal.start(
        "s-1", name="trip", version=3, input='{"id":"o1"}', fingerprint="fp1", lease=30, timeout=600,
        first=_row(0), holder="host:1",
    )  # fmt: skip
    assert started.outcome is StartOutcome.CREATED
    assert journal.load("s-1") == started.snapshot
    assert [row.index for row in started.snapshot.steps] == [0]
    phases = [
        Phase(steps=(_row(0, StepState.SUCCEEDED, result="1"), _row(1)), lease=30),
        Phase(lease=30),
        Phase(
            steps=(_row(1, StepState.FAILED, error="boom"),),
            state=SagaState.COMPENSATING,
            error="boom",
            lease=30,
        ),
        Phase(state=SagaState.COMPENSATING, lease=30),
        Phase(state=SagaState.WAITING, waiting_for="approval", wait_until=T0 + 500, wake_at=T0 + 500),
    ]
    for phase in phases:
        clock.advance(7)
        answered = journal.commit("s-1", 1, phase)
        assert _saga(journal) == answered, phase
    _start(journal, "s-2")
    clock.advance(3)
    done = journal.commit("s-2", 1, Phase(steps=(_row(0, StepState.SUCCEEDED),), state=SagaState.COMPLETED))
    assert _saga(journal, "s-2") == done and done.state is SagaState.COMPLETED and done.lease_until == 0


def test_start_with_a_timeout_records_the_deadline(journal: SagaJournal) -> None:
    _start(journal, timeout=3600.0)
    snapshot = journal.load("s-1")
    assert snapshot is not None and snapshot.saga.deadline == T0 + 3600


def test_start_takes_over_only_an_expired_lease_of_the_same_saga(
    journal: SagaJournal, clock: FakeClock
) -> None:
    _start(journal)
    clock.advance(29)
    assert journal.start("s-1", name="trip", version=1, input="{}", fingerprint="fp1", lease=30).outcome is (
        StartOutcome.EXISTING
    )
    clock.advance(1)
    for other in ({"name": "other"}, {"version": 2}, {"fingerprint": "fp2"}):
        options = {"name": "trip", "version": 1, "fingerprint": "fp1", **other}
        result = journal.start("s-1", input="{}", lease=30, **options)  # type: ignore[arg-type]
        assert result.outcome is StartOutcome.EXISTING and result.snapshot.saga.token == 1
    taken = journal.start("s-1", name="trip", version=1, input="{}", fingerprint="fp1", lease=30)
    assert taken.outcome is StartOutcome.TOOK_OVER
    saga = taken.snapshot.saga
    assert (
        saga.token == 2
        and saga.recoveries == 1
        and saga.lease_until == T0 + 60
        and saga.input == '{"id":"o1"}'
    )


def test_commit_writes_a_phase_and_is_fenced(journal: SagaJournal, clock: FakeClock) -> None:
    token = _start(journal)
    clock.advance(7)
    record = journal.commit("s-1", token, Phase(steps=(_row(0),), lease=30))
    assert record.updated_at == T0 + 7 and record.lease_until == T0 + 37 and record.state is SagaState.RUNNING
    clock.advance(1)
    done = _row(0, StepState.SUCCEEDED, result='{"ok":"é✓"}', attempts=1)
    journal.commit("s-1", token, Phase(steps=(done, _row(1)), lease=30))
    snapshot = journal.load("s-1")
    assert snapshot is not None
    first, second = snapshot.steps
    assert first.state is StepState.SUCCEEDED and first.result == '{"ok":"é✓"}' and first.attempts == 1
    assert first.started_at == T0 + 7 and first.updated_at == T0 + 8  # started_at is kept
    assert second.started_at == T0 + 8 and second.compensation == "undo"
    with pytest.raises(LostSagaLease):
        journal.commit("s-1", token + 1, Phase(lease=30))
    with pytest.raises(LostSagaLease):
        journal.commit("nope", 1, Phase(lease=30))


def test_a_state_change_records_the_error_and_a_zero_lease_releases(journal: SagaJournal) -> None:
    token = _start(journal)
    record = journal.commit("s-1", token, Phase(state=SagaState.COMPENSATING, error='{"why":1}', lease=30))
    assert record.state is SagaState.COMPENSATING and record.error == '{"why":1}'
    record = journal.commit("s-1", token, Phase(state=SagaState.COMPENSATED, error='{"why":1}'))
    assert record.lease_until == 0 and record.state is SagaState.COMPENSATED
    with pytest.raises(LostSagaLease, match="already"):
        journal.commit("s-1", token, Phase(lease=30))


def test_a_commit_keeps_a_lease_ending_in_the_last_fifth_of_the_one_it_asks_for(
    journal: SagaJournal, clock: FakeClock
) -> None:
    """lease.renewed, on every backend: phases that follow each other quickly leave the lease (and
    the recovery sweep's index) alone; past a fifth of the lease, or asked for a shorter one, the
    commit renews it to now + lease."""
    token = _start(journal)  # lease 30: until T0 + 30
    clock.advance(5)
    kept = journal.commit("s-1", token, Phase(steps=(_row(0),), lease=30))
    assert (kept.lease_until, kept.updated_at) == (T0 + 30, T0 + 5)  # 25 s of 30 ahead: kept
    snapshot = journal.load("s-1")
    assert snapshot is not None and snapshot.steps[0].state is StepState.STARTED  # the rest is written
    clock.advance(1.5)
    assert journal.commit("s-1", token, Phase(lease=30)).lease_until == T0 + 36.5  # 23.5 s ahead
    assert journal.commit("s-1", token, Phase(lease=10)).lease_until == T0 + 16.5  # shorter: applied
    assert journal.commit("s-1", token, Phase(lease=60)).lease_until == T0 + 66.5  # longer: applied
    assert journal.commit("s-1", token, Phase(lease=60)).lease_until == T0 + 66.5
    assert journal.commit("s-1", token, Phase(state=SagaState.COMPLETED)).lease_until == 0


def test_a_start_writes_its_first_step_only_with_the_saga_it_creates(
    journal: SagaJournal, clock: FakeClock
) -> None:
    """``first`` is the created saga's first phase; a take-over or an existing saga keeps the step
    rows the journal holds (a step that succeeded stays so)."""
    created = journal.start(
        "s-1", name="trip", version=1, input="{}", fingerprint="fp1", lease=30, first=_row(0)
    )
    assert created.outcome is StartOutcome.CREATED and [r.state for r in created.snapshot.steps] == [
        StepState.STARTED
    ]
    token = created.snapshot.saga.token
    journal.commit("s-1", token, Phase(steps=(_row(0, StepState.SUCCEEDED, result="1"), _row(1)), lease=30))
    for wait, outcome in ((1, StartOutcome.EXISTING), (40, StartOutcome.TOOK_OVER)):
        clock.advance(wait)
        again = journal.start(
            "s-1", name="trip", version=1, input="{}", fingerprint="fp1", lease=30, first=_row(0)
        )
        assert again.outcome is outcome
        steps = again.snapshot.steps
        assert [(r.index, r.state, r.result) for r in steps] == [
            (0, StepState.SUCCEEDED, "1"),
            (1, StepState.STARTED, None),
        ]
        assert steps == _load_steps(journal)


def _load_steps(journal: SagaJournal) -> tuple[StepRecord, ...]:
    snapshot = journal.load("s-1")
    assert snapshot is not None
    return snapshot.steps


def test_a_heartbeat_only_extends_the_lease(journal: SagaJournal, clock: FakeClock) -> None:
    token = _start(journal)
    clock.advance(20)
    record = journal.commit("s-1", token, Phase(lease=30))
    assert record.lease_until == T0 + 50 and record.state is SagaState.RUNNING and record.token == token


def test_claim_takes_a_due_saga_once(journal: SagaJournal, clock: FakeClock) -> None:
    token = _start(journal)
    assert journal.claim("s-1", lease=30) is None  # its runner's lease is live
    assert journal.claim("unknown", lease=30) is None
    journal.commit("s-1", token, Phase(steps=(_row(0),), lease=30))
    clock.advance(31)
    claimed = journal.claim("s-1", lease=60)
    assert claimed is not None
    assert claimed.saga.token == token + 1 and claimed.saga.recoveries == 1
    assert claimed.saga.lease_until == T0 + 91 and claimed.steps[0].state is StepState.STARTED
    assert journal.claim("s-1", lease=60) is None
    with pytest.raises(LostSagaLease):
        journal.commit("s-1", token, Phase(lease=30))  # the old runner is fenced out


def test_claim_race_lets_exactly_one_through(journal_factory: JournalFactory, clock: FakeClock) -> None:
    journals = [journal_factory.open() for _ in range(6)]
    _start(journals[0])
    clock.advance(31)
    barrier = threading.Barrier(len(journals))
    won: list[int] = []

    def race(j: SagaJournal) -> None:
        barrier.wait()
        got = j.claim("s-1", lease=30)
        if got is not None:
            won.append(got.saga.token)

    threads = [threading.Thread(target=race, args=(j,)) for j in journals]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert won == [2]


def test_parking_a_saga_and_waking_it_at_its_deadline(journal: SagaJournal, clock: FakeClock) -> None:
    token = _start(journal)
    journal.commit("s-1", token, Phase(steps=(_row(0),), lease=30))
    _park(journal, "s-1", token, "approval", T0 + 3600)
    snapshot = journal.load("s-1")
    assert snapshot is not None
    saga = snapshot.saga
    assert saga.state is SagaState.WAITING and saga.waiting_for == "approval"
    assert saga.lease_until == T0 + 3600 and saga.wait_until == T0 + 3600
    with pytest.raises(LostSagaLease):
        journal.commit("s-1", token, Phase(lease=30))  # nobody holds a waiting saga
    clock.advance(3599)
    assert journal.claim("s-1", lease=30) is None and journal.due() == []
    clock.advance(1)
    assert [r.saga_id for r in journal.due()] == ["s-1"]
    claimed = journal.claim("s-1", lease=30)
    assert claimed is not None
    assert claimed.saga.state is SagaState.RUNNING and claimed.saga.recoveries == 0  # a wake, not a recovery
    assert claimed.saga.waiting_for == "approval" and claimed.saga.wait_until == T0 + 3600


def test_start_takes_over_a_waiting_saga_when_due(journal: SagaJournal, clock: FakeClock) -> None:
    token = _start(journal)
    _park(journal, "s-1", token, "approval", T0 + 10)
    assert _start(journal) == token  # EXISTING: not due yet
    clock.advance(10)
    taken = journal.start("s-1", name="trip", version=1, input="{}", fingerprint="fp1", lease=30)
    assert taken.outcome is StartOutcome.TOOK_OVER and taken.snapshot.saga.state is SagaState.RUNNING
    assert taken.snapshot.saga.recoveries == 0


def test_signals_are_delivered_once_and_wake_the_saga_waiting_for_them(
    journal: SagaJournal, clock: FakeClock
) -> None:
    token = _start(journal)
    _park(journal, "s-1", token, "approval", FOREVER)
    clock.advance(86_400 * 5)
    assert journal.due() == []
    assert journal.signal("s-1", "other", '"x"') is SignalOutcome.DELIVERED
    assert journal.due() == []  # not the awaited signal
    assert journal.signal("s-1", "approval", '{"by":"ana"}') is SignalOutcome.DELIVERED
    assert journal.signal("s-1", "approval", '{"by":"bob"}') is SignalOutcome.DUPLICATE
    due = journal.due()
    assert [r.saga_id for r in due] == ["s-1"] and due[0].lease_until == clock.now
    claimed = journal.claim("s-1", lease=30)
    assert claimed is not None
    assert dict(claimed.signals) == {"other": '"x"', "approval": '{"by":"ana"}'}


def test_a_signal_that_came_before_the_parking_makes_it_due_at_once(journal: SagaJournal) -> None:
    token = _start(journal)
    assert journal.signal("s-1", "approval", "true") is SignalOutcome.DELIVERED  # running: kept for later
    _park(journal, "s-1", token, "approval", FOREVER)
    snapshot = journal.load("s-1")
    assert (
        snapshot is not None and snapshot.saga.lease_until == T0 and snapshot.saga.state is SagaState.WAITING
    )
    assert dict(snapshot.signals) == {"approval": "true"}


def test_signals_to_unknown_or_ended_sagas(journal: SagaJournal) -> None:
    with pytest.raises(SagaNotFound):
        journal.signal("nope", "approval", "null")
    token = _start(journal)
    journal.commit("s-1", token, Phase(state=SagaState.COMPLETED))
    assert journal.signal("s-1", "approval", "null") is SignalOutcome.TOO_LATE
    snapshot = journal.load("s-1")
    assert snapshot is not None and dict(snapshot.signals) == {}


def test_cancel(journal: SagaJournal, clock: FakeClock) -> None:
    with pytest.raises(SagaNotFound):
        journal.cancel("nope", "{}")
    _start(journal, "running")
    assert journal.cancel("running", '{"why":"no"}') is CancelOutcome.REQUESTED
    assert journal.cancel("running", '{"why":"again"}') is CancelOutcome.ALREADY
    snapshot = journal.load("running")
    assert snapshot is not None
    saga = snapshot.saga
    assert saga.cancel_requested and saga.error == '{"why":"no"}' and saga.state is SagaState.RUNNING
    assert saga.lease_until == T0 + 30  # its runner notices at the next boundary

    token = _start(journal, "waiting")
    _park(journal, "waiting", token, "approval", FOREVER)
    clock.advance(5)
    assert journal.cancel("waiting", "{}") is CancelOutcome.REQUESTED
    assert [r.saga_id for r in journal.due()] == ["waiting"]

    token = _start(journal, "compensating")
    journal.commit("compensating", token, Phase(state=SagaState.COMPENSATING, lease=30))
    assert journal.cancel("compensating", "{}") is CancelOutcome.ALREADY

    token = _start(journal, "done")
    journal.commit("done", token, Phase(state=SagaState.COMPLETED))
    assert journal.cancel("done", "{}") is CancelOutcome.TOO_LATE


def test_a_cancel_once_the_pivot_has_a_row_is_too_late_and_not_recorded(journal: SagaJournal) -> None:
    """The journal itself refuses a cancel once the pivot (or a later step) has a row, deciding on
    the rows of its own transaction: a caller that read the saga before the pivot's commit cannot
    get REQUESTED for a cancel the runner will ignore. A pivot row marked not applied (it never
    ran) does not count."""
    compensated = _row(0, StepState.SUCCEEDED, result="1")
    pivot = _row(1, StepState.SUCCEEDED, kind=StepKind.PIVOT, result="2")
    rows = {
        "pivot-started": (compensated, _row(1, kind=StepKind.PIVOT)),
        "pivot-done": (compensated, pivot),
        "retriable": (compensated, pivot, _row(2, kind=StepKind.RETRIABLE)),
        "not-applied": (compensated, _row(1, StepState.FAILED, kind=StepKind.PIVOT, not_applied=True)),
        "before": (compensated, _row(1)),
    }
    for saga_id, steps in rows.items():
        token = _start(journal, saga_id)
        journal.commit(saga_id, token, Phase(steps=steps, lease=30))
    for saga_id in ("pivot-started", "pivot-done", "retriable"):
        assert journal.cancel(saga_id, '{"why":"late"}') is CancelOutcome.TOO_LATE, saga_id
        saga = _saga(journal, saga_id)
        assert (saga.cancel_requested, saga.error, saga.state) == (False, None, SagaState.RUNNING)
    for saga_id in ("not-applied", "before"):
        assert journal.cancel(saga_id, '{"why":"in time"}') is CancelOutcome.REQUESTED, saga_id
        assert _saga(journal, saga_id).cancel_requested

    # Parked after its pivot, waiting for a signal: too late as well.
    token = _start(journal, "waiting")
    journal.commit("waiting", token, Phase(steps=(compensated, pivot)))
    _park(journal, "waiting", token, "approval", FOREVER)
    assert journal.cancel("waiting", "{}") is CancelOutcome.TOO_LATE
    assert not _saga(journal, "waiting").cancel_requested


def test_a_pending_cancel_makes_a_parking_due_at_once(journal: SagaJournal) -> None:
    token = _start(journal)
    journal.cancel("s-1", "{}")
    _park(journal, "s-1", token, "approval", FOREVER)
    snapshot = journal.load("s-1")
    assert snapshot is not None and snapshot.saga.lease_until == T0


def test_a_completion_unless_cancelled_leaves_a_cancelled_saga_running(
    journal: SagaJournal, clock: FakeClock
) -> None:
    """A phase completing the saga ``unless_cancelled``: with a cancellation pending (it came while
    the last step ran) the step rows are written but the saga stays RUNNING with the cancellation's
    cause and a renewed lease, decided in the commit's transaction; without the flag, or without a
    pending cancellation, it completes with its lease released."""
    last = (_row(0, StepState.SUCCEEDED, result="1"), _row(1, StepState.SUCCEEDED, result='"b!"'))
    finish = Phase(steps=last, state=SagaState.COMPLETED, lease=30, unless_cancelled=True)
    for saga_id in ("cancelled", "plain", "unflagged"):
        _start(journal, saga_id)
        journal.commit(saga_id, 1, Phase(steps=(_row(0, StepState.SUCCEEDED, result="1"), _row(1)), lease=30))
    journal.cancel("cancelled", '{"why":"operator"}')
    journal.cancel("unflagged", '{"why":"operator"}')
    clock.advance(10)

    kept = journal.commit("cancelled", 1, finish)
    assert (kept.state, kept.error, kept.cancel_requested) == (SagaState.RUNNING, '{"why":"operator"}', True)
    assert kept.lease_until == T0 + 40 and kept.token == 1
    snapshot = journal.load("cancelled")
    assert snapshot is not None and snapshot.saga == kept
    assert [(r.state, r.result) for r in snapshot.steps] == [
        (StepState.SUCCEEDED, "1"),
        (StepState.SUCCEEDED, '"b!"'),
    ]
    assert journal.cancel("cancelled", "{}") is CancelOutcome.ALREADY
    # its runner goes on with the same token: compensating
    journal.commit("cancelled", 1, Phase(state=SagaState.COMPENSATING, error='{"why":"operator"}', lease=30))
    assert _saga(journal, "cancelled").state is SagaState.COMPENSATING

    done = journal.commit("plain", 1, finish)
    assert (done.state, done.error, done.lease_until) == (SagaState.COMPLETED, None, 0)
    assert journal.cancel("plain", "{}") is CancelOutcome.TOO_LATE  # after the completion: too late

    # Without the flag (past the pivot) a pending cancellation does not stop the completion.
    unflagged = Phase(steps=last, state=SagaState.COMPLETED, error='{"why":"operator"}')
    ended = journal.commit("unflagged", 1, unflagged)
    assert (ended.state, ended.lease_until) == (SagaState.COMPLETED, 0)
    for saga_id in ("plain", "unflagged"):
        snapshot = journal.load(saga_id)
        assert snapshot is not None and [r.state for r in snapshot.steps] == [StepState.SUCCEEDED] * 2
    assert journal.due() == []


def test_due_lists_overdue_sagas_longest_overdue_first(journal: SagaJournal, clock: FakeClock) -> None:
    _start(journal, "a", lease=50)
    _start(journal, "b", lease=10)
    _start(journal, "live", lease=500)
    token = _start(journal, "done", lease=5)
    journal.commit("done", token, Phase(state=SagaState.COMPLETED))
    token = _start(journal, "waits", lease=5)
    _park(journal, "waits", token, "x", T0 + 20)
    clock.advance(100)
    assert [r.saga_id for r in journal.due()] == ["b", "waits", "a"]
    assert [r.saga_id for r in journal.due(limit=2)] == ["b", "waits"]
    assert journal.due(limit=0) == []
    assert journal.claim("b", lease=30) is not None
    assert [r.saga_id for r in journal.due()] == ["waits", "a"]


def test_list_filters_and_pages_by_id(journal: SagaJournal) -> None:
    for saga_id in ("c", "a", "b", "d"):
        _start(journal, saga_id)
    token = _start(journal, "e")
    journal.commit("e", token, Phase(state=SagaState.FAILED))
    assert [r.saga_id for r in journal.list()] == ["a", "b", "c", "d", "e"]
    assert [r.saga_id for r in journal.list(limit=2, after="a")] == ["b", "c"]
    assert [r.saga_id for r in journal.list(states=[SagaState.FAILED])] == ["e"]
    assert journal.list(states=[SagaState.WAITING]) == []


def test_load_unknown_is_none(journal: SagaJournal) -> None:
    assert journal.load("nope") is None


def test_times_read_back_exactly(journal: SagaJournal, clock: FakeClock) -> None:
    clock.set(1_700_000_000.123456)
    token = _start(journal, lease=0.1)
    record = journal.commit("s-1", token, Phase(lease=7.000001))
    assert record.updated_at == 1_700_000_000.123456 and record.lease_until == 1_700_000_000.123456 + 7.000001


def test_every_primitive_on_the_servers_own_clock(journal_factory: JournalFactory) -> None:
    journal = journal_factory.open(clock=None)  # the database's (or Redis's) time
    before = time.time()
    token = _start(journal, timeout=3600.0)
    snapshot = journal.load("s-1")
    assert snapshot is not None
    saga = snapshot.saga
    assert abs(saga.created_at - before) < 60 and saga.deadline == saga.created_at + 3600
    _park(journal, "s-1", token, "go", FOREVER)
    assert journal.due() == []
    assert journal.signal("s-1", "go", "1") is SignalOutcome.DELIVERED
    assert [r.saga_id for r in journal.due()] == ["s-1"]
    claimed = journal.claim("s-1", lease=30)
    assert claimed is not None and claimed.saga.lease_until > claimed.saga.updated_at >= saga.created_at
    assert journal.cancel("s-1", "{}") is CancelOutcome.REQUESTED
    record = journal.commit("s-1", claimed.saga.token, Phase(state=SagaState.FAILED, error="{}"))
    assert record.state is SagaState.FAILED and journal.due() == []
    assert journal.now() >= record.updated_at


# -- Redis specifics ----------------------------------------------------------------------------


@pytest.fixture
def redis_journal(clock: FakeClock, tmp_path: Path) -> Iterator[tuple[SagaJournal, JournalFactory]]:
    for factory in factory_for("redis", clock, tmp_path):
        yield factory.open(), factory


def test_redis_refuses_braces_in_saga_ids(redis_journal: tuple[SagaJournal, JournalFactory]) -> None:
    from sagaguard.idempotency.errors import ConfigurationError

    journal, _ = redis_journal
    with pytest.raises(ConfigurationError, match="braces"):
        _start(journal, "a{b}")


def test_redis_due_index_repairs_itself(
    redis_journal: tuple[SagaJournal, JournalFactory], clock: FakeClock
) -> None:
    import redis

    journal, factory = redis_journal
    client = redis.Redis.from_url(factory.url, decode_responses=True)
    key = f"{factory.prefix}:due"
    try:
        _start(journal, "live")
        token = _start(journal, "ended")
        journal.commit("ended", token, Phase(state=SagaState.COMPLETED))
        with pytest.raises(SagaNotFound):
            journal.signal("ghost", "x", "null")  # leaves an index entry for a saga that is not there
        assert journal.due() == []
        # The live saga's entry now carries its lease; the ghost's waits out a grace period.
        scores = dict(client.zrange(key, 0, -1, withscores=True))
        assert scores == {"live": T0 + 30, "ghost": T0 + 60}
        clock.advance(61)
        assert [r.saga_id for r in journal.due()] == ["live"]
        assert dict(client.zrange(key, 0, -1, withscores=True)) == {"live": T0 + 30}
    finally:
        client.close()


# -- lease holders and the take-over of a dead holder's live saga ----------------------------------


@pytest.fixture(scope="module")
def dead() -> str:
    """The holder identity of a real process that ran on this host: SIGKILLed and reaped."""
    return dead_holder()


@pytest.fixture(scope="module")
def alive() -> Iterator[str]:
    """The holder identity of another live process on this host."""
    with live_holder() as who:
        yield who


def _elsewhere(who: str) -> str:
    """``who`` as if it ran on another host: never probed here, so never judged dead."""
    parsed = holder.parse(who)
    assert parsed is not None
    return str(holder.Holder("another-machine/4026531836", parsed.pid, parsed.start))


def test_start_claim_and_take_over_record_the_holder(journal: SagaJournal, clock: FakeClock) -> None:
    _start(journal)
    assert _saga(journal).holder == holder.current()  # None: this process
    clock.advance(31)
    claimed = journal.claim("s-1", lease=30, holder="h|1|2")
    assert claimed is not None and claimed.saga.holder == "h|1|2"
    taken = journal.take_over("s-1", claimed.saga.token, lease=30, holder="h|3|4")
    assert taken is not None and taken.saga.holder == "h|3|4"
    clock.advance(31)
    restarted = journal.start("s-1", name="trip", version=1, input="{}", fingerprint="fp1", lease=30)
    assert restarted.outcome is StartOutcome.TOOK_OVER and restarted.snapshot.saga.holder == holder.current()
    assert [r.holder for r in journal.list()] == [holder.current()]


def test_take_over_is_fenced_on_the_token_whatever_the_lease(journal: SagaJournal, clock: FakeClock) -> None:
    token = _start(journal)
    journal.commit("s-1", token, Phase(steps=(_row(0),), lease=30))
    taken = journal.take_over("s-1", token, lease=10, holder="h|1|2")
    assert taken is not None
    saga = taken.saga
    assert (saga.token, saga.recoveries, saga.lease_until) == (token + 1, 1, T0 + 10)
    assert saga.state is SagaState.RUNNING
    assert [s.index for s in taken.steps] == [0]
    with pytest.raises(LostSagaLease):
        journal.commit("s-1", token, Phase(lease=30))  # the dead holder's late write is refused
    assert journal.take_over("s-1", token, lease=10) is None  # the old token: someone took it
    assert journal.take_over("nope", 1, lease=10) is None
    _park(journal, "s-1", token + 1, "approval", T0 + 3600)
    assert journal.take_over("s-1", token + 1, lease=10) is None  # nobody holds a waiting saga


def test_a_dead_holders_live_saga_is_taken_over_by_start_claim_and_due(
    journal: SagaJournal, dead: str
) -> None:
    for saga_id in ("s-1", "s-2", "s-3"):
        _start(journal, saga_id, holder=dead)
    live = journal.load("s-1")
    assert live is not None and live.saga.holder == dead and live.saga.lease_until == T0 + 30
    assert [r.saga_id for r in journal.due()] == ["s-1", "s-2", "s-3"]  # its lease has 30 s to run
    other = journal.start("s-1", name="trip", version=1, input="{}", fingerprint="other", lease=30)
    assert other.outcome is StartOutcome.EXISTING  # another input: a conflict, never a take-over
    started = journal.start("s-1", name="trip", version=1, input="{}", fingerprint="fp1", lease=30)
    assert started.outcome is StartOutcome.TOOK_OVER
    assert (started.snapshot.saga.token, started.snapshot.saga.holder) == (2, holder.current())
    claimed = journal.claim("s-2", lease=30)
    assert claimed is not None and claimed.saga.token == 2 and claimed.saga.recoveries == 1
    assert [r.saga_id for r in journal.due()] == ["s-3"]  # the taken-over ones are held by us now
    token = _start(journal, "s-3")
    assert token == 2


def test_a_live_holder_on_this_host_or_any_holder_elsewhere_keeps_its_lease(
    journal: SagaJournal, alive: str, dead: str
) -> None:
    for saga_id, who in (("s-1", alive), ("s-2", _elsewhere(dead)), ("s-3", holder.current())):
        _start(journal, saga_id, holder=who)
        again = journal.start(saga_id, name="trip", version=1, input="{}", fingerprint="fp1", lease=30)
        assert again.outcome is StartOutcome.EXISTING and again.snapshot.saga.token == 1
        assert journal.claim(saga_id, lease=30) is None
    assert journal.due() == []


def test_sixteen_racers_for_a_dead_holders_saga_one_wins(journal_factory: JournalFactory, dead: str) -> None:
    journals = [journal_factory.open() for _ in range(16)]
    token = _start(journals[0], holder=dead)
    journals[0].commit("s-1", token, Phase(steps=(_row(0),), state=SagaState.COMPENSATING, lease=30))
    barrier = threading.Barrier(len(journals))
    won: list[int] = []

    def race(i: int, j: SagaJournal) -> None:
        barrier.wait()
        if i % 2:
            got = j.claim("s-1", lease=30)
            if got is not None:
                won.append(got.saga.token)
        else:
            started = j.start("s-1", name="trip", version=1, input="{}", fingerprint="fp1", lease=30)
            if started.outcome is StartOutcome.TOOK_OVER:
                won.append(started.snapshot.saga.token)

    threads = [threading.Thread(target=race, args=(i, j)) for i, j in enumerate(journals)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert won == [2]
    saga = _saga(journals[0])
    assert (saga.state, saga.token, saga.recoveries) == (SagaState.COMPENSATING, 2, 1)
