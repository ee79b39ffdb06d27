"""The child side of test_crewai_saga.py: a real CrewAI trip crew in an agent saga, run by
``.venv-crewai/bin/python``.

One agent (CrewAI's own OpenAI client pointed at ``sagaguard.connectors.testing.LocalChatModel``: it calls the
task's tool, then answers) and three tasks: ``book`` (``book_hotel`` at the local HTTP API, declared
on its class with its undo), ``pay`` (``charge`` through the real ``stripe`` SDK at the local Stripe,
declared by name at the adapter) and ``fly`` (``book_flight``: a read, which fails or not as the step
says). The crew says ``tool_failure_policy="raise"``, so a failing tool ends the kickoff; the crews
that are restored (after a kill, or after their run ended) checkpoint on ``task_started`` and
``task_completed`` (CrewAI's checkpoints cost seconds). The undos are in ``tests/_crewaisaga.py``,
where the worker finds them too.

Run as ``python tests/_crewaisagachild.py '<json>'``: ``model``, ``api``, ``stripe`` (the servers)
and ``steps``, each played in a fresh fork (``tests/_crewaichild.py``'s :func:`main`) with ``dir``
(the journal, the effects and the checkpoints), ``run`` (names the trip at the servers), ``action``
(``start``: a new crew; ``resume``: ``Crew.from_checkpoint`` from the newest checkpoint), and
optionally:

- ``flight``: ``ok``, ``fail``, or ``vanish`` (a BaseException, as a crash);
- ``approve``: the pay task's guardrail asks a stand-in human, who answers this (true, or a reason
  to reject);
- ``cancel``: the booking tool cancels the run once it booked, as an operator would from another
  terminal;
- ``leave`` (``on_failure="leave"``), ``pivot`` (the charge is declared the pivot), ``async``
  (``akickoff``), ``again`` (then restore the crew from its newest checkpoint and kick it off);
- ``model_sees_errors``: the crew leaves CrewAI's tool failure policy to hand a tool's error to the
  model, and the failing flight is declared (``cancel_flight``): its failure must still end the run;
- ``lost``: the charge is ``ChargeLost`` (a guarded effect in the body), undone by ``refund_lost``;
- ``crash``: the kill point, ``before_flight`` (after the charge, in the next tool),
  ``in_charge`` (inside the charge, once Stripe applied it) or ``in_refund`` (in the compensation).

``action: example`` runs the docs example ``example`` in the fork instead; ``action: arun`` awaits a
declared tool's async body in an open run (``async with``), which then fails.

Prints one JSON line per kickoff that returned or raised: what it raised, the run's id, its saga's
state and its rows.
"""

from __future__ import annotations

import asyncio
import json
import os
import runpy
import sys
from pathlib import Path
from typing import Any

from _crewaichild import checkpoints, main
from _crewaisaga import die_once, post, stripe_client, trip_crew, undos
from crewai import LLM, Agent, Crew, Task
from crewai.events.event_bus import crewai_event_bus
from crewai.state.checkpoint_config import CheckpointConfig
from crewai.tools import BaseTool

from sagaguard.connectors.declare import changes_world
from sagaguard.connectors.frameworks.crewai import CrewGuard
from sagaguard.connectors.frameworks.crewai_saga import CrewSaga
from sagaguard.idempotency import Guard, open_store
from sagaguard.idempotency.effect import current_effect
from sagaguard.saga import cancel
from sagaguard.saga.agent import AgentRunner, AgentSaga
from sagaguard.saga.journals import open_journal


@changes_world(undo="cancel_booking")  # declared on the class: it survives Crew.from_checkpoint
class BookHotel(BaseTool):
    """Books the trip's hotel at the local HTTP API."""

    name: str = "book_hotel"
    description: str = "Book the hotel for the trip."
    hotel: str
    cancel_on: str = ""
    """A journal URL: cancel the run there once booked (an operator, from another terminal)."""

    def _run(self, nights: int = 2) -> str:
        booking = post("/bookings", {"hotel": self.hotel, "nights": nights}, f"book-{self.hotel}")
        if self.cancel_on:
            from sagaguard.connectors.frameworks.crewai import kickoff_id

            journal = open_journal(self.cancel_on)
            try:
                cancel(journal, str(kickoff_id()), reason="the operator cancelled the trip")
            finally:
                journal.close()
        return json.dumps(booking)


