"""The throughput yardstick's smoke run (bench/throughput.py --quick): every row is produced.

Only the shape is checked, never a timing: the figures themselves belong in docs/benchmarks.md.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import require_postgres, require_redis

# Half a minute or more (it runs the throughput bench): runs with the long sweeps (-m slow, `make slow`, CI),
# not in `make test`, which must stay well under its 15-minute budget.
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif("'slow' not in config.getoption('markexpr')", reason="runs with -m slow"),
]


ROOT = Path(__file__).resolve().parent.parent
LEVELS = ["threads.1", "threads.8", "threads.32", "threads.128", "tasks.64", "tasks.256"]


def _summary_ok(summary: dict[str, float]) -> None:
    assert summary["calls"] > 0
    assert set(summary) == {"calls", "rate", "p50", "p99", "cpu_us"}


def test_quick_run_produces_every_row(tmp_path: Path) -> None:
    pg_url, redis_url = require_postgres(), require_redis()
    out = tmp_path / "figures.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "throughput.py"), "--quick", "--no-write",
         "--pg-url", pg_url, "--redis-url", redis_url, "--json", str(out)],
        capture_output=True, text=True, timeout=280, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    saved = json.loads(out.read_text())
    results, meta = saved["results"], saved["meta"]
    assert meta["failures"] == {}
    for backend in ("postgres", "sqlite", "redis"):
        rows = results[backend]["rows"]["guard"]
        assert list(rows) == LEVELS, backend
        for level in LEVELS:
            assert set(rows[level]) == {"floor", "guard"}
            for summary in rows[level].values():
                _summary_ok(summary)
    for backend in ("postgres", "sqlite"):
        saga = results[backend]["rows"]["saga"]
        assert list(saga) == LEVELS[:4]
        for level in saga.values():
            assert set(level) == {"floor", "saga"}
            for summary in level.values():
                _summary_ok(summary)
    for backend in ("postgres", "sqlite"):
        outbox = results[backend]["rows"]["outbox"]
        assert list(outbox) == LEVELS[:4]
        for level in outbox.values():
            assert set(level) == {"floor", "outbox"}
            assert level["outbox"]["calls"] > 0 and level["outbox"]["delivered"] >= 0
    assert set(results["sqlite"]["counts"]["guard"]) == {"statements", "commits"}
    assert set(results["postgres"]["counts"]["guard"]) == {"commits", "wal_bytes"}
    # Counted, not timed: a guarded new call is two commits on each SQL backend.
    assert results["sqlite"]["counts"]["guard"]["commits"] == pytest.approx(2.0)
    assert results["postgres"]["counts"]["guard"]["commits"] == pytest.approx(2.0, abs=0.1)
    assert list(results["memory"]["rows"]["guard"]) == ["threads.1", "tasks.64"]
    text = proc.stdout
    for heading in ("Guarded new calls against the floor", "client CPU per call",
                    "What the database pays", "Saga steps against one-row commits",
                    "Outbox enqueue + relay delivery"):  # fmt: skip
        assert heading in text
