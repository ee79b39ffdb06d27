"""Crash tests: a relay process is SIGKILLed at three points, a fresh one delivers everything.

The handler charges a :class:`~sagaguard.idempotency.testing.CounterService` (its own process) under the
message's provider key as ``Idempotency-Key``; the service dedups on it, as Stripe would. What is
asserted is what the world saw: every message's charge made exactly once, in aggregate order, and
nothing left in the outbox. The delivery attempts (every handler call, logged to a file before the
call, so a SIGKILL loses none) are reported: they show the redeliveries the provider absorbed.

Points: ``after_claim`` (a batch claimed, nothing delivered), ``before_ack`` (the batch delivered,
its ack not written), ``mid_batch`` (half the batch delivered). Runs on SQLite and Postgres.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _outboxkit import BACKENDS, World, open_world
from conftest import FakeClock
from sqlalchemy.orm import Session

from sagaguard.idempotency.testing import CounterService

CHILD = Path(__file__).resolve().parent / "_outboxchild.py"
MESSAGES, AGGREGATES, BATCH, LEASE = 30, 6, 10, 1.0

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(params=BACKENDS)
def outbox_world(request: pytest.FixtureRequest, tmp_path: Path, clock: FakeClock) -> Iterator[World]:
    """A world on SQLite and on Postgres."""
    yield from open_world(request.param, tmp_path, clock)


@pytest.fixture(scope="module")
def service() -> Iterator[CounterService]:
    with CounterService() as running:
        yield running


def run_child(spec: dict[str, Any], timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(CHILD), json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.mark.parametrize("point", ["after_claim", "before_ack", "mid_batch"])
def test_a_killed_relay_loses_nothing_and_the_world_sees_each_message_once(
    outbox_world: World,
    service: CounterService,
    point: str,
    tmp_path: Path,
    record_property: Any,
) -> None:
    world = outbox_world
    world.outbox.clock = None  # the children run on real time
    prefix = f"{world.backend}-{point}-{world.table[-6:]}"
    with Session(world.engine) as session:
        for i in range(MESSAGES):
            aggregate = f"{prefix}-agg{i % AGGREGATES}"
            payload = {"order": f"{prefix}-m{i}", "seq": i}
            world.outbox.enqueue(session, "charge", payload, aggregate_type="order", aggregate_id=aggregate)
        session.commit()
    log = tmp_path / "attempts.log"
    spec = {
        "url": world.url,
        "table": world.table,
        "service": service.url,
        "attempts_log": str(log),
        "batch": BATCH,
        "lease": LEASE,
    }

    killed = run_child({**spec, "crash": point})
    assert killed.returncode == -signal.SIGKILL, (
        f"exit {killed.returncode}:\n{killed.stdout}\n{killed.stderr}"
    )
    assert f"SIGKILL at {point}" in killed.stderr
    before = service.counts()

    fresh = run_child(spec)
    assert fresh.returncode == 0, f"exit {fresh.returncode}:\n{fresh.stdout}\n{fresh.stderr}"

    counts = {k: v for k, v in service.counts().items() if k.startswith(prefix)}
    assert counts == {f"{prefix}-m{i}": 1 for i in range(MESSAGES)}, "a charge was lost or made twice"
    order: dict[str, list[int]] = defaultdict(list)
    for charge in service.charges():
        if charge.key.startswith(prefix):
            order[f"agg{charge.amount % AGGREGATES}"].append(charge.amount)
    assert all(seqs == sorted(seqs) for seqs in order.values()), order
    rows = world.rows()
    assert {row["status"] for row in rows} == {"delivered"}
    attempts = log.read_text().split() if log.exists() else []
    claims = sum(row["attempts"] for row in rows)
    charged_before_kill = sum(v for k, v in before.items() if k.startswith(prefix))
    report = (
        f"{world.backend} {point}: {MESSAGES} messages, {len(attempts)} delivery attempts "
        f"({len(attempts) - MESSAGES} redelivered, absorbed by the provider key), {claims} claims, "
        f"{charged_before_kill} charged before the kill"
    )
    record_property("outbox_crash", report)
    print(report)
    assert len(set(attempts)) == MESSAGES
    if point == "after_claim":
        assert len(attempts) == MESSAGES and charged_before_kill == 0
        assert claims > MESSAGES  # the dead relay's claims used an attempt
    elif point == "before_ack":
        assert charged_before_kill > 0 and len(attempts) == MESSAGES + charged_before_kill
    else:
        assert charged_before_kill == BATCH // 2 and len(attempts) == MESSAGES + charged_before_kill