class Charge(BaseTool):
    """Charges the card through the real Stripe SDK (declared by name at the adapter)."""

    name: str = "charge"
    description: str = "Charge the card for the trip."
    trip: str

    def _run(self, amount: int = 4200) -> str:
        intent = stripe_client().v1.payment_intents.create(
            {"amount": amount, "currency": "eur", "payment_method": "pm_card_visa", "confirm": True,
             "metadata": {"run": self.trip}},
            {"idempotency_key": current_effect().provider_key},
        )  # fmt: skip
        return json.dumps({"id": intent.id, "amount": intent.amount, "run": self.trip})


class ChargeLost(BaseTool):
    """Charges through a guarded effect inside the body (``payments.charge``, keyed on the body's
    scope); ``crash: in_charge`` kills the process right after Stripe applied it: its answer is
    lost, and its undo (``refund_lost``) finds it by its provider key."""

    name: str = "charge"
    description: str = "Charge the card for the trip."
    trip: str

    def _run(self, amount: int = 4200) -> str:
        def charge() -> dict[str, Any]:
            key = current_effect().provider_key
            intent = stripe_client().v1.payment_intents.create(
                {"amount": amount, "currency": "eur", "payment_method": "pm_card_visa", "confirm": True,
                 "metadata": {"run": self.trip, "key": key}},
                {"idempotency_key": key},
            )  # fmt: skip
            die_once("in_charge")
            return {"id": intent.id, "amount": intent.amount, "run": self.trip}

        return json.dumps(GUARD[0].run("payments.charge", charge))


GUARD: list[Guard] = []


class BookHotelAsync(BaseTool):
    """Books the hotel with an async body (reached by ``await tool.arun()``)."""

    name: str = "book_hotel_async"
    description: str = "Book the hotel for the trip, asynchronously."
    hotel: str

    async def _arun(self, nights: int = 3) -> str:
        body = {"hotel": self.hotel, "nights": nights}
        return json.dumps(await asyncio.to_thread(post, "/bookings", body, f"book-{self.hotel}"))

    def _run(self, nights: int = 3) -> str:
        raise NotImplementedError("async only")


async def book_async(crew_guard: CrewGuard, runner: AgentRunner, run_id: str, hotel: str) -> str:
    """A declared tool's async body as a step: ``await tool.arun()`` in an open run, then a failure."""
    from sagaguard.idempotency.keys import scope

    tool = crew_guard.guard_tool(changes_world(undo="cancel_booking")(BookHotelAsync(hotel=hotel)))
    try:
        # Outside a kickoff, a scope stands for it (sagaguard.connectors.frameworks.crewai).
        with scope(run_id):
            async with runner.run(trip_crew, run_id):
                await tool.arun()
                raise RuntimeError("the flight failed")
    except RuntimeError as exc:
        return type(exc).__name__
    return "nothing raised"


class Vanished(BaseException):
    """The process stops as a crash would (no exception the run compensates for)."""


class BookFlight(BaseTool):
    """Books the flight: a read here, which fails as the step says."""

    name: str = "book_flight"
    description: str = "Book the flight for the trip."
    mode: str = "ok"

    def _run(self) -> str:
        die_once("before_flight")  # protect made fly wait: its task_started checkpoint is on disk
        if self.mode == "fail":
            raise RuntimeError("no seats to Oslo")
        if self.mode == "vanish":
            raise Vanished
        return json.dumps({"flight": "OSL-1"})


def build(folder: Path, config: dict[str, Any], crew_saga: CrewSaga) -> Crew:
    llm = LLM(model="gpt-4o-mini", base_url=config["model"], api_key="sk-local", max_retries=0)
    agent = Agent(role="travel agent", goal="Book trips", backstory="Careful.", llm=llm, max_iter=3)
    booker = BookHotel(hotel=config["run"], cancel_on=config["db"] if config.get("cancel") else "")
    book = Task(description="Book the hotel.", expected_output="A booking.", agent=agent, tools=[booker])
    approve = config.get("approve")
    pay = Task(
        description="Charge the card.", expected_output="A receipt.", agent=agent,
        tools=[ChargeLost(trip=config["run"]) if config.get("lost") else Charge(trip=config["run"])],
        guardrail=None if approve is None else crew_saga.approval(lambda _output: approve),
    )  # fmt: skip
    fly = Task(description="Book the flight.", expected_output="A ticket.", agent=agent,
               tools=[BookFlight(mode=config.get("flight", "ok"))])  # fmt: skip
    events: list[Any] = ["task_started", "task_completed"]
    checkpoint = CheckpointConfig(location=str(folder / "checkpoints"), on_events=events)
    return Crew(
        agents=[agent], tasks=[book, pay, fly],
        tool_failure_policy=None if config.get("model_sees_errors") else "raise",  # None: CrewAI's default
        checkpoint=checkpoint if config.get("crash") or config.get("again") else None,  # to restore
    )  # fmt: skip


