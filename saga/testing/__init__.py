"""The saga kill-point harness, shipped to users: SIGKILL a saga at every boundary, recover it in a
fresh process, and count at the outside world what happened.

A saga is crash-safe when, wherever its process dies, a fresh process finishes it (COMPLETED,
COMPENSATED, or parked as NEEDS_ATTENTION, never stuck RUNNING or COMPENSATING) and the world saw each
effect at most once, with every effect of a compensated saga undone. This module tests exactly that,
with real processes and a real ``SIGKILL`` (no ``finally``, no ``atexit``, no flush)::

    from sagaguard.saga.testing import Storage, kill_points, run_kill_point_sweep

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
``before`` or ``after`` it: ``journal.commit#2:before`` (step 1's success and step 2's start are
not yet committed; the start registered step 0, commit 1 recorded it and started step 1),
``store.complete#2:before`` (the second guarded effect happened, its record is not written: the
in-doubt crash), ``store.claim#4:after`` (claimed, not yet sent). The child wraps
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
:class:`~sagaguard.idempotency.guard.Guard` (its store is the crashing one) and returns the saga and its
input. ``params`` are strings: the ``--param k=v`` of the command line plus ``saga_id``.
:func:`trip_scenario` is the worked example: a four-step trip (charge the card, reserve a seat, book
a hotel, send the receipt; undone by refund, release, cancel) whose every effect and compensation
is an HTTP call to an :class:`~sagaguard.idempotency.testing.CounterService` in its own process, guarded with
a reconciler that asks the service whether an effect with the call's provider key happened.

**One point** (:func:`run_kill_point`): a child runs the saga and is SIGKILLed at the point; a fresh
child (started alongside, warmed up and waiting at a gate, so it costs no import time) recovers it,
by running the same saga id again (``recovery="rerun"``: the runner takes the saga over once the dead
runner's short lease ran out) or through :func:`sagaguard.saga.recovery.recover` (``recovery="sweep"``, then
the rerun, which replays what the sweeper recorded). The result holds the journal's state after
the crash and after the recovery, the guard records left unsettled, and whatever ``observe`` saw.
:meth:`PointResult.problems` lists the generic violations; the scenario's own checks
(:func:`trip_problems`) count at the service. With ``then=[...]`` the recovering children are
killed too, each at its own point (counted from its own start), before a last one finishes:
crashes during recovery.

The child is ``python -m sagaguard.saga.testing child --scenario M:F --saga-id ID --journal URL --store URL
[--kill SPEC] ...`` (see ``--help``); it prints one JSON line with the outcome.
"""

from __future__ import annotations

from sagaguard.saga.testing.child import child_main
from sagaguard.saga.testing.child import main as main  # `python -m` entry point, not in __all__
from sagaguard.saga.testing.points import JOURNAL_METHODS, STORE_METHODS, Boundary, KillPoint, Tripwire
from sagaguard.saga.testing.runner import PointResult, run_kill_point, run_kill_point_sweep, trace_run
from sagaguard.saga.testing.scenario import Scenario, ScenarioFactory, Storage, load_factory
from sagaguard.saga.testing.shadow import kill_points, points_of
from sagaguard.saga.testing.trip import (
    TRIP_EFFECTS,
    Trip,
    TripRejected,
    trip_ledger,
    trip_problems,
    trip_saga,
    trip_scenario,
)
from sagaguard.saga.testing.wrappers import CrashingJournal, CrashingSagaStore, describe_phase

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
