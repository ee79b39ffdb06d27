"""The saga's atomic phases, counted: the start registers the first step, every later commit records
one step's result with the next step's start, and a saga of n steps makes n + 1 journal commits.

``start(first=...)`` is held to its contract on every backend; a journal written against the older
contract (no ``first``) still runs sagas, with one more commit; a fenced phase that is refused
writes no step row; a replayed start leaves no span behind for the step it did not register.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _guardutil import span_exporter
from _sagajournals import JOURNALS, JournalFactory, factory_for
from conftest import FakeClock

from sagaguard.idempotency import Guard, MemoryStore
from sagaguard.saga import (
    LostSagaLease,
    MemoryJournal,
    Phase,
    Saga,
    SagaJournal,
    SagaRunner,
    SagaState,
    StartOutcome,
    StartResult,
    StepContext,
    StepKind,
    StepRecord,
    StepState,
)

T0 = FakeClock.START
_NAME = "sagaguard.saga.name"

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(params=JOURNALS)
def journal_factory(
    request: pytest.FixtureRequest, clock: FakeClock, tmp_path: Path
) -> Iterator[JournalFactory]:
    yield from factory_for(request.param, clock, tmp_path)


@pytest.fixture
def journal(journal_factory: JournalFactory) -> SagaJournal:
    return journal_factory.open()


def _first(index: int = 0) -> StepRecord:
    return StepRecord(
        index, f"step{index}", StepKind.COMPENSATABLE, StepState.STARTED, compensation="undo", trace="00-ab"
    )


def _start(journal: SagaJournal, first: StepRecord | None, **changes: Any) -> StartResult:
    options: dict[str, Any] = {"name": "trip", "version": 1, "input": "{}", "fingerprint": "fp1"}
    options.update(lease=30.0, **changes)
    return journal.start("s-1", first=first, **options)


# ------------------------------------------------------------------------------ the contract


def test_a_created_saga_has_its_first_step_registered_in_the_same_commit(
    journal: SagaJournal, clock: FakeClock
) -> None:
    started = _start(journal, _first())
    assert started.outcome is StartOutcome.CREATED
    expected = _first().evolve(started_at=T0, updated_at=T0)
    assert started.snapshot.steps == (expected,)
    clock.advance(5)
    loaded = journal.load("s-1")
    assert loaded is not None and loaded.steps == (expected,)
    assert loaded.saga.token == 1 and loaded.saga.updated_at == T0


def test_the_first_step_is_ignored_unless_the_start_creates_the_saga(
    journal: SagaJournal, clock: FakeClock
) -> None:
    _start(journal, None)
    existing = _start(journal, _first())
    assert existing.outcome is StartOutcome.EXISTING and existing.snapshot.steps == ()
    clock.advance(31)
    taken = _start(journal, _first())
    assert taken.outcome is StartOutcome.TOOK_OVER and taken.snapshot.steps == ()
    loaded = journal.load("s-1")
    assert loaded is not None and loaded.steps == ()


def test_a_refused_phase_writes_no_step_row(journal: SagaJournal, clock: FakeClock) -> None:
    token = _start(journal, _first()).snapshot.saga.token
    clock.advance(31)
    assert journal.claim("s-1", lease=30) is not None  # another runner took the saga over
    done = _first().evolve(state=StepState.SUCCEEDED, result="1")
    with pytest.raises(LostSagaLease):
        journal.commit("s-1", token, Phase(steps=(done, _first(1)), lease=30))
    loaded = journal.load("s-1")
    assert loaded is not None
    assert [(row.index, row.state) for row in loaded.steps] == [(0, StepState.STARTED)]


def test_a_phase_keeps_the_first_steps_start_time(journal: SagaJournal, clock: FakeClock) -> None:
    token = _start(journal, _first()).snapshot.saga.token
    clock.advance(2)
    done = _first().evolve(state=StepState.SUCCEEDED, result="1", attempts=1)
    journal.commit("s-1", token, Phase(steps=(done, _first(1)), lease=30))
    loaded = journal.load("s-1")
    assert loaded is not None
    assert [(row.state, row.started_at, row.updated_at) for row in loaded.steps] == [
        (StepState.SUCCEEDED, T0, T0 + 2),
        (StepState.STARTED, T0 + 2, T0 + 2),
    ]
    assert loaded.steps[0].result == "1" and loaded.steps[0].trace == "00-ab"


# ------------------------------------------------------------------------------ the runner


class CountingJournal:
    """Counts the writes a runner makes (start, commit) on the journal it wraps."""

    def __init__(self, inner: SagaJournal) -> None:
        self.inner = inner
        self.starts = 0
        self.commits: list[Phase] = []

    def start(self, saga_id: str, **options: Any) -> StartResult:
        self.starts += 1
        return self.inner.start(saga_id, **options)

    def commit(self, saga_id: str, token: int, phase: Phase) -> Any:
        if phase.steps or phase.state is not None:  # lease renewals are timing, not phases
            self.commits.append(phase)
        return self.inner.commit(saga_id, token, phase)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class OlderJournal(CountingJournal):
    """A journal written before ``start`` took ``first``: its start has no such parameter."""

    def start(  # type: ignore[override]
        self, saga_id: str, *, name: str, version: int, input: str, fingerprint: str, lease: float
    ) -> StartResult:
        self.starts += 1
        return self.inner.start(
            saga_id, name=name, version=version, input=input, fingerprint=fingerprint, lease=lease
        )


def _saga(steps: int, name: str = "chain") -> Saga[int]:
    chain: Saga[int] = Saga(name, input=int)
    for k in range(steps):

        def action(ctx: StepContext, value: int, k: int = k) -> int:
            return value + k

        chain.step(name=f"s{k}", compensate=None)(action)
    return chain


@pytest.mark.parametrize("steps", [1, 2, 5])
def test_a_saga_of_n_steps_makes_n_plus_one_commits(journal: SagaJournal, steps: int) -> None:
    counting = CountingJournal(journal)
    runner = SagaRunner(counting, Guard(MemoryStore()), renewer=False)  # type: ignore[arg-type]
    outcome = runner.run(_saga(steps), "s-1", 10)
    assert outcome.state is SagaState.COMPLETED
    assert outcome.results == {f"s{k}": 10 + k for k in range(steps)}
    assert counting.starts == 1 and len(counting.commits) == steps
    # Every commit records one step's success; all but the last start the next step, the last
    # completes the saga.
    for k, phase in enumerate(counting.commits):
        states = [(row.index, row.state) for row in phase.steps]
        if k < steps - 1:
            assert states == [(k, StepState.SUCCEEDED), (k + 1, StepState.STARTED)] and phase.state is None
        else:
            assert states == [(k, StepState.SUCCEEDED)] and phase.state is SagaState.COMPLETED
    loaded = journal.load("s-1")
    assert loaded is not None and [row.state for row in loaded.steps] == [StepState.SUCCEEDED] * steps


def test_a_journal_without_first_still_runs_sagas_with_one_more_commit() -> None:
    older = OlderJournal(MemoryJournal())
    runner = SagaRunner(older, Guard(MemoryStore()), renewer=False)  # type: ignore[arg-type]
    outcome = runner.run(_saga(3), "s-1", 1)
    assert outcome.state is SagaState.COMPLETED and outcome.results == {"s0": 1, "s1": 2, "s2": 3}
    assert older.starts == 1 and len(older.commits) == 4
    assert [(row.index, row.state) for row in older.commits[0].steps] == [(0, StepState.STARTED)]


def test_a_replayed_start_leaves_no_span_for_the_step_it_did_not_register() -> None:
    exporter = span_exporter()
    if exporter is None:
        pytest.skip("a non-SDK tracer provider is installed")
    name = f"chain_{uuid.uuid4().hex[:8]}"  # the exporter may also see other tests' spans

    def spans() -> list[str]:
        mine = [s for s in exporter.get_finished_spans() if (s.attributes or {}).get(_NAME) == name]
        return sorted(span.name for span in mine)

    journal = MemoryJournal()
    runner = SagaRunner(journal, Guard(MemoryStore()), renewer=False)
    chain = _saga(2, name)
    assert runner.run(chain, "s-1", 1).state is SagaState.COMPLETED
    assert spans() == [f"saga {name}", "saga.step s0", "saga.step s1"]
    exporter.clear()
    again = runner.run(chain, "s-1", 1)
    assert again.replayed
    assert spans() == [f"saga {name}"]
    loaded = journal.load("s-1")
    assert loaded is not None and loaded.steps[0].trace is not None
    exporter.clear()
