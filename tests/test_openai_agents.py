"""The OpenAI Agents SDK adapter (connectors/frameworks/openai_agents.py) with the real SDK and a scripted
model.

The scripted model (``tests/_agentschild.py``) gives every tool call a fresh random id and counts the
calls it answered; the tool counts its runs. A rerun with the same run key must leave both counts
where they were and see the same tool call ids; another run key runs both again.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from _agentschild import NAMESPACE, ScriptedModel
from agents import Agent, FunctionTool, RunConfig, Runner, RunState, SQLiteSession, function_tool

from sagaguard.connectors.frameworks.openai_agents import (
    AgentRun,
    JournaledModel,
    dump_response,
    load_response,
    tool_call_key,
)
from sagaguard.idempotency import ConfigurationError, Guard, KeyConflict, MemoryStore, State
from sagaguard.idempotency.keys import EffectIdentity

pytestmark = pytest.mark.timeout(60)


class Refunds:
    """A ``refund`` tool that counts its runs."""

    def __init__(self, *, needs_approval: bool = False) -> None:
        self.runs: list[str] = []

        @function_tool(needs_approval=needs_approval)
        def refund(order: str) -> str:
            """Refund an order."""
            self.runs.append(order)
            return f"refunded {order} (#{len(self.runs)})"

        self.tool: FunctionTool = refund


def make_agent(model: ScriptedModel, refunds: Refunds) -> Agent[Any]:
    return Agent(name="refunds", instructions="Refund orders.", model=model, tools=[refunds.tool])


@pytest.fixture
def guard() -> Guard:
    return Guard(MemoryStore(), namespace=NAMESPACE)


def test_first_run_executes_and_a_rerun_replays_tools_and_model(guard: Guard) -> None:
    model, refunds = ScriptedModel(), Refunds()
    agent = make_agent(model, refunds)

    first_run = AgentRun(guard, "ticket-1/turn-1")
    first = Runner.run_sync(first_run.wrap(agent), "Refund order 42")
    assert first.final_output == "done: refunded 42 (#1)"
    assert (model.calls, refunds.runs) == (2, ["42"])
    assert (first_run.usage.calls, first_run.usage.saved_calls) == (2, 0)

    again_run = AgentRun(guard, "ticket-1/turn-1")  # a rerun after a crash: a fresh AgentRun
    again = Runner.run_sync(again_run.wrap(agent), "Refund order 42")
    assert again.final_output == first.final_output
    assert (model.calls, refunds.runs) == (2, ["42"])  # nothing paid, nothing refunded again
    assert (again_run.usage.calls, again_run.usage.saved_calls) == (0, 2)
    assert again_run.usage.saved_tokens == 30

    def call_ids(result: Any) -> list[str]:
        return [i.raw_item.call_id for i in result.new_items if i.type == "tool_call_item"]

    assert call_ids(again) == call_ids(first) == model.call_ids


def test_a_different_run_key_executes_again(guard: Guard) -> None:
    model, refunds = ScriptedModel(), Refunds()
    agent = make_agent(model, refunds)
    Runner.run_sync(AgentRun(guard, "run-a").wrap(agent), "Refund order 42")
    Runner.run_sync(AgentRun(guard, "run-b").wrap(agent), "Refund order 42")
    assert (model.calls, refunds.runs) == (4, ["42", "42"])
    assert len(set(model.call_ids)) == 2


def test_async_runner_and_the_tool_record(guard: Guard) -> None:
    model, refunds = ScriptedModel(), Refunds()
    wrapped = AgentRun(guard, "run-async").wrap(make_agent(model, refunds))
    result = asyncio.run(Runner.run(wrapped, "Refund order 42"))
    assert result.final_output == "done: refunded 42 (#1)"
    identity = EffectIdentity.explicit(NAMESPACE, tool_call_key("run-async", model.call_ids[0]), "refund")
    record = guard.store.get(identity.key)
    assert record is not None and record.state is State.SUCCEEDED


def test_a_changed_prompt_under_the_same_run_key_is_a_conflict(guard: Guard) -> None:
    model, refunds = ScriptedModel(), Refunds()
    agent = make_agent(model, refunds)
    Runner.run_sync(AgentRun(guard, "run-c").wrap(agent), "Refund order 42")
    with pytest.raises(KeyConflict):
        Runner.run_sync(AgentRun(guard, "run-c").wrap(agent), "Refund order 43")
    assert refunds.runs == ["42"]


def test_wrap_copies_the_agent_graph_and_leaves_the_original_alone(guard: Guard) -> None:
    model, refunds = ScriptedModel(), Refunds()
    helper = Agent(name="helper", model=model, tools=[refunds.tool])
    front = Agent(name="front", model=model, handoffs=[helper])
    helper.handoffs = [front]  # a cycle
    wrapped = AgentRun(guard, "graph").wrap(front)
    assert isinstance(wrapped.model, JournaledModel) and wrapped.model.inner is model
    (wrapped_helper,) = wrapped.handoffs
    assert isinstance(wrapped_helper, Agent) and wrapped_helper is not helper
    assert wrapped_helper.handoffs == [wrapped]
    assert isinstance(wrapped_helper.tools[0], FunctionTool)
    assert wrapped_helper.tools[0].on_invoke_tool is not refunds.tool.on_invoke_tool
    assert front.model is model and helper.tools[0] is refunds.tool
    only = AgentRun(guard, "graph", tools=["other"]).wrap(helper)
    assert only.tools[0] is refunds.tool  # not chosen: left as it is


def test_sessions_a_rerun_of_a_turn_replays(guard: Guard, tmp_path: Path) -> None:
    """A turn whose run crashed saved nothing to the session; rerunning it with its run key replays."""
    model, refunds = ScriptedModel(), Refunds()
    agent = make_agent(model, refunds)
    db = str(tmp_path / "session.db")
    first = Runner.run_sync(
        AgentRun(guard, "chat-9/turn-1").wrap(agent), "Refund order 42", session=SQLiteSession("a", db)
    )
    # The same turn replayed into a fresh session (what a crashed turn left: nothing of this turn).
    again = Runner.run_sync(
        AgentRun(guard, "chat-9/turn-1").wrap(agent), "Refund order 42", session=SQLiteSession("b", db)
    )
    assert again.final_output == first.final_output
    assert (model.calls, refunds.runs) == (2, ["42"])
    items = asyncio.run(SQLiteSession("b", db).get_items())
    assert any(isinstance(i, dict) and i.get("type") == "function_call_output" for i in items)
    # The next turn is another run key, and sees the history.
    Runner.run_sync(
        AgentRun(guard, "chat-9/turn-2").wrap(agent), "And order 43", session=SQLiteSession("b", db)
    )
    assert model.calls == 3  # the model answers from the history's tool output: no new tool call


def test_human_approval_resume_in_another_process_replays_the_resume(guard: Guard) -> None:
    model, refunds = ScriptedModel(), Refunds(needs_approval=True)
    agent = make_agent(model, refunds)

    interrupted = Runner.run_sync(AgentRun(guard, "hitl-1").wrap(agent), "Refund order 42")
    (approval,) = interrupted.interruptions
    assert refunds.runs == [] and model.calls == 1
    saved = json.dumps(interrupted.to_state().to_json())  # to the database; a human approves later

    def resume() -> Any:
        run = AgentRun(guard, "hitl-1")  # a fresh process: a fresh run, same key
        wrapped = run.wrap(agent)
        state = run.resume(asyncio.run(RunState.from_json(wrapped, json.loads(saved))))
        assert run.model_calls == 1
        state.approve(state.get_interruptions()[0])
        return Runner.run_sync(wrapped, state)

    done = resume()
    assert done.final_output == "done: refunded 42 (#1)"
    assert (model.calls, refunds.runs) == (2, ["42"])
    again = resume()  # the resume crashed and is run again from the saved state
    assert again.final_output == done.final_output
    assert (model.calls, refunds.runs) == (2, ["42"])
    assert approval.raw_item.call_id == model.call_ids[0]  # type: ignore[union-attr]


def test_streaming_is_refused_unless_passthrough(guard: Guard) -> None:
    model, refunds = ScriptedModel(), Refunds()

    async def stream() -> None:
        result = Runner.run_streamed(AgentRun(guard, "s").wrap(make_agent(model, refunds)), "hi")
        async for _ in result.stream_events():
            pass

    with pytest.raises(ConfigurationError):
        asyncio.run(stream())
    assert model.calls == 0


def test_responses_round_trip_as_the_provider_sent_them() -> None:
    model = ScriptedModel()
    settings: Any = None
    response = asyncio.run(
        model.get_response(
            None,
            "x",
            settings,
            [],
            None,
            [],
            settings,
            previous_response_id=None,
            conversation_id=None,
            prompt=None,
        )
    )
    data = dump_response(response)
    assert "async_" not in data["output"][0] and "async" not in data["output"][0]
    back = load_response(json.loads(json.dumps(data)))
    assert dump_response(back) == data
    assert back.output[0].call_id == response.output[0].call_id  # type: ignore[union-attr]


def test_bad_configuration(guard: Guard) -> None:
    with pytest.raises(ConfigurationError):
        AgentRun(guard, "")
    assert RunConfig().model is None  # the journal is bypassed only by RunConfig(model=...)


def test_a_failed_model_call_leaves_no_record_and_a_rerun_asks_again(guard: Guard) -> None:
    class Flaky(ScriptedModel):
        fail = True

        async def get_response(self, *args: Any, **kwargs: Any) -> Any:
            if self.fail:
                self.fail = False
                raise RuntimeError("model unavailable")
            return await super().get_response(*args, **kwargs)

    model, refunds = Flaky(), Refunds()
    agent = make_agent(model, refunds)
    with pytest.raises(RuntimeError, match="model unavailable"):
        Runner.run_sync(AgentRun(guard, "flaky").wrap(agent), "Refund order 42")
    result = Runner.run_sync(AgentRun(guard, "flaky").wrap(agent), "Refund order 42")
    assert result.final_output == "done: refunded 42 (#1)"
    assert (model.calls, refunds.runs) == (2, ["42"])
