"""The saga kill-point harness, shipped to users: SIGKILL a saga at every boundary, recover it in a
fresh process, and count at the outside world what happened.

A saga is crash-safe when, wherever its process dies, a fresh process finishes it (COMPLETED,
COMPENSATED, or parked as NEEDS_ATTENTION, never stuck RUNNING or COMPENSATING) and the world saw each
effect at most once, with every effect of a compensated saga undone. This module tests exactly that,
with real processes and a real ``SIGKILL`` (no ``finally``, no ``atexit``, no flush)::

    from saga.testing import Storage, kill_points, run_kill_point_sweep

    points = kill_points(my_saga, fail_at="book_hotel")      # every distinct crash boundary
    results = run_kill_point_sweep(
        points,
        scenario="myapp.crashtests:scenario",                # builds the saga in the child process
        storage=lambda n: Storage.sqlite(tmp_dir / f"point{n}.db"),
        observe=lambda saga_id: my_service.effects_for(saga_id),   # what the world saw
    )
    for result in results:
        assert not result.problems(), (result.point.label, result.problems())
        assert my_checks(result.state, result.seen) == []

**Kill points.** A :class:`KillPoint` names the N-th call of one journal or store method and
``before`` or ``after`` it: ``journal.commit#3:before`` (step 1's success and step 2's start are
not yet committed), ``store.complete#2:before`` (the second guarded effect happened, its record is
not written: the in-doubt crash), ``store.claim#4:after`` (claimed, not yet sent). The child wraps
its journal in :class:`CrashingJournal` and its store in :class:`CrashingSagaStore`; both count
calls and SIGKILL the process at the point. Nothing in production code knows about them.

:func:`kill_points` enumerates the points of a saga without touching the world: it runs a *shadow*
of the saga (same steps, kinds, retries and compensations, each action making ``effects`` no-op
guarded calls) on an in-memory journal and store, records the sequence of journal and store calls,
and returns one point per distinct durable state: before each write, after each claim that wins
its record (the effect has not been sent yet), and after the last write. With ``fail_at`` the
named step fails, so the points cover the compensation run. If the saga's real steps make more or
fewer guarded calls than the shadow assumes, pass ``effects=``; :func:`trace_run` records a real
run to compare against.

**Scenarios.** The child process builds the saga from a *scenario factory* named ``module:attr``: a
callable ``factory(guard, params) -> Scenario`` that declares the saga's effects with the given
:class:`~idempotency.guard.Guard` (its store is the crashing one) and returns the saga and its input.
``params`` are strings: the ``--param k=v`` of the command line plus ``saga_id``.
:func:`trip_scenario` is the worked example: a four-step trip (charge the card, reserve a seat, book
a hotel, send the receipt; undone by refund, release, cancel) whose every effect and compensation
is an HTTP call to an :class:`~idempotency.testing.CounterService` in its own process, guarded with
a reconciler that asks the service whether an effect with the call's provider key happened.

**One point** (:func:`run_kill_point`): a child runs the saga and is SIGKILLed at the point; a fresh
child (started alongside, warmed up and waiting at a gate, so it costs no import time) recovers it,
by running the same saga id again (``recovery="rerun"``: the runner takes the saga over once the dead
runner's short lease ran out) or through :func:`saga.recovery.recover` (``recovery="sweep"``, then
the rerun, which replays what the sweeper recorded). The result holds the journal's state after
the crash and after the recovery, the guard records left unsettled, and whatever ``observe`` saw.
:meth:`PointResult.problems` lists the generic violations; the scenario's own checks
(:func:`trip_problems`) count at the service. With ``then=[...]`` the recovering children are
killed too, each at its own point (counted from its own start), before a last one finishes:
crashes during recovery.

The child is ``python -m saga.testing child --scenario M:F --saga-id ID --journal URL --store URL
[--kill SPEC] ...`` (see ``--help``); it prints one JSON line with the outcome.
"""

from __future__ import annotations

import argparse
import asyncio
import builtins
import contextlib
import importlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, NoReturn, TypeVar

import tenacity

from idempotency.effect import Retry, current_effect
from idempotency.errors import NotApplied
from idempotency.guard import Guard
from idempotency.keys import EffectIdentity
from idempotency.records import ClaimOutcome, ClaimResult, Disposition, Record, State
from idempotency.store import IdempotencyStore
from idempotency.stores.memory import MemoryStore
from idempotency.testing import Charge, CounterClient, sigkill
from saga.definition import Saga, StepContext
from saga.journal import SagaJournal
from saga.journals.memory import MemoryJournal
from saga.records import (
    LIVE_STATES,
    Phase,
    SagaOutcome,
    SagaRecord,
    SagaSnapshot,
    SagaState,
    StartOutcome,
    StartResult,
    StepKind,
)
from saga.recovery import arecover, recover
from saga.runner import SagaRunner

__all__ = [
    "JOURNAL_METHODS",
    "STORE_METHODS",
    "TRIP_EFFECTS",
    "Boundary",
    "CrashingJournal",
    "CrashingSagaStore",
    "KillPoint",
    "PointResult",
    "Scenario",
    "ScenarioFactory",
    "Storage",
    "Trip",
    "TripRejected",
    "Tripwire",
    "child_main",
    "describe_phase",
    "kill_points",
    "load_factory",
    "points_of",
    "run_kill_point",
    "run_kill_point_sweep",
    "trace_run",
    "trip_ledger",
    "trip_problems",
    "trip_saga",
    "trip_scenario",
]

T = TypeVar("T")

JOURNAL_METHODS = ("start", "claim", "commit")
"""Journal calls a point can name (``claim`` is the recovery sweeper's take-over)."""
STORE_METHODS = ("claim", "complete", "fail")
"""Store calls a point can name (heartbeats are timing-dependent and change no outcome)."""

