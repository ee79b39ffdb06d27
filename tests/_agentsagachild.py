"""A trip agent for the agent-saga crash tests, run as a real process (and imported by the worker).

The agent books a hotel and charges a card at a local HTTP API (``$AGENT_API``, a
``sagaguard.connectors.testing`` server that counts what it applied), then its flight tool fails. Kill points,
by ``$AGENT_KILL``: ``after_charge`` (the agent process SIGKILLs itself once the charge is recorded),
``in_charge`` (right after the API applied the charge, before its record),
``in_refund`` (the process running the refund undo SIGKILLs itself right after the API applied the
refund, once: a marker file in ``$AGENT_MARKS`` says it happened), ``completed`` (the run completed,
the program has not saved its answer). With ``$AGENT_FLIGHT=ok`` the flight books and the run
completes (the answer, the booking, is printed too); with ``$AGENT_EXCLUSIVE=1`` the run is opened
``exclusive=True``, the engines' mode. The undos are idempotent the
way a real one is: each request carries an ``Idempotency-Key`` derived from what it undoes.

``python tests/_agentsagachild.py`` runs the agent (``thread-1``) and prints the outcome as JSON
(run again after a kill, it finishes a compensation the killed process left, or resumes the run);
``sagaguard sagas worker --app _agentsagachild:registry`` finishes what the agent left. The guard
and the runner have the defaults a user gets (5 s effect lease, 30 s run lease): a restart on the
same host takes a dead process's claims and run over at once.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import httpx

from sagaguard.idempotency import Guard, open_store
from sagaguard.saga import SagaRegistry
from sagaguard.saga.agent import AgentRunEnded, AgentRunner, AgentSaga, UndoRegistry, current_run
from sagaguard.saga.journals import open_journal

API = os.environ.get("AGENT_API", "http://127.0.0.1:9")
DB = os.environ.get("AGENT_DB", "sqlite:///agent.db")
KILL = os.environ.get("AGENT_KILL", "")
MARKS = Path(os.environ.get("AGENT_MARKS", "."))
RUN_ID = "thread-1"
FLIGHT = os.environ.get("AGENT_FLIGHT", "fail")
EXCLUSIVE = os.environ.get("AGENT_EXCLUSIVE") == "1"


def _post(path: str, body: dict[str, Any], key: str) -> dict[str, Any]:
    reply = httpx.post(f"{API}{path}", json=body, headers={"Idempotency-Key": f'"{key}"'}, timeout=10)
    reply.raise_for_status()
    return dict(reply.json())


def _die_once(point: str) -> None:
    mark = MARKS / f"killed-{point}"
    if point == KILL and not mark.exists():
        mark.write_text("1")
        os.kill(os.getpid(), signal.SIGKILL)


def _charged(reply: dict[str, Any]) -> dict[str, Any]:
    _die_once("in_charge")  # the API charged; the charge's record is still in progress
    return reply


undos = UndoRegistry()


@undos.register
def cancel_booking(arguments: dict[str, Any], result: Any | None) -> None:
    _post("/cancellations", {"hotel": arguments["hotel"]}, f"cancel-{arguments['hotel']}")


@undos.register
def refund(arguments: dict[str, Any], result: Any | None) -> None:
    _post("/refunds", {"amount": arguments["amount"]}, f"refund-{arguments['card']}")
    _die_once("in_refund")


trip_agent = AgentSaga("trip_agent", undos)
registry = SagaRegistry(trip_agent)
guard = Guard(open_store(DB))


def main() -> int:
    runner = AgentRunner(open_journal(DB), guard, sleep=lambda _s: None)
    try:
        with runner.run(trip_agent, RUN_ID, exclusive=EXCLUSIVE) as run:
            hotel, card = "ritz", "card-1"
            booking = current_run().call(
                "book_hotel", lambda: _post("/bookings", {"hotel": hotel}, f"book-{hotel}"), {"hotel": hotel},
                undo="cancel_booking", call_id="call-1",
            )  # fmt: skip
            run.call(
                "charge", lambda: _charged(_post("/charges", {"amount": 420}, f"charge-{card}")),
                {"amount": 420, "card": card}, undo="refund", call_id="call-2",
            )  # fmt: skip
            _die_once("after_charge")
            if FLIGHT != "ok":
                raise RuntimeError("the flight tool failed")
        _die_once("completed")  # the run completed; its answer is not saved yet
    except RuntimeError:
        pass
    except AgentRunEnded as ended:  # re-opened mid-compensation: finished here, never run forward
        print(json.dumps({"state": ended.state, "reopened": True}))
        return 0
    finally:
        runner.close()
    assert run.outcome is not None
    report: dict[str, Any] = {"state": run.outcome.state.value}
    if FLIGHT == "ok":
        report |= {"replayed": run.outcome.replayed, "answer": booking}
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
