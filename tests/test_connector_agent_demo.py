"""The agent demo (``sagaguard.connectors.demo.agent``, what ``make agent-demo`` and ``sagaguard demo agent``
run) finishes green and prints what it claims.

Its agent processes are real LangGraph processes SIGKILLed after the email and in the middle of
the compensation; ``sagaguard sagas worker`` in a fresh process finishes it. The supervisor counts
at the local services itself and exits 0 only when the counts are the expected ones; this test
checks the exit code, the side-by-side rows, the emails in the order the SMTP sink got them, and
the run's timeline.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import openai
import pytest

from sagaguard.connectors.demo import main
from sagaguard.connectors.testing import LocalChatModel

ROOT = Path(__file__).resolve().parent.parent


def _row(out: str, title: str) -> tuple[int, int]:
    """The (sagaguard, checkpointer alone) numbers of the table row ``title``."""
    found = re.search(rf"^\s+{re.escape(title)}\s+(\d+)\s+(\d+)", out, re.M)
    assert found is not None, f"no row {title!r} in:\n{out}"
    return int(found[1]), int(found[2])


@pytest.mark.timeout(300)  # five LangGraph processes and a worker, on a shared machine
def test_the_agent_demo_undoes_each_booking_and_charge_once_and_the_checkpointer_alone_none(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["agent"]) == 0
    out = capsys.readouterr().out
    assert "[sagaguard]   killed (SIGKILL at agent_after_email)" in out
    assert "[sagaguard]   killed (SIGKILL at agent_after_refund)" in out
    assert "[checkpointer alone]   killed (SIGKILL at agent_after_email)" in out
    assert "the run is compensated" in out
    assert _row(out, "hotel bookings") == (1, 1)
    assert _row(out, "hotel cancellations") == (1, 0)
    assert _row(out, "card charges") == (1, 1)
    assert _row(out, "refunds") == (1, 0)
    assert _row(out, "emails") == (2, 1)
    assert _row(out, "model calls") == (4, 4)
    guarded, alone = out.split("emails sagaguard sent")[1].split("emails checkpointer alone sent")
    assert re.findall(r"\d\. (\w+):", guarded) == ["Confirmed", "Cancelled"]  # the correction after
    assert re.findall(r"\d\. (\w+):", alone.split("timeline")[0]) == ["Confirmed"]
    for step in ("tool.email_confirmation.2", "tool.charge_card.1", "tool.book_hotel.0"):
        assert f"step {step}: compensated" in out
    assert "saga: compensated" in out
    assert "OK: with sagaguard" in out
    assert "UNEXPECTED" not in out


def test_without_the_langgraph_extra_one_line_names_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "langgraph" else real(name, *a)
    )
    assert main(["agent"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'langgraph'" in err[0] and "sagaguard[demo,langgraph]" in err[0]


def test_sagaguard_demo_agent_is_the_agent_demo() -> None:
    cli = "import sys; from sagaguard.idempotency.cli import main; sys.exit(main(sys.argv[1:]))"
    done = subprocess.run(
        [sys.executable, "-c", cli, "demo", "agent", "--help"],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "usage: sagaguard demo agent" in done.stdout


def test_a_scripted_local_model_plans_one_turn_at_a_time() -> None:
    script = [
        [{"name": "book_hotel", "args": {"nights": 3}}],
        [{"name": "charge_card", "args": {"amount": 5}}],
    ]
    with LocalChatModel(script=script, in_process=True) as model:
        client = openai.OpenAI(api_key="sk-local", base_url=model.base_url, max_retries=0)
        messages: list[Any] = [{"role": "user", "content": "book"}]
        tools: Any = [{"type": "function", "function": {"name": "other", "parameters": {"type": "object"}}}]
        names = []
        for _ in range(3):
            reply = client.chat.completions.create(model="local", messages=messages, tools=tools).choices[0]
            calls = reply.message.tool_calls or []
            names.append([(c.function.name, c.function.arguments) for c in calls])  # type: ignore[union-attr]
            messages.append(reply.message.model_dump(exclude_none=True))
            messages += [{"role": "tool", "tool_call_id": c.id, "content": "ok"} for c in calls]
        client.close()
    assert names == [[("book_hotel", '{"nights": 3}')], [("charge_card", '{"amount": 5}')], []]
    assert reply.message.content == "done after 2 turns"
