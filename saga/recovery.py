"""The recovery sweeper: continue sagas whose runner is gone, or whose wait is over.

:func:`recover` asks the journal for *due* sagas (running or compensating with an expired lease,
or with a live one whose holder is provably dead on this host, see :mod:`sagaguard.saga.lease`; waiting
with their signal delivered, their deadline passed or a cancellation pending), claims each
(one conditional write: of any number of workers racing for a saga exactly one gets it), looks up
its definition by the name and version its journal records, and drives it on: forward from the
first unfinished step (the guard resolves that step's in-doubt effects), or on with compensation.
A saga taken over more often than ``max_recoveries`` is parked as NEEDS_ATTENTION instead.

:class:`RecoveryWorker` runs it in a loop with a graceful stop; ``sagaguard sagas worker`` runs
that worker from the command line::

    worker = RecoveryWorker(journal, guard, SagaRegistry(trip_v1, trip_v2), interval=5)
    worker.run()          # until worker.stop() (or SIGTERM, with run_worker)
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import signal as signals
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from sagaguard.idempotency.backends.offload import in_thread
from sagaguard.idempotency.checks import count, seconds
from sagaguard.idempotency.codec import decode_error, encode_error
from sagaguard.idempotency.errors import CodecError
from sagaguard.idempotency.guard import Guard
from sagaguard.saga.definition import Saga
from sagaguard.saga.errors import DefinitionMismatch, LostSagaLease, UnknownSaga
from sagaguard.saga.journal import SagaJournal
from sagaguard.saga.records import Phase, SagaOutcome, SagaSnapshot, SagaState
from sagaguard.saga.registry import SagaRegistry, as_registry
from sagaguard.saga.runner import DEFAULT_MAX_RECOVERIES, SagaRunner

__all__ = ["RecoveryReport", "RecoveryWorker", "arecover", "recover", "run_worker"]

log = logging.getLogger("sagaguard.saga.recovery")

Sagas = SagaRegistry | Saga[Any] | Iterable[Saga[Any]]


@dataclass(frozen=True, slots=True)
class RecoveryReport:
    """What one sweep did.

    Attributes:
        found: due sagas the journal listed.
        outcomes: sagas this sweep claimed and drove, by id: where each ended (or waits again).
        lost: sagas another worker claimed first (or that stopped being due): left alone.
        skipped: due sagas whose definition (name, version) is not registered here, with the
            reason: not claimed, so a worker that knows them takes them.
        errors: sagas claimed but not finished because the journal or guard failed, with the
            error; their lease runs out and a later sweep tries again.
    """

    found: int = 0
    outcomes: Mapping[str, SagaOutcome] = field(default_factory=dict)
    lost: tuple[str, ...] = ()
    skipped: Mapping[str, str] = field(default_factory=dict)
    errors: Mapping[str, str] = field(default_factory=dict)

    @property
    def recovered(self) -> tuple[str, ...]:
        """The ids of the sagas this sweep drove."""
        return tuple(self.outcomes)


def _runner(
    journal: SagaJournal,
    guard: Guard,
    *,
    registry: SagaRegistry,
    runner: SagaRunner | None,
    lease: float,
    max_recoveries: int | None,
    sleep: Callable[[float], None],
) -> SagaRunner:
    seconds("lease", lease)  # checked even when a given runner's own lease is used instead
    if runner is not None:
        return runner
    return SagaRunner(
        journal, guard, lease=lease, max_recoveries=max_recoveries, registry=registry, sleep=sleep
    )


class _Sweep:
    """Collects a report while the sweep runs."""

    def __init__(self) -> None:
        self.found = 0
        self.outcomes: dict[str, SagaOutcome] = {}
        self.lost: list[str] = []
        self.skipped: dict[str, str] = {}
        self.errors: dict[str, str] = {}

    def report(self) -> RecoveryReport:
        return RecoveryReport(self.found, self.outcomes, tuple(self.lost), self.skipped, self.errors)


def _candidates(
    journal: SagaJournal, registry: SagaRegistry, runner: SagaRunner, limit: int, sweep: _Sweep
) -> list[tuple[Saga[Any], SagaSnapshot]]:
    """Claim the due sagas this process knows how to run."""
    claimed: list[tuple[Saga[Any], SagaSnapshot]] = []
    due = journal.due(limit=limit)
    sweep.found = len(due)
    for record in due:
        try:
            saga = registry.get(record.name, record.version)
        except UnknownSaga as exc:
            sweep.skipped[record.saga_id] = str(exc)
            continue
        snapshot = journal.claim(record.saga_id, lease=runner.lease)
        if snapshot is None:
            sweep.lost.append(record.saga_id)
            continue
        claimed.append((saga, snapshot))
    return claimed


def _park(journal: SagaJournal, snapshot: SagaSnapshot, exc: Exception) -> SagaOutcome:
    """Park a claimed saga its definition cannot run (changed steps, unreadable input)."""
    record = snapshot.saga
    text = encode_error(exc)
    journal.commit(record.saga_id, record.token, Phase(state=SagaState.NEEDS_ATTENTION, error=text))
    log.error("saga %s parked for an operator: %s", record.saga_id, exc)
    return SagaOutcome(record.saga_id, SagaState.NEEDS_ATTENTION, error=decode_error(text))


def _settle(
    journal: SagaJournal, sweep: _Sweep, saga_id: str, snapshot: SagaSnapshot, exc: Exception
) -> None:
    if isinstance(exc, LostSagaLease):
        sweep.lost.append(saga_id)
    elif isinstance(exc, DefinitionMismatch | CodecError):
        try:
            sweep.outcomes[saga_id] = _park(journal, snapshot, exc)
        except Exception as again:
            sweep.errors[saga_id] = f"{type(again).__name__}: {again}"
    else:
        log.warning("recovering saga %s failed: %s", saga_id, exc, exc_info=exc)
        sweep.errors[saga_id] = f"{type(exc).__name__}: {exc}"


def recover(
    journal: SagaJournal,
    guard: Guard,
    registry: Sagas,
    *,
    limit: int = 100,
    lease: float = 60.0,
    max_recoveries: int | None = DEFAULT_MAX_RECOVERIES,
    sleep: Callable[[float], None] = time.sleep,
    runner: SagaRunner | None = None,
) -> RecoveryReport:
    """One sweep: claim up to ``limit`` due sagas and drive each until it ends or waits again.

    Args:
        journal: where the sagas are recorded.
        guard: the effect guard their steps use (the same store their first runner used).
        registry: the definitions this process can run (a registry, one saga, or several).
        limit: at most this many sagas per sweep.
        lease: seconds this worker's lease lasts after each commit (renewed while steps run).
        max_recoveries: take-overs after a lost lease before a saga needs attention; None: no cap.
        sleep: the sleep between step retries (inject one in tests).
        runner: drive with this runner instead (then ``lease``, ``max_recoveries`` and ``sleep``
            are its own).

    Returns:
        What the sweep did. A journal error while listing propagates; errors while driving one
        saga are reported and the sweep goes on. A saga whose journal no longer matches its
        definition (:class:`~sagaguard.saga.errors.StepMismatch`) or whose input no longer reads back is
        parked as NEEDS_ATTENTION with that error.

    Raises:
        ConfigurationError: ``lease`` is not a finite number of seconds > 0 or ``limit`` not an
            int >= 1 (naming the option), before anything is claimed.
    """
    reg = as_registry(registry)
    limit = count("limit", limit)
    drive = _runner(
        journal, guard, registry=reg, runner=runner, lease=lease, max_recoveries=max_recoveries, sleep=sleep
    )
    sweep = _Sweep()
    for saga, snapshot in _candidates(journal, reg, drive, limit, sweep):
        saga_id = snapshot.saga.saga_id
        try:
            definition = saga.for_run(snapshot, drive.guard)  # an agent run's: built from its rows
            if _has_async(definition):
                sweep.outcomes[saga_id] = asyncio.run(drive.aresume(definition, snapshot))
            else:
                sweep.outcomes[saga_id] = drive.resume(definition, snapshot)
        except Exception as exc:
            _settle(journal, sweep, saga_id, snapshot, exc)
    if runner is None:
        drive.close()
    return sweep.report()


async def arecover(
    journal: SagaJournal,
    guard: Guard,
    registry: Sagas,
    *,
    limit: int = 100,
    lease: float = 60.0,
    max_recoveries: int | None = DEFAULT_MAX_RECOVERIES,
    runner: SagaRunner | None = None,
) -> RecoveryReport:
    """The async twin of :func:`recover`: journal calls and sync steps run in worker threads."""
    reg = as_registry(registry)
    limit = count("limit", limit)
    drive = _runner(
        journal,
        guard,
        registry=reg,
        runner=runner,
        lease=lease,
        max_recoveries=max_recoveries,
        sleep=time.sleep,
    )
    sweep = _Sweep()
    claimed = await in_thread(_candidates, journal, reg, drive, limit, sweep)
    for saga, snapshot in claimed:
        saga_id = snapshot.saga.saga_id
        try:
            definition = saga.for_run(snapshot, drive.guard)
            sweep.outcomes[saga_id] = await drive.aresume(definition, snapshot)
        except Exception as exc:
            await in_thread(_settle, journal, sweep, saga_id, snapshot, exc)
    if runner is None:
        drive.close()
    return sweep.report()


def _has_async(saga: Saga[Any]) -> bool:
    return any(
        inspect.iscoroutinefunction(s.action)
        or (s.compensation_fn is not None and inspect.iscoroutinefunction(s.compensation_fn))
        for s in saga.steps
    )


class RecoveryWorker:
    """Runs :func:`recover` every ``interval`` seconds until :meth:`stop`.

    A sweep that found a full page (``limit`` sagas) is followed at once by the next. :meth:`stop`
    lets the saga being driven reach its end (or its next wait) and then returns from :meth:`run`.

    Args:
        journal, guard, registry: as for :func:`recover`.
        interval: seconds between sweeps (0: back to back).
        limit, lease, max_recoveries, sleep: as for :func:`recover`.
        on_report: called with each sweep's report (logging, metrics).

    Raises:
        ConfigurationError: ``interval`` is not a finite number of seconds >= 0, ``lease`` not one
            > 0, ``limit`` not an int >= 1 (or as for :class:`~sagaguard.saga.runner.SagaRunner`),
            naming the option; nothing has run then.
    """

    def __init__(
        self,
        journal: SagaJournal,
        guard: Guard,
        registry: Sagas,
        *,
        interval: float = 5.0,
        limit: int = 100,
        lease: float = 60.0,
        max_recoveries: int | None = DEFAULT_MAX_RECOVERIES,
        sleep: Callable[[float], None] = time.sleep,
        on_report: Callable[[RecoveryReport], None] | None = None,
    ) -> None:
        self.journal = journal
        self.guard = guard
        self.registry = as_registry(registry)
        # A NaN or negative interval would make run() sweep without pausing; 0 (back to back) is
        # a choice, for tests and drains.
        self.interval = seconds("interval", interval, zero_ok=True)
        self.limit = count("limit", limit)
        self.runner = SagaRunner(
            journal, guard, lease=lease, max_recoveries=max_recoveries, registry=self.registry, sleep=sleep
        )
        self._on_report = on_report
        self._stop = threading.Event()
        self.sweeps = 0

    def run_once(self) -> RecoveryReport:
        """One sweep."""
        report = recover(self.journal, self.guard, self.registry, limit=self.limit, runner=self.runner)
        self.sweeps += 1
        if report.found or report.errors:
            log.info(
                "recovery sweep: %d due, %d driven, %d taken by others, %d skipped, %d failed",
                report.found, len(report.outcomes), len(report.lost), len(report.skipped),
                len(report.errors),
            )  # fmt: skip
        if self._on_report is not None:
            self._on_report(report)
        return report

    def run(self, *, sweeps: int | None = None) -> None:
        """Sweep until :meth:`stop` (or ``sweeps`` sweeps). A sweep that fails is logged and retried
        after ``interval``."""
        done = 0
        try:
            while not self._stop.is_set() and (sweeps is None or done < sweeps):
                try:
                    report = self.run_once()
                    backlog = report.found >= self.limit
                except Exception as exc:
                    log.warning("recovery sweep failed, will retry: %s", exc)
                    backlog = False
                done += 1
                if not backlog and (sweeps is None or done < sweeps):
                    self._stop.wait(self.interval)
        finally:
            self.runner.close()

    def stop(self) -> None:
        """Ask :meth:`run` to return after the saga it is driving (thread- and signal-safe)."""
        self._stop.set()

    @property
    def stopping(self) -> bool:
        """Whether :meth:`stop` was called."""
        return self._stop.is_set()


def run_worker(
    journal: SagaJournal,
    guard: Guard,
    registry: Sagas,
    *,
    handle_signals: bool = True,
    **options: Any,
) -> RecoveryWorker:
    """Run a :class:`RecoveryWorker` in this thread until SIGINT or SIGTERM; returns it, stopped.

    Args:
        journal, guard, registry: as for :func:`recover`.
        handle_signals: install SIGINT/SIGTERM handlers that stop the worker gracefully (main
            thread only; they are restored afterwards).
        options: passed to :class:`RecoveryWorker` (``interval``, ``limit``, ``lease``, ...).
    """
    worker = RecoveryWorker(journal, guard, registry, **options)
    previous: dict[signals.Signals, Any] = {}
    if handle_signals and threading.current_thread() is threading.main_thread():
        for sig in (signals.SIGINT, signals.SIGTERM):
            previous[sig] = signals.signal(sig, lambda _n, _f: worker.stop())
    try:
        worker.run()
    finally:
        for number, handler in previous.items():
            signals.signal(number, handler)
    return worker
