"""The guard takes over a claim whose holder died on this host at once, on every backend.

The dead holder is a real process: started, its identity read from ``/proc``, SIGKILLed and reaped;
its claim is written as that process would have written it. Time is the injected clock, and the
guard's sleep refuses to be called where no wait is allowed.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import FakeClock

from sagaguard.idempotency import AlreadyInProgress, Guard, holder, scope
from sagaguard.idempotency.guard import DEFAULT_LEASE, DEFAULT_WAIT
from sagaguard.idempotency.keys import EffectIdentity, fingerprint
from sagaguard.idempotency.records import ClaimOutcome, Record, State
from sagaguard.idempotency.store import IdempotencyStore

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")

NAMESPACE = "default"


def _identity_of(proc: subprocess.Popen[bytes]) -> str:
    me = holder.parse(holder.current())
    assert me is not None
    text = Path(f"/proc/{proc.pid}/stat").read_text()
    return str(holder.Holder(me.host, proc.pid, text[text.rfind(")") + 2 :].split()[19]))


def _sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


@pytest.fixture(scope="module")
def dead() -> str:
    """The holder identity of a process that ran on this host and is gone."""
    proc = _sleeper()
    who = _identity_of(proc)
    proc.kill()
    proc.wait()
    assert holder.is_dead_on_this_host(who)
    return who


def claim_as(store: IdempotencyStore, monkeypatch: pytest.MonkeyPatch, who: str, scope_id: str) -> Record:
    identity = EffectIdentity.of(NAMESPACE, scope_id, "pay.charge", 0)
    with monkeypatch.context() as patched:
        patched.setattr(holder, "current", lambda: who)
        got = store.claim(identity, fingerprint({"amount": 5}), DEFAULT_LEASE)
    assert got.outcome is ClaimOutcome.CLAIMED
    return got.record


def no_sleep(seconds: float) -> None:
    raise AssertionError(f"the guard waited {seconds} s for a dead holder")


async def no_async_sleep(seconds: float) -> None:
    no_sleep(seconds)


def test_a_dead_holders_live_claim_is_taken_over_at_once(
    store: IdempotencyStore, monkeypatch: pytest.MonkeyPatch, dead: str
) -> None:
    guard = Guard(store, sleep=no_sleep)  # the default lease and wait
    runs: list[int] = []

    @guard.effect("pay.charge", provider_idempotent=True)  # a re-send is absorbed: run again
    def charge(amount: int) -> int:
        runs.append(amount)
        return amount * 2

    old = claim_as(store, monkeypatch, dead, "order-1")
    try:
        with scope("order-1"):
            assert charge(5) == 10
    finally:
        guard.close()
    assert runs == [5]
    rec = store.get(old.key)
    assert rec is not None
    assert (rec.state, rec.token, rec.attempts) == (State.SUCCEEDED, old.token + 1, 2)
    assert rec.holder == holder.current()


def test_async_a_dead_holders_live_claim_is_taken_over_at_once(
    store: IdempotencyStore, monkeypatch: pytest.MonkeyPatch, dead: str
) -> None:
    guard = Guard(store, sleep=no_sleep, async_sleep=no_async_sleep)
    runs: list[int] = []

    @guard.effect("pay.charge", provider_idempotent=True)
    async def charge(amount: int) -> int:
        runs.append(amount)
        return amount * 2

    old = claim_as(store, monkeypatch, dead, "order-2")

    async def main() -> int:
        with scope("order-2"):
            return await charge(5)

    try:
        assert asyncio.run(main()) == 10
    finally:
        guard.close()
    assert runs == [5]
    rec = store.get(old.key)
    assert rec is not None
    assert (rec.state, rec.token, rec.attempts) == (State.SUCCEEDED, old.token + 1, 2)


def test_a_live_holder_on_this_host_is_waited_for(
    store: IdempotencyStore, monkeypatch: pytest.MonkeyPatch, clock: FakeClock
) -> None:
    proc = _sleeper()
    try:
        alive = _identity_of(proc)
        waited: list[float] = []
        guard = Guard(store, wait=1.0, sleep=waited.append)  # the clock stands: the lease holds
        runs: list[int] = []

        @guard.effect("pay.charge", provider_idempotent=True)
        def charge(amount: int) -> int:
            runs.append(amount)
            return amount

        old = claim_as(store, monkeypatch, alive, "order-3")
        with scope("order-3"), pytest.raises(AlreadyInProgress):
            charge(5)
        guard.close()
    finally:
        proc.kill()
        proc.wait()
    assert runs == []
    assert sum(waited) == pytest.approx(1.0)
    rec = store.get(old.key)
    assert rec is not None
    assert (rec.state, rec.token, rec.holder) == (State.IN_PROGRESS, old.token, alive)


class _WithoutTakeOver:
    """A store wrapper written before ``take_over`` existed."""

    def __init__(self, inner: IdempotencyStore) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        if name == "take_over":
            raise AttributeError(name)
        return getattr(self._inner, name)


def test_a_store_without_take_over_waits_for_the_lease(
    store: IdempotencyStore, monkeypatch: pytest.MonkeyPatch, clock: FakeClock, dead: str
) -> None:
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        clock.advance(seconds)

    guard = Guard(_WithoutTakeOver(store), sleep=sleep)  # type: ignore[arg-type]

    @guard.effect("pay.charge", provider_idempotent=True)
    def charge(amount: int) -> int:
        return amount

    old = claim_as(store, monkeypatch, dead, "order-4")
    try:
        with scope("order-4"):
            assert charge(5) == 5
    finally:
        guard.close()
    assert DEFAULT_LEASE <= sum(slept) <= DEFAULT_WAIT  # took over by lease expiry
    rec = store.get(old.key)
    assert rec is not None and (rec.token, rec.attempts) == (old.token + 1, 2)
