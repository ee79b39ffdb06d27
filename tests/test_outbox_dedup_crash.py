"""A saga step SIGKILLed between its enqueue's commit and its record sends one email, not two.

The step (``tests/_outboxdedupchild.py``) enqueues a confirmation email through the outbox in its
own transaction, commits, and is killed with SIGKILL before the saga journal records the step. A
fresh process recovers the saga, so the step runs again and enqueues again; then it runs the relay
until the outbox is idle. The deferred send's dedup key is its effect key (the step's scope, the
effect's name and ordinal), so the second enqueue finds the committed message. What is asserted is
what the world saw: one message at the SMTP sink (in this process), one row in the outbox. Runs
with the outbox on SQLite and on Postgres.
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
from _outboxkit import BACKENDS, World, open_world
from conftest import FakeClock

from sagaguard.connectors.testing.smtp import SmtpSink
from sagaguard.idempotency.testing import CRASH_ENV

CHILD = Path(__file__).resolve().parent / "_outboxdedupchild.py"

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(params=BACKENDS)
def outbox_world(request: pytest.FixtureRequest, tmp_path: Path, clock: FakeClock) -> Iterator[World]:
    yield from open_world(request.param, tmp_path, clock)


@pytest.fixture
def sink() -> Iterator[SmtpSink]:
    with SmtpSink() as running:
        yield running


def _child(config: dict[str, Any], crash_at: str | None) -> tuple[int, list[dict[str, Any]], str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop(CRASH_ENV, None)
    if crash_at is not None:
        env[CRASH_ENV] = crash_at
    done = subprocess.run(
        [sys.executable, str(CHILD), json.dumps(config)],
        check=False, stdin=subprocess.DEVNULL, capture_output=True, text=True, env=env, timeout=90,
    )  # fmt: skip
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return done.returncode, events, done.stderr


def test_a_step_killed_after_its_enqueue_committed_sends_one_email(
    outbox_world: World, sink: SmtpSink, tmp_path: Path
) -> None:
    world = outbox_world
    config = {
        "outbox": world.url, "table": world.table, "store": f"sqlite:///{tmp_path}/store.db",
        "journal": f"sqlite:///{tmp_path}/journal.db", "smtp_host": sink.host, "smtp_port": sink.port,
        "saga_id": f"order-{uuid.uuid4().hex[:8]}", "mode": "run",
    }  # fmt: skip

    code, events, stderr = _child(config, "after_enqueue_commit")
    assert code == -signal.SIGKILL, stderr
    [enqueued] = events
    [row] = world.rows()
    assert row["status"] == "pending" and sink.count() == 0

    code, events, stderr = _child({**config, "mode": "recover"}, None)

    assert code == 0, stderr
    again, done = events
    assert again["message_id"] == enqueued["message_id"], "the re-run found the message it had enqueued"
    assert done == {"event": "done", "state": "completed", "delivered": 1}
    [row] = world.rows()
    assert row["status"] == "delivered"
    assert sink.count() == 1
