"""The proxy's runs (:class:`~sagaguard.connectors.mcp.proxyruns.ProxyRuns`) when an operator's cancel
arrives while a call of the connection is in flight: the run is undone only once that call is
recorded, so the call being applied is undone too, never missed; and undone, not completed, when the
connection ends before any sweep saw the cancel. In one process, on the memory journal and store,
each step of the interleaving driven by events (no sleeps)."""

from __future__ import annotations

from typing import Any

import anyio
from anyio import wait_all_tasks_blocked

from sagaguard.connectors.mcp.proxyruns import ProxyRuns
from sagaguard.idempotency import Guard, MemoryStore
from sagaguard.saga.agent import AgentSaga, OnFailure, UndoRegistry
from sagaguard.saga.control import cancel
from sagaguard.saga.journals.memory import MemoryJournal
from sagaguard.saga.records import CancelOutcome, SagaState


def test_a_cancel_arriving_while_a_call_is_in_flight_undoes_that_call_too_once_it_is_recorded() -> None:
    journal, guard, runs, undone = _proxy_runs()
    seen: dict[str, Any] = {}

    async def book(reference: str) -> str:
        return reference

    async def body() -> None:
        async with runs.calling("c1") as run:
            await run.acall("book", lambda: book("b1"), {"n": 1}, undo="cancel_booking")

        async def applying() -> str:
            # The server is applying the second booking when the operator cancels the run.
            journal.cancel(run.run_id, "operator")
            await runs.cancelled("c1")
            await wait_all_tasks_blocked()
            seen["undone while in flight"] = list(undone)
            seen["state while in flight"] = _state(journal, run.run_id)
            return "b2"

        async with runs.calling("c1") as run:
            await run.acall("book", applying, {"n": 2}, undo="cancel_booking")
        seen["run"] = run.run_id

    async def main() -> None:
        await runs.serve(body)

    try:
        anyio.run(main)
    finally:
        guard.close()
    assert seen["undone while in flight"] == [] and seen["state while in flight"] is SagaState.RUNNING
    assert undone == ["b2", "b1"]  # the call in flight is undone too, the last first, each once
    assert _state(journal, seen["run"]) is SagaState.COMPENSATED


def _proxy_runs() -> tuple[MemoryJournal, Guard, ProxyRuns, list[str]]:
    """Runs of a proxy whose one undo, ``cancel_booking``, appends the booking it undoes to the
    list returned; sweeps an hour apart (one, at the start), so only the connection sees a cancel."""
    undone: list[str] = []
    undos = UndoRegistry()

    @undos.named("cancel_booking")
    def cancel_booking(arguments: dict[str, Any], result: Any) -> None:
        undone.append(result)

    journal, guard = MemoryJournal(), Guard(MemoryStore())
    agent = AgentSaga("mcp-proxy.test", undos, on_failure=OnFailure.LEAVE)
    return journal, guard, ProxyRuns(journal, guard, agent, interval=3600, say=lambda _line: None), undone


def _state(journal: MemoryJournal, run_id: str) -> SagaState:
    snapshot = journal.load(run_id)
    assert snapshot is not None
    return snapshot.saga.state


def test_a_cancel_no_sweep_saw_before_the_connection_ended_undoes_the_run_rather_than_completing_it() -> None:
    """The operator cancels while the connection's last call is in flight (``sagas cancel`` answers
    REQUESTED), and the connection ends (a stateless HTTP request answered, a client gone) before
    any sweep looked: the run is undone, not completed with the cancel ignored."""
    journal, guard, runs, undone = _proxy_runs()
    seen: dict[str, Any] = {}

    async def body() -> None:
        async with runs.calling("request:1") as run:

            async def applying() -> str:
                seen["cancel"] = cancel(journal, run.run_id, reason="operator")
                return "b1"

            await run.acall("book", applying, {"n": 1}, undo="cancel_booking")
            seen["run"] = run.run_id
        await runs.close("request:1")  # the end of the request: no sweep since the cancel

    try:
        anyio.run(runs.serve, body)
    finally:
        guard.close()
    assert seen["cancel"] is CancelOutcome.REQUESTED
    assert undone == ["b1"]
    assert _state(journal, seen["run"]) is SagaState.COMPENSATED


def test_the_proxys_worker_holds_what_it_undoes_under_the_proxys_lease() -> None:
    """``--lease`` is the lease of the connections' runs and of the runs the proxy's worker takes
    over to undo: a proxy that dies while undoing is waited for no longer than one it ran."""
    undos = UndoRegistry()
    agent = AgentSaga("mcp-proxy.test", undos, on_failure=OnFailure.LEAVE)
    runs = ProxyRuns(MemoryJournal(), Guard(MemoryStore()), agent, lease=7.0, say=lambda _line: None)
    assert runs.runner.lease == runs.worker.runner.lease == 7.0
