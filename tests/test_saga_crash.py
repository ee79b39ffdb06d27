"""Saga crash tests: a real SIGKILL at every boundary of a saga, recovery in a fresh process, and the
outside world's count of what happened.

The saga is :func:`sagaguard.saga.testing.trip_saga`: charge the card, reserve a seat, book a hotel (undone by
a refund, a release, a cancellation), then the pivot, sending the receipt. Every effect and every
compensation is an HTTP call to a :class:`~sagaguard.idempotency.testing.CounterService` running in its own
process, guarded with a reconciler that asks the service about the call's provider key. Two runs
are crashed: one where every step succeeds (``complete``) and one where ``book_hotel`` fails after
its booking reached the service, so the saga compensates (``compensate``).

For each kill point (:func:`sagaguard.saga.testing.kill_points`: before each journal commit, before and after
each guarded effect, inside each compensation) a child runs the saga on a SQLite file (or Postgres)
and is SIGKILLed there; a fresh child recovers it: it runs the same saga id again and takes it over
once the dead runner's lease ran out, or the recovery sweeper (``sagaguard.saga.recovery.recover``) does.
Asserted for every point, at the service: each effect happened at most once; the saga ended
COMPLETED or COMPENSATED (never stuck RUNNING or COMPENSATING); every effect of a compensated trip
was undone exactly once; no guard record is left in progress or in doubt.

The default run covers :data:`CASES`: each kind of point in both runs, the sweeper, the async
driver, crashes during recovery, a few points on Postgres, and a negative control without the guard
that the harness must catch; they run three at a time in one module fixture. ``-m slow`` sweeps
every point of both runs, recovered by rerun and by the sweeper, driven sync and async.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import pytest
from conftest import POSTGRES_URL, postgres_problem, require_postgres

from sagaguard.idempotency import Guard, MemoryStore
from sagaguard.idempotency.testing import CounterClient, CounterService
from sagaguard.saga.definition import Saga, StepContext
from sagaguard.saga.journals.memory import MemoryJournal
from sagaguard.saga.records import LIVE_STATES, SagaState, StepState
from sagaguard.saga.runner import SagaRunner
from sagaguard.saga.testing import (
    CrashingJournal,
    CrashingSagaStore,
    KillPoint,
    PointResult,
    Storage,
    Tripwire,
    kill_points,
    points_of,
    run_kill_point,
    run_kill_point_sweep,
    trace_run,
    trip_ledger,
    trip_problems,
    trip_saga,
)

SCENARIO = "sagaguard.saga.testing:trip_scenario"
LEASE = 0.5
"""The children's runner and guard lease, in real seconds: what a recovery waits for at most."""

pytestmark = pytest.mark.timeout(600)


def _shape() -> Saga[Any]:
    """The trip saga's definition, for its shape only (nothing is called)."""
    return trip_saga(Guard(MemoryStore()), CounterClient("http://127.0.0.1:9"))


RUNS: dict[str, tuple[str, SagaState]] = {
    "complete": ("", SagaState.COMPLETED),
    "compensate": ("book_hotel", SagaState.COMPENSATED),
}
"""run name -> (the step that fails, the state the saga must end in whatever the crash)."""

POINTS: dict[str, list[KillPoint]] = {
    run: kill_points(_shape(), fail_at=fail_at or None) for run, (fail_at, _) in RUNS.items()
}


@dataclass(frozen=True)
class Case:
    """One crash-and-recover scenario of the default suite."""

    run: str
    spec: str
    why: str
    then: tuple[str, ...] = ()
    """Points at which the recovering children die too, one after the other."""
    recovery: str = "rerun"
    driver: str = "sync"
    backend: str = "sqlite"
    guarded: bool = True
    lease: float = LEASE
    """0: the defaults a user gets (the runner's 60 s lease and 10 s wait): a recovery that had to
    wait for the dead runner's lease would give up after the wait (SagaInProgress)."""

    @property
    def id(self) -> str:
        extra = (
            [*self.then, self.recovery, self.driver, self.backend]
            + ([] if self.guarded else ["unguarded"])
            + ([] if self.lease else ["default-lease"])
        )
        return "-".join([self.run, self.spec, *(e for e in extra if e not in ("rerun", "sync", "sqlite"))])


