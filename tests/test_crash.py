"""Crash tests: a worker is SIGKILLed mid-charge, restarted, and the world is charged at most once.

Each test runs ``tests/_crashchild.py`` (a guarded "charge" that POSTs to a :class:`CounterService`
in its own process) against SQLite (a file), Postgres and Redis (and, with ``-m cluster``, a local
Redis Cluster), and kills it with a real SIGKILL at
one point of the guard's life: before the claim, after the claim (before the effect), after the
effect (before the record) and after the record. A fresh child then runs the same scope again.

What is asserted is what the *outside world* saw, counted at the service: every scenario ends with
the charge made exactly once, or with ``OutcomeUnknown`` and the charge made once (never twice).
The store record is checked too (state, fencing token), through a store on the server's own clock.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from _crashchild import EFFECT, EXIT_OK, EXIT_UNKNOWN, NAMESPACE
from conftest import CLUSTER, SHARED_BACKENDS, FakeClock, StoreFactory, store_factory_for

from sagaguard.idempotency.codec import Codec
from sagaguard.idempotency.holder import HOST_ENV
from sagaguard.idempotency.keys import EffectIdentity
from sagaguard.idempotency.records import Record, State
from sagaguard.idempotency.store import IdempotencyStore
from sagaguard.idempotency.testing import CRASH_ENV, Charge, CounterService

LEASE = 0.5
"""The children's lease, in real seconds: a restarted child waits this long for the dead one's claim."""

CHILD = Path(__file__).resolve().parent / "_crashchild.py"
ROOT = CHILD.parent.parent
CHARGE = Codec(Charge)

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(params=[*SHARED_BACKENDS, CLUSTER])
def shared_store_factory(
    request: pytest.FixtureRequest, clock: FakeClock, tmp_path: Path
) -> Iterator[StoreFactory]:
    """conftest's ``shared_store_factory``, and the Redis store on a local Redis Cluster (``-m cluster``)."""
    yield from store_factory_for(request, clock, tmp_path)


@pytest.fixture(scope="module")
def service() -> Iterator[CounterService]:
    """One counter service for the module; every test charges its own business key."""
    with CounterService() as running:
        yield running


@dataclass
class Run:
    """How one child ended."""

    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> dict[str, Any]:
        lines = self.stdout.strip().splitlines()
        assert lines, f"the child printed nothing (exit {self.returncode}):\n{self.stderr}"
        return dict(json.loads(lines[-1]))

    def killed_at(self, point: str) -> None:
        assert self.returncode == -signal.SIGKILL, (
            f"expected SIGKILL at {point}, got exit {self.returncode}:\n{self.stdout}\n{self.stderr}"
        )
        assert f"SIGKILL at {point}" in self.stderr, self.stderr

    def charged(self) -> Charge:
        assert self.returncode == EXIT_OK, f"exit {self.returncode}:\n{self.stdout}\n{self.stderr}"
        return Charge(**self.output["charge"])

    def unknown(self) -> dict[str, Any]:
        assert self.returncode == EXIT_UNKNOWN, f"exit {self.returncode}:\n{self.stdout}\n{self.stderr}"
        assert self.output["outcome"] == "unknown"
        return self.output


