"""The engine-neutral part of the DBOS and Temporal agent-saga adapters, in one process.

Tool calls hold the run only while they call (parked WAITING between them); the end of the
workflow completes, undoes, parks for an operator or cancels the run, and is safe to run again; a
call on a cancelled run is refused before its tool runs; a step that finds the run held waits on the
journal's (injected) clock, then lets the engine retry; a compensation a dead process left is
finished by the next end once the holder's lease ran out, or at once when the holder is dead here.
Real engines and real SIGKILLs are in tests/test_dbos_saga.py and tests/test_temporal_saga.py; the
adapters' edges are checked here too (a DBOS tool outside a step, a Temporal tool outside an
activity, an async Temporal tool).
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import threading
from typing import Any

import pytest
from _holders import dead_holder
from conftest import FakeClock
from temporalio import activity
from temporalio.testing import ActivityEnvironment

from sagaguard.connectors.declare import changes_world, read_only
from sagaguard.connectors.frameworks._engine_saga import AgentRunStopped, Ending, EngineSaga
from sagaguard.idempotency import ConfigurationError, Guard, MemoryStore, holder
from sagaguard.saga import MemoryJournal, SagaInProgress, SagaState, StepState, cancel
from sagaguard.saga.agent import AgentRunner, AgentSaga, OnFailure, UndoRegistry

pytestmark = pytest.mark.timeout(60)

LEASE = 5.0
RUN = "wf-1"


class Crash(BaseException):
    """The process dies here."""


class World:
    def __init__(self, *, on_failure: str = "compensate") -> None:
        self.clock = FakeClock()
        self.log: list[str] = []
        self.crash_in: set[str] = set()
        self.undos = UndoRegistry()

        @self.undos.register
        def refund(arguments: Any, result: Any) -> None:
            self.log.append(f"refund {arguments['amount']}")
            if "refund" in self.crash_in:
                self.crash_in.discard("refund")
                raise Crash

        @self.undos.register
        def cancel_booking(arguments: Any, result: Any) -> None:
            self.log.append(f"cancel {result['booking']}")

        self.agent = AgentSaga(f"engine_{on_failure}", self.undos, on_failure=on_failure)
        self.journal = MemoryJournal(clock=self.clock)
        self.runner = AgentRunner(self.journal, Guard(MemoryStore(clock=self.clock)), lease=LEASE)
        self.engine = EngineSaga(self.runner, self.agent, sleep=self.clock.advance)

    def book(self, call_id: str = "1") -> Any:
        def body() -> dict[str, str]:
            self.log.append("book")
            return {"booking": "bk-1"}

        declared = changes_world(undo="cancel_booking")
        return self.engine.call(RUN, "book", body, {"hotel": "ritz"}, call_id=call_id, declaration=declared)

    def charge(self, call_id: str = "2", amount: int = 420) -> Any:
        def body() -> dict[str, int]:
            self.log.append(f"charge {amount}")
            return {"amount": amount}

        declared = changes_world(undo="refund")
        return self.engine.call(
            RUN, "charge", body, {"amount": amount}, call_id=call_id, declaration=declared
        )

    def state(self) -> SagaState:
        found = self.journal.load(RUN)
        assert found is not None
        return found.saga.state


@pytest.fixture
def world() -> Any:
    made = World()
    yield made
    made.runner.close()


def test_a_read_only_tool_runs_as_it_is_and_writes_nothing(world: World) -> None:
    assert (
        world.engine.call(RUN, "search", lambda: "found", {}, call_id="1", declaration=read_only) == "found"
    )
    assert world.journal.load(RUN) is None


def test_calls_hold_the_run_only_while_they_call_and_the_end_completes_it_once(world: World) -> None:
    world.book()
    assert world.state() is SagaState.WAITING  # no process holds it between two steps
    assert world.charge() == {"amount": 420}
    assert world.charge() == {"amount": 420}  # the engine re-ran the step: replayed
    assert world.engine.end(RUN, Ending.COMPLETE).state is SagaState.COMPLETED
    assert world.engine.end(RUN, "complete").state is SagaState.COMPLETED  # an engine's re-run
    assert world.log == ["book", "charge 420"]


def test_a_step_re_run_after_its_run_completed_replays_and_a_new_one_is_stopped(world: World) -> None:
    """Issue 26, item 6, in the engines' mode: a step the engine runs again once the run has
    completed (its first run's completion was lost) replays its recorded result; a new call is
    refused (``AgentRunStopped``, the tool did not run). Before, the re-run step was refused too."""
    world.book()
    world.charge()
    assert world.engine.end(RUN, Ending.COMPLETE).state is SagaState.COMPLETED
    before = world.journal.load(RUN)
    assert world.charge() == {"amount": 420}  # the same step id: replayed
    with pytest.raises(AgentRunStopped) as stopped:
        world.charge(call_id="3")
    assert stopped.value.reason == "completed"
    assert world.log == ["book", "charge 420"]
    assert world.journal.load(RUN) == before  # nothing written


def test_the_end_of_a_failed_workflow_undoes_the_calls_in_reverse_once(world: World) -> None:
    world.book()
    world.charge()
    outcome = world.engine.end(RUN, Ending.FAIL, "RuntimeError: no seats left")
    assert outcome.state is SagaState.COMPENSATED
    assert world.engine.end(RUN, Ending.FAIL, "again").state is SagaState.COMPENSATED
    assert world.log == ["book", "charge 420", "refund 420", "cancel bk-1"]
    found = world.journal.load(RUN)
    assert found is not None and "no seats left" in (found.saga.error or "")


def test_with_on_failure_leave_the_failed_run_waits_for_an_operator() -> None:
    world = World(on_failure=OnFailure.LEAVE)
    try:
        world.charge()
        assert world.engine.end(RUN, Ending.FAIL, "boom").state is SagaState.NEEDS_ATTENTION
        assert world.log == ["charge 420"]
    finally:
        world.runner.close()


def test_the_end_of_a_cancelled_workflow_cancels_and_undoes_the_run(world: World) -> None:
    world.charge()
    assert world.engine.end(RUN, Ending.CANCEL, "the workflow was cancelled").state is SagaState.COMPENSATED
    found = world.journal.load(RUN)
    assert found is not None and found.saga.cancel_requested
    assert "the workflow was cancelled" in (found.saga.error or "")
    assert world.log == ["charge 420", "refund 420"]


def test_a_call_of_a_run_cancelled_from_outside_is_refused_and_the_end_undoes_it(world: World) -> None:
    world.book()
    cancel(world.journal, RUN, reason="the operator said no")  # sagaguard sagas cancel RUN
    with pytest.raises(AgentRunStopped) as stopped:
        world.charge(call_id="3")
    assert stopped.value.reason == "cancelled"
    assert world.state() is SagaState.COMPENSATED  # undone by the refused call, in its step
    assert world.engine.end(RUN, Ending.FAIL, "AgentRunStopped").state is SagaState.COMPENSATED
    assert world.log == ["book", "cancel bk-1"]  # the charge never ran
    found = world.journal.load(RUN)
    assert found is not None and "the operator said no" in (found.saga.error or "")
    with pytest.raises(AgentRunStopped):
        world.charge(call_id="4")  # the run has ended: still refused


def test_a_call_waits_while_the_run_is_held_then_leaves_it_to_the_engine(world: World) -> None:
    world.book()
    world.engine.hold_wait = LEASE / 2  # while the holder's lease is live (it is not renewed here)
    other = AgentRunner(world.journal, world.runner.guard, lease=LEASE)
    held = other.run(world.agent, RUN, exclusive=True)
    elsewhere = contextvars.copy_context()  # another worker's activity, holding the run
    elsewhere.run(held.__enter__)
    try:
        start = world.clock.now
        with pytest.raises(SagaInProgress):
            world.charge()
        assert world.clock.now - start >= world.engine.hold_wait  # waited on the journal's clock
        assert world.log == ["book"]  # nothing ran
    finally:
        other.close()


def test_a_compensation_left_by_a_dead_process_is_finished_by_the_next_end(world: World) -> None:
    world.book()
    world.charge()
    world.crash_in.add("refund")
    with pytest.raises(Crash):  # the process dies in the middle of its compensation
        contextvars.copy_context().run(world.engine.end, RUN, Ending.FAIL, "boom")
    assert world.state() is SagaState.COMPENSATING
    outcome = world.engine.end(RUN, Ending.FAIL, "boom")  # waits out the dead holder's lease
    assert outcome.state is SagaState.COMPENSATED
    assert world.log == ["book", "charge 420", "refund 420", "refund 420", "cancel bk-1"]
    found = world.journal.load(RUN)
    assert found is not None
    assert {row.state for row in found.steps if row.name.startswith("tool.")} == {StepState.COMPENSATED}


def no_sleep(seconds: float) -> None:
    raise AssertionError(f"waited {seconds} s for a dead holder")


def test_a_run_held_by_a_dead_process_is_taken_over_at_once(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same on this host with the holder provably dead: neither a call nor the end waits."""
    world.book()
    gone = dead_holder()

    def dies() -> None:
        raise Crash  # the process dies in the middle of the call, holding the run

    declared = changes_world(undo="refund")
    with monkeypatch.context() as patched, pytest.raises(Crash):  # as the dead process wrote it
        patched.setattr(holder, "current", lambda: gone)
        contextvars.copy_context().run(
            world.engine.call, RUN, "charge", dies, {"amount": 1}, call_id="0", declaration=declared
        )
    world.engine = EngineSaga(world.runner, world.agent, sleep=no_sleep)  # any wait fails the test
    world.charge()  # at once: the dead holder's run is taken over
    world.crash_in.add("refund")
    with monkeypatch.context() as patched, pytest.raises(Crash):
        patched.setattr(holder, "current", lambda: gone)
        contextvars.copy_context().run(world.engine.end, RUN, Ending.FAIL, "boom")
    assert world.state() is SagaState.COMPENSATING
    outcome = world.engine.end(RUN, Ending.FAIL, "boom")  # at once, its lease live
    assert outcome.state is SagaState.COMPENSATED
    # The dead call's effect was claimed (it may have reached the world), so it is undone too.
    assert world.log == ["book", "charge 420", "refund 420", "refund 420", "refund 1", "cancel bk-1"]


def test_the_dbos_tool_outside_a_dbos_step_is_refused(world: World) -> None:
    from sagaguard.connectors.frameworks.dbos_saga import dbos_run_id

    with pytest.raises(ConfigurationError):
        dbos_run_id()


def test_a_temporal_tool_outside_an_activity_is_refused_and_an_async_one_registers(world: World) -> None:
    from sagaguard.connectors.frameworks.temporal_saga import TemporalSagaTools, temporal_call_id

    tools = TemporalSagaTools(world.runner, world.agent)

    @activity.defn
    @tools.tool
    @changes_world(undo="refund")
    async def charge(amount: int) -> dict[str, int]:
        world.log.append(f"charge {amount}")
        return {"amount": amount}

    with pytest.raises(ConfigurationError):
        asyncio.run(charge(1))
    env = ActivityEnvironment()
    env.info = dataclasses.replace(ActivityEnvironment.default_info(), workflow_id=RUN, activity_id="7")
    assert asyncio.run(env.run(charge, 420)) == {"amount": 420}
    assert asyncio.run(env.run(charge, 420)) == {"amount": 420}  # a retried attempt: replayed
    assert world.log == ["charge 420"]
    found = world.journal.load(RUN)
    assert found is not None
    row = found.steps[0]
    assert row.name == "tool.charge.0" and row.state is StepState.SUCCEEDED
    assert f"{RUN}/{temporal_call_id(env.info)}" in (row.result or "")


def test_two_steps_of_one_run_at_once_never_overlap_nor_share_a_row() -> None:
    # Two workers' tool steps of one run at the same time (parallel activities), real clock: the
    # second waits for the first's hold instead of attaching to it and writing its rows over.
    undos = UndoRegistry()
    undos.add("undo", lambda arguments, result: None)
    agent = AgentSaga("engine_parallel", undos)
    journal = MemoryJournal()
    runner = AgentRunner(journal, Guard(MemoryStore()), lease=LEASE)
    engine = EngineSaga(runner, agent)
    log: list[str] = []
    a_started, b_started = threading.Event(), threading.Event()

    def a_body() -> str:
        log.append("a starts")
        a_started.set()
        b_started.wait(timeout=1.0)  # with the hold, b cannot start while a calls
        log.append("a ends")
        return "a"

    def b_body() -> str:
        b_started.set()
        log.append("b starts")
        return "b"

    declared = changes_world(undo="undo")
    first = threading.Thread(
        target=lambda: engine.call(RUN, "a", a_body, {}, call_id="1", declaration=declared)
    )
    try:
        first.start()
        assert a_started.wait(timeout=30)
        assert engine.call(RUN, "b", b_body, {}, call_id="2", declaration=declared) == "b"
        first.join(timeout=30)
        assert log == ["a starts", "a ends", "b starts"]
        found = journal.load(RUN)
        assert found is not None
        tools = [row for row in found.steps if row.name.startswith("tool.")]
        assert [row.name for row in tools] == ["tool.a.0", "tool.b.2"]
        assert {row.state for row in tools} == {StepState.SUCCEEDED}
    finally:
        runner.close()


def test_a_workflow_cancelled_after_its_pivot_undoes_only_what_came_after_it(world: World) -> None:
    world.book(call_id="1")
    world.engine.call(RUN, "sign", lambda: "contract", {}, call_id="2", declaration=changes_world(pivot=True))
    world.charge(call_id="3")
    outcome = world.engine.end(RUN, Ending.CANCEL, "the workflow was cancelled")
    assert world.log == ["book", "charge 420", "refund 420"]  # the booking before the pivot is kept
    found = world.journal.load(RUN)
    assert found is not None and not found.saga.cancel_requested  # refused past the pivot
    assert outcome.state is found.saga.state is SagaState.COMPENSATED
