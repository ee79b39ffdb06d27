"""The helpers shipped in ``sagaguard.idempotency.testing``: the counter service and the crashing store."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

import pytest
from conftest import FakeClock, closed_port

from sagaguard.idempotency import (
    NOT_APPLIED,
    Applied,
    Guard,
    IdempotencyStore,
    MemoryStore,
    ReconcileRequest,
    scope,
)
from sagaguard.idempotency.keys import EffectIdentity, fingerprint
from sagaguard.idempotency.records import ClaimOutcome, State
from sagaguard.idempotency.testing import (
    CRASH_ENV,
    STORE_CRASH_POINTS,
    Charge,
    CounterClient,
    CounterService,
    CounterServiceError,
    CrashingStore,
    crash_at,
)

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def service() -> Iterator[CounterService]:
    with CounterService() as running:
        yield running


@pytest.fixture
def counter(service: CounterService) -> CounterService:
    service.reset()
    return service


# ------------------------------------------------------------------------------ counter service


def test_charges_are_counted_in_all_and_per_key(counter: CounterService) -> None:
    first = counter.client.charge("order-1", 100)
    second = counter.client.charge("order-1", 100)
    counter.client.charge("order-2", 5)

    assert first.charge_id != second.charge_id
    assert (first.count, second.count) == (1, 2)
    assert counter.count() == 3
    assert counter.count("order-1") == 2
    assert counter.count("nobody") == 0
    assert counter.counts() == {"order-1": 2, "order-2": 1}
    assert [c.charge_id for c in counter.charges(key="order-1")] == [first.charge_id, second.charge_id]


def test_an_idempotency_key_replays_the_first_response(counter: CounterService) -> None:
    first = counter.client.charge("order-1", 100, idempotency_key="idem-1")
    again = counter.client.charge("order-1", 100, idempotency_key="idem-1")

    assert again.charge_id == first.charge_id
    assert (first.replayed, again.replayed) == (False, True)
    assert counter.count() == 1


def test_an_idempotency_key_reused_with_other_parameters_is_refused(counter: CounterService) -> None:
    counter.client.charge("order-1", 100, idempotency_key="idem-1")
    with pytest.raises(CounterServiceError) as info:
        counter.client.charge("order-1", 999, idempotency_key="idem-1")
    assert info.value.status == 400
    assert counter.count() == 1


def test_dedup_can_be_switched_off_per_request(counter: CounterService) -> None:
    counter.client.charge("order-1", 100, idempotency_key="idem-1", dedup=False)
    counter.client.charge("order-1", 100, idempotency_key="idem-1", dedup=False)
    assert counter.count() == 2


def test_charges_can_be_found_by_provider_key_metadata_or_header(counter: CounterService) -> None:
    by_metadata = counter.client.charge("order-1", 100, provider_key="pk-1")
    by_header = counter.client.charge("order-2", 100, idempotency_key="pk-2")

    assert counter.charges(provider_key="pk-1") == [by_metadata]
    assert [c.charge_id for c in counter.charges(provider_key="pk-2")] == [by_header.charge_id]
    assert counter.charges(provider_key="pk-3") == []


def test_bad_requests_are_refused(counter: CounterService) -> None:
    client = counter.client
    with pytest.raises(CounterServiceError) as info:
        client._request("POST", "/charge", {"key": "order-1", "amount": "lots"})
    assert info.value.status == 400
    with pytest.raises(CounterServiceError) as info:
        client._request("GET", "/nowhere")
    assert info.value.status == 404
    assert counter.count() == 0


def _request(provider_key: str) -> ReconcileRequest:
    identity = EffectIdentity.of("ns", "scope", "charge", 0)
    claim = MemoryStore().claim(identity, fingerprint({}), 1.0)
    return ReconcileRequest(identity, provider_key, {}, claim.record)


def test_the_reconciler_finds_a_charge_by_provider_key(counter: CounterService) -> None:
    reconcile = counter.client.reconciler()
    assert reconcile(_request("pk-1")) is NOT_APPLIED

    made = counter.client.charge("order-1", 100, provider_key="pk-1")

    assert reconcile(_request("pk-1")) == Applied(made)


def test_an_unreachable_service_raises() -> None:
    client = CounterClient(f"http://127.0.0.1:{closed_port()}", timeout=2)
    with pytest.raises(CounterServiceError) as info:
        client.charge("order-1", 1)
    assert info.value.status is None
    with pytest.raises(CounterServiceError):
        client.reconciler()(_request("pk-1"))  # the guard counts a raising reconciler as Unknown


def test_the_service_runs_in_its_own_process_and_stops() -> None:
    running = CounterService().start()
    pid = running.pid
    assert pid is not None and pid != os.getpid()
    running.stop()
    running.stop()  # idempotent
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    with pytest.raises(RuntimeError):
        _ = running.url


# ------------------------------------------------------------------------------- crashing store


class Crash(BaseException):
    """Stands in for SIGKILL in-process: nothing on the way catches a BaseException."""


def raise_crash(point: str) -> NoReturn:
    raise Crash(point)


def test_a_crashing_store_is_a_store() -> None:
    assert isinstance(CrashingStore(MemoryStore(), "before_claim"), IdempotencyStore)


def test_an_unknown_explicit_crash_point_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown store crash point"):
        CrashingStore(MemoryStore(), "after_effect")


def test_the_crash_point_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CRASH_ENV, "after_claim")
    assert crash_at() == "after_claim"
    assert CrashingStore(MemoryStore()).at == "after_claim"
    monkeypatch.setenv(CRASH_ENV, "after_effect")  # a body's point: the store passes through
    store = CrashingStore(MemoryStore(), kill=raise_crash)
    assert store.claim(EffectIdentity.of("ns", "s", "n", 0), "f", 1.0).outcome is ClaimOutcome.CLAIMED
    monkeypatch.delenv(CRASH_ENV)
    assert crash_at() is None


@pytest.mark.parametrize(
    ("point", "state_after"),
    [
        ("before_claim", None),
        ("after_claim", State.IN_PROGRESS),
        ("before_complete", State.IN_PROGRESS),
        ("after_complete", State.SUCCEEDED),
    ],
)
def test_the_store_dies_at_its_point(point: str, state_after: State | None) -> None:
    inner = MemoryStore()
    guard = Guard(CrashingStore(inner, point, kill=raise_crash))
    calls = []

    @guard.effect("charge")
    def charge() -> int:
        calls.append(1)
        return 1

    with scope("run-1"), pytest.raises(Crash, match=point):
        charge()

    record = inner.get(EffectIdentity.of("default", "run-1", "charge", 0).key)
    assert (record.state if record else None) is state_after
    assert len(calls) == (1 if point in ("before_complete", "after_complete") else 0)


def test_after_a_crash_before_the_record_the_next_run_reconciles(clock: FakeClock) -> None:
    inner = MemoryStore(clock=clock)
    made: list[int] = []

    def run(store: IdempotencyStore) -> int:
        guard = Guard(store, lease=5.0, wait=0)

        @guard.effect("charge", reconciler=lambda request: Applied(made[0]) if made else NOT_APPLIED)
        def charge() -> int:
            made.append(len(made) + 100)
            return made[-1]

        with scope("run-1"):
            return charge()

    with pytest.raises(Crash):
        run(CrashingStore(inner, "before_complete", kill=raise_crash))
    clock.advance(6.0)

    assert run(inner) == 100
    assert made == [100]


@pytest.mark.parametrize("where", ["crash_point", "store"])
def test_a_real_sigkill(where: str) -> None:
    program = {
        "crash_point": "from sagaguard.idempotency.testing import crash_point; crash_point('after_effect')",
        "store": (
            "from sagaguard.idempotency import MemoryStore, EffectIdentity\n"
            "from sagaguard.idempotency.testing import CrashingStore\n"
            "CrashingStore(MemoryStore()).claim(EffectIdentity.of('a', 'b', 'c', 0), 'f', 1.0)"
        ),
    }[where]
    point = "after_effect" if where == "crash_point" else "after_claim"
    env = {**os.environ, CRASH_ENV: point, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", program + "\nprint('survived')"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert done.returncode == -signal.SIGKILL
    assert "survived" not in done.stdout
    assert f"SIGKILL at {point}" in done.stderr

    env.pop(CRASH_ENV)
    done = subprocess.run(
        [sys.executable, "-c", program + "\nprint('survived')"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert (done.returncode, done.stdout.strip()) == (0, "survived")


def test_store_points_are_listed() -> None:
    assert set(STORE_CRASH_POINTS) >= {"before_claim", "after_claim", "before_complete", "after_complete"}


def test_charges_round_trip_as_effect_results() -> None:
    from sagaguard.idempotency.codec import Codec

    charge = Charge("ch_1", "order-1", 100, 1, provider_key="pk", replayed=True)
    codec = Codec(Charge)
    assert codec.decode(codec.encode(charge)) == charge
