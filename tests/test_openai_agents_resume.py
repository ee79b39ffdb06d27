"""Resuming a session's turn after a crash mid-run (issue 6): :meth:`AgentRun.resume_turn`.

The SDK saves a turn's input to the session when the run starts and each step (a model answer and its
tool outputs) as it finishes, so a turn killed mid-run left part of itself in the session. The agent:
a :class:`PlanModel` asking for three ``refund`` calls per turn, one per answer, under fresh random call
ids. Two turns in one ``SQLiteSession``; the second is killed right before or after each of its session
saves, or inside a model call, and resumed with the documented recipe. The tool counts its runs per
order (the effect); the model counts the answers it was paid for. A clean run of two turns pays 8.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from _agentschild import NAMESPACE, PlanModel
from agents import Agent, Runner, SQLiteSession, function_tool

from sagaguard.connectors.frameworks.openai_agents import AgentRun, turn_progress
from sagaguard.idempotency import ConfigurationError, Guard, KeyConflict, MemoryStore
from sagaguard.idempotency.testing import CRASH_ENV

pytestmark = pytest.mark.timeout(120)

CHILD = Path(__file__).resolve().parent / "_agentschild.py"
TURNS = ("first", "second")
CLEAN_ANSWERS = 8  # per turn: three tool calls and the final text


class Crash(BaseException):
    """The process dies here (in-process stand-in for a kill; not an Exception, so nothing catches it)."""


class CrashingSession(SQLiteSession):
    """An SQLiteSession that dies right before or right after its ``crash_at``-th save."""

    def __init__(self, session_id: str, db: str) -> None:
        super().__init__(session_id, db)
        self.saves = 0
        self.crash_at: int | None = None
        self.before = False

    async def add_items(self, items: list[Any]) -> None:
        if not items:
            return await super().add_items(items)
        self.saves += 1
        hit = self.saves == self.crash_at
        if hit and self.before:
            raise Crash
        await super().add_items(items)
        if hit:
            raise Crash


class World:
    """The agent, its tool's runs and the session: one conversation."""

    def __init__(self, db: str, model: PlanModel | None = None) -> None:
        self.guard = Guard(MemoryStore(), namespace=NAMESPACE)
        self.model = model if model is not None else PlanModel(3)
        self.refunds: Counter[str] = Counter()

        @function_tool
        def refund(order: str) -> str:
            """Refund an order."""
            self.refunds[order] += 1
            return f"refunded {order}"

        self.agent = Agent(name="refunds", instructions="Refund orders.", model=self.model, tools=[refund])
        self.session = CrashingSession("chat", db)

    async def turn(self, n: int) -> Any:
        """The documented recipe: run (or go on with) turn ``n``; None when it had finished."""
        run = AgentRun(self.guard, f"chat/turn-{n}")
        go_on = await run.resume_turn(self.session, n, TURNS[n - 1])
        if go_on is None:
            return None
        return (await Runner.run(run.wrap(self.agent), go_on, session=self.session)).final_output

    async def user_messages(self) -> list[Any]:
        items = await self.session.get_items()
        return [i.get("content") for i in items if isinstance(i, dict) and i.get("role") == "user"]


def expected_refunds() -> Counter[str]:
    return Counter(f"{text}/{k}" for text in TURNS for k in (1, 2, 3))


@pytest.mark.parametrize("before", [False, True], ids=["after-save", "before-save"])
@pytest.mark.parametrize("save", [1, 2, 3, 4, 5])
def test_a_second_turn_killed_at_a_session_save_resumes_and_finishes(
    tmp_path: Path, save: int, before: bool
) -> None:
    """Save 1 of a turn is its input, saves 2..4 its three steps, save 5 its final text."""
    world = World(str(tmp_path / "session.db"))

    async def scenario() -> None:
        assert await world.turn(1) == "done: 3"
        world.session.crash_at, world.session.before = world.session.saves + save, before
        with pytest.raises(Crash):
            await world.turn(2)
        world.session.crash_at = None
        assert await world.turn(2) in ("done: 3", None)  # None: the final text had been saved
        assert await world.turn(2) is None  # finished: a further rerun runs nothing
        assert await world.user_messages() == list(TURNS)  # each input saved once

    asyncio.run(scenario())
    assert world.refunds == expected_refunds()  # every tool ran once: nothing twice, nothing lost
    # Every answer the killed run got was journaled before the save, so none is paid twice.
    assert world.model.calls == CLEAN_ANSWERS
    progress = turn_progress(asyncio.run(world.session.get_items()), 2)
    assert (progress.started, progress.answers, progress.finished) == (True, 4, True)


