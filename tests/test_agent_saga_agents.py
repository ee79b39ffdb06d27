"""OpenAI Agents SDK turns as agent sagas (``sagaguard.connectors.frameworks.openai_agents_saga.SagaTurn``),
with the real SDK, a scripted model (``tests/_agentsagasdk.py``), the real ``stripe`` SDK against the local
Stripe server and a local HTTP API; effects and undos are counted at the servers.

A turn books a hotel and charges a card (two parallel tool calls), then its flight fails: each
booking and charge is undone once. Stopped at an approval, a turn is rejected (undone) or approved
(it completes, keeping its effects) by fresh objects, as another process would. A real process
SIGKILLed in its model call, resumed from its session, and SIGKILLed again right after its refund
reached Stripe is finished by ``sagaguard sagas worker``; a turn paused at an approval in one
process is rejected from another.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import _agentsagasdk as sdk
import _agenttrip as trip
import httpx
import pytest
from agents import RunState
from agents.exceptions import UserError

from sagaguard.connectors.frameworks.openai_agents import MODEL_EFFECT, model_call_key
from sagaguard.connectors.frameworks.openai_agents_saga import SagaTurn, turn_run_id
from sagaguard.connectors.testing import LocalIdempotentApi, LocalStripe
from sagaguard.idempotency import ConfigurationError, Guard
from sagaguard.idempotency.keys import derive_explicit_key
from sagaguard.idempotency.stores.sql import SqlStore
from sagaguard.saga import SagaState, StepState, cancel
from sagaguard.saga.agent import AgentRunCancelled, AgentRunner, NoOpenRun, ToolCall
from sagaguard.saga.journals.sql import SqlJournal
from sagaguard.saga.records import SagaSnapshot

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[LocalStripe, LocalIdempotentApi]]:
    with LocalStripe(in_process=True) as stripe, LocalIdempotentApi(in_process=True) as api:
        yield stripe, api


@pytest.fixture
def stripe(servers: tuple[LocalStripe, LocalIdempotentApi]) -> LocalStripe:
    servers[0].reset()
    return servers[0]


@pytest.fixture
def api(servers: tuple[LocalStripe, LocalIdempotentApi], stripe: LocalStripe) -> Iterator[LocalIdempotentApi]:
    servers[1].reset()
    saved = dict(trip.CONFIG)
    trip.configure(api=servers[1].url, stripe_base=stripe.api_base, stripe_key=stripe.api_key, flight="fails")
    yield servers[1]
    trip.CONFIG.clear()
    trip.CONFIG.update(saved)


@pytest.fixture
def url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'agent.db'}"


@pytest.fixture
def runner(url: str) -> Iterator[AgentRunner]:
    made = AgentRunner(SqlJournal(url), Guard(SqlStore(url)), sleep=lambda _s: None)
    yield made
    made.close()


def applied(api: LocalIdempotentApi) -> Counter[str]:
    found = httpx.get(f"{api.url}/resources", timeout=10).json()["resources"]
    return Counter(resource["path"] for resource in found)


def money(stripe: LocalStripe) -> dict[str, int]:
    counts = stripe.counters()
    return {"charges": counts.get("charges", 0), "refunds": counts.get("refunds", 0)}


def load(runner: AgentRunner, run_id: str = "trip-1/turn-1") -> SagaSnapshot:
    found = runner.journal.load(run_id)
    assert found is not None
    return found


def calls(snapshot: SagaSnapshot) -> dict[str, ToolCall]:
    found = {}
    for row in snapshot.steps:
        call = ToolCall.of_row(row)
        if call is not None:
            found[call.tool] = call
    return found


async def first_turn(runner: AgentRunner, model: sdk.TripModel, **options: Any) -> Any:
    async with sdk.turn(runner) as opened:
        return await opened.run(sdk.build(model), trip.TEXT, **options)


# --------------------------------------------------------------------------- in this process


def test_a_turn_that_fails_on_a_later_tool_undoes_every_booking_and_charge_once(
    stripe: LocalStripe, api: LocalIdempotentApi, runner: AgentRunner
) -> None:
    model = sdk.TripModel()
    with pytest.raises(UserError, match="no seats"):  # the SDK wraps what a tool raised
        asyncio.run(first_turn(runner, model))
    assert money(stripe) == {"charges": 1, "refunds": 1}
    assert applied(api) == {"/bookings": 1, "/cancellations": 1}  # the flight failed: nothing to undo
    snapshot = load(runner)
    assert snapshot.saga.state is SagaState.COMPENSATED
    assert [r.state for r in snapshot.steps] == [StepState.COMPENSATED] * 2 + [StepState.FAILED] * 2
    assert snapshot.steps[2].not_applied  # the flight, declared permanent=(NoSeats,)
    made = calls(snapshot)
    assert sorted(made) == ["book_flight", "book_hotel", "charge"]
    # keyed on the turn and the SDK's tool_call_id; the undo got the tool's output
    assert sorted(c.key for c in made.values()) == sorted(f"trip-1/turn-1/{i}" for i in model.call_ids)
    assert made["charge"].result["payment_intent"].startswith("pi_")
    assert made["book_hotel"].arguments == {"hotel": "ritz"}


def test_a_turn_opened_with_plain_with_around_run_sync_is_undone_the_same_way(
    stripe: LocalStripe, api: LocalIdempotentApi, runner: AgentRunner
) -> None:
    from agents import Runner

    with pytest.raises(UserError, match="no seats"), sdk.turn(runner) as opened:
        Runner.run_sync(opened.wrap(sdk.build(sdk.TripModel())), trip.TEXT)
    assert opened.outcome is not None and opened.outcome.state is SagaState.COMPENSATED
    assert money(stripe) == {"charges": 1, "refunds": 1}
    assert applied(api) == {"/bookings": 1, "/cancellations": 1}


def test_a_turn_rejected_at_an_approval_is_undone_by_a_fresh_turn_object(
    stripe: LocalStripe, api: LocalIdempotentApi, runner: AgentRunner
) -> None:
    trip.configure(flight="approval")
    result = asyncio.run(first_turn(runner, sdk.TripModel()))
    assert [item.name for item in result.interruptions] == ["book_flight"]
    assert load(runner).saga.state is SagaState.WAITING  # paused: no process held
    outcome = asyncio.run(sdk.turn(runner).reject("the manager said no"))
    assert outcome.state is SagaState.COMPENSATED
    assert outcome.error is not None and outcome.error.message == "the manager said no"
    assert money(stripe) == {"charges": 1, "refunds": 1}
    assert applied(api) == {"/bookings": 1, "/cancellations": 1}


def test_a_turn_approved_later_completes_and_keeps_its_effects(
    stripe: LocalStripe, api: LocalIdempotentApi, runner: AgentRunner
) -> None:
    trip.configure(flight="approval")
    saved = json.dumps(asyncio.run(first_turn(runner, sdk.TripModel())).to_state().to_json())
    model = sdk.TripModel()  # the approval arrives in a fresh process: fresh objects

    async def approve() -> Any:
        async with sdk.turn(runner) as opened:
            agent = sdk.build(model)
            state = opened.resume(await RunState.from_json(opened.wrap(agent), json.loads(saved)))
            for item in state.get_interruptions():
                state.approve(item)
            done = await opened.run(agent, state)
            return done.final_output, opened.usage.calls

    assert asyncio.run(approve()) == ("done", 1)  # only the answer after the flight is paid
    assert load(runner).saga.state is SagaState.COMPLETED
    assert money(stripe) == {"charges": 1, "refunds": 0}
    assert applied(api) == {"/bookings": 1, "/flights": 1}
    guard = runner.guard  # the model calls are journaled under the turn's run id
    for ordinal in range(3):
        key = derive_explicit_key(
            guard.namespace, model_call_key(turn_run_id("trip-1", 1), ordinal), MODEL_EFFECT
        )
        assert guard.store.get(key) is not None, ordinal


def test_a_cancelled_turn_stops_at_its_next_declared_call_and_is_undone(
    stripe: LocalStripe, api: LocalIdempotentApi, runner: AgentRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    trip.configure(flight="ok")
    original = trip.book_hotel

    def book_hotel(hotel: str) -> dict[str, Any]:
        made = original(hotel)
        cancel(runner.journal, "trip-1/turn-1", reason="the customer withdrew")  # an operator
        return made

    monkeypatch.setattr(trip, "book_hotel", book_hotel)
    with pytest.raises(AgentRunCancelled):
        asyncio.run(first_turn(runner, sdk.TripModel()))
    assert load(runner).saga.state is SagaState.COMPENSATED
    assert applied(api)["/flights"] == 0  # registered after the cancellation: never ran
    assert applied(api)["/cancellations"] == 1
    assert money(stripe)["refunds"] == money(stripe)["charges"]  # a charge that ran was refunded


def test_a_declared_tool_outside_an_open_turn_is_refused(
    api: LocalIdempotentApi, runner: AgentRunner
) -> None:
    turn = sdk.turn(runner)
    with pytest.raises(UserError) as raised:
        asyncio.run(turn.run(sdk.build(sdk.TripModel()), trip.TEXT))
    assert isinstance(raised.value.__cause__, NoOpenRun)  # one error type for every adapter
    assert applied(api)["/bookings"] == 0
    for bad in (("", 1), ("trip-1", 0)):
        with pytest.raises(ConfigurationError):
            SagaTurn(runner, trip.trip_agent, *bad)


def test_exported_members() -> None:
    import sagaguard.connectors.frameworks.openai_agents_saga as module

    assert sorted(module.__all__) == ["SagaTurn", "turn_run_id"]
    for name in module.__all__:
        assert hasattr(module, name), name


# ------------------------------------------------------------------ real SIGKILLs, fresh processes

CHILD = Path(sdk.__file__).resolve()


def _env(stripe: LocalStripe, api: LocalIdempotentApi, folder: Path, **extra: str) -> dict[str, str]:
    from test_agent_saga_crash import ROOT

    path = os.pathsep.join(p for p in (str(ROOT), str(CHILD.parent), os.environ.get("PYTHONPATH", "")) if p)
    return {
        **os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", "AGENT_API": api.url,
        "STRIPE_BASE": stripe.api_base, "STRIPE_KEY": stripe.api_key, "AGENT_DIR": str(folder),
        "SAGAGUARD_STORE": f"sqlite:///{folder / 'agent.db'}", "SAGAGUARD_CRASH_AT": "", **extra,
    }  # fmt: skip


def _child(mode: str, env: dict[str, str]) -> Any:
    from test_agent_saga_crash import _run

    return _run([sys.executable, str(CHILD), mode], env)


def _state(folder: Path) -> SagaState:
    journal = SqlJournal(f"sqlite:///{folder / 'agent.db'}")
    try:
        found = journal.load("trip-1/turn-1")
        assert found is not None
        return found.saga.state
    finally:
        journal.close()


@pytest.mark.timeout(240)  # fresh processes that import the Agents SDK, on a shared machine
def test_an_agents_sdk_turn_killed_mid_run_and_mid_compensation_undoes_each_call_once(tmp_path: Path) -> None:
    from test_agent_saga_crash import worker_until_done

    with LocalStripe() as stripe, LocalIdempotentApi() as api:  # their own processes: they outlive the kills
        killed = _child("run", _env(stripe, api, tmp_path, SAGAGUARD_CRASH_AT="in_model"))
        assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr
        assert money(stripe) == {"charges": 1, "refunds": 0}
        assert applied(api) == {"/bookings": 1}
        # A fresh process goes on from the session: the flight fails, the turn compensates, and the
        # process is killed right after the refund reached Stripe.
        resumed = _child("run", _env(stripe, api, tmp_path, SAGAGUARD_CRASH_AT="in_refund"))
        assert resumed.returncode == -signal.SIGKILL, resumed.stdout + resumed.stderr
        assert money(stripe) == {"charges": 1, "refunds": 1}
        assert _state(tmp_path) is SagaState.COMPENSATING
        db = f"sqlite:///{tmp_path / 'agent.db'}"
        worker_until_done(
            _env(stripe, api, tmp_path),
            db,
            kill_expected=False,
            app="_agenttrip:registry",
            run_id="trip-1/turn-1",
        )
        assert money(stripe) == {"charges": 1, "refunds": 1}
        assert applied(api) == {"/bookings": 1, "/cancellations": 1}
    assert _state(tmp_path) is SagaState.COMPENSATED


@pytest.mark.slow  # two fresh processes (about 20 s on a loaded machine); in-process: fresh objects
@pytest.mark.skipif("'slow' not in config.getoption('markexpr')", reason="runs with -m slow")
@pytest.mark.timeout(240)
def test_an_agents_sdk_turn_paused_at_an_approval_is_rejected_from_another_process(tmp_path: Path) -> None:
    with LocalStripe() as stripe, LocalIdempotentApi() as api:
        paused = _child("run", _env(stripe, api, tmp_path, AGENT_FLIGHT="approval"))
        assert paused.returncode == 0, paused.stdout + paused.stderr
        assert json.loads(paused.stdout.splitlines()[-1]) == {"output": None, "state": None}
        assert _state(tmp_path) is SagaState.WAITING
        rejected = _child("reject", _env(stripe, api, tmp_path, AGENT_FLIGHT="approval"))
        assert rejected.returncode == 0, rejected.stdout + rejected.stderr
        assert json.loads(rejected.stdout.splitlines()[-1]) == {"state": "compensated"}
        assert money(stripe) == {"charges": 1, "refunds": 1}
        assert applied(api) == {"/bookings": 1, "/cancellations": 1}
