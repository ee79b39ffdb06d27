"""The fleet benchmark's smoke run (bench/fleet.py --quick): every figure is produced, and the
recovery run loses nothing.

Only the shape and the counts are checked, never a timing: the figures belong in docs/benchmarks.md.
The quick run starts its own Postgres cluster and Redis Cluster, runs 1 and 2 worker processes per
backend for a second each, counts what a unit costs the database, then SIGKILLs a worker whose
runner holds a 2 s lease and waits for a sweeper on another host to resume its sagas.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from _pgpair import pair_problem
from _rediscluster import cluster_problem
from conftest import require_service

# A few minutes (it starts two servers and about forty worker processes): runs with the long sweeps
# (-m slow, `make slow`, CI), not in `make test`.
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif("'slow' not in config.getoption('markexpr')", reason="runs with -m slow"),
]

ROOT = Path(__file__).resolve().parent.parent
KINDS = {"saga", "saga_floor"}
COSTS = {"call", "call_floor", "call_same", "step", "step_floor"}


def test_quick_run_produces_every_figure_and_loses_nothing(tmp_path: Path) -> None:
    require_service("Postgres binaries", pair_problem())
    require_service("Redis Cluster", cluster_problem())
    out = tmp_path / "fleet.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "fleet.py"), "--quick", "--json", str(out)],
        capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(out.read_text())["results"]
    assert set(results["backends"]) == {"postgres", "redis"}
    for backend, found in results["backends"].items():
        assert list(found["levels"]) == ["1", "2"], backend
        for n, level in found["levels"].items():
            assert set(level) == KINDS
            for window in level.values():
                assert window["workers"] == int(n)
                assert window["units"] > 0 and window["rate"] > 0
                assert window["server"]["cpu"] > 0 and window["server"]["statements"] > 0
        assert set(found["costs"]) == COSTS
    counted = results["backends"]["postgres"]["counted"]
    # Counted, not timed: a guarded call and its floor are two round trips each, a floor step one.
    assert counted["call"]["statements"] == pytest.approx(2.0)
    assert counted["call_floor"]["statements"] == pytest.approx(2.0)
    assert counted["step_floor"]["statements"] == pytest.approx(3.0)  # a saga of three
    assert counted["saga_floor"]["statements"] == pytest.approx(9.0)
    # Exact: no autovacuum, no stale statistics, no background WAL in the counts.
    assert counted["call"]["commits"] == pytest.approx(2.0)
    assert counted["call_floor"]["commits"] == pytest.approx(2.0)
    assert counted["call"]["wal_bytes"] > counted["call_floor"]["wal_bytes"] > 0
    # The second floor, the store's record on the bare driver: two commits, more WAL than a
    # two-column row.
    assert counted["call_same"]["statements"] == pytest.approx(2.0)
    assert counted["call_same"]["commits"] == pytest.approx(2.0)
    assert counted["call_same"]["wal_bytes"] > counted["call_floor"]["wal_bytes"]
    redis = results["backends"]["redis"]["counted"]
    assert redis["call_floor"]["statements"] == pytest.approx(2.0)  # SET NX, SET: MONITOR saw each
    assert redis["call"]["statements"] >= 2.0
    assert redis["call_same"]["statements"] == pytest.approx(4.0)  # HSET, WAIT; HSET, PEXPIRE
    recovery = results["recovery"]
    assert recovery["backend"] == "postgres"
    assert recovery["sagas_of_the_dead"] >= 1
    assert recovery["resumed"] == recovery["sagas_of_the_dead"]
    assert recovery["left_behind"] == 0, recovery["states"]
    assert recovery["duplicates"] == 0
    assert recovery["effects_counted"] == recovery["effects_expected"] > 0
    for heading in ("throughput by worker processes", "what each unit costs", "Recovery after a SIGKILL"):
        assert heading in proc.stdout
