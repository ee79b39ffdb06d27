"""sagaguard.connectors.frameworks.openai_agents: read-only tools by default, declared tools at most once, and
the three choices of ``on_doubt`` when an effect is left in doubt, with the real SDK and a scripted model.

The effect in doubt is a send (a ``guard.effect``, at most once) whose connection drops after the
message went out. Its tool lets errors propagate (``failure_error_function=None``): with the SDK's
default, a tool's exception becomes text for the model before the adapter sees it. The operator
resolves the send with the real CLI (``sagaguard effects resolve``) on the same SQLite store.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _agentschild import NAMESPACE, ScriptedModel
from agents import Agent, FunctionTool, Runner, function_tool
from agents.exceptions import UserError

from sagaguard.connectors.declare import changes_world
from sagaguard.connectors.frameworks.openai_agents import AgentRun
from sagaguard.connectors.in_doubt import ReturnPending, Stop, WaitForOperator
from sagaguard.idempotency import Guard, OutcomeUnknown, State
from sagaguard.idempotency.cli import main as cli
from sagaguard.idempotency.store import IdempotencyStore
from sagaguard.idempotency.stores.sql import SqlStore

pytestmark = pytest.mark.timeout(60)


class World:
    """A ``notify`` tool whose send drops its first connection, and a declared ``wire`` tool."""

    def __init__(self, guard: Guard) -> None:
        self.sent: list[str] = []
        self.drops = 1

        @guard.effect("mail.send", result_type=str)
        def send(order: str) -> str:
            self.sent.append(order)
            if self.drops:
                self.drops -= 1
                raise ConnectionResetError("connection lost after DATA")
            return f"sent {order}"

        @function_tool(failure_error_function=None)
        def notify(order: str) -> str:
            """Email about an order."""
            return send(order)

        @changes_world
        @function_tool(failure_error_function=None)
        def wire(order: str) -> str:
            """Wire money for an order."""
            self.sent.append(f"wire:{order}")
            if self.drops:
                self.drops -= 1
                raise ConnectionResetError("the bank hung up")
            return f"wired {order}"

        self.tools: dict[str, FunctionTool] = {"notify": notify, "wire": wire}

    def agent(self, name: str) -> Agent[Any]:
        model = ScriptedModel(tool=name)
        return Agent(name="ops", instructions="Do it.", model=model, tools=[self.tools[name]])


@pytest.fixture
def url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'effects.db'}"


@pytest.fixture
def guard(url: str) -> Iterator[Guard]:
    store = SqlStore(url)
    g = Guard(store, namespace=NAMESPACE)
    yield g
    g.close()
    store.close()


def in_doubt(store: IdempotencyStore, name: str) -> str:
    keys = [r.key for r in store.list() if r.name == name and r.state is State.IN_DOUBT]
    assert len(keys) == 1, keys
    return keys[0]


def resolve(url: str, key: str, result: Any) -> None:
    assert cli(["--store", url, "effects", "resolve", key, "--applied", "--result", json.dumps(result)]) == 0


def run(guard: Guard, world: World, name: str, **options: Any) -> Any:
    agent = AgentRun(guard, f"ticket/{name}/turn-1", **options).wrap(world.agent(name))
    return Runner.run_sync(agent, "Do order 42")


def test_stop_raises_and_the_rerun_replays_what_the_operator_resolved(guard: Guard, url: str) -> None:
    world = World(guard)
    with pytest.raises(UserError) as stopped:  # the SDK wraps what a tool raises
        run(guard, world, "notify", on_doubt=Stop())
    assert isinstance(stopped.value.__cause__, OutcomeUnknown)
    assert not [r for r in guard.store.list() if r.name == "notify"]  # the doubt is the send's alone
    resolve(url, in_doubt(guard.store, "mail.send"), "sent 42")
    assert run(guard, world, "notify").final_output == "done: sent 42"  # the same run key
    assert world.sent == ["42"]


def test_a_declared_tool_in_doubt_is_resolved_with_its_output(guard: Guard, url: str) -> None:
    world = World(guard)
    with pytest.raises(UserError) as stopped:
        run(guard, world, "wire")
    assert isinstance(stopped.value.__cause__, OutcomeUnknown)
    resolve(url, in_doubt(guard.store, "wire"), "wired 42")  # the tool's output, as JSON
    assert run(guard, world, "wire").final_output == "done: wired 42"
    assert world.sent == ["wire:42"]


def test_return_pending_hands_the_model_a_pending_result(guard: Guard) -> None:
    world = World(guard)
    result = run(guard, world, "notify", on_doubt=ReturnPending())
    output = str(result.final_output).removeprefix("done: ")
    pending = json.loads(output)
    assert (pending["status"], pending["effect"]) == ("pending", "mail.send")
    assert pending["key"] == in_doubt(guard.store, "mail.send")
    assert world.sent == ["42"]


def test_wait_for_operator_polls_then_replays_the_resolution(guard: Guard, url: str) -> None:
    world = World(guard)
    looks: list[float] = []

    async def operator_sleep(seconds: float) -> None:
        looks.append(seconds)
        if len(looks) == 2:
            await asyncio.to_thread(resolve, url, in_doubt(guard.store, "mail.send"), "sent 42")

    waiting = WaitForOperator(timeout=60.0, interval=3.0, async_sleep=operator_sleep, clock=lambda: 0.0)
    result = run(guard, world, "notify", on_doubt=waiting)
    assert result.final_output == "done: sent 42"
    assert looks == [3.0, 3.0]
    assert world.sent == ["42"]


def test_wait_for_operator_then_pending_after_the_timeout(guard: Guard) -> None:
    world = World(guard)
    now = [0.0]

    async def sleep(seconds: float) -> None:
        now[0] += seconds

    waiting = WaitForOperator(timeout=5.0, interval=2.0, then=ReturnPending(), async_sleep=sleep,
                              clock=lambda: now[0])  # fmt: skip
    result = run(guard, world, "notify", on_doubt=waiting)
    assert json.loads(str(result.final_output).removeprefix("done: "))["status"] == "pending"
    assert now[0] == 6.0
