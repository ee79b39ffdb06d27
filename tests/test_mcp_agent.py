"""Agents (LangGraph, the OpenAI Agents SDK) whose tools are an MCP server's, through the guarded
session, in an agent saga; real processes SIGKILLed where it matters; counted at the fakes.

The agent (``tests/_mcpagentchild.py``) charges the card, sends the receipt and, failing on a
later tool, has its run compensated: the charge refunded by an MCP ``refund`` call. Killed (the
agent after the server charged, before it recorded the answer; the server after charging, before
answering; the agent in its own undo; the server in the undo), the run is finished by a rerun, by
the same process's retries, or by a worker in a fresh process: one charge, at most one email, one
refund, every time.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _mcpkit import CLI, TESTS, counts, server_env, sink_fixture, stripe_fixture

from sagaguard.connectors.testing import LocalStripe
from sagaguard.connectors.testing.smtp import SmtpSink
from sagaguard.saga import SagaState
from sagaguard.saga.journals import open_journal

__all__ = ["sink_fixture", "stripe_fixture"]  # the fixtures `sink` and `stripe`, re-used
pytestmark = pytest.mark.timeout(300)  # several fresh processes each, on a shared machine
SLOW = [
    pytest.mark.slow,
    pytest.mark.skipif("'slow' not in config.getoption('markexpr')", reason="runs with -m slow"),
]

CHILD = TESTS / "_mcpagentchild.py"
RUN = "shop-run-1"


@pytest.fixture
def world(stripe: LocalStripe, sink: SmtpSink) -> tuple[LocalStripe, SmtpSink]:
    stripe.reset()
    sink.reset()
    return stripe, sink


def env_for(world: tuple[LocalStripe, SmtpSink], folder: Path, **extra: str) -> dict[str, str]:
    db = f"sqlite:///{folder / 'agent.db'}"
    env = server_env(*world, folder, extra.pop("server_kill", ""))
    return {**env, "AGENT_DIR": str(folder), "SAGAGUARD_STORE": db, **extra}


def agent(framework: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, str(CHILD), framework]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=180, check=False)


def state(folder: Path) -> SagaState:
    journal = open_journal(f"sqlite:///{folder / 'agent.db'}")
    try:
        found = journal.load(RUN)
        assert found is not None
        return found.saga.state
    finally:
        journal.close()


def worker_until_done(env: dict[str, str], folder: Path) -> None:
    """``sagaguard sagas worker --once`` in fresh processes until the run has ended."""
    db = f"sqlite:///{folder / 'agent.db'}"
    argv = [sys.executable, "-c", CLI, "sagas", "worker", "--app", "_mcpagentchild:registry",
            "--journal", db, "--once"]  # fmt: skip
    for _ in range(60):
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120, check=False)
        assert done.returncode == 0, done.stdout + done.stderr
        if state(folder) not in (SagaState.RUNNING, SagaState.COMPENSATING):
            return
        # Polled, not a threshold: a dead process's run on this host is taken over at once.
        time.sleep(0.5)
    raise AssertionError("the run never ended")


@pytest.mark.parametrize("framework", ["langgraph", pytest.param("agents", marks=SLOW)])
def test_an_agent_that_fails_refunds_its_mcp_charge_once(
    framework: str, world: tuple[LocalStripe, SmtpSink], tmp_path: Path
) -> None:
    env = env_for(world, tmp_path, AGENT_FAIL="1")
    first = agent(framework, env)
    assert '"failed: ' in first.stdout and "compensated" in first.stdout, first.stdout + first.stderr
    assert state(tmp_path) is SagaState.COMPENSATED
    assert counts(*world) == {"charges": 1, "refunds": 1, "emails": 1}


def test_an_agent_that_completes_keeps_its_charge_and_its_email(
    world: tuple[LocalStripe, SmtpSink], tmp_path: Path
) -> None:
    env = env_for(world, tmp_path)
    assert '"completed"' in agent("agents", env).stdout
    assert state(tmp_path) is SagaState.COMPLETED
    assert counts(*world) == {"charges": 1, "refunds": 0, "emails": 1}


@pytest.mark.parametrize(
    ("framework", "kill", "charged"),
    [
        # charged and answered; the agent died before recording the answer
        pytest.param("langgraph", {"AGENT_KILL": "after_charge"}, 1, id="langgraph-agent-after-charge"),
        # charged; the server died before answering
        pytest.param("langgraph", {"server_kill": "after_charge"}, 1, id="langgraph-server-after-charge"),
    ],
)
def test_a_charge_left_in_doubt_by_a_kill_is_never_repeated_and_is_undone(
    framework: str, kill: dict[str, str], charged: int, world: tuple[LocalStripe, SmtpSink], tmp_path: Path
) -> None:
    env = env_for(world, tmp_path, AGENT_FAIL="1", **kill)
    first = agent(framework, env)
    if "AGENT_KILL" in kill:
        assert first.returncode == -signal.SIGKILL, first.stderr
        assert counts(*world) == {"charges": charged, "refunds": 0, "emails": 0}
        first = agent(framework, env)  # the rerun finds the charge in doubt: parked, not re-sent
    assert "compensated" in first.stdout, first.stdout + first.stderr[-3000:]
    # In doubt, the run stopped there (no receipt); its undo looked the charge up by its key.
    assert counts(*world) == {"charges": charged, "refunds": charged, "emails": 0}


def test_the_agent_killed_in_its_undo_is_finished_by_a_worker_in_a_fresh_process(
    world: tuple[LocalStripe, SmtpSink], tmp_path: Path
) -> None:
    env = env_for(world, tmp_path, AGENT_FAIL="1", AGENT_KILL="after_refund")
    first = agent("langgraph", env)
    assert first.returncode == -signal.SIGKILL, first.stderr
    assert counts(*world) == {"charges": 1, "refunds": 1, "emails": 1}
    assert state(tmp_path) is SagaState.COMPENSATING
    worker_until_done({**env, "AGENT_KILL": ""}, tmp_path)  # re-sends the undo under its key
    assert state(tmp_path) is SagaState.COMPENSATED
    assert counts(*world) == {"charges": 1, "refunds": 1, "emails": 1}


SWEEP = [
    # (who is killed where, what the fakes count once the run has ended: charges, refunds, emails)
    ({"AGENT_KILL": "before_charge"}, (0, 0, 0)),
    ({"AGENT_KILL": "after_charge"}, (1, 1, 0)),
    ({"server_kill": "after_charge"}, (1, 1, 0)),
    ({"AGENT_KILL": "after_send_email"}, (1, 1, 1)),
    ({"AGENT_KILL": "after_refund"}, (1, 1, 1)),
    ({"server_kill": "in_refund"}, (1, 1, 1)),
]


@pytest.mark.slow
@pytest.mark.skipif("'slow' not in config.getoption('markexpr')", reason="runs with -m slow")
@pytest.mark.parametrize("framework", ["langgraph", "agents"])
@pytest.mark.parametrize(("kill", "expected"), SWEEP, ids=[next(iter(k.values())) + "-" + next(iter(k))
                                                             for k, _ in SWEEP])  # fmt: skip
def test_kill_sweep_every_point_each_framework(
    framework: str,
    kill: dict[str, str],
    expected: tuple[int, int, int],
    world: tuple[LocalStripe, SmtpSink],
    tmp_path: Path,
) -> None:
    """Killed at each point, rerun (as a supervisor would) and swept by the worker until the run
    ended: it is compensated, and the fakes saw each effect at most once and each undo once."""
    env = env_for(world, tmp_path, AGENT_FAIL="1", **kill)
    for _ in range(3):
        if agent(framework, env).returncode != -signal.SIGKILL:
            break
    if state(tmp_path) in (SagaState.RUNNING, SagaState.COMPENSATING):
        worker_until_done({**env, "AGENT_KILL": ""}, tmp_path)
    assert state(tmp_path) is SagaState.COMPENSATED
    seen = counts(*world)
    assert (seen["charges"], seen["refunds"], seen["emails"]) == expected
