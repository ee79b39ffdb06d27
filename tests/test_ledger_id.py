"""Provider keys are unique per ledger (issue 28 item 4): the ledger id.

Two ledgers (a staging and a production database, two deployments) that share a provider account, a
namespace and a scope derive one effect key; before ledger ids they also sent one provider key, so
the second ledger took the first one's PaymentIntent (or HTTP answer) as its own and no money moved.
Every ledger now keeps an id, drawn once, that enters its provider keys. A ledger that held records
before it had an id keeps the empty id, the old derivation: a record in doubt from before the
upgrade is re-sent under the key it was first sent with. Counted at the local Stripe-compatible
server and at a local HTTP API that deduplicates by ``Idempotency-Key``.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import sqlalchemy as sa
import tenacity
from _connectorutil import LEASE, after_lease, crash_before_record, crashing_guard
from conftest import FakeClock, require_postgres, require_redis

from sagaguard.connectors.http import IdempotentHttp
from sagaguard.connectors.stripe import StripeEffects
from sagaguard.connectors.testing import LocalStripe
from sagaguard.connectors.testing.http_server import LocalIdempotentApi
from sagaguard.idempotency import ConfigurationError, Guard, MemoryStore, Retry, scope
from sagaguard.idempotency.backends.sql_engine import make_engine
from sagaguard.idempotency.keys import EffectIdentity, check_ledger_id, provider_key
from sagaguard.idempotency.store import IdempotencyStore
from sagaguard.idempotency.stores.redis import RedisStore
from sagaguard.idempotency.stores.sql import SqlStore

pytestmark = pytest.mark.timeout(60)

CARD = "pm_card_visa"
FAST = Retry(stop=tenacity.stop_after_attempt(3), wait=tenacity.wait_none())


@pytest.fixture(scope="module")
def stripe_server() -> Iterator[LocalStripe]:
    with LocalStripe(search_lag=3600) as running:
        yield running


@pytest.fixture(scope="module")
def api() -> Iterator[LocalIdempotentApi]:
    with LocalIdempotentApi() as running:
        yield running


def guard_of(store: IdempotencyStore) -> Guard:
    return Guard(store, lease=LEASE, sleep=lambda s: None)


def stripe_on(server: LocalStripe, guard: Guard) -> StripeEffects:
    return StripeEffects(guard, api_key=server.api_key, api_base=server.api_base, timeout=2.0, retry=FAST)


def http_on(api: LocalIdempotentApi, guard: Guard) -> IdempotentHttp:
    return IdempotentHttp(guard, httpx.Client(base_url=api.url, timeout=5.0), retry=FAST)


def previous_release(url: str, table: str = "sagaguard_effects") -> None:
    """Make a database of this release look like one of the release before ledger ids: no ledger
    table, the effects table set at ``effects_0001`` (its records untouched)."""
    engine = make_engine(url)
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql(f"DROP TABLE {table}_ledger")
            conn.exec_driver_sql(f"UPDATE {table}_version SET version_num = 'effects_0001'")
    finally:
        engine.dispose()


# ------------------------------------------------------------------- two ledgers, one provider


def test_two_sqlite_ledgers_charging_one_stripe_account_each_charge(
    stripe_server: LocalStripe, tmp_path: Path
) -> None:
    """Before ledger ids the second ledger's charge was Stripe's replay of the first one's."""
    stripe_server.reset()
    payments = []
    for name in ("staging", "production"):
        store = SqlStore(f"sqlite:///{tmp_path / name}.db")
        try:
            with scope("order-1"):  # one namespace ("default"), one scope, one effect name
                payments.append(
                    stripe_on(stripe_server, guard_of(store)).charge(1500, "usd", payment_method=CARD)
                )
        finally:
            store.close()
    counters = stripe_server.counters()
    assert payments[0].id != payments[1].id
    assert counters["charges"] == 2 and counters.get("replays", 0) == 0


