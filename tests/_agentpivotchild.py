"""A trip agent whose pivot is a confirmation email, for the pivot crash tests, run as a real process.

The agent books a hotel and charges a card at a local HTTP API (``$AGENT_API``, a
``sagaguard.connectors.testing`` server that counts what it applied), then sends the confirmation
email (the pivot: once sent, the trip stands), then ends. ``$AGENT_KILL=in_email`` SIGKILLs the
process right after the API accepted the email, before its result is recorded (once: a mark in
``$AGENT_MARKS`` says it happened). ``$AGENT_FAIL=1`` makes the agent fail after its tools.

``python tests/_agentpivotchild.py`` runs the agent (``trip-p``) and prints the run's outcome as
JSON: ``{"state": ...}``, or ``{"ended": state}`` when the run no longer takes calls.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import httpx

from sagaguard.idempotency import Guard, OutcomeUnknown, open_store
from sagaguard.saga import SagaRegistry
from sagaguard.saga.agent import AgentRunEnded, AgentRunner, AgentSaga, UndoRegistry
from sagaguard.saga.journals import open_journal

API = os.environ.get("AGENT_API", "http://127.0.0.1:9")
DB = os.environ.get("AGENT_DB", "sqlite:///agent.db")
KILL = os.environ.get("AGENT_KILL", "")
MARKS = Path(os.environ.get("AGENT_MARKS", "."))
RUN_ID = "trip-p"


def _post(path: str, body: dict[str, Any], key: str) -> dict[str, Any]:
    reply = httpx.post(f"{API}{path}", json=body, headers={"Idempotency-Key": f'"{key}"'}, timeout=10)
    reply.raise_for_status()
    return dict(reply.json())


def _die_once(point: str) -> None:
    mark = MARKS / f"killed-{point}"
    if point == KILL and not mark.exists():
        mark.write_text("1")
        os.kill(os.getpid(), signal.SIGKILL)


undos = UndoRegistry()


@undos.register
def cancel_booking(arguments: dict[str, Any], result: Any | None) -> None:
    _post("/cancellations", {"hotel": arguments["hotel"]}, f"cancel-{arguments['hotel']}")


@undos.register
def refund(arguments: dict[str, Any], result: Any | None) -> None:
    _post("/refunds", {"amount": arguments["amount"]}, f"refund-{arguments['card']}")


def _email(to: str) -> dict[str, Any]:
    sent = _post("/emails", {"to": to}, f"email-{to}")  # one identity per email: its call's
    _die_once("in_email")
    return sent


pivot_agent = AgentSaga("pivot_agent", undos)
registry = SagaRegistry(pivot_agent)
guard = Guard(open_store(DB))


def main() -> int:
    runner = AgentRunner(open_journal(DB), guard, sleep=lambda _s: None)
    try:
        with runner.run(pivot_agent, RUN_ID) as run:
            run.call(
                "book_hotel", lambda: _post("/bookings", {"hotel": "ritz"}, "book-ritz"), {"hotel": "ritz"},
                undo="cancel_booking", call_id="call-1",
            )  # fmt: skip
            run.call(
                "charge", lambda: _post("/charges", {"amount": 420}, "charge-card-1"),
                {"amount": 420, "card": "card-1"}, undo="refund", call_id="call-2",
            )  # fmt: skip
            run.call("send_confirmation", lambda: _email("ana@example.com"), {"to": "ana"}, pivot=True,
                     call_id="call-3")  # fmt: skip
            if os.environ.get("AGENT_FAIL"):
                raise RuntimeError("the agent failed after its pivot")
    except (OutcomeUnknown, RuntimeError) as exc:
        assert run.outcome is not None, exc
    except AgentRunEnded as ended:
        print(json.dumps({"ended": ended.state}))
        return 0
    finally:
        runner.close()
    assert run.outcome is not None
    print(json.dumps({"state": run.outcome.state.value}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