_SPEC = re.compile(r"(journal|store)\.([a-z_]+)#([1-9][0-9]*):(before|after)")


# ----------------------------------------------------------------------------------- kill points


@dataclass(frozen=True, slots=True)
class KillPoint:
    """Where a child dies: before or after the ``nth`` call (1-based) of ``target.method``; for a
    claim, the claim of the ``nth`` key (see :class:`Tripwire`).

    Only ``target``, ``method``, ``nth`` and ``when`` identify the point (:attr:`spec`); the rest
    describes it for reports and for picking subsets.
    """

    target: str
    """``journal`` or ``store``."""
    method: str
    nth: int
    when: str
    """``before`` or ``after``."""
    label: str = field(default="", compare=False)
    """What is durable when the process dies here, in words."""
    step: str | None = field(default=None, compare=False)
    """The step running (or being compensated) at the point, if any."""
    compensating: bool = field(default=False, compare=False)
    """The point lies inside a compensation."""

    def __post_init__(self) -> None:
        if not _SPEC.fullmatch(self.spec):
            raise ValueError(f"not a kill point: {self.spec!r}")
        methods = JOURNAL_METHODS if self.target == "journal" else STORE_METHODS
        if self.method not in methods:
            raise ValueError(f"{self.target} points name one of {methods}, not {self.method!r}")

    @property
    def spec(self) -> str:
        """The point as text, e.g. ``journal.commit#3:before`` (what ``--kill`` takes)."""
        return f"{self.target}.{self.method}#{self.nth}:{self.when}"

    @property
    def kind(self) -> str:
        """``journal``, ``effect`` (a store point in a forward step) or ``compensation``."""
        if self.target == "journal":
            return "journal"
        return "compensation" if self.compensating else "effect"

    @classmethod
    def parse(cls, spec: str) -> KillPoint:
        """The point :attr:`spec` names.

        Raises:
            ValueError: not of the form ``target.method#n:before|after``.
        """
        found = _SPEC.fullmatch(spec.strip())
        if found is None:
            raise ValueError(f"not a kill point: {spec!r} (e.g. journal.commit#3:before)")
        target, method, nth, when = found.groups()
        return cls(target, method, int(nth), when)

    def __str__(self) -> str:
        return f"{self.spec} ({self.label})" if self.label else self.spec


@dataclass(frozen=True, slots=True)
class Boundary:
    """One journal or store call as a :class:`Tripwire` saw it."""

    target: str
    method: str
    nth: int
    detail: str = ""
    """For a commit: what the phase writes; for a store call: ``scope|name``."""
    won: bool = False
    """For a claim: it created or took over its record (a store claim: the effect runs next)."""


class Tripwire:
    """Counts journal and store calls, records them, and kills the process at one point.

    Shared by a :class:`CrashingJournal` and a :class:`CrashingSagaStore`, so the recorded
    :attr:`events` are in the order the process made the calls. Thread-safe.

    Writes (``commit``, ``complete``, ``fail``) are numbered per call. Claims (``journal.start``,
    ``journal.claim``, ``store.claim``) are numbered per *key* (saga id, effect key), because a
    process polls a claim while another holder's lease runs out, as often as timing makes it:
    ``store.claim#3`` is the third effect claimed, ``before`` fires before its first claim call and
    ``after`` after the first call that won it (created or took it over).

    Args:
        point: where to die; None only records.
        kill: what dying means; the default is a real SIGKILL
            (:func:`idempotency.testing.sigkill`). In-process tests may pass a function that raises
            a ``BaseException``.
    """

    def __init__(self, point: KillPoint | None = None, *, kill: Callable[[str], NoReturn] = sigkill) -> None:
        self.point = point
        self.events: list[Boundary] = []
        self._kill = kill
        self._counts: dict[tuple[str, str], int] = {}
        self._keys: dict[tuple[str, str], dict[str, int]] = {}
        self._won: set[tuple[str, str, int]] = set()
        self._lock = threading.Lock()

    def before(self, target: str, method: str, key: str | None = None) -> int:
        """Count a call about to be made (a claim of ``key``), and die when the point is before
        it. Returns its number."""
        with self._lock:
            if key is None:
                nth = self._counts.get((target, method), 0) + 1
                self._counts[(target, method)] = nth
                first = True
            else:
                keys = self._keys.setdefault((target, method), {})
                first = key not in keys
                nth = keys.setdefault(key, len(keys) + 1)
        if first:
            self._check(target, method, nth, "before")
        return nth

    def after(self, target: str, method: str, nth: int, detail: str = "", *, won: bool | None = None) -> None:
        """Record a call that returned, and die when the point is after it. ``won`` says whether a
        claim created or took over its record (None for writes)."""
        with self._lock:
            self.events.append(Boundary(target, method, nth, detail, bool(won)))
            if won is None:
                due = True
            else:
                due = won and (target, method, nth) not in self._won
                if due:
                    self._won.add((target, method, nth))
        if due:
            self._check(target, method, nth, "after")

    def _check(self, target: str, method: str, nth: int, when: str) -> None:
        point = self.point
        if point is not None and (point.target, point.method, point.nth, point.when) == (
            target,
            method,
            nth,
            when,
        ):
            self._kill(point.spec)


def describe_phase(phase: Phase) -> str:
    """A phase in words: ``charge_card succeeded, reserve_seat started, saga compensating``."""
    parts = [f"{row.name} {row.state.value}" for row in phase.steps]
    if phase.state is not None:
        parts.append(f"saga {phase.state.value}")
    return ", ".join(parts) or "lease renewal"