def rows(journal: Any, run_id: str | None) -> tuple[str | None, list[dict[str, Any]]]:
    found = None if run_id is None else journal.load(run_id)
    if found is None:
        return None, []
    listed = []
    for row in found.steps:
        call = json.loads(row.result) if row.name.startswith("tool.") and row.result else None
        listed.append({"name": row.name, "state": row.state.value, "call": call})
    return found.saga.state.value, listed


def play(config: dict[str, Any]) -> None:
    folder = Path(config["dir"])
    folder.mkdir(parents=True, exist_ok=True)
    if config["action"] == "example":  # a docs example, in this fork: CrewAI is imported already
        os.chdir(folder)
        runpy.run_path(config["example"], run_name="__main__")
        import sagaguard.connectors.frameworks.crewai_saga

        exports = sorted(sagaguard.connectors.frameworks.crewai_saga.__all__)
        report = {"step": config["step"], "run": config["run"], "example": "ran", "exports": exports}
        print(json.dumps(report), flush=True)
        return
    os.environ["CREW_API"], os.environ["CREW_STRIPE"] = config["api"], config["stripe"]
    os.environ["CREW_MARKS"] = str(folder)
    db = config["db"] = f"sqlite:///{folder / 'agent.db'}"
    journal, store = open_journal(db), open_store(db)
    guard = Guard(store)  # the defaults: a process restarted at once takes a dead one's claims over
    GUARD[:] = [guard]
    agent = AgentSaga("trip_crew", undos, on_failure="leave") if config.get("leave") else trip_crew
    runner = AgentRunner(journal, guard, sleep=lambda _s: None)  # the default run lease (30 s)
    crew_saga = CrewSaga(runner, agent)
    charge = changes_world(pivot=True) if config.get("pivot") else changes_world(undo="refund")
    if config.get("lost"):
        charge = changes_world(undo="refund_lost")
    declare = {"charge": charge}
    if config.get("model_sees_errors"):  # the flight declared too: its failure is a step's
        declare["book_flight"] = changes_world(undo="cancel_flight")
    crew_guard = CrewGuard(guard, saga=crew_saga, declare=declare)
    report: dict[str, Any] = {"step": config["step"], "run": config["run"], "raised": None}
    try:
        if config["action"] == "arun":
            report["raised"] = asyncio.run(book_async(crew_guard, runner, config["run"], config["run"]))
            report["run_id"] = config["run"]
            report["state"], report["rows"] = rows(journal, config["run"])
            return
        if config["action"] == "resume":
            newest = checkpoints(folder)[-1]
            crew = crew_guard.protect(Crew.from_checkpoint(CheckpointConfig(restore_from=str(newest))))
        else:
            crew = crew_guard.protect(build(folder, config, crew_saga))
        try:
            asyncio.run(crew.akickoff()) if config.get("async") else crew.kickoff()
        except (Exception, Vanished) as exc:
            report["raised"] = type(exc).__name__
            report["reason"] = str(exc)
        except BaseException as exc:  # AgentRunCancelled: a BaseException, so tools cannot swallow it
            if type(exc).__name__ != "AgentRunCancelled":
                raise
            report["raised"] = type(exc).__name__
        run_id = crew_saga.run_id(crew)
        if report["raised"] == "Vanished" and run_id is not None:
            # The process "died" with its run open; a human rejects it from another process.
            outcome = crew_saga.reject(run_id, "the manager said no")
            report["rejected"] = outcome.state.value
        report["run_id"] = run_id
        report["state"], report["rows"] = rows(journal, run_id)
        if config.get("again"):  # the ended run's crew restored from its checkpoint, kicked off again
            crewai_event_bus.flush()
            newest = checkpoints(folder)[-1]
            restored = crew_guard.protect(Crew.from_checkpoint(CheckpointConfig(restore_from=str(newest))))
            try:
                restored.kickoff()
                report["again"] = "ran"
            except Exception as exc:
                report["again"] = type(exc).__name__
    finally:
        runner.close()
        guard.close()
        store.close()
        journal.close()
        print(json.dumps(report), flush=True)


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1]), play))
