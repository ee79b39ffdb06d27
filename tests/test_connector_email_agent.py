"""The email recipe for agents: a LangGraph tool commits the email to the transactional outbox and
returns; the relay delivers it. A SIGKILL of the agent right after the tool committed: the resumed
agent finishes, and exactly one email reaches the SMTP sink (a real aiosmtpd server), whether the
relay delivered before the resume or after it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from _emailagentchild import mailer

from sagaguard.connectors.testing.smtp import SmtpSink
from sagaguard.idempotency.testing import CRASH_ENV

CHILD = Path(__file__).resolve().parent / "_emailagentchild.py"
ROOT = CHILD.parent.parent

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def sink() -> Iterator[SmtpSink]:
    with SmtpSink() as running:
        yield running


def child(folder: Path, sink: SmtpSink, thread: str, action: str, crash: str | None = None) -> Any:
    config = {"dir": str(folder), "smtp": [sink.host, sink.port], "thread": thread, "action": action}
    env = {k: v for k, v in os.environ.items() if k != CRASH_ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(CHILD.parent)])
    if crash:
        env[CRASH_ENV] = crash
    return subprocess.run(
        [sys.executable, str(CHILD), json.dumps(config)],
        env=env, capture_output=True, text=True, timeout=90, check=False,
    )  # fmt: skip


def relay(folder: Path, sink: SmtpSink) -> int:
    """Run a relay until the outbox is idle; returns the messages the outbox holds."""
    guard, store, engine, outbox, _ = mailer(folder, [sink.host, sink.port])
    try:
        outbox.relay(engine).run(until_idle=True)
        with engine.connect() as conn:
            return int(conn.execute(sa.text("select count(*) from sagaguard_outbox")).scalar_one())
    finally:
        guard.close()
        store.close()
        engine.dispose()


@pytest.mark.parametrize("relay_first", [True, False], ids=["relay-before-resume", "relay-after-resume"])
def test_kill_right_after_the_tool_committed_sends_one_email(
    tmp_path: Path, sink: SmtpSink, relay_first: bool
) -> None:
    thread = f"t-{uuid.uuid4().hex[:8]}"
    killed = child(tmp_path, sink, thread, "start", crash="after_commit")
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert "SIGKILL at after_commit" in killed.stderr
    assert sink.count() == 0  # committed, not sent: the agent never talks to SMTP
    if relay_first:
        assert relay(tmp_path, sink) == 1
        assert sink.count() == 1
    resumed = child(tmp_path, sink, thread, "resume")
    assert resumed.returncode == 0, resumed.stderr
    done = json.loads(resumed.stdout.strip().splitlines()[-1])
    assert done["final"] == "done"
    assert len(done["answers"]) == 1 and str(done["answers"][0]).startswith("receipt queued")
    assert relay(tmp_path, sink) == 1  # the resumed tool found its message: none was added
    assert sink.count() == 1