class CrashingJournal:
    """Wraps any :class:`~saga.journal.SagaJournal` and dies at a journal kill point.

    ``start``, ``claim`` and ``commit`` are counted (the calls that write), except the commits that
    only renew the lease, which come from the runner's renewer thread whenever a step runs long;
    every other method is passed through untouched.

    Args:
        inner: the journal to wrap.
        tripwire: counts the calls and holds the point.
    """

    def __init__(self, inner: SagaJournal, tripwire: Tripwire) -> None:
        self.inner = inner
        self.tripwire = tripwire

    def start(self, saga_id: str, **options: Any) -> StartResult:
        nth = self.tripwire.before("journal", "start", saga_id)
        result = self.inner.start(saga_id, **options)
        won = result.outcome is not StartOutcome.EXISTING
        self.tripwire.after("journal", "start", nth, result.outcome.value, won=won)
        return result

    def claim(self, saga_id: str, **options: Any) -> SagaSnapshot | None:
        nth = self.tripwire.before("journal", "claim", saga_id)
        result = self.inner.claim(saga_id, **options)
        won = result is not None
        self.tripwire.after("journal", "claim", nth, "took over" if won else "not due", won=won)
        return result

    def commit(self, saga_id: str, token: int, phase: Phase) -> SagaRecord:
        if not phase.steps and phase.state is None:
            # A lease renewal (the runner's renewer thread, timing-dependent): never a point.
            return self.inner.commit(saga_id, token, phase)
        nth = self.tripwire.before("journal", "commit")
        record = self.inner.commit(saga_id, token, phase)
        self.tripwire.after("journal", "commit", nth, describe_phase(phase))
        return record

    def __getattr__(self, name: str) -> Any:
        # Everything that writes nothing a point could name (load, list, now, signal, close, ...).
        return getattr(self.inner, name)


class CrashingSagaStore:
    """Wraps any :class:`~idempotency.store.IdempotencyStore` and dies at a store kill point.

    Unlike :class:`idempotency.testing.CrashingStore` (first call at a named point) it counts calls,
    so ``store.complete#3:before`` is "the third guarded effect ran; its record is not written".

    Args:
        inner: the store to wrap.
        tripwire: counts the calls and holds the point.
    """

    def __init__(self, inner: IdempotencyStore, tripwire: Tripwire) -> None:
        self.inner = inner
        self.tripwire = tripwire
        self._names: dict[str, str] = {}

    def now(self) -> float:
        return self.inner.now()

    def claim(self, identity: EffectIdentity, fingerprint: str, lease: float) -> ClaimResult:
        detail = f"{identity.scope}|{identity.name}"
        self._names[identity.key] = detail
        nth = self.tripwire.before("store", "claim", identity.key)
        result = self.inner.claim(identity, fingerprint, lease)
        won = result.outcome is not ClaimOutcome.EXISTING
        self.tripwire.after("store", "claim", nth, detail, won=won)
        return result

    def get(self, key: str) -> Record | None:
        return self.inner.get(key)

    def complete(self, key: str, token: int, result: str, retention: float) -> Record:
        detail = self._names.get(key, "")
        nth = self.tripwire.before("store", "complete")
        record = self.inner.complete(key, token, result, retention)
        self.tripwire.after("store", "complete", nth, detail)
        return record

    def fail(
        self, key: str, token: int, disposition: Disposition, error: str, retention: float
    ) -> Record | None:
        detail = self._names.get(key, "")
        nth = self.tripwire.before("store", "fail")
        record = self.inner.fail(key, token, disposition, error, retention)
        self.tripwire.after("store", "fail", nth, detail)
        return record

    def heartbeat(self, key: str, token: int, lease: float) -> float:
        return self.inner.heartbeat(key, token, lease)

    def purge(self, *, limit: int = 1000) -> int:
        return self.inner.purge(limit=limit)

    def close(self) -> None:
        self.inner.close()

    def list(
        self,
        *,
        states: Collection[State] | None = None,
        namespace: str | None = None,
        limit: int = 100,
        after: str | None = None,
    ) -> builtins.list[Record]:
        return self.inner.list(states=states, namespace=namespace, limit=limit, after=after)


# ------------------------------------------------------------------ enumerating a saga's points


class _ShadowFailure(RuntimeError):
    """Raised by the shadow of the ``fail_at`` step (ambiguous: it may have applied)."""


def _nothing() -> None:
    return None


def _no_sleep(_seconds: float) -> None:
    return None


def _count(spec: int | Mapping[str, int], step: str) -> int:
    return spec if isinstance(spec, int) else int(spec.get(step, 1))


