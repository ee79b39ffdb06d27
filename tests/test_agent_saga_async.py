"""The async agent run on every journal: ``async with runner.run(...)`` and ``await run.acall(...)``
behave as the sync run does (the same rows, the same undos, in the same order), and never touch the
journal from the event loop's thread.

Mirrors the sync tests of ``tests/test_agent_saga.py`` that matter: a failing run undone in reverse
once, a completed run kept, a replay after a resume, a cancellation, a rejection, a pivot. Time is
the injected clock; a crash is a BaseException (a real SIGKILL of an async agent is in
``tests/test_agent_saga_agents.py``).
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import pytest
from conftest import FakeClock
from test_agent_saga import (  # the sync tests' fixtures: every journal, the same world
    LEASE,
    Crash,
    ToolFailed,
    World,
    agent,
    guard,
    journal,
    journal_factory,
    load,
    runner,
    sweep,
    world,
)

from sagaguard.idempotency import Guard
from sagaguard.idempotency.codec import decode_error
from sagaguard.saga import SagaState, StepState, cancel
from sagaguard.saga.agent import (
    AgentRunCancelled,
    AgentRunEnded,
    AgentRunner,
    AgentSaga,
    ToolCall,
    current_run,
    resume_signal,
)
from sagaguard.saga.journal import SagaJournal

__all__ = ["agent", "guard", "journal", "journal_factory", "runner", "world"]  # the fixtures, re-used

pytestmark = pytest.mark.timeout(60)

T = TypeVar("T")


def run(main: Callable[[], Coroutine[Any, Any, T]]) -> T:
    return asyncio.run(main())


async def book(world: World, hotel: str = "ritz", call_id: str | None = None) -> Any:
    async def booked() -> Any:
        await asyncio.sleep(0)  # a real await inside the tool
        return world.book(hotel)

    return await current_run().acall(
        "book_hotel", booked, {"hotel": hotel}, undo="cancel_booking", call_id=call_id
    )


async def charge(world: World, amount: int = 120) -> Any:
    async def charged() -> Any:
        return world.charge(amount)

    return await current_run().acall("charge", charged, {"amount": amount}, undo="refund")


def rows(journal: SagaJournal, run_id: str) -> list[tuple[str, StepState, str | None]]:
    return [(r.name, r.state, r.compensation) for r in load(journal, run_id).steps]


# --------------------------------------------------------------------------- the run's saga


def test_an_async_failing_run_undoes_its_calls_in_reverse_once(
    journal: SagaJournal, runner: AgentRunner, agent: AgentSaga, world: World
) -> None:
    async def main() -> None:
        async with runner.run(agent, "thread-1"):
            await book(world)
            await charge(world)
            raise ToolFailed("the flight tool failed")

    with pytest.raises(ToolFailed):
        run(main)
    assert [name for name, _ in world.log] == ["book", "charge", "refund", "cancel_booking"]
    assert world.did("refund") == [(120, {"charge": "ch-1", "amount": 120})]
    assert world.did("cancel_booking") == [("ritz", {"booking": "bk-ritz"})]
    snapshot = load(journal, "thread-1")
    assert snapshot.saga.state is SagaState.COMPENSATED
    assert [(r.name, r.state) for r in snapshot.steps] == [
        ("tool.book_hotel.0", StepState.COMPENSATED),
        ("tool.charge.1", StepState.COMPENSATED),
        ("agent.run.2", StepState.FAILED),
    ]
    assert decode_error(snapshot.saga.error or "").message == "the flight tool failed"


def test_the_async_and_the_sync_run_write_the_same_rows(
    journal: SagaJournal, runner: AgentRunner, agent: AgentSaga, world: World
) -> None:
    def sync_tool(name: str, fn: Callable[[], Any], arguments: dict[str, Any], undo: str) -> Any:
        return current_run().call(name, fn, arguments, undo=undo)

    with pytest.raises(ToolFailed), runner.run(agent, "sync"):
        sync_tool("book_hotel", lambda: world.book("ritz"), {"hotel": "ritz"}, "cancel_booking")
        sync_tool("charge", lambda: world.charge(120), {"amount": 120}, "refund")
        raise ToolFailed("later")

    async def main() -> None:
        async with runner.run(agent, "async"):
            await book(world)
            await charge(world)
            raise ToolFailed("later")

    with pytest.raises(ToolFailed):
        run(main)
    assert rows(journal, "async") == rows(journal, "sync")
    results = [(r.result or "").replace('"async/', '"sync/') for r in load(journal, "async").steps]
    assert results == [r.result or "" for r in load(journal, "sync").steps]  # the same call records
    assert [name for name, _ in world.log] == ["book", "charge", "refund", "cancel_booking"] * 2


def test_an_async_completed_run_keeps_its_effects(
    journal: SagaJournal, runner: AgentRunner, agent: AgentSaga, world: World
) -> None:
    async def search() -> str:
        return "3 hotels"

    async def main() -> None:
        async with runner.run(agent, "thread-1") as opened:
            await book(world)
            assert await opened.acall("search", search, {"q": "paris"}) == "3 hotels"  # not journaled

    run(main)
    snapshot = load(journal, "thread-1")
    assert snapshot.saga.state is SagaState.COMPLETED
    assert [r.name for r in snapshot.steps] == ["tool.book_hotel.0"]
    assert world.did("cancel_booking") == []

    async def again() -> None:
        async with runner.run(agent, "thread-1") as opened:  # re-opened: its answer, no new call
            assert opened.outcome is not None and opened.outcome.state is SagaState.COMPLETED
            with pytest.raises(AgentRunEnded):
                await opened.acall("refund", lambda: asyncio.sleep(0), {"amount": 1}, undo="refund")

    run(again)
    assert world.did("refund") == []


def test_an_async_call_made_again_after_a_resume_replays_and_keeps_its_row(
    journal: SagaJournal, runner: AgentRunner, agent: AgentSaga, world: World
) -> None:
    async def crashed() -> None:
        async with runner.run(agent, "thread-1"):
            await book(world, call_id="call-1")
            raise Crash

    async def resumed() -> Any:
        async with runner.run(agent, "thread-1"):  # the framework replays the same calls
            booked = await book(world, call_id="call-1")
            await charge(world)
            return booked

    with pytest.raises(Crash):
        run(crashed)
    assert run(resumed) == {"booking": "bk-ritz"}
    assert world.did("book") == ["ritz"]
    assert [r.name for r in load(journal, "thread-1").steps] == ["tool.book_hotel.0", "tool.charge.1"]
    assert load(journal, "thread-1").saga.state is SagaState.COMPLETED


def test_an_async_pivot_that_ran_stops_compensation_there(
    journal: SagaJournal, runner: AgentRunner, agent: AgentSaga, world: World
) -> None:
    async def sign() -> str:
        return world.sign()

    async def main() -> None:
        async with runner.run(agent, "thread-1") as opened:
            await book(world)
            await opened.acall("sign_contract", sign, {"party": "acme"}, pivot=True)
            await charge(world)
            raise ToolFailed("later")

    with pytest.raises(ToolFailed):
        run(main)
    assert world.did("refund") == [(120, {"charge": "ch-1", "amount": 120})]
    assert world.did("cancel_booking") == []  # before the pivot: forward only
    states = [r.state for r in load(journal, "thread-1").steps]
    assert states == [StepState.SUCCEEDED, StepState.SUCCEEDED, StepState.COMPENSATED, StepState.FAILED]


def test_parallel_async_calls_are_each_registered_once_and_undone(
    journal: SagaJournal, runner: AgentRunner, agent: AgentSaga, world: World
) -> None:
    async def main() -> None:
        async with runner.run(agent, "thread-1"):
            # the Agents SDK runs a turn's tool calls as concurrent tasks, each seeing the run
            await asyncio.gather(*(book(world, f"h{i}", call_id=f"call-{i}") for i in range(4)))
            raise ToolFailed("later")

    with pytest.raises(ToolFailed):
        run(main)
    snapshot = load(journal, "thread-1")
    registered = [_hotel(r.result) for r in snapshot.steps[:4]]
    assert sorted(registered) == ["h0", "h1", "h2", "h3"]
    undone = [arguments for arguments, _ in world.did("cancel_booking")]
    assert undone == registered[::-1]  # reverse of the order the journal registered them in


def _hotel(result: str | None) -> str:
    call = ToolCall.from_json(json.loads(result or "{}"))
    assert call is not None
    return str(call.arguments["hotel"])


# ------------------------------------------------------------------------------- triggers


def test_an_async_rejection_undoes_the_run(
    journal: SagaJournal, runner: AgentRunner, agent: AgentSaga, world: World
) -> None:
    async def paused() -> None:
        async with runner.run(agent, "thread-1") as opened:
            await book(world)
            await charge(world)
            opened.pause()  # the agent stopped at an approval

    run(paused)
    assert load(journal, "thread-1").saga.waiting_for == resume_signal(2)
    outcome = run(lambda: runner.areject(agent, "thread-1", "the manager said no"))
    assert outcome.state is SagaState.COMPENSATED
    assert outcome.error is not None and outcome.error.message == "the manager said no"
    assert [name for name, _ in world.log][-2:] == ["refund", "cancel_booking"]


def test_an_async_rejection_inside_the_block_undoes_the_run_and_ends_it(
    journal: SagaJournal, runner: AgentRunner, agent: AgentSaga, world: World
) -> None:
    async def main() -> Any:
        async with runner.run(agent, "thread-1") as opened:
            await book(world)
            outcome = await opened.areject("no")
            with pytest.raises(LookupError):
                current_run()  # the run is no longer current in this task
            return outcome

    assert run(main).state is SagaState.COMPENSATED
    assert load(journal, "thread-1").saga.state is SagaState.COMPENSATED
    assert world.did("cancel_booking") == [("ritz", {"booking": "bk-ritz"})]


def test_an_async_cancellation_stops_the_run_at_its_next_tool_call(
    journal: SagaJournal, runner: AgentRunner, agent: AgentSaga, world: World
) -> None:
    async def main() -> None:
        async with runner.run(agent, "thread-1"):
            await book(world)
            cancel(journal, "thread-1", reason="customer withdrew")
            await charge(world)

    with pytest.raises(AgentRunCancelled):
        run(main)
    assert world.did("charge") == []  # registered, never claimed, never run
    snapshot = load(journal, "thread-1")
    assert snapshot.saga.state is SagaState.COMPENSATED
    assert [(r.state, r.not_applied) for r in snapshot.steps[:2]] == [
        (StepState.COMPENSATED, False),
        (StepState.FAILED, True),
    ]
    assert world.did("cancel_booking") == [("ritz", {"booking": "bk-ritz"})]


def test_a_cancelled_task_leaves_the_run_as_a_crash_for_the_worker(
    *,
    journal: SagaJournal,
    guard: Guard,
    runner: AgentRunner,
    agent: AgentSaga,
    world: World,
    clock: FakeClock,
) -> None:
    started = asyncio.Event()

    async def agent_task() -> None:
        async with runner.run(agent, "thread-1"):
            await book(world)
            started.set()
            await asyncio.Event().wait()  # the agent waits on its model when its task is cancelled

    async def main() -> None:
        task = asyncio.create_task(agent_task())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(main)
    assert load(journal, "thread-1").saga.state is SagaState.RUNNING  # nothing decided in-process
    clock.advance(LEASE + 1)
    parked = sweep(journal, guard, agent).outcomes["thread-1"]
    assert (parked.state, parked.waiting_for) == (SagaState.WAITING, resume_signal(1))
    assert world.did("cancel_booking") == []


def test_an_async_run_never_touches_the_journal_on_the_event_loop(
    journal: SagaJournal, runner: AgentRunner, agent: AgentSaga, world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[tuple[str, threading.Thread]] = []
    for method in ("start", "load", "commit", "claim", "signal"):
        original = getattr(journal, method)

        def spy(*args: Any, _name: str = method, _original: Any = original, **kwargs: Any) -> Any:
            seen.append((_name, threading.current_thread()))
            return _original(*args, **kwargs)

        monkeypatch.setattr(journal, method, spy)
    loop_thread: list[threading.Thread] = []

    async def main() -> None:
        loop_thread.append(threading.current_thread())
        async with runner.run(agent, "thread-1"):
            await book(world)
            await charge(world)
            raise ToolFailed("later")

    with pytest.raises(ToolFailed):
        run(main)
    assert {name for name, _ in seen} >= {"start", "load", "commit"}
    assert [name for name, thread in seen if thread is loop_thread[0]] == []
    assert world.did("cancel_booking") == [("ritz", {"booking": "bk-ritz"})]


def test_a_call_still_running_when_the_run_ends_cannot_overwrite_its_rows(
    journal: SagaJournal, runner: AgentRunner, agent: AgentSaga, world: World
) -> None:
    seen: dict[str, Any] = {}

    async def main() -> None:
        release = asyncio.Event()

        async def slow() -> Any:
            await release.wait()  # still running when the run ends (nothing cancels it)
            return world.book("ritz")

        with pytest.raises(ToolFailed):
            async with runner.run(agent, "thread-1"):
                call = current_run().acall("book_hotel", slow, {"hotel": "ritz"}, undo="cancel_booking")
                late = asyncio.create_task(call)
                while not load(journal, "thread-1").steps:
                    await asyncio.sleep(0.001)  # registered (a journal row), its claim on the way
                raise ToolFailed("a sibling failed")
        seen["ended"] = load(journal, "thread-1")
        release.set()
        seen["returned"] = await late

    run(main)
    # COMPENSATED, or FAILED when its claim was not made yet (nothing to undo): the run has ended
    assert seen["ended"].saga.state in (SagaState.COMPENSATED, SagaState.FAILED)
    assert seen["returned"] == {"booking": "bk-ritz"}  # the call returns to its caller...
    assert load(journal, "thread-1").steps == seen["ended"].steps  # ...and writes nothing to the run
