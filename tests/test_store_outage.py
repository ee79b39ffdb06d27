"""Two sides of an effect, two errors: a store that fails before the body ran raises
``StoreUnavailable`` ("not run"); one that fails while recording after the body ran raises
``OutcomeNotRecorded`` ("ran, outcome in doubt"), sync and async, against real servers.

Redis: a redis-server of the test's own on a free port, SIGKILLed inside the effect body. Postgres:
reached through a TCP proxy cut inside the body (the server gone for the store); and, for the claim
left behind, the store's own sessions killed with ``pg_terminate_backend`` while Postgres stays up.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from _guardutil import TcpProxy
from conftest import FakeClock, closed_port, require_postgres

from sagaguard.idempotency import Guard, OutcomeNotRecorded, OutcomeUnknown, StoreUnavailable, scope
from sagaguard.idempotency.records import State
from sagaguard.idempotency.store import IdempotencyStore


class Outage:
    """A store and a way to take its server away from it."""

    def __init__(self, store: IdempotencyStore, stop: Callable[[], None]) -> None:
        self.store = store
        self.stop = stop
        """Takes the server away for good: the store can neither use nor open a connection."""


@pytest.fixture
def redis_outage() -> Iterator[Outage]:
    server = shutil.which("redis-server")
    if server is None:
        pytest.skip("redis-server is not installed")
    port = closed_port()
    proc = subprocess.Popen(
        [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    import redis

    from sagaguard.idempotency.stores.redis import RedisStore

    client = redis.Redis(port=port)
    for _ in range(500):  # until it answers (bounded), not a timing assertion
        try:
            client.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.01)
    client.close()

    def stop() -> None:
        proc.kill()
        proc.wait()

    store = RedisStore(f"redis://127.0.0.1:{port}/0", prefix="sg-outage")
    try:
        yield Outage(store, stop)
    finally:
        stop()
        store.close()


def kill_sessions(url: str, app: str) -> None:
    """Terminate every session tagged ``app`` from another connection (the server stays up)."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as admin:
        killed = admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE pid <> pg_backend_pid() AND datname = current_database() AND application_name = %s",
            (app,),
        ).fetchall()
    assert killed, "the store had no session to kill"


@pytest.fixture
def postgres_outage() -> Iterator[Outage]:
    """The store reaches Postgres through a TCP proxy that :attr:`Outage.stop` cuts: every session
    is dropped and no new one can be opened, as if the server had died (killing only the store's
    sessions would let a record made on a fresh connection, e.g. from another offload thread, go
    through: then nothing was lost)."""
    from urllib.parse import urlsplit

    import psycopg

    from sagaguard.idempotency.stores.sql import SqlStore

    url = require_postgres()
    parts = urlsplit(url)
    proxy = TcpProxy(parts.hostname or "127.0.0.1", parts.port or 5432)
    userinfo = parts.netloc.rpartition("@")[0]
    proxied = parts._replace(netloc=(f"{userinfo}@" if userinfo else "") + f"127.0.0.1:{proxy.port}").geturl()
    table = f"sg_outage_{uuid.uuid4().hex[:8]}"
    store = SqlStore(proxied, table_name=table)
    try:
        yield Outage(store, proxy.cut)
    finally:
        proxy.cut()
        store.close()
        with psycopg.connect(url, autocommit=True) as admin:
            for dropped in (table, f"{table}_version"):
                admin.execute(f'DROP TABLE IF EXISTS "{dropped}"')


@pytest.fixture(params=["postgres", "redis"])
def outage(request: pytest.FixtureRequest) -> Outage:
    return request.getfixturevalue(f"{request.param}_outage")  # type: ignore[no-any-return]


def check_not_recorded(info: pytest.ExceptionInfo[OutcomeNotRecorded]) -> OutcomeNotRecorded:
    err = info.value
    assert isinstance(err, OutcomeUnknown)
    assert not isinstance(err, StoreUnavailable)  # never "not run"
    assert isinstance(err.__cause__, StoreUnavailable)
    assert "ran" in str(err)
    return err