def kill_points(
    saga: Saga[Any],
    *,
    fail_at: str | None = None,
    failure_applied: bool = True,
    effects: int | Mapping[str, int] = 1,
    compensation_effects: int | Mapping[str, int] = 1,
) -> list[KillPoint]:
    """Every distinct crash boundary of one run of ``saga``, in the order the run meets them.

    Runs a shadow of the saga in memory (nothing of the saga's own code runs) and turns its journal
    and store calls into points (:func:`points_of`): before each write or winning claim, after each
    store claim that lets an effect run, and after the last write. Two boundaries with nothing
    durable between them are one point.

    Args:
        saga: the definition; only its shape is used (step names, kinds, retries, compensations).
        fail_at: the step that fails after its effects, making this a compensation run; None for a
            run where every step succeeds.
        failure_applied: the failure may have applied the step (so its own compensation runs);
            False for a failure classified *not applied*.
        effects: guarded calls each action makes (per step name, default 1).
        compensation_effects: guarded calls each compensation makes (per step name, default 1).

    Raises:
        ValueError: ``fail_at`` names no step of ``saga``, or the saga has a wait step (its run
            parks until a signal comes; name its points by hand).
    """
    names = [step.name for step in saga.steps]
    if fail_at is not None and fail_at not in names:
        raise ValueError(f"fail_at={fail_at!r} is not a step of {saga.name!r}: {names}")
    waits = [step.name for step in saga.steps if step.signal is not None]
    if waits:
        # A wait parks the saga until another process signals it: one run has no single sequence.
        raise ValueError(f"saga {saga.name!r} waits for signals ({waits}): enumerate its points by hand")
    tripwire = Tripwire()
    guard = Guard(CrashingSagaStore(MemoryStore(), tripwire), namespace="kill-points", sleep=_no_sleep)
    shadow: Saga[None] = Saga(saga.name, version=saga.version, input=type(None))

    def action(name: str) -> Callable[[StepContext, None], None]:
        def shadow_action(ctx: StepContext, _input: None) -> None:
            for _ in range(_count(effects, name)):
                guard.run("shadow.effect", _nothing, result_type=type(None))
            if name == fail_at:
                raise _ShadowFailure(name) if failure_applied else NotApplied(name)

        return shadow_action

    def compensation(name: str) -> Callable[[StepContext, None, object], None]:
        def shadow_compensation(ctx: StepContext, _input: None, _result: object) -> None:
            for _ in range(_count(compensation_effects, name)):
                guard.run("shadow.undo", _nothing, result_type=type(None))

        return shadow_compensation

    for step in saga.steps:
        if step.kind is StepKind.COMPENSATABLE:
            undo = None if step.compensation_fn is None else compensation(step.name)
            shadow.step(
                name=step.name,
                compensate=undo,
                retry=step.retry,
                compensation_retry=step.compensation_retry,
                not_applied=step.not_applied,
                classify=step.classifier,
            )(action(step.name))
        elif step.kind is StepKind.PIVOT:
            shadow.pivot(
                name=step.name, retry=step.retry, not_applied=step.not_applied, classify=step.classifier
            )(action(step.name))
        else:
            shadow.retriable(name=step.name, retry=step.retry, classify=step.classifier)(action(step.name))
    runner = SagaRunner(CrashingJournal(MemoryJournal(), tripwire), guard, sleep=_no_sleep)
    try:
        runner.run(shadow, "kill-points", None)
    finally:
        runner.close()
        guard.close()
    return points_of(tripwire.events)


def points_of(events: Sequence[Boundary]) -> list[KillPoint]:
    """The distinct kill points of a recorded run (see :func:`kill_points`).

    Before each write and each claim that wins its record; after each store claim that wins (the
    effect is not sent yet); after the last call. A claim that wins nothing (a replay, a poll of a
    live claim) writes nothing: dying before it is dying before the next call.
    """
    points: list[KillPoint] = []
    seen: set[tuple[str, str, int, str]] = set()

    def add(event: Boundary, when: str) -> None:
        ident = (event.target, event.method, event.nth, when)
        if ident not in seen:
            seen.add(ident)
            step, compensating = _where(event)
            points.append(
                KillPoint(
                    event.target, event.method, event.nth, when, _label(event, when), step, compensating
                )
            )

    claims = {("journal", "start"), ("journal", "claim"), ("store", "claim")}
    for event in events:
        if (event.target, event.method) not in claims:
            add(event, "before")
        elif event.won:
            add(event, "before")
            if event.target == "store":
                add(event, "after")
    written = [e for e in events if (e.target, e.method) not in claims or e.won]
    if written:  # after the last call that wrote anything: the run is over
        add(written[-1], "after")
    return points


def _where(event: Boundary) -> tuple[str | None, bool]:
    if event.target != "store":
        return None, False
    scope = event.detail.split("|", 1)[0]
    parts = scope.split("/")
    compensating = parts[-1] == "~compensate"
    step = parts[-2] if compensating and len(parts) >= 2 else parts[-1]
    return step, compensating


def _label(event: Boundary, when: str) -> str:
    if event.target == "journal":
        if event.method == "start":
            return "nothing written yet" if when == "before" else "saga started, no step yet"
        if event.method == "claim":
            return f"{when} take-over {event.nth} ({event.detail})"
        return f"{when} commit {event.nth}: {event.detail}"
    step, compensating = _where(event)
    name = event.detail.split("|", 1)[-1]
    where = f"compensation of {step}" if compensating else f"step {step}"
    what, run = f"effect {name}", "sent"
    if name.startswith("sagaguard.compensate."):
        what, run = "the compensation's record", "run"
    if event.method == "claim":
        return (
            f"{where}: before claiming {what}" if when == "before" else f"{where}: {what} claimed, not {run}"
        )
    if event.method == "complete":
        return f"{where}: {what} {run}, not recorded" if when == "before" else f"{where}: {what} recorded"
    return f"{where}: {what} failed, the failure not recorded"


# ----------------------------------------------------------------------------------- scenarios


@dataclass(frozen=True, slots=True)
class Scenario:
    """What a scenario factory returns: the saga to run and its input."""

    saga: Saga[Any]
    input: Any


ScenarioFactory = Callable[[Guard, Mapping[str, str]], Scenario]
"""``factory(guard, params) -> Scenario``: declares the saga's effects on ``guard``."""


def load_factory(ref: str) -> ScenarioFactory:
    """Import the scenario factory ``module:attr``.

    Raises:
        ValueError: ``ref`` is not ``module:attr`` or does not name a callable.
    """
    module_name, _, attr = ref.partition(":")
    if not module_name or not attr:
        raise ValueError(f"a scenario is named module:attr, not {ref!r}")
    found = getattr(importlib.import_module(module_name), attr, None)
    if not callable(found):
        raise ValueError(f"{ref} is not a callable scenario factory")
    factory: ScenarioFactory = found
    return factory


