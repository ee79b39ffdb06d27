"""The test side of the DBOS and Temporal agent-saga crash tests: the fake services, the children's
environment, and what the services saw (counted in their own processes, not in our code)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from sagaguard.connectors.testing import LocalIdempotentApi, LocalStripe
from sagaguard.saga.journals import open_journal
from sagaguard.saga.records import SagaSnapshot, SagaState

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
_CLI = "import sys; from sagaguard.idempotency.cli import main; sys.exit(main(sys.argv[1:]))"


@dataclass
class Services:
    """The local Stripe server and the hotel's HTTP API, each in its own process."""

    stripe: LocalStripe
    api: LocalIdempotentApi

    def reset(self) -> None:
        self.stripe.reset()
        self.api.reset()

    def seen(self) -> Counter[str]:
        """What reached the services: bookings, cancellations (HTTP), charges, refunds (Stripe)."""
        found = httpx.get(f"{self.api.url}/resources", timeout=10).json()["resources"]
        seen = Counter(resource["path"].strip("/") for resource in found)
        counters = self.stripe.counters()
        for name in ("charges", "refunds"):
            if counters.get(name):
                seen[name] = counters[name]
        return seen


@contextlib.contextmanager
def started_services() -> Iterator[Services]:
    """The two servers, each in its own process, for a module's tests."""
    with LocalStripe() as stripe, LocalIdempotentApi() as api:
        yield Services(stripe, api)


def child_env(services: Services, workdir: Path, *, kill: str = "", mode: str = "fail") -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT), str(TESTS), os.environ.get("PYTHONPATH", "")) if p)
    return {
        **os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1",
        "TRIP_API": services.api.url, "TRIP_STRIPE": services.stripe.api_base,
        "TRIP_STRIPE_KEY": services.stripe.api_key, "TRIP_DB": db_url(workdir),
        "TRIP_KILL": kill, "TRIP_MARKS": str(workdir), "TRIP_MODE": mode,
    }  # fmt: skip


def db_url(workdir: Path) -> str:
    return f"sqlite:///{workdir}/agent.db"


def run(argv: list[str], env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout, check=False)


def killed(done: subprocess.CompletedProcess[str]) -> None:
    assert done.returncode == -signal.SIGKILL, f"exit {done.returncode}:\n{done.stdout}\n{done.stderr}"


def ok(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 0, f"exit {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout.strip().splitlines()[-1]


def cli(*args: str) -> list[str]:
    """The ``sagaguard`` command line, run by this interpreter."""
    return [sys.executable, "-c", _CLI, *args]


def snapshot(workdir: Path, run_id: str) -> SagaSnapshot:
    journal = open_journal(db_url(workdir))
    try:
        found = journal.load(run_id)
    finally:
        journal.close()
    assert found is not None, f"no saga {run_id!r}"
    return found


def worker_until_ended(env: dict[str, str], workdir: Path, run_id: str) -> SagaSnapshot:
    """Run ``sagaguard sagas worker --once`` in fresh processes until the run's saga has ended."""
    argv = [
        *cli("sagas", "worker", "--app", "_enginesagaworld:registry", "--journal", db_url(workdir)),
        "--once",
    ]
    for _ in range(60):
        ok(run(argv, env))
        found = snapshot(workdir, run_id)
        if found.saga.state not in (SagaState.RUNNING, SagaState.COMPENSATING):
            return found
        # Real processes, real leases: a dead process's run lease runs out on the wall clock.
        # Not a threshold: the loop polls until the run has ended.
        time.sleep(0.5)
    raise AssertionError("the run never ended")


def wait_for(predicate: object, what: str, timeout: float = 60.0) -> None:
    """Poll ``predicate()`` until it is true (a condition, not a duration)."""
    assert callable(predicate)
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)