class Child:
    """A running child process."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        if proc.stdin is not None:  # gated: wait until it is ready to claim
            assert proc.stdout is not None
            line = proc.stdout.readline().strip()
            if line != "ready":
                proc.kill()
                _, err = proc.communicate()
                raise AssertionError(f"the child said {line!r}, not 'ready':\n{err}")

    def finish(self, timeout: float = 60.0) -> Run:
        """Open the gate (if any) and wait for the end."""
        try:
            out, err = self.proc.communicate("go\n" if self.proc.stdin is not None else None, timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, err = self.proc.communicate()
            raise AssertionError(f"the child hung:\n{out}\n{err}") from None
        return Run(self.proc.returncode, out, err)


@dataclass
class World:
    """One scenario: a store data set, the service, and the business key (= the guard's scope)."""

    factory: StoreFactory
    service: CounterService
    order: str = field(default_factory=lambda: f"order-{uuid.uuid4().hex[:10]}")
    _store: IdempotencyStore | None = None
    _gated: list[subprocess.Popen[str]] = field(default_factory=list)

    @property
    def identity(self) -> EffectIdentity:
        """The effect's identity in the shared store's ledger (its provider key needs the id)."""
        return EffectIdentity.of(NAMESPACE, self.order, EFFECT, 0, self.store.ledger_id())

    @property
    def store(self) -> IdempotencyStore:
        """A store on the server's own clock, like the children's."""
        if self._store is None:
            self._store = self.factory.open(clock=None)
        return self._store

    def start(
        self, mode: str, crash_at: str | None = None, *, lease: float = LEASE, host_id: str | None = None
    ) -> Child:
        """Start a child that waits at its gate, warmed up (imports done, store open), until
        :meth:`Child.finish` opens it: a replacement worker already running when another dies.
        ``host_id`` sets ``$SAGAGUARD_HOST_ID``: the child plays another host."""
        child = Child(self._popen(mode, crash_at, lease, gate=True, host_id=host_id))
        self._gated.append(child.proc)
        return child

    def run(self, mode: str, crash_at: str | None = None, *, lease: float = LEASE) -> Run:
        """Run a child to its end; ``crash_at`` names where it dies (``$SAGAGUARD_CRASH_AT``)."""
        return Child(self._popen(mode, crash_at, lease, gate=False)).finish()

    def _popen(
        self, mode: str, crash_at: str | None, lease: float, *, gate: bool, host_id: str | None = None
    ) -> subprocess.Popen[str]:
        config = {
            "spec": self.factory.spec(),
            "service": self.service.url,
            "scope": self.order,
            "mode": mode,
            "lease": lease,
            "gate": gate,
        }
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path}
        env.pop(CRASH_ENV, None)
        env.pop(HOST_ENV, None)
        if host_id is not None:
            env[HOST_ENV] = host_id
        if crash_at is not None:
            env[CRASH_ENV] = crash_at
        return subprocess.Popen(
            [sys.executable, str(CHILD), json.dumps(config)],
            stdin=subprocess.PIPE if gate else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )

    def count(self) -> int:
        """Charges the service made for this order."""
        return self.service.count(self.order)

    def charges(self) -> list[Charge]:
        return self.service.charges(key=self.order)

    def record(self) -> Record:
        found = self.store.get(self.identity.key)
        assert found is not None, "no record"
        return found

    def recorded_charge(self) -> Charge:
        record = self.record()
        assert record.state is State.SUCCEEDED, record
        return CHARGE.decode(record.result or "null")


@pytest.fixture
def world(shared_store_factory: StoreFactory, service: CounterService) -> Iterator[World]:
    scenario = World(shared_store_factory, service)
    yield scenario
    for proc in scenario._gated:  # a test that failed early leaves its replacement at the gate
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_crash_before_the_claim_then_restart_charges_once(world: World) -> None:
    world.run("reconciler", crash_at="before_claim").killed_at("before_claim")
    assert world.count() == 0
    assert world.store.get(world.identity.key) is None

    run = world.run("reconciler")
    charge = run.charged()

    assert world.count() == 1
    # A fresh claim, nothing taken over: recorded under the token the charge ran under.
    assert (world.record().token, world.record().attempts) == (run.output["token"], 1)
    assert world.recorded_charge().charge_id == charge.charge_id


@pytest.mark.parametrize("host_id", [None, "another-host"], ids=["same-host", "other-host"])
def test_crash_after_the_claim_before_the_effect_then_restart_charges_once(
    world: World, host_id: str | None
) -> None:
    lease = 1.5
    replacement = world.start("reconciler", lease=lease, host_id=host_id)  # warmed up, at its gate
    assert world.store.get(world.identity.key) is None  # (opens our store now: checks below are quick)
    world.run("reconciler", crash_at="after_claim", lease=lease).killed_at("after_claim")
    assert world.count() == 0
    assert world.record().state is State.IN_PROGRESS  # the claim was written before any call
    dead = world.record().token

    # Started within the dead claim's lease, the replacement takes the record over (on the same host
    # at once: the holder is dead; on another host once it has polled the record until the lease
    # ran out), asks the reconciler, hears "no such charge", then charges.
    run = replacement.finish()
    charge = run.charged()

    if host_id is None:
        assert run.output["waited"] == 0
    else:
        assert 0 < run.output["waited"] < 2 * lease
    assert world.count() == 1
    assert world.record().token == run.output["token"] == dead + 1
    assert world.recorded_charge().charge_id == charge.charge_id


@pytest.mark.parametrize("point", ["before_complete", "after_effect"])
def test_crash_after_the_effect_reconciler_returns_the_charge_made(world: World, point: str) -> None:
    """(a) The reconciler asks GET /charges?provider_key=... and the restart returns that charge."""
    world.run("reconciler", crash_at=point).killed_at(point)
    assert world.count() == 1
    [first] = world.charges()
    assert first.provider_key == world.identity.provider_key
    assert world.record().state is State.IN_PROGRESS
    dead = world.record().token

    charge = world.run("reconciler").charged()

    assert charge.charge_id == first.charge_id
    assert world.count() == 1
    assert world.record().token == dead + 1
    assert world.recorded_charge().charge_id == first.charge_id