@dataclass(frozen=True, slots=True)
class Storage:
    """Where a child keeps its journal and its effect store (both must outlive the child).

    Attributes:
        journal_url: a SQLite file or Postgres URL for :class:`~saga.journals.sql.SqlJournal`.
        store_url: the same for :class:`~idempotency.stores.sql.SqlStore` (or any ``open_store``
            URL when ``store_table`` is None).
        journal_prefix: the journal's table prefix.
        store_table: the store's table name; None opens ``store_url`` with ``open_store``.
    """

    journal_url: str
    store_url: str
    journal_prefix: str = "sagaguard_"
    store_table: str | None = "sagaguard_effects"

    @classmethod
    def sqlite(cls, path: str | os.PathLike[str]) -> Storage:
        """Journal and store in one SQLite file."""
        url = f"sqlite:///{Path(path).resolve()}"
        return cls(url, url)

    def journal(self) -> SagaJournal:
        """Open the journal (tables are created when missing)."""
        from saga.journals.sql import SqlJournal

        return SqlJournal(self.journal_url, table_prefix=self.journal_prefix)

    def store(self) -> IdempotencyStore:
        """Open the store (tables are created when missing)."""
        if self.store_table is None:
            from idempotency.stores import open_store

            return open_store(self.store_url)
        from idempotency.stores.sql import SqlStore

        return SqlStore(self.store_url, table_name=self.store_table)

    def args(self) -> list[str]:
        """The child's command-line arguments for this storage."""
        out = [
            "--journal",
            self.journal_url,
            "--journal-prefix",
            self.journal_prefix,
            "--store",
            self.store_url,
        ]
        if self.store_table is not None:
            out += ["--store-table", self.store_table]
        return out


# --------------------------------------------------------------------------- the child process


def _unfinished(journal: SagaJournal, saga_id: str) -> bool:
    snapshot = journal.load(saga_id)
    return snapshot is not None and snapshot.saga.state in LIVE_STATES


def _deadline(runner: SagaRunner) -> float:
    return time.monotonic() + max(30.0, 20 * runner.lease)


def _sweep(journal: SagaJournal, runner: SagaRunner, guard: Guard, saga: Saga[Any], saga_id: str) -> bool:
    """Sweep with :func:`saga.recovery.recover` until it drove ``saga_id`` (its dead runner's lease
    must run out first) or the saga is not there to recover. Returns whether a sweep drove it."""
    deadline = _deadline(runner)
    while time.monotonic() < deadline and _unfinished(journal, saga_id):
        if saga_id in recover(journal, guard, saga, runner=runner).outcomes:
            return True
        time.sleep(0.05)
    return False


async def _asweep(
    journal: SagaJournal, runner: SagaRunner, guard: Guard, saga: Saga[Any], saga_id: str
) -> bool:
    """:func:`_sweep` with :func:`saga.recovery.arecover`."""
    deadline = _deadline(runner)
    while time.monotonic() < deadline and _unfinished(journal, saga_id):
        if saga_id in (await arecover(journal, guard, saga, runner=runner)).outcomes:
            return True
        await asyncio.sleep(0.05)
    return False


def _run(
    runner: SagaRunner, guard: Guard, scenario: Scenario, saga_id: str, *, sweep: bool, driver: str
) -> tuple[SagaOutcome, bool]:
    """Run (or, with ``sweep``, first recover) the saga with the sync or async driver."""
    journal, saga = runner.journal, scenario.saga
    if driver == "sync":
        swept = sweep and _sweep(journal, runner, guard, saga, saga_id)
        return runner.run(saga, saga_id, scenario.input), swept

    async def drive() -> tuple[SagaOutcome, bool]:
        swept = sweep and await _asweep(journal, runner, guard, saga, saga_id)
        return await runner.arun(saga, saga_id, scenario.input), swept

    return asyncio.run(drive())


def child_main(argv: Sequence[str] | None = None) -> int:
    """``python -m saga.testing child ...``: run (or recover) one saga, maybe dying at a point.

    Prints one JSON line: ``{"state", "replayed", "swept", "error", "trace"}`` (``swept``: the
    recovery sweeper drove the saga), or ``{"exception", "message"}`` with exit status 2 when the
    run raised.
    """
    parser = argparse.ArgumentParser(prog="python -m saga.testing child")
    parser.add_argument("--scenario", required=True, help="module:attr of a scenario factory")
    parser.add_argument("--saga-id", required=True)
    parser.add_argument("--journal", required=True, help="journal URL (sqlite:///f.db, postgresql://...)")
    parser.add_argument("--journal-prefix", default="sagaguard_")
    parser.add_argument("--store", required=True, help="effect store URL")
    parser.add_argument("--store-table", default=None)
    parser.add_argument("--namespace", default="default", help="the guard's namespace")
    parser.add_argument("--kill", default=None, help="a kill point, e.g. journal.commit#3:before")
    parser.add_argument("--lease", type=float, default=0.5, help="runner and guard lease, seconds")
    parser.add_argument("--param", action="append", default=[], help="k=v handed to the factory")
    parser.add_argument("--recovery", choices=("rerun", "sweep"), default="rerun")
    parser.add_argument("--driver", choices=("sync", "async"), default="sync", help="run or arun")
    parser.add_argument("--gate", action="store_true", help="say 'ready', then wait for a stdin line")
    args = parser.parse_args(argv)
    storage = Storage(args.journal, args.store, args.journal_prefix, args.store_table)
    tripwire = Tripwire(KillPoint.parse(args.kill) if args.kill else None)
    journal = CrashingJournal(storage.journal(), tripwire)
    guard = Guard(
        CrashingSagaStore(storage.store(), tripwire), namespace=args.namespace, lease=args.lease, wait=60.0
    )
    params = dict(item.split("=", 1) for item in args.param)
    params["saga_id"] = args.saga_id
    scenario = load_factory(args.scenario)(guard, params)
    runner = SagaRunner(journal, guard, lease=args.lease, wait=60.0)
    if args.gate:
        print("ready", flush=True)
        sys.stdin.readline()
    try:
        sweep = args.recovery == "sweep"
        outcome, swept = _run(runner, guard, scenario, args.saga_id, sweep=sweep, driver=args.driver)
    except Exception as exc:
        print(json.dumps({"exception": type(exc).__name__, "message": str(exc)}), flush=True)
        return 2
    finally:
        runner.close()
        guard.close()
    trace = [[e.target, e.method, e.nth, e.detail, e.won] for e in tripwire.events]
    error = None if outcome.error is None else f"{outcome.error.type_name}: {outcome.error.message}"
    print(
        json.dumps(
            {
                "state": outcome.state.value,
                "replayed": outcome.replayed,
                "swept": swept,
                "error": error,
                "trace": trace,
            }
        ),
        flush=True,
    )
    return 0


