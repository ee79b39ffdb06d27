"""The child process: ``python -m sagaguard.saga.testing child ...`` runs (or recovers) one saga, maybe dying
at a kill point, and prints one JSON line with the outcome.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

from sagaguard.idempotency.guard import Guard
from sagaguard.saga.definition import Saga
from sagaguard.saga.journal import SagaJournal
from sagaguard.saga.records import (
    LIVE_STATES,
    SagaOutcome,
)
from sagaguard.saga.recovery import arecover, recover
from sagaguard.saga.runner import SagaRunner
from sagaguard.saga.testing.points import KillPoint, Tripwire
from sagaguard.saga.testing.scenario import Scenario, Storage, load_factory
from sagaguard.saga.testing.wrappers import CrashingJournal, CrashingSagaStore


def _unfinished(journal: SagaJournal, saga_id: str) -> bool:
    snapshot = journal.load(saga_id)
    return snapshot is not None and snapshot.saga.state in LIVE_STATES


def _deadline(runner: SagaRunner) -> float:
    return time.monotonic() + max(30.0, 20 * runner.lease)


def _sweep(journal: SagaJournal, runner: SagaRunner, guard: Guard, saga: Saga[Any], saga_id: str) -> bool:
    """Sweep with :func:`sagaguard.saga.recovery.recover` until it drove ``saga_id`` (its dead runner's lease
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
    """:func:`_sweep` with :func:`sagaguard.saga.recovery.arecover`."""
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
    """``python -m sagaguard.saga.testing child ...``: run (or recover) one saga, maybe dying at a point.

    Prints one JSON line: ``{"state", "replayed", "swept", "error", "trace"}`` (``swept``: the
    recovery sweeper drove the saga), or ``{"exception", "message"}`` with exit status 2 when the
    run raised.
    """
    parser = argparse.ArgumentParser(prog="python -m sagaguard.saga.testing child")
    parser.add_argument("--scenario", required=True, help="module:attr of a scenario factory")
    parser.add_argument("--saga-id", required=True)
    parser.add_argument("--journal", required=True, help="journal URL (sqlite:///f.db, postgresql://...)")
    parser.add_argument("--journal-prefix", default="sagaguard_")
    parser.add_argument("--store", required=True, help="effect store URL")
    parser.add_argument("--store-table", default=None)
    parser.add_argument("--namespace", default="default", help="the guard's namespace")
    parser.add_argument("--kill", default=None, help="a kill point, e.g. journal.commit#3:before")
    parser.add_argument(
        "--lease",
        type=float,
        default=0.5,
        help="runner and guard lease, seconds; 0: their defaults and waits",
    )
    parser.add_argument("--param", action="append", default=[], help="k=v handed to the factory")
    parser.add_argument("--recovery", choices=("rerun", "sweep"), default="rerun")
    parser.add_argument("--driver", choices=("sync", "async"), default="sync", help="run or arun")
    parser.add_argument("--gate", action="store_true", help="say 'ready', then wait for a stdin line")
    args = parser.parse_args(argv)
    storage = Storage(args.journal, args.store, args.journal_prefix, args.store_table)
    tripwire = Tripwire(KillPoint.parse(args.kill) if args.kill else None)
    journal = CrashingJournal(storage.journal(), tripwire)
    # 0: what a user gets (the guard's and the runner's default leases and waits).
    store = CrashingSagaStore(storage.store(), tripwire)
    if args.lease == 0:
        guard = Guard(store, namespace=args.namespace)
    else:
        guard = Guard(store, namespace=args.namespace, lease=args.lease, wait=60.0)
    params = dict(item.split("=", 1) for item in args.param)
    params["saga_id"] = args.saga_id
    scenario = load_factory(args.scenario)(guard, params)
    runner = (
        SagaRunner(journal, guard)
        if args.lease == 0
        else SagaRunner(journal, guard, lease=args.lease, wait=60.0)
    )
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


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m sagaguard.saga.testing child ...`` (see :func:`child_main`)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] != "child":
        print("usage: python -m sagaguard.saga.testing child --help", file=sys.stderr)
        return 2
    return child_main(args[1:])
