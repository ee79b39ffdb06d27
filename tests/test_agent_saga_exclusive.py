"""An agent run opened exclusively: two places attached to one run never write the same row.

Engines may run two processes for one run at once (Temporal activities of one workflow on two
workers, a retried activity next to its zombie, DBOS steps). A run opened with ``exclusive=True``
refuses, with :class:`~sagaguard.saga.errors.SagaInProgress` and nothing written, while another open run
holds the run's lease; once the holder parks the run (``pause``) the next one takes it back and
appends after it; a dead holder's run is taken over once its lease ran out (the journal's clock is
injected), and the dead holder's late writes are fenced off.
"""

from __future__ import annotations

import contextvars
from typing import Any

import pytest
from conftest import FakeClock

from sagaguard.idempotency import Guard, MemoryStore
from sagaguard.saga import LostSagaLease, MemoryJournal, SagaInProgress, SagaState, StepState
from sagaguard.saga.agent import AgentRunEnded, AgentRunner, AgentSaga, UndoRegistry

pytestmark = pytest.mark.timeout(60)

LEASE = 30.0

undos = UndoRegistry()


@undos.register
def refund(arguments: Any, result: Any) -> None:
    pass


AGENT = AgentSaga("exclusive_agent", undos)


def _runner(journal: MemoryJournal, store: MemoryStore) -> AgentRunner:
    return AgentRunner(journal, Guard(store), lease=LEASE, sleep=lambda _s: None)


def test_a_held_run_is_refused_then_taken_back_and_appended_after_its_holder() -> None:
    clock = FakeClock()
    journal, store = MemoryJournal(clock=clock), MemoryStore(clock=clock)
    one, two = _runner(journal, store), _runner(journal, store)  # two "processes"
    try:
        first = one.run(AGENT, "run-1", exclusive=True)
        with first:
            first.call("charge", lambda: {"id": "ch-1"}, {"amount": 1}, undo="refund", call_id="a")
            before = journal.load("run-1")
            with pytest.raises(SagaInProgress), two.run(AGENT, "run-1", exclusive=True):
                pass
            after = journal.load("run-1")
            assert before is not None and after is not None
            assert (after.saga.token, after.steps) == (before.saga.token, before.steps)  # nothing written
            first.pause()
        with two.run(AGENT, "run-1", exclusive=True) as second:
            second.call("charge", lambda: {"id": "ch-2"}, {"amount": 2}, undo="refund", call_id="b")
            second.pause()
        snapshot = journal.load("run-1")
        assert snapshot is not None and snapshot.saga.state is SagaState.WAITING
        assert [row.name for row in snapshot.steps] == [
            "tool.charge.0", "agent.run.1", "tool.charge.2", "agent.run.3",
        ]  # fmt: skip
        assert [row.state for row in snapshot.steps[:3]] == [StepState.SUCCEEDED] * 3
    finally:
        one.close()
        two.close()


def test_a_dead_holders_run_is_taken_over_after_its_lease_and_its_late_writes_are_refused() -> None:
    clock = FakeClock()
    journal, store = MemoryJournal(clock=clock), MemoryStore(clock=clock)
    dead, alive = _runner(journal, store), _runner(journal, store)
    try:
        zombie = dead.run(AGENT, "run-2", exclusive=True)
        elsewhere = contextvars.copy_context()  # the dead process's context, not this test's
        elsewhere.run(zombie.__enter__)  # the process dies inside: it never leaves the block
        elsewhere.run(
            zombie.call, "charge", lambda: {"id": "ch-1"}, {"amount": 1}, undo="refund", call_id="a"
        )
        dead.close()  # and stops renewing
        with pytest.raises(SagaInProgress), alive.run(AGENT, "run-2", exclusive=True):
            pass
        clock.advance(LEASE + 1)
        with alive.run(AGENT, "run-2", exclusive=True) as run:
            value = run.call("charge", lambda: {"id": "ch-x"}, {"amount": 1}, undo="refund", call_id="a")
            assert value == {"id": "ch-1"}  # the dead holder's call, replayed, not made again
            with pytest.raises(LostSagaLease):
                elsewhere.run(zombie.call, "charge", lambda: 3, {"amount": 3}, undo="refund", call_id="c")
        snapshot = journal.load("run-2")
        assert snapshot is not None and snapshot.saga.state is SagaState.COMPLETED
        assert [row.name for row in snapshot.steps] == ["tool.charge.0"]
    finally:
        alive.close()


def test_a_completed_run_re_opened_exclusively_replays_its_calls_and_takes_no_new_one() -> None:
    """Issue 26, item 6, in the engines' mode: a crash between the run's completion and the
    program saving its answer; opened again with ``exclusive=True`` the run replays (nothing
    written, no lease held), its recorded call gives back its result and a new one is refused.
    Before, the open raised ``AgentRunEnded``."""
    clock = FakeClock()
    journal, store = MemoryJournal(clock=clock), MemoryStore(clock=clock)
    runner, made = _runner(journal, store), []

    def charge() -> dict[str, str]:
        made.append("ch-1")
        return {"id": "ch-1"}

    try:
        with runner.run(AGENT, "run-3", exclusive=True) as first:
            first.call("charge", charge, {"amount": 1}, undo="refund", call_id="a")
        before = journal.load("run-3")
        with runner.run(AGENT, "run-3", exclusive=True) as again:
            assert again.outcome is not None and again.outcome.state is SagaState.COMPLETED
            assert again.outcome.replayed
            assert again.call("charge", charge, {"amount": 1}, undo="refund", call_id="a") == {"id": "ch-1"}
            with pytest.raises(AgentRunEnded, match="completed"):
                again.call("charge", charge, {"amount": 2}, undo="refund", call_id="b")
        after = journal.load("run-3")
        assert before is not None and after is not None
        assert (after.saga, after.steps) == (before.saga, before.steps)  # nothing written
        assert made == ["ch-1"]
    finally:
        runner.close()