# --------------------------------------------------------------------------- the parent side


@dataclass(frozen=True, slots=True)
class PointResult(Generic[T]):
    """What one kill point did.

    Attributes:
        point: the point.
        saga_id: the saga instance it ran.
        killed: the first child died at the point, and each recovering child at its point in
            ``then`` (False: one never reached its point).
        crashed_state: the saga's state in the journal right after the first kill (None: not
            started).
        state: the saga's state after the recovery (None: still not in the journal).
        snapshot: the journal's saga and step rows after the recovery.
        unsettled: guard records of the run left IN_PROGRESS or IN_DOUBT after the recovery.
        recovered: the recovery child's JSON line (``state``, ``replayed``, ``swept``, ``error``)
            or ``exception`` and ``message``.
        seen: what ``observe`` returned after the recovery: what the world saw.
        seconds: wall time of the point, every child included.
        then: the points the recovering children were killed at.
        crash_log, recovery_log: each child's exit status, stdout and stderr, for failure messages.
    """

    point: KillPoint
    saga_id: str
    killed: bool
    crashed_state: SagaState | None
    state: SagaState | None
    snapshot: SagaSnapshot | None
    unsettled: tuple[Record, ...]
    recovered: Mapping[str, Any]
    seen: T
    seconds: float
    then: tuple[KillPoint, ...] = ()
    crash_log: str = field(default="", repr=False)
    recovery_log: str = field(default="", repr=False)

    def problems(self) -> list[str]:
        """The generic violations: not killed at the point, recovery failed, saga still live,
        guard records left unsettled. Empty when the point passed."""
        found: list[str] = []
        if not self.killed:
            where = ", then ".join(p.spec for p in (self.point, *self.then))
            found.append(f"a child was not killed where it should be ({where}):\n{self.crash_log}")
        if "exception" in self.recovered:
            found.append(f"recovery raised {self.recovered['exception']}: {self.recovered.get('message')}")
        if self.state is None or self.state in LIVE_STATES:
            found.append(f"the saga ended {self.state} after recovery:\n{self.recovery_log}")
        for record in self.unsettled:
            found.append(f"guard record {record.scope}|{record.name} left {record.state.value}")
        return found


def _child_env() -> dict[str, str]:
    root = str(Path(__file__).resolve().parent.parent)
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path}


def _spawn(arguments: Sequence[str], *, gate: bool) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "saga.testing", "child", *arguments, *(["--gate"] if gate else [])],
        stdin=subprocess.PIPE if gate else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_child_env(),
    )