def test_store_lost_while_recording_a_success_is_not_recorded_not_unavailable(outage: Outage) -> None:
    guard = Guard(outage.store)
    runs: list[int] = []

    @guard.effect("pay.charge")
    def charge(amount: int) -> dict[str, int]:
        runs.append(amount)
        outage.stop()  # the provider has charged; the store goes away before the record
        return {"charged": amount}

    try:
        with scope("order-1"), pytest.raises(OutcomeNotRecorded) as info:
            charge(500)
        err = check_not_recorded(info)
        assert (err.has_result, err.result, err.error) == (True, {"charged": 500}, None)
        assert err.record.state is State.IN_PROGRESS and err.record.token > 0
        assert runs == [500]
        with scope("order-2"), pytest.raises(StoreUnavailable):  # refused before its body: not run
            charge(700)
        assert runs == [500]
    finally:
        guard.close()


def test_store_lost_while_recording_a_failure_is_not_recorded(outage: Outage) -> None:
    guard = Guard(outage.store)

    @guard.effect("pay.charge")
    def charge(amount: int) -> int:
        outage.stop()
        raise TimeoutError("the provider did not answer")  # ambiguous: may have been applied

    try:
        with scope("order-1"), pytest.raises(OutcomeNotRecorded) as info:
            charge(500)
        err = check_not_recorded(info)
        assert (err.has_result, err.result) == (False, None)
        assert isinstance(err.error, TimeoutError)
    finally:
        guard.close()


@pytest.mark.parametrize("offload", [None, True, False])
def test_async_store_lost_while_recording_a_success_is_not_recorded(outage: Outage, offload: Any) -> None:
    guard = Guard(outage.store, offload=offload)
    runs: list[int] = []

    @guard.effect("pay.charge")
    async def charge(amount: int) -> int:
        runs.append(amount)
        outage.stop()
        return amount * 2

    async def main() -> None:
        with scope("order-1"), pytest.raises(OutcomeNotRecorded) as info:
            await charge(500)
        err = check_not_recorded(info)
        assert (err.has_result, err.result) == (True, 1000)
        with scope("order-2"), pytest.raises(StoreUnavailable):
            await charge(700)

    try:
        asyncio.run(main())
    finally:
        guard.close()
    assert runs == [500]


def test_the_claim_left_by_a_lost_store_is_taken_over_in_doubt_later(clock: FakeClock) -> None:
    """Postgres itself stayed up (only the store's sessions were killed): the record is still the
    claim, and once its lease has run out the next attempt takes it over in doubt and, with no
    reconciler, parks it (OutcomeUnknown): it never runs the charge again blindly."""
    from sagaguard.idempotency.stores.sql import SqlStore

    url = require_postgres()
    app, table = f"sg-outage-{uuid.uuid4().hex[:8]}", f"sg_outage_{uuid.uuid4().hex[:8]}"
    first = SqlStore(
        f"{url}{'&' if '?' in url else '?'}application_name={app}", table_name=table, clock=clock
    )
    second = SqlStore(url, table_name=table, clock=clock)
    runs: list[int] = []

    def build(store: IdempotencyStore) -> tuple[Guard, Callable[[int], int]]:
        guard = Guard(store)

        @guard.effect("pay.charge")
        def charge(amount: int) -> int:
            runs.append(amount)
            if len(runs) == 1:
                kill_sessions(url, app)
            return amount

        return guard, charge

    guard_a, charge_a = build(first)
    guard_b, charge_b = build(second)
    try:
        with scope("order-1"), pytest.raises(OutcomeNotRecorded) as info:
            charge_a(5)
        held = info.value.record
        left = second.get(held.key)
        assert left is not None and (left.state, left.token) == (State.IN_PROGRESS, held.token)
        clock.advance(held.lease_until - clock.now + 1)  # the claim's lease runs out
        with scope("order-1"), pytest.raises(OutcomeUnknown) as again:
            charge_b(5)
        assert not isinstance(again.value, OutcomeNotRecorded)
        assert runs == [5]
        parked = second.get(held.key)
        assert parked is not None and (parked.state, parked.token) == (State.IN_DOUBT, held.token + 1)
    finally:
        guard_a.close()
        guard_b.close()
        first.close()
        second.close()
        import psycopg

        with psycopg.connect(url, autocommit=True) as admin:
            for dropped in (table, f"{table}_version"):
                admin.execute(f'DROP TABLE IF EXISTS "{dropped}"')