def test_crash_after_the_effect_provider_dedup_absorbs_the_resend(world: World) -> None:
    """(b) provider_idempotent=True: the re-send carries the same Idempotency-Key; the service replays."""
    world.run("provider", crash_at="before_complete").killed_at("before_complete")
    assert world.count() == 1
    [first] = world.charges()
    assert first.idempotency_key == world.identity.provider_key

    charge = world.run("provider").charged()

    assert charge.charge_id == first.charge_id
    assert charge.replayed, "the service should have answered the re-send from its idempotency cache"
    assert world.count() == 1
    assert world.recorded_charge().charge_id == first.charge_id


def test_crash_after_the_effect_without_resolver_is_unknown_until_an_operator_resolves(world: World) -> None:
    """(c) No reconciler, no provider dedup: at-most-once parks the record IN_DOUBT for a human."""
    world.run("none", crash_at="before_complete").killed_at("before_complete")
    assert world.count() == 1
    dead = world.record().token

    for restart in (1, 2):  # however often it is restarted, it never charges again
        unknown = world.run("none").unknown()
        assert unknown["key"] == world.identity.key
        assert world.count() == 1, f"restart {restart} charged again"
        record = world.record()
        assert record.state is State.IN_DOUBT
        assert record.token == unknown["token"] == dead + restart

    # The operator looks the charge up at the provider and records it under the record's token.
    [found] = world.service.charges(provider_key=world.identity.provider_key)
    world.store.complete(world.identity.key, world.record().token, CHARGE.encode(found), 3600.0)

    charge = world.run("none").charged()

    assert charge.charge_id == found.charge_id  # replayed from the record
    assert world.count() == 1


def test_crash_after_the_record_then_restart_replays(world: World) -> None:
    world.run("none", crash_at="after_complete").killed_at("after_complete")
    assert world.count() == 1
    [first] = world.charges()
    assert world.recorded_charge().charge_id == first.charge_id
    recorded = world.record()

    run = world.run("none")
    charge = run.charged()

    assert charge.charge_id == first.charge_id
    assert run.output["token"] is None  # the body did not run again
    assert world.count() == 1
    # A plain replay: nothing was taken over.
    assert (world.record().token, world.record().attempts) == (recorded.token, 1)


# ------------------------------------------------------------------------------------ the sweep

SWEEP_POINTS = ("before_claim", "after_claim", "after_effect", "before_complete", "after_complete")
MODES = ("reconciler", "provider", "none")


@pytest.mark.slow
# About a minute per backend: it runs only when asked for (-m slow, `make slow`), whatever the
# default marker selection is.
@pytest.mark.skipif("'slow' not in config.getoption('markexpr')", reason="the sweep runs with -m slow")
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("point", SWEEP_POINTS)
def test_sweep_every_point_and_mode_charges_at_most_once(world: World, point: str, mode: str) -> None:
    """Every crash point x every resolution mode: never two charges; settled when it can be."""
    world.run(mode, crash_at=point).killed_at(point)
    assert world.count() <= 1

    outcomes = []
    for _ in range(2):
        run = world.run(mode)
        assert world.count() <= 1, f"charged twice after a crash at {point} ({mode})"
        outcomes.append(run.returncode)
        if run.returncode == EXIT_OK:
            charge = run.charged()
            assert world.count() == 1
            assert world.recorded_charge().charge_id == charge.charge_id
        else:
            run.unknown()
            assert world.record().state is State.IN_DOUBT

    if mode != "none" or point in ("before_claim", "after_complete"):
        # A reconciler or a provider key settles every doubt; without either, only the points
        # that leave no doubt (nothing claimed yet, or already recorded) end in a charge.
        assert outcomes == [EXIT_OK, EXIT_OK]
    else:
        assert outcomes == [EXIT_UNKNOWN, EXIT_UNKNOWN]
        assert world.count() == (0 if point == "after_claim" else 1)


def test_the_demo_shows_one_charge_with_sagaguard_and_two_without(capsys: pytest.CaptureFixture[str]) -> None:
    """``sagaguard demo`` is this file's story on the embedded SQLite store; it must keep telling it."""
    from sagaguard.connectors.demo.small import main

    assert main([]) == 0
    out = capsys.readouterr().out
    assert re.search(r"service saw\s+1 charge\s+2 charges", out), out
    assert out.rstrip().endswith("the naive retry charged twice.")
