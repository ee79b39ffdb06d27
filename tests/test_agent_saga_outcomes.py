"""What ``sagaguard sagas show`` and the timeline report of an agent run's tool calls: each call's
real outcome (not started, in flight, in doubt, failed, succeeded, undone), read from the ledger,
on a failing trip: a hotel booked, a charge cut by a crash (in doubt, then re-sent at least once),
a car refused by the rental company (failed, not applied), the run undone.

On main every tool row was reported ``succeeded`` (an agent row stores its call from the start),
the refused car and the charge in doubt included.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import tenacity

from sagaguard.idempotency import Guard, OutcomeUnknown, open_store
from sagaguard.idempotency.cli import main
from sagaguard.idempotency.effect import Retry
from sagaguard.saga import SagaState
from sagaguard.saga.agent import AgentRunner, AgentSaga, UndoRegistry
from sagaguard.saga.journal import SagaJournal
from sagaguard.saga.journals import open_journal

pytestmark = pytest.mark.timeout(60)

RUN = "trip-o"


class Crash(BaseException):
    """The process dies here."""


class SoldOut(Exception):
    """The rental company refused: no car was booked."""


@pytest.fixture
def url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path}/trip.db"


@pytest.fixture
def journal(url: str) -> Iterator[SagaJournal]:
    opened = open_journal(url)
    yield opened
    opened.close()


@pytest.fixture
def runner(url: str, journal: SagaJournal) -> Iterator[AgentRunner]:
    made = AgentRunner(journal, Guard(open_store(url)), sleep=lambda _s: None)
    yield made
    made.close()


def _undos(world: list[str]) -> UndoRegistry:
    undos = UndoRegistry()
    for name in ("cancel_hotel", "refund", "cancel_car"):
        undos.add(name, lambda _a, _r, name=name: world.append(name))  # type: ignore[misc]
    return undos


def _show(url: str, capsys: pytest.CaptureFixture[str]) -> tuple[list[str], dict[str, Any]]:
    """``sagas show RUN`` as text (its step lines) and as JSON."""
    assert main(["sagas", "show", RUN, "--store", url]) == 0
    text = capsys.readouterr().out
    steps = [line.strip() for line in text.splitlines() if line.startswith("  ") and ". tool." in line]
    assert main(["sagas", "show", RUN, "--store", url, "--json"]) == 0
    return steps, json.loads(capsys.readouterr().out)


def _charge(world: list[str], crash: bool) -> str:
    world.append("charge")
    if crash:
        raise Crash
    return "ch-1"


def test_sagas_show_reports_each_tool_calls_real_outcome_on_a_failing_trip(
    url: str, runner: AgentRunner, capsys: pytest.CaptureFixture[str]
) -> None:
    world: list[str] = []
    agent = AgentSaga("trip_agent", _undos(world))
    charge = {"policy": "at_least_once"}
    with pytest.raises(Crash), runner.run(agent, RUN) as run:
        run.call("book_hotel", lambda: "bk-1", {"hotel": "ritz"}, undo="cancel_hotel", call_id="c1")
        run.call(
            "charge", lambda: _charge(world, True), {"amount": 1}, undo="refund", call_id="c2", options=charge
        )
    steps, _ = _show(url, capsys)
    assert steps == [
        "0. tool.book_hotel.0 [compensatable] succeeded",
        "1. tool.charge.1 [compensatable] in doubt",  # cut by the crash: maybe charged
    ]

    def car() -> str:
        raise SoldOut("no cars left")

    with pytest.raises(SoldOut), runner.run(agent, RUN) as run:  # resumed: replays, then fails
        run.call("book_hotel", lambda: "bk-1", {"hotel": "ritz"}, undo="cancel_hotel", call_id="c1")
        run.call(
            "charge",
            lambda: _charge(world, False),
            {"amount": 1},
            undo="refund",
            call_id="c2",
            options=charge,
        )
        run.call(
            "book_car",
            car,
            {"car": "mini"},
            undo="cancel_car",
            call_id="c3",
            options={"permanent": (SoldOut,)},
        )
    assert run.outcome is not None and run.outcome.state is SagaState.COMPENSATED
    assert world == ["charge", "charge", "refund", "cancel_hotel"]  # the refused car is not undone
    steps, data = _show(url, capsys)
    assert steps == [
        "0. tool.book_hotel.0 [compensatable] undone",
        "1. tool.charge.1 [compensatable] undone",
        "2. tool.book_car.2 [compensatable] failed (not applied)",
    ]
    assert [s["outcome"] for s in data["steps"]] == ["undone", "undone", "failed", None]
    assert main(["sagas", "show", RUN, "--store", url]) == 0
    timeline = [line.strip() for line in capsys.readouterr().out.splitlines() if "step tool." in line]
    forward = [
        line.split(": ", 1)[1] for line in timeline if "started" not in line and "compensated" not in line
    ]
    assert [what.split("  (")[0] for what in forward] == ["succeeded", "succeeded", "failed"]


class Reset(Exception):
    """The connection dropped mid-call: the effect may have happened."""


def test_a_call_in_doubt_that_the_compensation_undid_stops_counting_as_in_doubt(
    url: str, runner: AgentRunner, capsys: pytest.CaptureFixture[str]
) -> None:
    world: list[str] = []
    agent = AgentSaga("trip_agent", _undos(world))

    def charge() -> str:
        world.append("charge")
        raise Reset("connection reset")

    with pytest.raises(OutcomeUnknown), runner.run(agent, RUN) as run:
        run.call("charge", charge, {"amount": 1}, undo="refund", call_id="c1")
    assert run.outcome is not None and run.outcome.state is SagaState.COMPENSATED
    assert world == ["charge", "refund"]
    assert main(["effects", "list", "--store", url, "--json"]) == 0
    records = json.loads(capsys.readouterr().out)
    assert [(r["name"], r["state"]) for r in records if r["name"] == "agent.tool.charge"] == [
        ("agent.tool.charge", "failed")  # on main: in_doubt for ever, though the charge was refunded
    ]
    assert not [r for r in records if r["state"] in ("in_doubt", "in_progress")]
    steps, _ = _show(url, capsys)
    assert steps == ["0. tool.charge.0 [compensatable] undone"]
    assert main(["sagas", "show", RUN, "--store", url]) == 0
    out = capsys.readouterr().out
    assert "step tool.charge.0: in doubt" in out and "step tool.charge.0: compensated" in out


def test_sagas_show_names_the_cause_of_a_parked_compensation(
    url: str, runner: AgentRunner, capsys: pytest.CaptureFixture[str]
) -> None:
    """An undo failing for longer than its in-line retries parks the run COMPENSATING for the
    worker; ``sagas show`` says why (on main the cause was only on the compensation's record)."""
    undos = UndoRegistry()

    @undos.register
    def cancel_hotel(arguments: Any, result: Any) -> None:
        raise RuntimeError("hotel API unreachable")

    later = Retry(stop=tenacity.stop_after_attempt(5), wait=tenacity.wait_fixed(60))
    agent = AgentSaga("trip_agent", undos, compensation_retry=later)
    with pytest.raises(ValueError), runner.run(agent, RUN) as run:
        run.call("book_hotel", lambda: "bk-1", {"hotel": "ritz"}, undo="cancel_hotel", call_id="c1")
        raise ValueError("the car tool failed")
    assert run.outcome is not None and run.outcome.state is SagaState.COMPENSATING
    assert main(["sagas", "show", RUN, "--store", url]) == 0
    out = capsys.readouterr().out
    assert "step tool.book_hotel.0: compensation retrying" in out
    assert "RuntimeError: hotel API unreachable" in out
