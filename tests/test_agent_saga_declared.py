"""The agent-saga recipe as the docs write it finishes after a SIGKILL inside a compensatable tool,
with no operator (issue 26 item 1).

The children (``tests/_agentsagadeclared.py``, ``tests/_agentsagasdkdeclared.py``,
``tests/_dbossagadeclared.py``, ``tests/_temporalsagadeclared.py``, ``tests/_crewaisagadeclared.py``)
are the LangGraph, OpenAI Agents SDK, DBOS, Temporal and CrewAI recipes of docs/agent_sagas.md with
the page's own declarations, checked against the page here, so the page cannot drift from what is
tested; they share one booking world (``tests/_declaredworld.py``). Killed inside the booking tool
after the API applied the booking (LangGraph: before or after the booking's own record), the agent
is restarted at once (Temporal: a fresh worker; CrewAI: the crew restored from its checkpoint):
the run resumes, the tool's body runs again in the same scope, its guarded request replays (or is
re-sent under its key and absorbed), and the trip completes: nothing undone, each effect once at
the API (counted there, in another process), one record per tool call and per request.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest
from _crewenv import OFFLINE
from test_crewai import crew_python  # noqa: F401 - the fixture, shared
from test_temporal_saga import temporal  # noqa: F401 - the fixture (a dev server), shared

from sagaguard.connectors.testing import LocalChatModel
from sagaguard.connectors.testing.http_server import LocalIdempotentApi
from sagaguard.idempotency import open_store
from sagaguard.idempotency.records import State

pytestmark = pytest.mark.timeout(180)  # fresh processes that import LangGraph, on a shared machine

ROOT = Path(__file__).resolve().parent.parent
CHILD = Path(__file__).resolve().parent / "_agentsagadeclared.py"
SDK_CHILD = CHILD.parent / "_agentsagasdkdeclared.py"
DBOS_CHILD = CHILD.parent / "_dbossagadeclared.py"
TEMPORAL_CHILD = CHILD.parent / "_temporalsagadeclared.py"
CREW_CHILD = CHILD.parent / "_crewaisagadeclared.py"
PAGE = ROOT / "docs" / "agent_sagas.md"
ONLY_SLOW = [
    pytest.mark.slow,
    pytest.mark.skipif("'slow' not in config.getoption('markexpr')", reason="runs with -m slow"),
]
DECLARATION = re.compile(r"changes_world\((?:[^()]|\([^()]*\))*\)")


def _run(
    api: LocalIdempotentApi,
    folder: Path,
    crash_at: str = "",
    child: Path = CHILD,
    *args: str,
    python: Path | str = sys.executable,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    path = os.pathsep.join(p for p in (str(ROOT), str(CHILD.parent), os.environ.get("PYTHONPATH", "")) if p)
    env = {
        **os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", "AGENT_API": api.url,
        "AGENT_DIR": str(folder), "SAGAGUARD_CRASH_AT": crash_at, **(env or {}),
    }  # fmt: skip
    argv = [str(python), str(child), *args]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120, check=False)


def _records(folder: Path) -> Counter[tuple[str, State]]:
    """The effect records of the run in ``folder``, by name and state."""
    store = open_store(f"sqlite:///{folder / 'agent.db'}")
    try:
        return Counter((record.name, record.state) for record in store.list())
    finally:
        store.close()


ONE_PER_CALL = Counter({
    ("agent.tool.book_hotel", State.SUCCEEDED): 1, ("agent.tool.charge", State.SUCCEEDED): 1,
    ("booking.hotel", State.SUCCEEDED): 1, ("payments.charge", State.SUCCEEDED): 1,
})  # fmt: skip
"""One record per tool call and per request, each succeeded."""


def _applied(api: LocalIdempotentApi) -> Counter[str]:
    found = httpx.get(f"{api.url}/resources", timeout=10).json()["resources"]
    return Counter(resource["path"] for resource in found)


@pytest.fixture
def api() -> Any:
    with LocalIdempotentApi() as server:
        yield server


@pytest.mark.parametrize(
    ("child", "section"),
    [
        (CHILD, "## LangGraph"), (SDK_CHILD, "## OpenAI Agents SDK"), (DBOS_CHILD, "## DBOS"),
        (TEMPORAL_CHILD, "## Temporal"), (CREW_CHILD, "## CrewAI"),
    ],
)
def test_the_child_declares_its_tools_exactly_as_the_page_does(child: Path, section: str) -> None:
    """Every declaration of the child appears, character for character, in its framework's recipe
    in docs/agent_sagas.md, and no compensatable step in the page's examples needs a ``policy=``."""
    page = PAGE.read_text(encoding="utf-8")
    recipe = page[page.index(section) :]
    recipe = recipe[: recipe.index("\n## ", 1)]
    declared = set(DECLARATION.findall(child.read_text(encoding="utf-8")))
    assert declared == {'changes_world(undo="cancel_booking")', 'changes_world(undo="refund")'}
    for declaration in declared:
        assert declaration in recipe, declaration
    code = "".join(re.findall(r"```python\n(.*?)```", page, re.S))  # the page's examples
    assert not [d for d in DECLARATION.findall(code) if "undo=" in d and "policy=" in d]


