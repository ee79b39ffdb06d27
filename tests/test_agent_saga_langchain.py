"""LangChain ``create_agent`` runs as agent sagas
(``sagaguard.connectors.frameworks.langchain_saga.SagaMiddleware``), with the real framework, a scripted chat
model (``tests/_agentsagalc.py``), the real ``stripe`` SDK against the local Stripe server and a local HTTP
API; effects and undos are counted at the servers.

The agent books a hotel and charges a card (two parallel tool calls), then its flight fails: each
booking and charge is undone once, with ``invoke`` and with ``ainvoke``. Stopped at a
``HumanInTheLoopMiddleware`` approval, a run is rejected (undone) or approved (completed, its effects
kept). A real process SIGKILLed in its model call, cancelled with ``sagaguard sagas cancel``, is
undone by a worker SIGKILLed right after its refund reached Stripe, and finished by the next.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path
from typing import Any

import _agentsagalc as lc
import _agenttrip as trip
import pytest
from langchain_core.messages import HumanMessage
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.types import Command
from test_agent_saga_agents import _env, api, applied, load, money, runner, servers, stripe, url

from sagaguard.connectors.frameworks.langchain_saga import SagaMiddleware
from sagaguard.connectors.testing import LocalIdempotentApi, LocalStripe
from sagaguard.saga import SagaState, StepState
from sagaguard.saga.agent import AgentRunner, ToolCall
from sagaguard.saga.journals.sql import SqlJournal

__all__ = ["api", "runner", "servers", "stripe", "url"]  # the fixtures, re-used

pytestmark = pytest.mark.timeout(60)

INPUTS = {"messages": [HumanMessage(trip.TEXT)]}


def test_a_create_agent_run_that_fails_on_a_later_tool_undoes_every_booking_and_charge_once(
    stripe: LocalStripe, api: LocalIdempotentApi, runner: AgentRunner
) -> None:
    agent = lc.build(runner.guard, InMemorySaver())
    with pytest.raises(trip.NoSeats), runner.run(trip.trip_agent, trip.RUN):
        agent.invoke(INPUTS, lc.THREAD, durability="sync")
    assert money(stripe) == {"charges": 1, "refunds": 1}
    assert applied(api) == {"/bookings": 1, "/cancellations": 1}  # the flight failed: nothing to undo
    snapshot = load(runner, trip.RUN)
    assert snapshot.saga.state is SagaState.COMPENSATED
    assert [r.state for r in snapshot.steps] == [StepState.COMPENSATED] * 2 + [StepState.FAILED] * 2
    made = [ToolCall.of_row(r) for r in snapshot.steps[:3]]
    assert sorted(c.tool for c in made if c) == ["book_flight", "book_hotel", "charge"]
    charged = next(c for c in made if c and c.tool == "charge")
    assert charged.result["payment_intent"].startswith("pi_")  # the tool's output, for the undo
    assert charged.key.startswith("trip-1/call_")  # the run id and the model's tool_call_id


def test_an_async_create_agent_run_that_fails_undoes_its_calls_once(
    stripe: LocalStripe, api: LocalIdempotentApi, runner: AgentRunner
) -> None:
    agent = lc.build(runner.guard, InMemorySaver())

    async def main() -> None:
        async with runner.run(trip.trip_agent, trip.RUN):
            await agent.ainvoke(INPUTS, lc.THREAD, durability="sync")

    with pytest.raises(trip.NoSeats):
        asyncio.run(main())
    assert money(stripe) == {"charges": 1, "refunds": 1}
    assert applied(api) == {"/bookings": 1, "/cancellations": 1}
    assert load(runner, trip.RUN).saga.state is SagaState.COMPENSATED


def _paused(runner: AgentRunner, checkpointer: InMemorySaver) -> None:
    trip.configure(flight="approval")
    agent = lc.build(runner.guard, checkpointer)
    with runner.run(trip.trip_agent, trip.RUN) as run:
        result = agent.invoke(INPUTS, lc.THREAD, durability="sync")
        assert "__interrupt__" in result  # the HumanInTheLoopMiddleware stopped before the flight
        run.pause()
    assert load(runner, trip.RUN).saga.state is SagaState.WAITING


def test_a_create_agent_run_rejected_at_an_approval_is_undone(
    stripe: LocalStripe, api: LocalIdempotentApi, runner: AgentRunner, url: str
) -> None:
    _paused(runner, InMemorySaver())
    other = AgentRunner(SqlJournal(url), runner.guard, sleep=lambda _s: None)  # as another process
    try:
        outcome = other.reject(trip.trip_agent, trip.RUN, "the manager said no")
    finally:
        other.close()
    assert outcome.state is SagaState.COMPENSATED
    assert money(stripe) == {"charges": 1, "refunds": 1}
    assert applied(api) == {"/bookings": 1, "/cancellations": 1}


def test_a_create_agent_run_approved_later_completes_and_keeps_its_effects(
    stripe: LocalStripe, api: LocalIdempotentApi, runner: AgentRunner
) -> None:
    checkpointer = InMemorySaver()
    _paused(runner, checkpointer)
    agent = lc.build(runner.guard, checkpointer)
    with runner.run(trip.trip_agent, trip.RUN):  # the approval came: the run is taken back
        done = agent.invoke(
            Command(resume={"decisions": [{"type": "approve"}]}), lc.THREAD, durability="sync"
        )
    assert done["messages"][-1].content == "done"
    assert load(runner, trip.RUN).saga.state is SagaState.COMPLETED
    assert money(stripe) == {"charges": 1, "refunds": 0}
    assert applied(api) == {"/bookings": 1, "/flights": 1}


def test_a_step_s_body_runs_in_its_call_s_scope_so_effects_inside_need_no_key(
    stripe: LocalStripe, api: LocalIdempotentApi, runner: AgentRunner
) -> None:
    from langchain.agents import create_agent
    from langchain_core.tools import tool

    from sagaguard.connectors.declare import changes_world
    from sagaguard.connectors.stripe import StripeEffects
    from sagaguard.idempotency import current_scope

    payments = StripeEffects(runner.guard, api_key=stripe.api_key, api_base=stripe.api_base)
    scopes: list[str] = []

    @tool
    @changes_world(undo="refund")
    def charge(amount: int, order: str) -> dict[str, Any]:
        """Charge the card."""
        scopes.append(current_scope().id)
        payment = payments.charge(amount, "eur", payment_method="pm_card_visa")  # no key=: the scope's
        return {"payment_intent": payment.id, "amount": payment.amount}

    plan = {0: [("charge", {"amount": 420, "order": "trip-1"})]}
    model = lc.TripChatModel()
    agent = create_agent(
        model, tools=[charge], middleware=[SagaMiddleware(runner.guard)], checkpointer=InMemorySaver()
    )
    saved = dict(trip.PLAN)
    trip.PLAN.clear()
    trip.PLAN.update(plan)
    try:
        with runner.run(trip.trip_agent, trip.RUN):
            assert agent.invoke(INPUTS, lc.THREAD, durability="sync")["messages"][-1].content == "done"
    finally:
        trip.PLAN.clear()
        trip.PLAN.update(saved)
    (step,) = [ToolCall.of_row(r) for r in load(runner, trip.RUN).steps]
    assert step is not None and scopes == [step.key]  # the run id and the model's tool_call_id
    assert money(stripe) == {"charges": 1, "refunds": 0}


def test_saga_middleware_is_the_guard_middleware_with_saga_steps(runner: AgentRunner) -> None:
    from sagaguard.connectors.frameworks.langchain import GuardMiddleware
    from sagaguard.connectors.frameworks.langgraph_saga import SagaTools

    with pytest.warns(DeprecationWarning, match="GuardMiddleware"):
        middleware = SagaMiddleware(runner.guard)
    assert isinstance(middleware, GuardMiddleware)
    assert middleware.tool_guard.saga  # the saga mode of the one ToolGuard: other tools guarded
    with pytest.warns(DeprecationWarning, match="ToolGuard"):
        SagaTools()

    import sagaguard.connectors.frameworks.langchain_saga as module

    assert module.__all__ == ["SagaMiddleware"]


# ------------------------------------------------------------------ real SIGKILLs, fresh processes


@pytest.mark.timeout(240)  # fresh processes that import LangChain, on a shared machine
def test_a_create_agent_run_killed_cancelled_and_undone_by_a_worker_killed_mid_undo(tmp_path: Path) -> None:
    from test_agent_saga_crash import _cli, _run, worker_until_done

    child = [sys.executable, str(Path(lc.__file__).resolve())]
    db = f"sqlite:///{tmp_path / 'agent.db'}"
    with LocalStripe() as stripe, LocalIdempotentApi() as api:  # their own processes: they outlive the kills
        killed = _run(child, _env(stripe, api, tmp_path, SAGAGUARD_CRASH_AT="in_model"))
        assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr
        assert money(stripe) == {"charges": 1, "refunds": 0}
        assert applied(api) == {"/bookings": 1}
        cancelled = _run(_cli("sagas", "cancel", trip.RUN, "--journal", db), _env(stripe, api, tmp_path))
        assert cancelled.returncode == 0, cancelled.stdout + cancelled.stderr
        env = _env(stripe, api, tmp_path, SAGAGUARD_CRASH_AT="in_refund")
        worker_until_done(env, db, kill_expected=True, app="_agenttrip:registry", run_id=trip.RUN)
        assert (tmp_path / "killed-in_refund").exists()  # a worker died right after the refund
        assert money(stripe) == {"charges": 1, "refunds": 1}
        assert applied(api) == {"/bookings": 1, "/cancellations": 1}
    journal = SqlJournal(db)
    try:
        found = journal.load(trip.RUN)
        assert found is not None and found.saga.state is SagaState.COMPENSATED
    finally:
        journal.close()
