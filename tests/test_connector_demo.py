"""The trip demo (``sagaguard.connectors.demo``, what ``make demo`` runs) finishes green and shows what it
claims.

Its workers are real processes SIGKILLed in the middle of a saga; the supervisor checks the counts
at the local services itself and exits 0 only when they are the expected ones. These tests check
the exit code, the key lines of the side-by-side table and timelines, and the ``--trace`` spans.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from sagaguard.connectors.demo import main
from sagaguard.connectors.demo._trace import read_spans

ROOT = Path(__file__).resolve().parent.parent


def _row(out: str, title: str) -> list[tuple[int, int]]:
    """The (sagaguard, naive) numbers of every table row called ``title`` (trip 1's, then trip 2's)."""
    found = re.findall(rf"^\s+{re.escape(title)}\s+(\d+)\s+(\d+)", out, re.M)
    return [(int(a), int(b)) for a, b in found]


def test_demo_exits_0_and_prints_the_side_by_side_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 0
    out = capsys.readouterr().out
    assert "[sagaguard] trip 1, worker 1: killed (SIGKILL at store.complete#2:before" in out
    assert "[naive retry loop] trip 1, run 1: killed (SIGKILL at naive_after_charge" in out
    assert "took over the dead worker's saga" in out
    assert _row(out, "charges") == [(1, 2), (1, 1)]
    assert _row(out, "refunds") == [(0, 0), (1, 0)]
    assert _row(out, "emails") == [(1, 1), (0, 0)]
    assert _row(out, "model calls") == [(1, 2), (1, 1)]
    (g1, n1), _ = _row(out, "tokens paid")
    assert 0 < g1 < n1
    assert "saga: completed  (1 recovery)" in out
    assert "step charge_card: compensated" in out
    assert "saga: compensated" in out
    assert "OK: with sagaguard" in out
    assert "UNEXPECTED" not in out


def test_trace_writes_saga_step_compensation_and_tool_spans(tmp_path: Path) -> None:
    trace = tmp_path / "spans.jsonl"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "sagaguard.connectors.demo", "--trace", str(trace)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    spans = read_spans(trace)
    names = [span["name"] for span in spans]
    assert "saga book_trip" in names
    assert "saga.step charge_card" in names
    assert "sagaguard.effect stripe.charge" in names
    assert "sagaguard.effect llm.plan" in names
    assert "sagaguard.effect stripe.refund" in names
    assert len({span["pid"] for span in spans}) >= 2  # the workers' spans are there too
    by_id: dict[str, dict[str, Any]] = {span["span_id"]: span for span in spans}
    compensations = [span for span in spans if span["name"] == "saga.compensate charge_card"]
    assert compensations
    for span in compensations:
        assert span["parent_span_id"] in by_id and by_id[span["parent_span_id"]]["name"] == "saga book_trip"
        linked = [by_id.get(link["span_id"], {}).get("name") for link in span["links"]]
        assert "saga.step charge_card" in linked
    for span in spans:
        assert set(span) >= {"name", "trace_id", "span_id", "parent_span_id", "links", "attributes", "status"}