def _finish(proc: subprocess.Popen[str], timeout: float, stdin: str | None = None) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(stdin, timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        err += f"\n(killed after {timeout} s: the child hung)"
    return proc.returncode, out, err


def _last_json(out: str) -> dict[str, Any]:
    for line in reversed(out.strip().splitlines()):
        with contextlib.suppress(ValueError):
            found = json.loads(line)
            if isinstance(found, dict):
                return found
    return {"exception": "NoOutput", "message": "the child printed no result"}


def run_kill_point(
    point: KillPoint,
    *,
    scenario: str,
    storage: Storage,
    observe: Callable[[str], T],
    then: Sequence[KillPoint] = (),
    saga_id: str | None = None,
    params: Mapping[str, str] | None = None,
    lease: float = 0.5,
    recovery: str = "rerun",
    driver: str = "sync",
    timeout: float = 120.0,
) -> PointResult[T]:
    """Kill a child at ``point``, recover the saga in a fresh child, and report.

    Args:
        point: where the first child dies.
        scenario: ``module:attr`` of the scenario factory every child builds the saga with.
        storage: journal and store, shared by the children (use a fresh one, or at least a fresh
            ``saga_id``, per point).
        observe: called with the saga id after the recovery; its value is :attr:`PointResult.seen`
            (e.g. the effects the outside service counted for that saga).
        then: kill the recovering children too, one after the other, at these points (counted
            from each child's own start): crashes during recovery. The last child is left alone.
        saga_id: the instance to run; a fresh one by default. It is also the guard's namespace.
        params: handed to the factory (plus ``saga_id``).
        lease: the children's runner and guard lease: how long a recovery waits for the dead
            child's claims to run out.
        recovery: ``rerun`` (run the same saga id again) or ``sweep``
            (:func:`saga.recovery.recover` first, then the rerun, which replays what it recorded).
        driver: ``sync`` (:meth:`SagaRunner.run`, :func:`~saga.recovery.recover`) or ``async``
            (:meth:`SagaRunner.arun`, :func:`~saga.recovery.arecover`), in every child.
        timeout: seconds each child may take.
    """
    saga_id = saga_id or f"kp-{uuid.uuid4().hex[:12]}"
    journal, store = storage.journal(), storage.store()  # creates the tables before the children
    arguments = [
        "--scenario", scenario, "--saga-id", saga_id, "--namespace", saga_id, "--lease", str(lease),
        "--recovery", recovery, "--driver", driver, *storage.args(),
    ]  # fmt: skip
    for key, value in (params or {}).items():
        arguments += ["--param", f"{key}={value}"]
    started = time.monotonic()
    # Every recovering child imports and connects while the first one runs, then waits at its gate.
    waiting = [_spawn([*arguments, "--kill", p.spec], gate=True) for p in then]
    waiting.append(_spawn(arguments, gate=True))
    try:
        first = _spawn([*arguments, "--kill", point.spec], gate=False)
        crashers: list[tuple[KillPoint, subprocess.Popen[str], str | None]] = [(point, first, None)]
        crashers += [(p, proc, "go\n") for p, proc in zip(then, waiting, strict=False)]
        killed, logs, crashed = True, [], None
        for at, proc, gate in crashers:
            code, out, err = _finish(proc, timeout, gate)
            killed = killed and code == -signal.SIGKILL and f"SIGKILL at {at.spec}" in err
            logs.append(f"[killed at {at.spec}] exit {code}\n{out}{err}")
            if crashed is None:
                crashed = journal.load(saga_id)
        code, out, err = _finish(waiting[-1], timeout, "go\n")
        seconds = time.monotonic() - started
        snapshot = journal.load(saga_id)
        unsettled = tuple(store.list(states=(State.IN_PROGRESS, State.IN_DOUBT), namespace=saga_id))
        return PointResult(
            point=point,
            saga_id=saga_id,
            killed=killed,
            crashed_state=None if crashed is None else crashed.saga.state,
            state=None if snapshot is None else snapshot.saga.state,
            snapshot=snapshot,
            unsettled=unsettled,
            recovered=_last_json(out),
            seen=observe(saga_id),
            seconds=seconds,
            then=tuple(then),
            crash_log="\n".join(logs),
            recovery_log=f"exit {code}\n{out}{err}",
        )
    finally:
        for proc in waiting:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        journal.close()
        store.close()


def run_kill_point_sweep(
    points: Iterable[KillPoint],
    *,
    scenario: str,
    storage: Callable[[int], Storage],
    observe: Callable[[str], T],
    params: Mapping[str, str] | None = None,
    lease: float = 0.5,
    recovery: str = "rerun",
    driver: str = "sync",
    timeout: float = 120.0,
    workers: int = 1,
) -> list[PointResult[T]]:
    """:func:`run_kill_point` for every point, each on ``storage(i)`` under a fresh saga id.

    Args:
        workers: points run at once (each is two child processes that mostly wait).

    Returns:
        One result per point, in the order of ``points``.
    """

    def one(item: tuple[int, KillPoint]) -> PointResult[T]:
        i, point = item
        return run_kill_point(
            point,
            scenario=scenario,
            storage=storage(i),
            observe=observe,
            params=params,
            lease=lease,
            recovery=recovery,
            driver=driver,
            timeout=timeout,
        )

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        return list(pool.map(one, enumerate(points)))


def trace_run(
    *,
    scenario: str,
    storage: Storage,
    saga_id: str | None = None,
    params: Mapping[str, str] | None = None,
    timeout: float = 120.0,
) -> tuple[dict[str, Any], list[Boundary]]:
    """Run a scenario once in a child, undisturbed, and return its outcome line and the boundaries
    it met: compare them with :func:`kill_points` to check the shadow matches the real saga."""
    saga_id = saga_id or f"kp-{uuid.uuid4().hex[:12]}"
    storage.journal().close()
    storage.store().close()
    arguments = ["--scenario", scenario, "--saga-id", saga_id, "--namespace", saga_id, *storage.args()]
    for key, value in (params or {}).items():
        arguments += ["--param", f"{key}={value}"]
    code, out, err = _finish(_spawn(arguments, gate=False), timeout)
    result = _last_json(out)
    if code != 0 or "trace" not in result:
        raise RuntimeError(f"the traced run failed (exit {code}):\n{out}\n{err}")
    events = [Boundary(str(t), str(m), int(n), str(d), bool(f)) for t, m, n, d, f in result.pop("trace")]
    return result, events


# ----------------------------------------------------------------------- the worked example


class TripRejected(RuntimeError):
    """Raised by the step :attr:`Trip.fail_at` names, *after* its effect reached the service: an
    ambiguous failure, so the step's own compensation runs with ``result=None``."""


@dataclass(frozen=True, slots=True)
class Trip:
    """The trip saga's input."""

    order: str
    """Business key: every effect is counted at the service as ``{order}/{effect}``."""
    amount: int = 100
    fail_at: str | None = None
    """A step that fails after its effect (a compensation run), or None."""


TRIP_EFFECTS: Mapping[str, tuple[str, str | None]] = {
    "charge_card": ("card.charge", "card.refund"),
    "reserve_seat": ("seat.reserve", "seat.release"),
    "book_hotel": ("hotel.book", "hotel.cancel"),
    "send_receipt": ("receipt.send", None),
}
"""Each step's effect and the effect that undoes it, as counted at the service."""

_ONE_RETRY = Retry(stop=tenacity.stop_after_attempt(2), wait=tenacity.wait_none())


def trip_saga(guard: Guard, client: CounterClient, *, guarded: bool = True) -> Saga[Trip]:
    """The four-step trip: charge the card, reserve a seat, book a hotel (each undone by a refund,
    a release, a cancellation), then the pivot, sending the receipt.

    Every effect and compensation is an HTTP call to the counter service, guarded with a
    reconciler that asks the service for a call with the effect's provider key, so an effect a
    crash left in doubt is settled by asking the world, never by calling it again.

    Args:
        guard: declares the effects.
        client: talks to the counter service.
        guarded: False makes the effects plain HTTP calls: the negative control, which a crash
            between an effect and its step's commit makes happen twice.
    """
    reconcile = client.reconciler()

    def http_effect(name: str) -> Callable[[str, int], Charge]:
        def call(business_key: str, amount: int) -> Charge:
            return client.charge(business_key, amount, provider_key=current_effect().provider_key)

        def unguarded(business_key: str, amount: int) -> Charge:
            return client.charge(business_key, amount)

        return guard.effect(name, reconciler=reconcile)(call) if guarded else unguarded

    calls = {name: http_effect(name) for pair in TRIP_EFFECTS.values() for name in pair if name}

    def forward(step: str, trip: Trip) -> Charge:
        effect = TRIP_EFFECTS[step][0]
        done = calls[effect](f"{trip.order}/{effect}", trip.amount)
        if trip.fail_at == step:
            raise TripRejected(f"{step} was rejected after {effect}")
        return done

    def undo(ctx: StepContext, trip: Trip, done: Charge | None) -> None:
        effect, reverse = TRIP_EFFECTS[ctx.step]
        assert reverse is not None
        if done is None:
            # The step's result was never recorded (it failed, or crashed, after its effect): ask
            # the service whether the effect happened, by the provider key it was sent under.
            sent = EffectIdentity.of(guard.namespace, ctx.step_scope, effect, 0).provider_key
            found = client.charges(provider_key=sent)
            if not found:
                return
            done = found[0]
        calls[reverse](f"{trip.order}/{reverse}", done.amount)

    trip: Saga[Trip] = Saga("trip", version=1, input=Trip)

    @trip.step
    def charge_card(ctx: StepContext, t: Trip) -> Charge:
        return forward("charge_card", t)

    @charge_card.compensation
    def refund(ctx: StepContext, t: Trip, charge: Charge | None) -> None:
        undo(ctx, t, charge)

    @trip.step
    def reserve_seat(ctx: StepContext, t: Trip) -> Charge:
        return forward("reserve_seat", t)

    @reserve_seat.compensation
    def release(ctx: StepContext, t: Trip, seat: Charge | None) -> None:
        undo(ctx, t, seat)

    @trip.step(retry=_ONE_RETRY)
    def book_hotel(ctx: StepContext, t: Trip) -> Charge:
        return forward("book_hotel", t)

    @book_hotel.compensation
    def cancel(ctx: StepContext, t: Trip, booking: Charge | None) -> None:
        undo(ctx, t, booking)

    @trip.pivot
    def send_receipt(ctx: StepContext, t: Trip) -> Charge:
        return forward("send_receipt", t)

    return trip


def trip_scenario(guard: Guard, params: Mapping[str, str]) -> Scenario:
    """The scenario factory of :func:`trip_saga` (``saga.testing:trip_scenario``).

    Params: ``service`` (the counter service URL), ``saga_id`` (also the order), ``fail_at``
    (optional step name), ``guarded`` (``no`` for the unguarded negative control).
    """
    saga = trip_saga(guard, CounterClient(params["service"]), guarded=params.get("guarded") != "no")
    return Scenario(saga, Trip(order=params["saga_id"], fail_at=params.get("fail_at") or None))


def trip_ledger(client: CounterClient, order: str) -> dict[str, int]:
    """How often the service saw each effect of ``order``, by effect name (``card.charge``...)."""
    prefix = f"{order}/"
    return {key[len(prefix) :]: n for key, n in client.counts().items() if key.startswith(prefix)}


def trip_problems(state: SagaState | None, ledger: Mapping[str, int]) -> list[str]:
    """What is wrong with a trip's end, counted at the service (empty when nothing is).

    Each effect at most once; a COMPLETED trip made every forward effect once and undid none; a
    COMPENSATED trip undid every forward effect it made, exactly once, and sent no receipt.
    """
    found = [f"{name} happened {n} times" for name, n in sorted(ledger.items()) if n > 1]
    forward = [pair[0] for pair in TRIP_EFFECTS.values()]
    undos = [pair[1] for pair in TRIP_EFFECTS.values() if pair[1]]
    if state is SagaState.COMPLETED:
        found += [f"{name} never happened in a completed trip" for name in forward if not ledger.get(name)]
        found += [f"{name} happened in a completed trip" for name in undos if ledger.get(name, 0)]
    elif state is SagaState.COMPENSATED:
        for effect, reverse in TRIP_EFFECTS.values():
            if reverse and ledger.get(effect, 0) != ledger.get(reverse, 0):
                found.append(f"{effect} x{ledger.get(effect, 0)} but {reverse} x{ledger.get(reverse, 0)}")
        if ledger.get("receipt.send", 0):
            found.append("a compensated trip sent its receipt")
    elif state is not SagaState.NEEDS_ATTENTION:
        found.append(f"the trip ended {state}")
    return found


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m saga.testing child ...`` (see :func:`child_main`)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] != "child":
        print("usage: python -m saga.testing child --help", file=sys.stderr)
        return 2
    return child_main(args[1:])


if __name__ == "__main__":
    # Run the imported module's main, not this __main__ copy: scenario factories import
    # saga.testing, and one copy of its classes is enough.
    from saga.testing import main as _main

    sys.exit(_main())
