"""Recovery time of an agent run SIGKILLed in the middle of its compensation, restarted at once.

The trip agent of ``tests/_agentsagachild.py`` (the default leases: 30 s run, 5 s effect) books a
hotel and charges a card at a local API, fails, and is SIGKILLed inside its refund undo, right after
the API applied the refund. A supervisor then restarts the agent at once, and after it runs
``sagaguard sagas worker --once`` (the default 60 s worker lease) in fresh processes, 0.2 s apart,
until the run has ended. Measured: seconds from the kill (the killed process reaped) until the
run's saga is COMPENSATED, and by whom (the restarted agent, or the worker after N passes); the
API's counts are checked (one refund, one cancellation).

::

    .venv/bin/python bench/saga_takeover.py --runs 3                    # this tree's saga package
    .venv/bin/python bench/saga_takeover.py --runs 3 --code /work/main  # another tree's (before)
    .venv/bin/python bench/saga_takeover.py --runs 3 --declared 60      # the declared trip saga

``--declared LEASE``: the declared trip saga of :mod:`sagaguard.saga.testing` (runner and guard lease LEASE
seconds; 60 is the runner's default), SIGKILLed right after its seat-release compensation reached
the counter service, then run again at once with the same id: seconds from the kill to the end of
the rerun (COMPENSATED).

``--code`` puts another checkout's packages first on the children's ``PYTHONPATH`` (the agent child
stays this tree's, so both run the same agent with the same default leases).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
if sys.path[0] != str(ROOT):  # the project's connectors package, not bench/connectors.py
    sys.path.insert(0, str(ROOT))
CHILD = ROOT / "tests" / "_agentsagachild.py"
_CLI = "import sys; from sagaguard.idempotency.cli import main; sys.exit(main(sys.argv[1:]))"


def _env(code: Path, api: str, db: str, marks: Path) -> dict[str, str]:
    path = os.pathsep.join([str(code), str(ROOT), str(CHILD.parent)])
    return {
        **os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", "AGENT_API": api, "AGENT_DB": db,
        "AGENT_KILL": "in_refund", "AGENT_MARKS": str(marks), "SAGAGUARD_STORE": db,
    }  # fmt: skip


def _state(env: dict[str, str], db: str) -> str:
    probe = (
        f"from sagaguard.saga.journals import open_journal; j = open_journal({db!r}); "
        "print(j.load('thread-1').saga.state.value)"
    )
    return subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True
    ).stdout.strip()


def one(code: Path, api: str) -> dict[str, object]:
    """One kill and recovery; its figures."""
    with tempfile.TemporaryDirectory() as tmp:
        db = f"sqlite:///{tmp}/agent.db"
        env = _env(code, api, db, Path(tmp))
        killed = subprocess.run(
            [sys.executable, str(CHILD)], env=env, capture_output=True, text=True, check=False
        )
        assert killed.returncode == -signal.SIGKILL, killed.stderr
        start = time.monotonic()
        again = subprocess.run(
            [sys.executable, str(CHILD)], env=env, capture_output=True, text=True, check=False
        )
        assert again.returncode == 0, again.stderr
        by, passes = "restarted agent", 0
        worker = [sys.executable, "-c", _CLI, "sagas", "worker", "--app", "_agentsagachild:registry"]
        worker += ["--journal", db, "--once"]
        while _state(env, db) != "compensated":
            passes += 1
            subprocess.run(worker, env=env, capture_output=True, text=True, check=True)
            by = f"worker, {passes} pass(es)"
            if _state(env, db) != "compensated":
                time.sleep(0.2)
        seconds = time.monotonic() - start
        return {"seconds": round(seconds, 2), "by": by, "agent": json.loads(again.stdout)}


def declared(code: Path, service: str, lease: float) -> dict[str, object]:
    """The declared trip saga (``sagaguard.saga.testing``), killed as its release compensation was sent, then
    run again at once with the same id; seconds from the kill to the rerun's end."""
    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{tmp}/trip.db"
        saga_id = f"trip-{os.getpid()}-{time.monotonic_ns()}"
        argv = [sys.executable, "-m", "sagaguard.saga.testing", "child"]
        argv += ["--scenario", "sagaguard.saga.testing:trip_scenario"]
        argv += ["--saga-id", saga_id, "--namespace", saga_id, "--journal", url, "--store", url]
        argv += ["--lease", str(lease), "--param", f"service={service}", "--param", "fail_at=book_hotel"]
        argv += ["--param", "guarded=yes"]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(code), str(ROOT)])}
        kill = [*argv, "--kill", "store.complete#6:before"]
        # cwd: ``python -m`` puts the working directory first on sys.path, before PYTHONPATH.
        killed = subprocess.run(kill, env=env, capture_output=True, text=True, check=False, cwd=tmp)
        assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr
        start = time.monotonic()
        again = subprocess.run(argv, env=env, capture_output=True, text=True, check=False, cwd=tmp)
        seconds = time.monotonic() - start
        assert again.returncode == 0, again.stdout + again.stderr
        return {"seconds": round(seconds, 2), "by": "rerun", "outcome": json.loads(again.stdout)["state"]}


def main() -> int:
    """Run ``--runs`` kills; print one JSON line per run and the median."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--code", type=Path, default=ROOT, help="the checkout the children run")
    parser.add_argument(
        "--declared", type=float, default=0.0, metavar="LEASE",
        help="measure the declared trip saga instead, its runner and guard lease LEASE seconds",
    )  # fmt: skip
    args = parser.parse_args()
    from sagaguard.connectors.testing.http_server import LocalIdempotentApi
    from sagaguard.idempotency.testing import CounterService

    times = []
    if args.declared:
        with CounterService() as service:
            for _ in range(args.runs):
                figures = declared(args.code.resolve(), service.url, args.declared)
                times.append(float(figures["seconds"]))  # type: ignore[arg-type]
                print(json.dumps(figures), flush=True)
        print(json.dumps({"code": str(args.code), "runs": args.runs, "median_s": statistics.median(times)}))
        return 0
    for _ in range(args.runs):
        with LocalIdempotentApi() as api:
            figures = one(args.code.resolve(), api.url)
            found = httpx.get(f"{api.url}/resources", timeout=10).json()["resources"]
            applied = Counter(r["path"] for r in found)
            assert applied == {"/bookings": 1, "/charges": 1, "/refunds": 1, "/cancellations": 1}, applied
        times.append(float(figures["seconds"]))  # type: ignore[arg-type]
        print(json.dumps(figures), flush=True)
    print(json.dumps({"code": str(args.code), "runs": args.runs, "median_s": statistics.median(times)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