def test_a_ledgers_reconciler_does_not_take_another_ledgers_payment(
    stripe_server: LocalStripe, tmp_path: Path, clock: FakeClock
) -> None:
    """Ledger B's charge dies after its claim, before its request; its reconciler lists Stripe by
    the metadata: it must not find ledger A's PaymentIntent of the same scope (it did, by the bare
    effect key) but charge once itself."""
    stripe_server.reset()
    a, b = (SqlStore(f"sqlite:///{tmp_path / name}.db", clock=clock) for name in ("a", "b"))
    try:
        with scope("order-2"):
            first = stripe_on(stripe_server, guard_of(a)).charge(2500, "usd", payment_method=CARD)
        with scope("order-2"):
            crash_before_record(
                lambda: stripe_on(stripe_server, crashing_guard(b, "after_claim")).charge(
                    2500, "usd", payment_method=CARD
                )
            )
        after_lease(clock)
        with scope("order-2"):
            second = stripe_on(stripe_server, guard_of(b)).charge(2500, "usd", payment_method=CARD)
        # What B's compensation would refund: B's payment, never A's.
        mine = EffectIdentity.of("default", "order-2", "stripe.charge", 0, b.ledger_id()).search_key
        found = stripe_on(stripe_server, guard_of(b)).find_payments(mine, since=0.0) or []
        assert [intent["id"] for intent in found] == [second.id]
    finally:
        a.close()
        b.close()
    assert second.id != first.id
    assert stripe_server.counters()["charges"] == 2


def test_two_ledgers_posting_to_one_http_api_each_apply(api: LocalIdempotentApi) -> None:
    api.reset()
    answers = []
    for _ in range(2):  # two memory stores: two ledgers, each with an id drawn at construction
        with scope("order-3"):
            answers.append(
                http_on(api, guard_of(MemoryStore())).post("/orders", json={"sku": "A"}, name="shop.order")
            )
    assert answers[0].json()["key"] != answers[1].json()["key"]
    assert api.counters()["applied"] == 2


# ------------------------------------------------------------------ nothing recorded changes


def test_an_upgraded_sql_ledger_resends_an_in_doubt_call_under_its_first_key(
    api: LocalIdempotentApi, tmp_path: Path, clock: FakeClock
) -> None:
    """A call left in doubt by the release before ledger ids (its keys are the empty id's: the
    store is pinned to it here, which derives exactly what that release derived), re-sent after the
    upgrade, reaches the API under the same key: absorbed, applied once."""
    api.reset()
    url = f"sqlite:///{tmp_path / 'old.db'}"
    old = SqlStore(url, clock=clock, ledger_id="")
    with scope("order-4"):
        crash_before_record(
            lambda: http_on(api, crashing_guard(old)).post("/orders", json={"n": 4}, name="shop.order")
        )
    old.close()
    previous_release(url)
    assert api.counters()["applied"] == 1

    upgraded = SqlStore(url, clock=clock, create=True)  # create=True: effects_0002 runs
    try:
        assert upgraded.ledger_id() == ""
        after_lease(clock)
        with scope("order-4"):
            answer = http_on(api, guard_of(upgraded)).post("/orders", json={"n": 4}, name="shop.order")
    finally:
        upgraded.close()
    identity = EffectIdentity.of("default", "order-4", "shop.order", 0)
    assert answer.json()["key"] == provider_key(identity.key)  # the derivation without a ledger id
    counters = api.counters()
    assert counters["applied"] == 1 and counters["requests"] == 2
    reopened = SqlStore(url, create=False)
    try:
        assert reopened.ledger_id() == ""  # kept: stable for the life of the ledger
    finally:
        reopened.close()


def test_an_upgraded_stripe_ledger_finds_its_in_doubt_charge_by_the_old_metadata(
    stripe_server: LocalStripe, tmp_path: Path, clock: FakeClock
) -> None:
    stripe_server.reset()
    url = f"sqlite:///{tmp_path / 'old.db'}"
    old = SqlStore(url, clock=clock, ledger_id="")
    with scope("order-5"):
        crash_before_record(
            lambda: stripe_on(stripe_server, crashing_guard(old)).charge(3100, "usd", payment_method=CARD)
        )
    old.close()
    previous_release(url)
    upgraded = SqlStore(url, clock=clock, create=True)
    try:
        after_lease(clock)
        with scope("order-5"):
            payment = stripe_on(stripe_server, guard_of(upgraded)).charge(3100, "usd", payment_method=CARD)
    finally:
        upgraded.close()
    assert payment.amount_received == 3100
    assert stripe_server.counters()["charges"] == 1


