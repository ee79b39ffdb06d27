"""A compensation that keeps failing does not hold the runner's caller.

Before: under the default ``compensation_retry`` the runner slept between ten attempts (about 189 s)
before parking the saga. Now it tries a short burst in-line (``compensation_inline`` seconds of
sleep at most), parks the saga COMPENSATING with its lease ending when the next attempt is due, and
returns; the recovery worker retries it then, with the retry policy going on across runs. Sleeps and
time are injected: the tests count the sleeps the runner asked for, never measure them.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from _sagajournals import JOURNALS, JournalFactory, factory_for
from conftest import FakeClock

from sagaguard.idempotency import NotApplied
from sagaguard.saga import Saga, SagaJournal, SagaRunner, SagaState, StepContext, StepRecord, StepState
from sagaguard.saga.decisions import (
    RetryAction,
    compensation_retry,
    compensation_retry_base,
    recovery_allowance,
)
from sagaguard.saga.records import SagaSnapshot, StepKind
from sagaguard.saga.recovery import recover

INLINE = 2.0  # the runner's default compensation_inline


@pytest.mark.parametrize(
    ("pause", "slept", "inline", "action"),
    [
        (None, 0.0, 2.0, RetryAction.GIVE_UP),
        (None, 5.0, 2.0, RetryAction.GIVE_UP),
        (0.0, 0.0, 0.0, RetryAction.RETRY_INLINE),
        (0.5, 0.0, 2.0, RetryAction.RETRY_INLINE),
        (1.0, 1.0, 2.0, RetryAction.RETRY_INLINE),
        (1.5, 1.0, 2.0, RetryAction.RETRY_LATER),
        (30.0, 0.0, 2.0, RetryAction.RETRY_LATER),
        (0.1, 0.0, 0.0, RetryAction.RETRY_LATER),
    ],
)
def test_compensation_retry_decision(
    pause: float | None, slept: float, inline: float, action: RetryAction
) -> None:
    assert compensation_retry(pause, slept, inline) is action


def _row(attempts: int, error: str | None, state: StepState = StepState.SUCCEEDED) -> StepRecord:
    return StepRecord(
        index=0, name="charge", kind=StepKind.COMPENSATABLE, state=state, compensation="refund",
        compensation_attempts=attempts, compensation_error=error,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("attempts", "error", "base"),
    [(0, None, 0), (1, None, 0), (3, '{"type":"x"}', 3)],
)
def test_compensation_retry_base(attempts: int, error: str | None, base: int) -> None:
    assert compensation_retry_base(_row(attempts, error)) == base


def test_recovery_allowance_counts_recorded_compensation_attempts() -> None:
    from sagaguard.saga.records import SagaRecord

    record = SagaRecord(
        saga_id="s", name="n", version=1, fingerprint="f", input="{}", state=SagaState.COMPENSATING,
        token=1, lease_until=0.0, created_at=0.0, updated_at=0.0,
    )  # fmt: skip
    rows = (_row(2, "e"), _row(1, None, StepState.COMPENSATED), _row(0, None))
    assert recovery_allowance(SagaSnapshot(record, rows, {})) == 3
    assert recovery_allowance(SagaSnapshot(record, (), {})) == 0


class Psp:
    """A fake payment service: counts refund attempts and the refunds it applied."""

    def __init__(self) -> None:
        self.down = True
        self.attempts = 0
        self.applied: list[str] = []

    def refund(self, charge: str) -> None:
        self.attempts += 1
        if self.down:
            raise ConnectionError("psp unreachable")
        if charge in self.applied:
            return  # the provider's own dedup is not what the test relies on: it counts below
        self.applied.append(charge)


@dataclass
class Order:
    id: str


def _saga(psp: Psp) -> Saga[Order]:
    s: Saga[Order] = Saga("refundable", version=1, input=Order)

    def refund(ctx: StepContext, order: Order, charge: str | None) -> None:
        psp.refund(f"ch_{order.id}")

    @s.step(compensate=refund)
    def charge(ctx: StepContext, order: Order) -> str:
        return f"ch_{order.id}"

    @s.pivot
    def ship(ctx: StepContext, order: Order) -> None:
        raise NotApplied("out of stock")

    return s


@pytest.fixture(params=JOURNALS)
def factory(request: pytest.FixtureRequest, clock: FakeClock, tmp_path: Path) -> Iterator[JournalFactory]:
    yield from factory_for(request.param, clock, tmp_path)


class Sleeps:
    def __init__(self) -> None:
        self.calls: list[float] = []

    def __call__(self, seconds: float) -> None:
        self.calls.append(seconds)


def _charge_row(journal: SagaJournal, saga_id: str) -> StepRecord:
    snapshot = journal.load(saga_id)
    assert snapshot is not None
    return snapshot.steps[0]


def _drive_until_due(journal: SagaJournal, clock: FakeClock, saga_id: str) -> None:
    """Move the clock to the parked saga's next attempt time (its lease's end)."""
    snapshot = journal.load(saga_id)
    assert snapshot is not None
    clock.advance(max(snapshot.saga.lease_until - clock.now, 0.0) + 0.001)


def test_caller_returns_after_the_burst_and_the_worker_compensates_once(
    factory: JournalFactory, clock: FakeClock
) -> None:
    psp = Psp()
    saga = _saga(psp)
    journal, guard = factory.open(), factory.guard()
    sleeps = Sleeps()
    runner = SagaRunner(journal, guard, lease=30, wait=0, sleep=sleeps)

    outcome = runner.run(saga, "o-1", Order("1"))

    # The caller got control back after a short in-line burst, the saga parked for the worker.
    assert outcome.state is SagaState.COMPENSATING
    assert sum(sleeps.calls) <= INLINE
    tried = psp.attempts
    assert tried >= 1 and psp.applied == []
    row = _charge_row(journal, "o-1")
    assert row.state is StepState.SUCCEEDED and row.compensation_attempts == tried
    assert row.compensation_error is not None and "psp unreachable" in row.compensation_error

    # Not due yet: a sweep takes nothing and calls nobody.
    worker_sleeps = Sleeps()
    report = recover(journal, guard, saga, sleep=worker_sleeps)
    assert report.outcomes == {} and psp.attempts == tried

    # Due and the provider back: the worker compensates, once.
    psp.down = False
    _drive_until_due(journal, clock, "o-1")
    report = recover(journal, guard, saga, sleep=worker_sleeps)
    assert report.outcomes["o-1"].state is SagaState.COMPENSATED
    assert psp.applied == ["ch_1"] and psp.attempts == tried + 1
    row = _charge_row(journal, "o-1")
    assert row.state is StepState.COMPENSATED and row.compensation_attempts == tried + 1

    # Nothing runs it again: another sweep, or the caller running the same id.
    clock.advance(3600)
    assert recover(journal, guard, saga, sleep=worker_sleeps).outcomes == {}
    again = runner.run(saga, "o-1", Order("1"))
    assert again.replayed and again.state is SagaState.COMPENSATED
    assert psp.applied == ["ch_1"] and psp.attempts == tried + 1
    runner.close()


def test_a_compensation_that_never_succeeds_needs_attention_after_its_budget(
    factory: JournalFactory, clock: FakeClock
) -> None:
    psp = Psp()
    saga = _saga(psp)
    journal, guard = factory.open(), factory.guard()
    sleeps = Sleeps()
    runner = SagaRunner(journal, guard, lease=30, wait=0, sleep=sleeps)
    outcome = runner.run(saga, "o-2", Order("2"))
    assert outcome.state is SagaState.COMPENSATING and sum(sleeps.calls) <= INLINE

    drives = 0
    while outcome.state is SagaState.COMPENSATING:
        drives += 1
        assert drives <= 10, "the retry budget must end the retries"
        _drive_until_due(journal, clock, "o-2")
        worker_sleeps = Sleeps()
        outcome = recover(journal, guard, saga, sleep=worker_sleeps).outcomes["o-2"]
        assert sum(worker_sleeps.calls) <= INLINE  # each sweep also tries only a burst

    # The default compensation_retry's ten attempts, spread over runs; the cap on take-overs did
    # not count the parkings (the cause is the compensation's error, not RecoveryExhausted).
    assert outcome.state is SagaState.NEEDS_ATTENTION
    assert outcome.error is not None and "psp unreachable" in outcome.error.message
    assert psp.attempts == 10 and psp.applied == []
    row = _charge_row(journal, "o-2")
    assert row.state is StepState.COMPENSATION_FAILED and row.compensation_attempts == 10
    assert drives >= 2  # it really was handed to the worker, more than once
    runner.close()


def test_compensation_inline_is_checked(factory: JournalFactory) -> None:
    from sagaguard.idempotency.errors import ConfigurationError

    with pytest.raises(ConfigurationError):
        SagaRunner(factory.open(), factory.guard(), compensation_inline=-1.0)
    with pytest.raises(ConfigurationError):
        SagaRunner(factory.open(), factory.guard(), compensation_inline=float("nan"))