CASES: list[Case] = [
    # Each kind of point (journal, effect, compensation) in both runs, on SQLite.
    Case("complete", "store.claim#1:before", "started with the first step registered, nothing sent"),
    Case("complete", "store.claim#3:after", "hotel claimed, not sent: the reconciler says not applied"),
    Case("complete", "store.complete#2:before", "seat reserved, not recorded: the reconciler finds it"),
    Case("complete", "journal.commit#2:before", "seat recorded by the guard, not in the journal"),
    Case("complete", "journal.commit#4:after", "completed: the rerun replays"),
    Case("compensate", "journal.commit#3:before", "hotel failed after booking, failure not committed"),
    Case("compensate", "store.complete#4:before", "cancellation sent, not recorded (result=None)"),
    Case("compensate", "store.claim#6:after", "the release compensation claimed, not run"),
    Case("compensate", "store.complete#9:before", "refund ran, its compensation record not written"),
    # Recovered by the sweeper (sagaguard.saga.recovery.recover / arecover), and driven by arun.
    Case("complete", "store.complete#2:before", "as above, the sweeper recovers", recovery="sweep"),
    Case("compensate", "store.complete#4:before", "as above, arecover", recovery="sweep", driver="async"),
    Case("compensate", "journal.commit#4:before", "hotel cancelled, not committed; arun", driver="async"),
    # Crashes during recovery.
    Case(
        "complete",
        "store.complete#2:before",
        "seat reserved; the 1st recovery reconciles it and dies before recording; the 2nd books the "
        "hotel and dies before committing; the 3rd finishes",
        then=("store.complete#1:before", "journal.commit#2:before"),
    ),
    Case(
        "compensate",
        "store.complete#4:before",
        "cancellation sent; the recovery reconciles it and dies before recording",
        then=("store.complete#1:before",),
    ),
    Case(
        "compensate",
        "journal.commit#4:before",
        "the sweeper takes the saga over and dies at once; the next sweep takes it again",
        then=("journal.claim#1:after",),
        recovery="sweep",
    ),
    # The defaults a user gets (60 s saga lease, 10 s wait), restarted at once on the same host:
    # killed mid-compensation, the dead runner's saga is taken over at once, never waited for.
    Case("compensate", "store.complete#6:before", "release sent; rerun at once takes it over", lease=0),
    Case(
        "compensate",
        "store.complete#4:before",
        "cancellation sent; the rerun dies too before recording; the next rerun takes it over at once",
        then=("store.complete#1:before",),
        lease=0,
    ),
    Case("compensate", "journal.commit#4:before", "the sweeper takes it at once", recovery="sweep", lease=0),
    # A few on Postgres.
    Case("complete", "store.complete#2:before", "seat reserved, not recorded", backend="postgres"),
    Case("complete", "journal.commit#2:before", "seat not in the journal", backend="postgres"),
    Case("compensate", "store.complete#6:before", "release sent", recovery="sweep", backend="postgres"),
]
"""The default suite's crash scenarios. They run together, a few at a time (:func:`outcomes`)."""

CONTROL = Case("complete", "journal.commit#1:before", "charged, step not committed", guarded=False)
"""The negative control: the same trip without the guard."""


def _point(run: str, spec: str) -> KillPoint:
    wanted = KillPoint.parse(spec)
    for point in POINTS[run]:
        if point == wanted:
            return point
    raise AssertionError(f"{spec} is not a kill point of the {run} run: {[p.spec for p in POINTS[run]]}")


@pytest.fixture(scope="module")
def service() -> Iterator[CounterService]:
    """One counter service for the module; every point charges under its own saga id."""
    with CounterService() as running:
        yield running


