"""Where a saga step's time goes, apart from the disk: the flow's own CPU, and the journal's CPU.

::

    .venv/bin/python bench/_saga_profile.py                 # figures only
    .venv/bin/python bench/_saga_profile.py --profile       # and cProfile's top entries

- *flow*: a saga of 10 no-op steps on a journal that stores nothing (:class:`NullJournal`), so
  what is left is the coordinator's decisions, the runner's loop, contexts and records.
- *journal*: one atomic phase (a step's success + the next step started) through
  :class:`~sagaguard.saga.journals.sql.SqlJournal` on an in-memory SQLite database, against a raw sqlite3
  commit of one UPDATE on the same kind of database: no fsync on either side, so the difference is
  the journal's CPU per phase (Python, pool, statements).

Figures are the best of five repeats in thread CPU time, so a busy machine does not count against
them; they add up to less than a whole step on disk, which :mod:`bench.saga` measures.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sqlite3
import sys
import time
import timeit
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sagaguard.idempotency import Guard, MemoryStore
from sagaguard.saga import Saga, SagaRunner, StepContext
from sagaguard.saga.journals.sql import SqlJournal
from sagaguard.saga.records import (
    Phase,
    SagaRecord,
    SagaSnapshot,
    SagaState,
    StartOutcome,
    StartResult,
    StepKind,
    StepRecord,
    StepState,
)

STEPS = 10


class NullJournal:
    """Creates every saga it is asked to start and accepts every commit; stores nothing."""

    def __init__(self) -> None:
        self._record: SagaRecord | None = None

    def now(self) -> float:
        return 1000.0

    def start(
        self, saga_id: str, *, name: str, version: int, input: str, fingerprint: str,
        lease: float, timeout: float = 0.0, first: StepRecord | None = None,
    ) -> StartResult:  # fmt: skip
        running = SagaState.RUNNING
        record = SagaRecord(saga_id, name, version, fingerprint, input, running, 1, 1060.0, 1000.0, 1000.0)
        self._record = record
        rows = () if first is None else (first.evolve(started_at=1000.0, updated_at=1000.0),)
        return StartResult(StartOutcome.CREATED, SagaSnapshot(record, rows, {}))

    def commit(self, saga_id: str, token: int, phase: Phase) -> SagaRecord:
        assert self._record is not None
        if phase.state is not None:
            self._record = self._record.evolve(state=phase.state, error=phase.error)
        return self._record


def _noop(ctx: StepContext, value: int) -> int:
    return value


def _best_us(fn: Callable[[], object], number: int, per: int = 1) -> float:
    return min(timeit.repeat(fn, number=number, repeat=5, timer=time.thread_time)) / number / per * 1e6


def flow_case() -> Callable[[], object]:
    """One run of the 10-step no-op saga on the null journal."""
    noops: Saga[int] = Saga("bench_noops", input=int)
    for k in range(STEPS):
        noops.step(name=f"s{k}", compensate=None)(_noop)
    runner = SagaRunner(NullJournal(), Guard(MemoryStore()), wait=0)  # type: ignore[arg-type]
    ids = iter(range(10**9))
    tag = uuid.uuid4().hex[:8]
    return lambda: runner.run(noops, f"{tag}-{next(ids)}", 1)


def phase_cases() -> tuple[Callable[[], object], Callable[[], object]]:
    """One atomic phase on an in-memory SqlJournal, and one raw sqlite3 UPDATE commit."""
    journal = SqlJournal("sqlite://")
    saga_id = uuid.uuid4().hex
    first = StepRecord(0, "s0", StepKind.COMPENSATABLE, StepState.STARTED)
    started = journal.start(saga_id, name="n", version=1, input="1", fingerprint="f", lease=60, first=first)
    token = started.snapshot.saga.token
    count = iter(range(1, 10**9))

    def phase() -> None:
        k = next(count)
        done = StepRecord(k - 1, f"s{k - 1}", StepKind.COMPENSATABLE, StepState.SUCCEEDED, result="1")
        nxt = StepRecord(k, f"s{k}", StepKind.COMPENSATABLE, StepState.STARTED)
        journal.commit(saga_id, token, Phase(steps=(done, nxt), lease=60))

    raw = sqlite3.connect(":memory:", isolation_level=None)
    raw.execute("CREATE TABLE floor (id INTEGER PRIMARY KEY, n INTEGER)")
    raw.execute("INSERT INTO floor VALUES (1, 0)")

    def floor() -> None:
        raw.execute("BEGIN IMMEDIATE")
        raw.execute("UPDATE floor SET n = n + 1 WHERE id = 1")
        raw.execute("COMMIT")

    return phase, floor


def _profile(fn: Callable[[], object], calls: int, top: int = 25) -> str:
    profile = cProfile.Profile(timer=time.thread_time)
    profile.enable()
    for _ in range(calls):
        fn()
    profile.disable()
    out = io.StringIO()
    pstats.Stats(profile, stream=out).strip_dirs().sort_stats("tottime").print_stats(top)
    return out.getvalue()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--profile", action="store_true", help="print cProfile's top entries too")
    args = parser.parse_args(argv)
    flow = flow_case()
    phase, floor = phase_cases()
    for warm in (flow, phase, floor):
        for _ in range(50):
            warm()
    results: dict[str, Any] = {
        "flow CPU per step (null journal)": _best_us(flow, 200, STEPS),
        "SqlJournal phase commit CPU (in-memory SQLite)": _best_us(phase, 2000),
        "raw sqlite3 UPDATE commit CPU (in-memory)": _best_us(floor, 2000),
    }
    for label, us in results.items():
        print(f"{label:50} {us:8.1f} µs")
    if args.profile:
        print("\n== flow ==\n" + _profile(flow, 300))
        print("\n== SqlJournal phase ==\n" + _profile(phase, 3000))
    return 0


if __name__ == "__main__":
    sys.exit(main())