@pytest.mark.parametrize(
    "crash_at",
    ["in_booking", pytest.param("booked", marks=ONLY_SLOW)],  # seconds each: one in the default suite
)
def test_the_recipe_killed_inside_a_compensatable_tool_resumes_and_completes(
    api: LocalIdempotentApi, tmp_path: Path, crash_at: str
) -> None:
    killed = _run(api, tmp_path, crash_at)
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr
    assert _applied(api) == {"/bookings": 1}
    again = _run(api, tmp_path)  # restarted at once, on the same host: no operator
    assert again.returncode == 0, again.stdout + again.stderr
    assert json.loads(again.stdout) == {"state": "completed", "answer": "done"}
    assert _applied(api) == {"/bookings": 1, "/charges": 1}  # nothing twice, nothing undone
    assert _records(tmp_path) == ONE_PER_CALL


def test_the_agents_sdk_recipe_killed_inside_a_compensatable_tool_resumes_and_completes(
    api: LocalIdempotentApi, tmp_path: Path
) -> None:
    """The same kill in the Agents SDK recipe: the turn goes on from its session (``resume_turn``),
    the journaled model replays the booking's call id, the tool's step is found, its request absorbed."""
    killed = _run(api, tmp_path, "in_booking", SDK_CHILD)
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr
    assert _applied(api) == {"/bookings": 1}
    again = _run(api, tmp_path, child=SDK_CHILD)  # restarted at once: no operator
    assert again.returncode == 0, again.stdout + again.stderr
    assert json.loads(again.stdout) == {"state": "completed", "answer": "done"}
    assert _applied(api) == {"/bookings": 1, "/charges": 1}  # nothing twice, nothing undone
    # and the journaled model's answers: booking, charge, "done"
    assert _records(tmp_path) == ONE_PER_CALL + Counter({("agents.model", State.SUCCEEDED): 3})


def test_the_dbos_recipe_killed_inside_a_compensatable_step_is_recovered_and_completes(
    api: LocalIdempotentApi, tmp_path: Path
) -> None:
    """The same kill in the DBOS recipe: DBOS recovers the workflow in the restarted process, the
    step runs again, its call finds its step (the dead holder's run taken over at once, on this
    host), its request absorbed."""
    killed = _run(api, tmp_path, "in_booking", DBOS_CHILD)
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr
    assert _applied(api) == {"/bookings": 1}
    again = _run(api, tmp_path, child=DBOS_CHILD)  # restarted at once: no operator
    assert again.returncode == 0, again.stdout + again.stderr
    assert json.loads(again.stdout.splitlines()[-1]) == {"result": "booked", "state": "completed"}
    assert _applied(api) == {"/bookings": 1, "/charges": 1}  # nothing twice, nothing undone
    assert _records(tmp_path) == ONE_PER_CALL


def test_the_temporal_recipe_killed_inside_a_compensatable_activity_is_retried_and_completes(
    api: LocalIdempotentApi, tmp_path: Path, temporal: str  # noqa: F811 - the shared fixture
) -> None:
    """The same kill in the Temporal recipe: the worker dies inside the booking activity; a fresh
    worker (started at once) gets the activity retried by Temporal once its start-to-close timeout
    lapsed, the call finds its row (the dead holder's run taken over at once, on this host), its
    request is absorbed, and the workflow completes."""
    workflow = (temporal, f"q-{uuid.uuid4().hex}", f"trip-{uuid.uuid4().hex[:12]}")
    killed = _run(api, tmp_path, "in_booking", TEMPORAL_CHILD, *workflow, "start")
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr
    assert _applied(api) == {"/bookings": 1}
    again = _run(api, tmp_path, "", TEMPORAL_CHILD, *workflow, "resume")  # no operator
    assert again.returncode == 0, again.stdout + again.stderr
    assert json.loads(again.stdout.splitlines()[-1]) == {"result": "booked", "state": "completed"}
    assert _applied(api) == {"/bookings": 1, "/charges": 1}  # nothing twice, nothing undone
    assert _records(tmp_path) == ONE_PER_CALL


@pytest.mark.timeout(300)  # two processes that import CrewAI (seconds of CPU each)
def test_the_crewai_recipe_killed_inside_a_compensatable_tool_is_restored_and_completes(
    api: LocalIdempotentApi, tmp_path: Path, crew_python: Path  # noqa: F811 - the shared fixture
) -> None:
    """The same kill in the CrewAI recipe (its own environment): the program started again finds
    the crew's checkpoint and restores it (``Crew.from_checkpoint``), its kickoff continues the
    same run, the booking task's call finds its step, its request is absorbed, and the kickoff
    completes."""
    with LocalChatModel() as model:
        env = {**OFFLINE, "AGENT_MODEL": model.base_url, "CREWAI_STORAGE_DIR": str(tmp_path / "crewai")}
        killed = _run(api, tmp_path, "in_booking", CREW_CHILD, python=crew_python, env=env)
        assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr
        assert _applied(api) == {"/bookings": 1}
        again = _run(api, tmp_path, "", CREW_CHILD, python=crew_python, env=env)  # no operator
    assert again.returncode == 0, again.stdout + again.stderr[-6000:]
    out = json.loads(again.stdout.splitlines()[-1])
    assert (out["state"], out["restored"]) == ("completed", True)
    assert _applied(api) == {"/bookings": 1, "/charges": 1}  # nothing twice, nothing undone
    tools = Counter({key: n for key, n in _records(tmp_path).items() if not key[0].startswith("crewai.llm")})
    assert tools == ONE_PER_CALL