def crash_and_recover(service: CounterService, case: Case, storage: Storage) -> PointResult[dict[str, int]]:
    fail_at, _ = RUNS[case.run]
    return run_kill_point(
        _point(case.run, case.spec) if case.guarded else KillPoint.parse(case.spec),
        then=[KillPoint.parse(p) for p in case.then],
        scenario=SCENARIO,
        storage=storage,
        observe=lambda saga_id: trip_ledger(service.client, saga_id),
        params={"service": service.url, "fail_at": fail_at, "guarded": "yes" if case.guarded else "no"},
        lease=case.lease,
        recovery=case.recovery,
        driver=case.driver,
    )


@pytest.fixture(scope="module")
def outcomes(
    service: CounterService, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[Case, PointResult[dict[str, int]]]]:
    """Every case of :data:`CASES` (and the control), three at a time: each is a few child
    processes that mostly import and wait, so running them side by side keeps the suite short.
    Postgres cases are left out when Postgres does not answer (their test then skips or fails)."""
    root = tmp_path_factory.mktemp("sagacrash")
    prefixes: list[str] = []

    def storage(case: Case, i: int) -> Storage:
        if case.backend == "postgres":
            prefix = f"sgk_{uuid.uuid4().hex[:10]}_"
            prefixes.append(prefix)
            return Storage(POSTGRES_URL, POSTGRES_URL, journal_prefix=prefix, store_table=f"{prefix}effects")
        return Storage.sqlite(root / f"case{i}.db")

    todo = [c for c in [*CASES, CONTROL] if c.backend != "postgres" or postgres_problem() is None]

    def one(indexed: tuple[int, Case]) -> PointResult[dict[str, int]]:
        i, case = indexed
        return crash_and_recover(service, case, storage(case, i))

    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=int(os.environ.get("SAGAGUARD_CRASH_WORKERS", "3"))) as pool:
        done = list(pool.map(one, enumerate(todo)))
    print(f"\n{len(todo)} crash cases in {time.monotonic() - started:.1f} s")
    yield dict(zip(todo, done, strict=True))
    if prefixes:
        import psycopg
        from psycopg import sql

        with psycopg.connect(POSTGRES_URL, autocommit=True, connect_timeout=5) as conn:
            for prefix in prefixes:
                tables = ("sagas", "saga_steps", "saga_signals", "effects")
                for table in (*tables, "effects_version", "journal_version"):
                    name = sql.Identifier(prefix + table)
                    conn.execute(sql.SQL("DROP TABLE IF EXISTS {} CASCADE").format(name))


def check(run: str, result: PointResult[dict[str, int]]) -> None:
    """Everything a kill point must leave true, counted at the service and read in the journal."""
    where = f"{run} run, killed at {result.point}"
    assert not result.problems(), f"{where}: {result.problems()}"
    _, expected = RUNS[run]
    assert result.state is expected, f"{where}: ended {result.state}, {result.recovered}"
    assert not trip_problems(result.state, result.seen), (
        f"{where}: {trip_problems(result.state, result.seen)}"
    )
    ledger = result.seen
    if expected is SagaState.COMPLETED:
        assert ledger == {"card.charge": 1, "seat.reserve": 1, "hotel.book": 1, "receipt.send": 1}, where
    else:
        assert ledger == {
            "card.charge": 1,
            "card.refund": 1,
            "seat.reserve": 1,
            "seat.release": 1,
            "hotel.book": 1,
            "hotel.cancel": 1,
        }, where
    assert result.snapshot is not None
    states = [row.state for row in result.snapshot.steps]
    if expected is SagaState.COMPLETED:
        assert states == [StepState.SUCCEEDED] * 4, where
    else:
        assert states == [StepState.COMPENSATED] * 3, where
    if point_is_after_the_end(result.point, run):
        assert result.crashed_state is expected and result.recovered.get("replayed") is True, where


def point_is_after_the_end(point: KillPoint, run: str) -> bool:
    return point == POINTS[run][-1]


# ------------------------------------------------------------------------- the points themselves


