"""Several relay processes share one Postgres outbox: every message delivered once, per-aggregate
order kept, nothing left behind.

Four child relays (``tests/_outboxchild.py``) start together on a backlog spread over 500
aggregates. Each records, per delivery, the message and the start and end of its handler on
``CLOCK_MONOTONIC`` (one clock for every process of the machine), so the test can check across
processes that a message's handler started only after the previous message of its aggregate had
finished. It takes about 15 s, so it is part of the normal suite.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _outboxkit import World, open_world
from conftest import FakeClock

CHILD = Path(__file__).resolve().parent / "_outboxchild.py"
AGGREGATES = 500
RELAYS = 4


@pytest.fixture
def pg_world(tmp_path: Path, clock: FakeClock) -> Iterator[World]:
    """A world on Postgres only."""
    yield from open_world("postgres", tmp_path, clock)


def _enqueue(world: World, count: int) -> None:
    with world.engine.begin() as conn:
        for i in range(count):
            world.outbox.enqueue(
                conn, "noop", {"seq": i // AGGREGATES}, aggregate_type="a", aggregate_id=str(i % AGGREGATES)
            )


def _run_relays(world: World, tmp_path: Path, count: int, record_property: Any, *, batch: int) -> None:
    world.outbox.clock = None
    _enqueue(world, count)
    records = [tmp_path / f"relay{i}.txt" for i in range(RELAYS)]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(CHILD),
                json.dumps(
                    {
                        "url": world.url,
                        "table": world.table,
                        "batch": batch,
                        "lease": 30,
                        "record": str(record),
                        "gate": True,
                        "deadline": 600,
                    }
                ),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for record in records
    ]
    try:
        for proc in procs:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        started = time.monotonic()
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        results = []
        for proc in procs:
            out, err = proc.communicate(timeout=900)
            assert proc.returncode == 0, f"relay exited {proc.returncode}:\n{out}\n{err}"
            results.append(json.loads(out.strip().splitlines()[-1]))
        elapsed = time.monotonic() - started
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    deliveries: list[tuple[int, int, str, str, int]] = []
    for record in records:
        if record.exists():
            for line in record.read_text().splitlines():
                message_id, aggregate, seq, start, end = line.split()
                deliveries.append((int(start), int(end), message_id, aggregate, int(seq)))
    ids = [d[2] for d in deliveries]
    assert len(ids) == count and len(set(ids)) == count, "a message was delivered twice or not at all"
    deliveries.sort()
    last_end: dict[str, tuple[int, int]] = {}
    seen: dict[str, list[int]] = defaultdict(list)
    for start, end, _, aggregate, seq in deliveries:
        previous = last_end.get(aggregate)
        if previous is not None:
            assert previous[1] <= start, (
                f"aggregate {aggregate}: seq {seq} started before {previous[0]} ended"
            )
        last_end[aggregate] = (seq, end)
        seen[aggregate].append(seq)
    assert all(seqs == list(range(len(seqs))) for seqs in seen.values())
    assert len(seen) == AGGREGATES
    rows = world.rows()
    assert len(rows) == count and {row["status"] for row in rows} == {"delivered"}
    shares = [r["delivered"] for r in results]
    assert sum(shares) == count, shares
    # The work is shared (how evenly is a race: a relay that starts late may find little left).
    assert sum(1 for share in shares if share) >= 2, shares
    report = (
        f"{RELAYS} relays, {count:,} messages over {AGGREGATES} aggregates: {elapsed:.1f} s "
        f"({count / elapsed:,.0f}/s), shares {shares}"
    )
    record_property("outbox_scale", report)
    print(report)


@pytest.mark.timeout(600)
def test_four_relay_processes_share_20000_messages(
    pg_world: World, tmp_path: Path, record_property: Any
) -> None:
    _run_relays(pg_world, tmp_path, 20_000, record_property, batch=200)