def test_a_redis_prefix_holding_records_keeps_the_old_keys(api: LocalIdempotentApi, clock: FakeClock) -> None:
    url = require_redis()
    api.reset()
    prefix = f"sg-ledger-{uuid.uuid4().hex[:8]}"
    old = RedisStore(url, clock=clock, prefix=prefix, ledger_id="")  # writes no ledger key: as before
    try:
        with scope("order-6"):
            crash_before_record(
                lambda: http_on(api, crashing_guard(old)).post("/orders", json={"n": 6}, name="shop.order")
            )
        client = redis.Redis.from_url(url)
        assert client.get(f"{prefix}:{{ledger}}") is None
        upgraded = RedisStore(url, clock=clock, prefix=prefix)
        assert upgraded.ledger_id() == "" and client.get(f"{prefix}:{{ledger}}") == b""
        after_lease(clock)
        with scope("order-6"):
            answer = http_on(api, guard_of(upgraded)).post("/orders", json={"n": 6}, name="shop.order")
        assert answer.json()["key"] == provider_key(
            EffectIdentity.of("default", "order-6", "shop.order", 0).key
        )
        assert api.counters()["applied"] == 1
        assert [r.state.value for r in upgraded.list()] == ["succeeded"]  # the ledger key is no record
        upgraded.close()
    finally:
        old.close()
        for key in client.scan_iter(match=f"{prefix}:*"):
            client.delete(key)
        client.close()


# -------------------------------------------------------------------- drawn once, agreed on


def _agree(open_store: Callable[[], IdempotencyStore], n: int = 4) -> set[str]:
    """The ledger ids ``n`` threads read, opening one new ledger at once."""
    barrier = threading.Barrier(n, timeout=30)
    seen: list[Any] = [None] * n

    def worker(i: int) -> None:
        try:
            barrier.wait()
            store = open_store()
            try:
                seen[i] = store.ledger_id()
            finally:
                store.close()
        except BaseException as exc:
            seen[i] = exc

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not [s for s in seen if isinstance(s, BaseException)], seen
    return set(seen)


def test_concurrent_first_opens_of_a_sqlite_ledger_agree(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'new.db'}"
    (ledger,) = _agree(lambda: SqlStore(url))
    assert ledger != "" and check_ledger_id(ledger) == ledger
    again = SqlStore(url)
    assert again.ledger_id() == ledger
    again.close()


def test_concurrent_first_opens_of_a_postgres_ledger_agree() -> None:
    pg_url = require_postgres()
    table = f"sg_ledger_{uuid.uuid4().hex[:8]}"
    try:
        (ledger,) = _agree(lambda: SqlStore(pg_url, table_name=table))
        assert ledger != ""
    finally:
        engine = make_engine(pg_url)
        with engine.begin() as conn:
            for name in (table, f"{table}_version", f"{table}_ledger"):
                conn.execute(sa.text(f'DROP TABLE IF EXISTS "{name}"'))
        engine.dispose()


def test_concurrent_first_opens_of_a_redis_prefix_agree() -> None:
    url = require_redis()
    prefix = f"sg-ledger-{uuid.uuid4().hex[:8]}"
    try:
        (ledger,) = _agree(lambda: RedisStore(url, prefix=prefix))
        assert ledger != ""
    finally:
        client = redis.Redis.from_url(url)
        client.delete(f"{prefix}:{{ledger}}")
        client.close()


def test_two_memory_stores_are_two_ledgers_and_an_id_can_be_pinned(tmp_path: Path) -> None:
    assert MemoryStore().ledger_id() != MemoryStore().ledger_id()
    assert MemoryStore(ledger_id="prod-2026").ledger_id() == "prod-2026"
    url = f"sqlite:///{tmp_path / 'copy.db'}"
    kept = SqlStore(url)
    pinned = SqlStore(url, ledger_id="staging-copy")  # a copy that must not send the original's keys
    try:
        assert pinned.ledger_id() == "staging-copy" != kept.ledger_id()
        identity = EffectIdentity.of("default", "s", "pay.charge", 0)
        assert Guard(pinned).provider_key(identity) == provider_key(identity.key, "staging-copy")
        assert Guard(kept).provider_key(identity) != Guard(pinned).provider_key(identity)
    finally:
        kept.close()
        pinned.close()


@pytest.mark.parametrize("bad", ["has space", "x" * 65, "quote'", "ü", 7])
def test_a_malformed_ledger_id_is_refused(bad: Any) -> None:
    with pytest.raises(ConfigurationError, match="ledger id"):
        MemoryStore(ledger_id=bad)


def test_a_store_without_ledger_ids_keeps_the_old_keys() -> None:
    """A store (or wrapper) written before ledger ids has none: its guard derives the keys it
    always did."""

    class Old:
        def __init__(self, inner: IdempotencyStore) -> None:
            self._inner = inner

        def __getattr__(self, name: str) -> Any:
            if name == "ledger_id":
                raise AttributeError(name)
            return getattr(self._inner, name)

    guard = Guard(Old(MemoryStore()))  # type: ignore[arg-type]
    identity = EffectIdentity.of("default", "s", "pay.charge", 0)
    assert guard.ledger_id == "" and guard.provider_key(identity) == provider_key(identity.key)