def test_the_points_of_both_runs() -> None:
    """The enumeration covers every boundary once, in order, with a label; the subset spans every
    kind of point in both runs."""
    for run, points in POINTS.items():
        assert len(points) == len(set(points)), run
        assert points[0].spec == "journal.start#1:before"
        assert points[-1].when == "after" and points[-1].method == "commit"
        assert all(p.label for p in points)
    assert len(POINTS["complete"]) == 18  # 1 start, 4 commits, 4 effects x (claim before/after, sent)
    kinds = {(case.run, _point(case.run, case.spec).kind) for case in CASES}
    assert kinds >= {("complete", "journal"), ("complete", "effect")}
    assert kinds >= {("compensate", "journal"), ("compensate", "compensation")}
    compensation = [p for p in POINTS["compensate"] if p.kind == "compensation"]
    assert {p.step for p in compensation} == {"book_hotel", "reserve_seat", "charge_card"}


@pytest.mark.parametrize("spec", ["journal.commit#3:before", "store.claim#12:after", "store.fail#1:before"])
def test_a_kill_point_reads_back_from_its_spec(spec: str) -> None:
    assert KillPoint.parse(spec).spec == spec


@pytest.mark.parametrize("spec", ["journal.commit#0:before", "journal.load#1:before", "store.claim#1", "x"])
def test_a_malformed_kill_point_is_refused(spec: str) -> None:
    with pytest.raises(ValueError):
        KillPoint.parse(spec)


class Died(BaseException):
    """What the in-process kill raises instead of SIGKILL (nothing on the way may catch it)."""


def _die(point: str) -> NoReturn:
    raise Died(point)


def test_the_crashing_journal_dies_before_and_after_the_nth_commit_in_process() -> None:
    """The wrappers the children use, without a child: ``before`` leaves the commit unwritten,
    ``after`` leaves it written."""
    for when, committed in (("before", 1), ("after", 2)):
        tripwire = Tripwire(KillPoint("journal", "commit", 1, when), kill=_die)
        inner = MemoryJournal()
        journal = CrashingJournal(inner, tripwire)
        guard = Guard(CrashingSagaStore(MemoryStore(), tripwire), sleep=lambda _s: None)
        saga = _noop_saga()
        with pytest.raises(Died, match=r"journal\.commit#1:" + when):
            SagaRunner(journal, guard).run(saga, "s-1", None)
        snapshot = inner.load("s-1")
        assert snapshot is not None and snapshot.saga.state is SagaState.RUNNING
        # the start registers step a; commit 1 records it and starts b.
        assert len(snapshot.steps) == committed
        guard.close()


def _noop_saga() -> Saga[None]:
    noop: Saga[None] = Saga("noop", input=type(None))

    @noop.step(compensate=None)
    def a(ctx: StepContext, _input: None) -> int:
        return 1

    @noop.step(compensate=None)
    def b(ctx: StepContext, _input: None) -> int:
        return 2

    return noop


@pytest.mark.parametrize("run", list(RUNS))
def test_the_enumerated_points_match_a_real_run(run: str, service: CounterService, tmp_path: Path) -> None:
    """The shadow run behind :func:`kill_points` meets the same boundaries, in the same order, as
    the real trip in a child process (effect names aside), and an undisturbed run ends as expected."""
    fail_at, expected = RUNS[run]
    outcome, events = trace_run(
        scenario=SCENARIO,
        storage=Storage.sqlite(tmp_path / "trace.db"),
        params={"service": service.url, "fail_at": fail_at},
    )
    assert outcome["state"] == expected.value
    assert [p.spec for p in points_of(events)] == [p.spec for p in POINTS[run]]


def test_the_checks_catch_what_they_are_for() -> None:
    """The trip's checks are not vacuous: a duplicate, a missing undo, a stuck saga each show."""
    once = {"card.charge": 1, "seat.reserve": 1, "hotel.book": 1, "receipt.send": 1}
    assert trip_problems(SagaState.COMPLETED, once) == []
    assert trip_problems(SagaState.COMPLETED, {**once, "card.charge": 2})
    assert trip_problems(SagaState.COMPLETED, {**once, "card.refund": 1})
    assert trip_problems(SagaState.COMPLETED, {**once, "receipt.send": 0})
    undone = {"card.charge": 1, "card.refund": 1, "seat.reserve": 1, "seat.release": 1}
    assert trip_problems(SagaState.COMPENSATED, undone) == []
    assert trip_problems(SagaState.COMPENSATED, {**undone, "seat.release": 0})
    assert trip_problems(SagaState.COMPENSATED, {**undone, "hotel.book": 1})
    assert trip_problems(SagaState.RUNNING, once)
    assert trip_problems(SagaState.NEEDS_ATTENTION, {"card.charge": 1}) == []