def test_a_model_call_killed_in_flight_is_the_only_one_paid_again(tmp_path: Path) -> None:
    class Dying(PlanModel):
        die_at: int | None = None

        async def get_response(self, *args: Any, **kwargs: Any) -> Any:
            answer = await super().get_response(*args, **kwargs)
            if self.calls == self.die_at:
                raise Crash  # answered and paid, never recorded
            return answer

    model = Dying(3)
    world = World(str(tmp_path / "session.db"), model)

    async def scenario() -> None:
        assert await world.turn(1) == "done: 3"
        model.die_at = model.calls + 2  # the second answer of the second turn
        with pytest.raises(Crash):
            await world.turn(2)
        model.die_at = None
        assert await world.turn(2) == "done: 3"

    asyncio.run(scenario())
    assert world.refunds == expected_refunds()
    assert model.calls == CLEAN_ANSWERS + 1  # the answer in flight, asked again


def test_the_old_recipe_rerun_with_the_same_input_is_a_key_conflict(tmp_path: Path) -> None:
    """Why resume_turn exists: the rerun adds the input again, the journaled call's input differs."""
    world = World(str(tmp_path / "session.db"))

    async def scenario() -> None:
        await world.turn(1)
        world.session.crash_at = world.session.saves + 3  # after the second turn's step 2 was saved
        with pytest.raises(Crash):
            await world.turn(2)
        world.session.crash_at = None
        run = AgentRun(world.guard, "chat/turn-2")
        with pytest.raises(KeyConflict):
            await Runner.run(run.wrap(world.agent), TURNS[1], session=world.session)

    asyncio.run(scenario())
    assert world.refunds == Counter({"first/1": 1, "first/2": 1, "first/3": 1, "second/1": 1, "second/2": 1})


def test_a_turn_whose_input_was_never_saved_starts_with_its_input(tmp_path: Path) -> None:
    world = World(str(tmp_path / "session.db"))

    async def scenario() -> None:
        await world.turn(1)
        run = AgentRun(world.guard, "chat/turn-2", model_calls=5)
        assert await run.resume_turn(world.session, 2, "second") == "second"
        assert run.model_calls == 0
        with pytest.raises(ConfigurationError):
            await run.resume_turn(world.session, 3, "third")  # turn 2 is not in the session

    asyncio.run(scenario())


def test_turn_progress_counts_answers_between_user_messages() -> None:
    def call(n: int) -> dict[str, Any]:
        return {"type": "function_call", "call_id": f"c{n}", "name": "t", "arguments": "{}"}

    def out(n: int) -> dict[str, Any]:
        return {"type": "function_call_output", "call_id": f"c{n}", "output": "ok"}

    final = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "x"}]}
    items = [
        {"role": "user", "content": "a"}, {"type": "reasoning", "id": "r", "summary": []}, call(1), call(2),
        out(1), out(2), call(3), out(3), final,
        {"role": "user", "content": "b"}, call(4), out(4),
    ]  # fmt: skip
    one, two, three = (turn_progress(items, n) for n in (1, 2, 3))
    assert (one.started, one.answers, one.finished) == (True, 3, True)
    assert (two.started, two.answers, two.finished) == (True, 1, False)
    assert (three.started, three.answers, three.finished) == (False, 0, False)
    with pytest.raises(ConfigurationError):
        turn_progress(items, 0)
    with pytest.raises(ConfigurationError):
        turn_progress(items, 4)


def run_child(config: dict[str, Any], crash_at: str | None = None) -> subprocess.CompletedProcess[str]:
    root = str(CHILD.parent.parent)
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path}
    env.pop(CRASH_ENV, None)
    if crash_at is not None:
        env[CRASH_ENV] = crash_at
    return subprocess.run(
        [sys.executable, str(CHILD), json.dumps(config)],
        capture_output=True, text=True, env=env, timeout=90, check=False,
    )  # fmt: skip


def test_sigkill_after_a_step_of_the_second_turn_then_a_fresh_process_resumes(tmp_path: Path) -> None:
    ledger = tmp_path / "refunds.txt"
    config = {
        "store": f"sqlite:///{tmp_path / 'effects.db'}",
        "session": str(tmp_path / "session.db"),
        "ledger": str(ledger),
        "turns": list(TURNS),
    }
    # Saves 1-5 are the first turn; save 6 is the second turn's input, save 8 its step 2.
    killed = run_child(config, crash_at="saved_8")
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert Counter(ledger.read_text().split()) == Counter({"first/1": 1, "first/2": 1, "first/3": 1,
                                                           "second/1": 1, "second/2": 1})  # fmt: skip

    resumed = run_child(config)
    assert resumed.returncode == 0, resumed.stderr
    report = json.loads(resumed.stdout.strip().splitlines()[-1])
    assert report["outputs"] == ["done: 3"]  # turn 1 had finished: not run again
    assert (report["paid"], report["saved"]) == (2, 0)  # step 3's answer and the final text
    assert Counter(ledger.read_text().split()) == expected_refunds()
