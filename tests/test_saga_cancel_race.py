"""A cancel racing the runner's commit of its pivot, on Postgres: what the cancel answers is what
the runner does.

A raw connection holds the saga row's lock, as a phase commit in flight does. The runner's commit
of the pivot's STARTED row and an operator's cancel both wait for it, in the order the test
chooses; the lock is then released and they go in that order.

- The pivot's commit first: the cancel, deciding on the rows of its own transaction after that
  commit, is TOO_LATE and records nothing. A cancel deciding on a read made before the commit, or
  a conditional UPDATE (Postgres re-checks only the updated row after waiting for its lock, not
  the steps its subquery read), answers REQUESTED for a cancellation the runner never honours.
- The cancel first: REQUESTED, and the pivot's commit returns the saga with the cancellation
  pending, so the runner abandons before the pivot runs.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from _sagajournals import JournalFactory, factory_for
from conftest import FakeClock

from sagaguard.saga import CancelOutcome, Phase, SagaState, StepKind, StepRecord, StepState
from sagaguard.saga.decisions import abandon_cause
from sagaguard.saga.records import SagaRecord


@pytest.fixture
def journal_factory(clock: FakeClock, tmp_path: Path) -> Iterator[JournalFactory]:
    yield from factory_for("postgres", clock, tmp_path)


def _waiting_for_the_lock(url: str, table: str) -> int:
    """How many other sessions wait for a lock in a statement on ``table``."""
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE pid <> pg_backend_pid() "
            "AND wait_event_type = 'Lock' AND position(%s in query) > 0",
            (table,),
        ).fetchone()
    return int(row[0]) if row else 0


def _until_waiting(url: str, table: str, count: int) -> None:
    deadline = time.monotonic() + 60
    while _waiting_for_the_lock(url, table) < count:
        assert time.monotonic() < deadline, f"{count} sessions never waited for the saga row"
        time.sleep(0.02)


class _Call(threading.Thread):
    """Runs ``call`` in a thread, keeping its result or its exception."""

    def __init__(self, call: Callable[[], Any]) -> None:
        super().__init__(daemon=True)
        self._call = call
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self._call()
        except BaseException as exc:  # handed to the test
            self.error = exc

    def outcome(self) -> Any:
        self.join(timeout=60)
        assert not self.is_alive(), "the call never returned"
        if self.error is not None:
            raise self.error
        return self.result


@pytest.mark.parametrize("first", ["pivot", "cancel"])
def test_a_cancel_racing_the_pivots_commit_answers_what_the_runner_does(
    journal_factory: JournalFactory, first: str
) -> None:
    runner, operator = journal_factory.open(), journal_factory.open()
    started = runner.start("s-1", name="trip", version=1, input="{}", fingerprint="fp", lease=30.0)
    token = started.snapshot.saga.token
    booked = StepRecord(0, "book", StepKind.COMPENSATABLE, StepState.SUCCEEDED, compensation="u", result="1")
    runner.commit("s-1", token, Phase(steps=(booked,), lease=30))
    pivot = StepRecord(1, "charge", StepKind.PIVOT, StepState.STARTED)

    table = f"{journal_factory.prefix}sagas"
    url = journal_factory.url
    calls = {
        "pivot": _Call(lambda: runner.commit("s-1", token, Phase(steps=(pivot,), lease=30))),
        "cancel": _Call(lambda: operator.cancel("s-1", '{"why":"operator"}')),
    }
    second = "cancel" if first == "pivot" else "pivot"
    with psycopg.connect(url) as holder:
        holder.execute(f'SELECT 1 FROM "{table}" WHERE saga_id = %s FOR UPDATE', ("s-1",))
        calls[first].start()
        _until_waiting(url, table, 1)
        calls[second].start()
        _until_waiting(url, table, 2)
        holder.rollback()  # the phase in flight ends; the waiters go in the order they came

    committed: SagaRecord = calls["pivot"].outcome()
    answered = calls["cancel"].outcome()
    snapshot = runner.load("s-1")
    assert snapshot is not None and snapshot.saga.state is SagaState.RUNNING
    if first == "pivot":
        assert answered is CancelOutcome.TOO_LATE
        assert not committed.cancel_requested and not snapshot.saga.cancel_requested
        assert abandon_cause(snapshot) is None  # the pivot runs, nothing was promised otherwise
    else:
        assert answered is CancelOutcome.REQUESTED
        assert committed.cancel_requested
        # The runner decides on the row its commit returned: the pivot it just wrote never ran.
        assert abandon_cause(snapshot, fresh=1) == '{"why":"operator"}'