def test_kill_points_refuse_what_they_cannot_shadow() -> None:
    with pytest.raises(ValueError, match="not a step"):
        kill_points(_shape(), fail_at="fly")
    waits: Saga[None] = Saga("waits", input=type(None))
    waits.wait("approved")
    with pytest.raises(ValueError, match="waits for signals"):
        kill_points(waits)


# ------------------------------------------------------------------------ crash, then recover


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_kill_then_recover_in_a_fresh_process(
    case: Case, outcomes: dict[Case, PointResult[dict[str, int]]]
) -> None:
    """SIGKILL at the point (and at ``then`` in the recovering children), recover in a fresh
    process: each effect at most once at the service, the saga COMPLETED or COMPENSATED with every
    effect undone, no guard record in doubt."""
    if case.backend == "postgres":
        require_postgres()
    result = outcomes[case]
    check(case.run, result)
    if case.recovery == "sweep" and result.crashed_state in LIVE_STATES:
        assert result.recovered["swept"] is True, "the sweeper did not drive the saga: the rerun did"
        assert result.recovered["replayed"] is True
    if case.then:
        assert result.snapshot is not None
        assert result.snapshot.saga.recoveries >= len(case.then) + 1


def test_the_harness_sees_a_duplicate_when_effects_are_not_guarded(
    outcomes: dict[Case, PointResult[dict[str, int]]],
) -> None:
    """The negative control: the same trip with plain HTTP calls, killed after the charge but
    before its step is committed, charges twice, and the harness says so."""
    result = outcomes[CONTROL]
    assert not result.problems()  # killed there, recovered, completed: the journal is content...
    assert result.state is SagaState.COMPLETED
    assert result.seen["card.charge"] == 2  # ...but the card was charged twice
    assert trip_problems(result.state, result.seen) == ["card.charge happened 2 times"]


# --------------------------------------------------------------------------------- the sweep


@pytest.mark.slow
# Minutes, not seconds: it runs only when asked for (-m slow, `make slow`), whatever the default
# marker selection is.
@pytest.mark.skipif("'slow' not in config.getoption('markexpr')", reason="the sweep runs with -m slow")
@pytest.mark.parametrize("driver", ["sync", "async"])
@pytest.mark.parametrize("recovery", ["rerun", "sweep"])
@pytest.mark.parametrize("run", list(RUNS))
def test_sweep_every_kill_point(
    run: str, recovery: str, driver: str, service: CounterService, tmp_path: Path
) -> None:
    """Every point of the run, two at a time, recovered by a rerun of the saga id or by the
    recovery sweeper, driven sync or async; one report listing every point that failed."""
    fail_at, _ = RUNS[run]
    started = time.monotonic()
    results = run_kill_point_sweep(
        POINTS[run],
        scenario=SCENARIO,
        storage=lambda i: Storage.sqlite(tmp_path / f"p{i}.db"),
        observe=lambda saga_id: trip_ledger(service.client, saga_id),
        params={"service": service.url, "fail_at": fail_at},
        lease=LEASE,
        recovery=recovery,
        driver=driver,
        workers=int(os.environ.get("SAGAGUARD_SWEEP_WORKERS", "2")),
    )
    failures = []
    for result in results:
        try:
            check(run, result)
        except AssertionError as exc:
            failures.append(f"{result.point}: {exc}")
    print(
        f"\n{run}/{recovery}/{driver}: swept {len(results)} kill points in {time.monotonic() - started:.1f} s"
    )
    assert len(results) == len(POINTS[run])
    assert not failures, "\n".join(failures)
    if recovery == "sweep":  # the sweeper, not the rerun, drove every saga it found unfinished
        assert all(r.recovered.get("swept") for r in results if r.crashed_state in LIVE_STATES)
