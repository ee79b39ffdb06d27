"""The Stripe connector's ``_async`` methods: the real SDK's async API against the local server.

The same server and the same in-process "crash" as test_connector_stripe.py (a store that raises at
``before_complete``: Stripe applied the call, its record was never written); the real SIGKILL of an
async charge is the last test here. Each test runs its coroutine with ``asyncio.run`` and builds its
``StripeEffects`` inside it (the async HTTP client keeps connections for the loop that made them).
The reconciling decisions the sync and async methods share are table-tested at the top, without a
server.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
import stripe
import tenacity
from _connectorchild import EXIT_OK, NAMESPACE
from _connectorutil import LEASE, Crash, after_lease, crashing_guard
from conftest import FakeClock, StoreFactory

from sagaguard.connectors.errors import ProviderRejected, ProviderUnavailable
from sagaguard.connectors.stripe import METADATA_KEY, Payment, Refund, StripeEffects, refund_compensation
from sagaguard.connectors.stripe import _flows as flows
from sagaguard.connectors.testing import LocalStripe
from sagaguard.idempotency import Applied, Guard, MemoryStore, OutcomeUnknown, Retry, State, scope
from sagaguard.idempotency.effect import NOT_APPLIED, Unknown
from sagaguard.idempotency.keys import EffectIdentity
from sagaguard.idempotency.store import IdempotencyStore
from sagaguard.idempotency.testing import CRASH_ENV
from sagaguard.saga import MemoryJournal, Saga, SagaRunner, SagaState, StepContext

DAY = 86_400.0
CARD = "pm_card_visa"
FAST = Retry(stop=tenacity.stop_after_attempt(3), wait=tenacity.wait_none())
CHILD = Path(__file__).resolve().parent / "_stripeasyncchild.py"
T = TypeVar("T")

pytestmark = [
    pytest.mark.timeout(120),
    # stripe's HTTPXClient posts its form body as data=bytes, which httpx deprecates: the SDK's business.
    pytest.mark.filterwarnings("ignore:Use 'content=<...>' to upload raw bytes:DeprecationWarning"),
]


@pytest.fixture(scope="module")
def server() -> Iterator[LocalStripe]:
    with LocalStripe(search_lag=3600) as running:
        yield running


@pytest.fixture(autouse=True)
def fresh(server: LocalStripe) -> None:
    server.reset()


@pytest.fixture
def memory(clock: FakeClock) -> MemoryStore:
    return MemoryStore(clock=clock)


async def _no_sleep(seconds: float) -> None:
    return None


def effects(server: LocalStripe, store: IdempotencyStore, **options: Any) -> StripeEffects:
    guard = options.pop("guard", None) or Guard(
        store, lease=LEASE, sleep=lambda s: None, async_sleep=_no_sleep
    )
    options.setdefault("retry", FAST)
    options.setdefault("timeout", 2.0)
    return StripeEffects(guard, api_key=server.api_key, api_base=server.api_base, **options)


def run(payments: StripeEffects, body: Callable[[StripeEffects], Awaitable[T]]) -> T:
    """``await body(payments)`` on a fresh event loop, then close the async HTTP client."""

    async def main() -> T:
        try:
            return await body(payments)
        finally:
            await payments.aclose()

    return asyncio.run(main())


def crash_before_record(payments: StripeEffects, body: Callable[[StripeEffects], Awaitable[Any]]) -> None:
    """Run ``body`` (an async effect on a :func:`crashing_guard`) and swallow the crash."""
    try:
        run(payments, body)
    except Crash:
        return
    raise AssertionError("the call did not reach its crash point")


def sdk(server: LocalStripe) -> stripe.StripeClient:
    return stripe.StripeClient(server.api_key, base_addresses={"api": server.api_base}, max_network_retries=0)


def charge_in(scope_id: str, amount: int, **kwargs: Any) -> Callable[[StripeEffects], Awaitable[Payment]]:
    async def body(payments: StripeEffects) -> Payment:
        with scope(scope_id):
            return await payments.charge_async(
                amount, "usd", payment_method=kwargs.pop("card", CARD), **kwargs
            )

    return body


# ------------------------------------------------------------------- the shared decisions


def _intent(id: str, status: str, created: int = 1) -> dict[str, Any]:
    return {
        "id": id, "status": status, "created": created, "amount": 100, "currency": "usd",
        "metadata": {METADATA_KEY: "k"},
    }  # fmt: skip


@pytest.mark.parametrize(
    ("found", "expected"),
    [
        (None, Unknown()),
        ([], NOT_APPLIED),
        ([_intent("pi_1", "canceled"), _intent("pi_2", "requires_payment_method")], NOT_APPLIED),
        ([_intent("pi_1", "canceled"), _intent("pi_2", "succeeded")], "pi_2"),
        ([_intent("pi_3", "requires_capture")], "pi_3"),
        ([_intent("pi_4", "processing")], "pi_4"),
    ],
)
def test_a_charge_resolves_from_what_was_found(found: Any, expected: Any) -> None:
    resolution = flows.charge_resolution(found)
    if isinstance(expected, str):
        assert isinstance(resolution, Applied) and resolution.result.id == expected
    else:
        assert resolution == expected


def test_undo_voids_authorisations_refunds_payments_oldest_first_and_skips_the_rest() -> None:
    intents = [
        _intent("pi_new", "succeeded", created=3),
        _intent("pi_held", "requires_capture", created=2),
        _intent("pi_gone", "canceled", created=1),
        _intent("pi_refunded", "succeeded", created=4),
    ]
    asked: list[tuple[str, str]] = []

    def do(op: flows.Op) -> Any:
        assert isinstance(op, flows.Undo)
        asked.append((op.effect, op.payment_intent))
        if op.payment_intent == "pi_refunded":
            raise ProviderRejected("already", "stripe", 400, "charge_already_refunded")
        return op.payment_intent

    assert flows.drive(flows.undo(intents), do) == ["pi_held", "pi_new"]
    assert asked == [
        ("stripe.cancel", "pi_held"),
        ("stripe.refund", "pi_new"),
        ("stripe.refund", "pi_refunded"),
    ]

    def refused(op: flows.Op) -> Any:
        raise ProviderRejected("no", "stripe", 400, "amount_too_large")

    with pytest.raises(ProviderRejected, match="no"):
        flows.drive(flows.undo([_intent("pi_1", "succeeded")]), refused)


# --------------------------------------------------------------------------------- charging


def test_async_charge_runs_once_and_shares_its_record_with_the_sync_method(
    server: LocalStripe, memory: MemoryStore
) -> None:
    payments = effects(server, memory)
    first = run(payments, charge_in("order-1", 1999, metadata={"order": "1"}))
    again = run(payments, charge_in("order-1", 1999, metadata={"order": "1"}))
    with scope("order-1"):  # the sync method: the same effect, key and record
        sync = payments.charge(1999, "usd", payment_method=CARD, metadata={"order": "1"})

    assert first == again == sync
    assert first.status == "succeeded" and first.amount_received == 1999
    identity = EffectIdentity.of("default", "order-1", "stripe.charge", 0, memory.ledger_id())
    assert first.effect_key == identity.search_key
    intent = sdk(server).v1.payment_intents.retrieve(first.id)
    assert intent.metadata.to_dict() == {
        "order": "1",
        METADATA_KEY: identity.search_key,
        "sagaguard_effect": "stripe.charge",
    }
    assert server.counters()["charges"] == 1
    assert server.counters()["requests"] == 2, "the create and the retrieve above; the replays call nothing"


def test_async_card_declined_is_not_applied_recorded_and_replayed(
    server: LocalStripe, memory: MemoryStore
) -> None:
    payments = effects(server, memory)
    for _ in range(2):
        with pytest.raises(ProviderRejected) as declined:
            run(payments, charge_in("order-2", 900, card="pm_card_chargeDeclined"))
        assert (declined.value.status, declined.value.code) == (402, "generic_decline")
    assert server.counters()["requests"] == 1
    record = memory.get(EffectIdentity.of("default", "order-2", "stripe.charge", 0).key)
    assert record is not None and record.state is State.FAILED


def test_an_async_timeout_after_stripe_applied_is_resent_under_the_same_key(
    server: LocalStripe, memory: MemoryStore
) -> None:
    payments = effects(server, memory, timeout=0.4)
    server.fault("timeout", "/v1/payment_intents", method="POST", seconds=1.0)

    payment = run(payments, charge_in("order-3", 1500))

    counters = server.counters()
    assert payment.status == "succeeded"
    assert (counters["charges"], counters["replays"]) == (1, 1)


def test_a_given_client_serves_the_async_calls_with_its_network_retries_overridden(
    server: LocalStripe, memory: MemoryStore
) -> None:
    """The SDK's default client (requests, with an async fallback) built with 5 network retries:
    the guard's retry is the budget, one request per guard attempt."""
    client = stripe.StripeClient(
        server.api_key, base_addresses={"api": server.api_base}, max_network_retries=5
    )
    guard = Guard(memory, lease=LEASE, sleep=lambda s: None, async_sleep=_no_sleep)
    payments = StripeEffects(
        guard, client, retry=Retry(stop=tenacity.stop_after_attempt(2), wait=tenacity.wait_none())
    )
    server.fault("fail", "/v1/payment_intents", method="POST", status=500, times=1)

    payment = run(payments, charge_in("order-4", 700))

    counters = server.counters()
    assert payment.status == "succeeded"
    assert counters["faults_fired"] == 1 and counters["requests"] == 1 and counters["charges"] == 1


# --------------------------------------------------------------------------- reconciliation


def test_an_async_in_doubt_charge_is_reconciled_from_the_list_endpoint(
    server: LocalStripe, store: IdempotencyStore, clock: FakeClock
) -> None:
    crash_before_record(effects(server, store, guard=crashing_guard(store)), charge_in("order-5", 2500))
    assert server.counters()["charges"] == 1
    after_lease(clock)

    payment = run(effects(server, store), charge_in("order-5", 2500))

    counters = server.counters()
    assert payment.amount_received == 2500
    assert counters["charges"] == 1 and counters["lists"] == 1
    assert counters.get("searches", 0) == 0, "search lags: the list endpoint must have found it"
    record = store.get(EffectIdentity.of("default", "order-5", "stripe.charge", 0).key)
    assert record is not None and record.state is State.SUCCEEDED


def test_an_async_in_doubt_charge_after_the_key_window_is_found_not_charged_again(
    server: LocalStripe, memory: MemoryStore, clock: FakeClock
) -> None:
    crash_before_record(effects(server, memory, guard=crashing_guard(memory)), charge_in("order-6", 3000))
    clock.advance(2 * DAY)
    server.advance_clock(2 * DAY)  # Stripe has forgotten the idempotency key

    payment = run(effects(server, memory), charge_in("order-6", 3000))

    assert payment.amount_received == 3000
    assert server.counters()["charges"] == 1


def test_past_the_key_window_an_async_unknown_charge_is_not_resent(
    server: LocalStripe, memory: MemoryStore, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    crash_before_record(effects(server, memory, guard=crashing_guard(memory)), charge_in("order-7", 3200))
    clock.advance(2 * DAY)
    server.advance_clock(2 * DAY)
    payments = effects(server, memory)

    async def broken(*args: Any, **kwargs: Any) -> Any:
        raise ProviderUnavailable("list failed", "stripe")

    monkeypatch.setattr(payments, "find_payments_async", broken)
    with pytest.raises(OutcomeUnknown, match="window"):
        run(payments, charge_in("order-7", 3200))
    assert server.counters()["charges"] == 1


def test_async_search_is_only_the_fallback_for_a_listing_too_long(
    server: LocalStripe, memory: MemoryStore, clock: FakeClock
) -> None:
    crash_before_record(effects(server, memory, guard=crashing_guard(memory)), charge_in("order-8", 3400))
    client = sdk(server)
    for i in range(101):  # newer PaymentIntents push the lost one off the first page
        client.v1.payment_intents.create({"amount": 100 + i, "currency": "usd"})
    server.advance_clock(7200)  # past the search index's lag
    after_lease(clock)

    payment = run(effects(server, memory, max_list_pages=1), charge_in("order-8", 3400))

    assert payment.amount == 3400
    assert server.counters()["searches"] == 1 and server.counters()["charges"] == 1


# ----------------------------------------------------------------------- capture, refund, undo


def test_async_authorise_capture_and_cancel_once(server: LocalStripe, memory: MemoryStore) -> None:
    payments = effects(server, memory)

    async def body(p: StripeEffects) -> tuple[Payment, Payment, Payment]:
        with scope("order-9"):
            held = await p.charge_async(4000, "usd", payment_method=CARD, capture=False)
            captured = await p.capture_async(held.id)
            other = await p.charge_async(100, "usd", payment_method=CARD, capture=False)
            voided = await p.cancel_async(other.id)
        with scope("order-9"):  # a re-run replays all four
            assert await p.charge_async(4000, "usd", payment_method=CARD, capture=False) == held
            assert await p.capture_async(held.id) == captured
            await p.charge_async(100, "usd", payment_method=CARD, capture=False)
            assert await p.cancel_async(other.id) == voided
        return held, captured, voided

    held, captured, voided = run(payments, body)

    assert (
        held.status == "requires_capture" and captured.status == "succeeded" and voided.status == "canceled"
    )
    counters = server.counters()
    assert (counters["charges"], counters["captures"], counters["cancels"]) == (2, 1, 1)


def test_an_async_in_doubt_refund_is_found_by_the_reconciler(
    server: LocalStripe, memory: MemoryStore, clock: FakeClock
) -> None:
    with scope("order-10"):
        payment = effects(server, memory).charge(5000, "usd", payment_method=CARD)

    async def refund(p: StripeEffects) -> Refund:
        with scope("order-10/refund"):
            return await p.refund_async(payment.id, amount=2000)

    crash_before_record(effects(server, memory, guard=crashing_guard(memory)), refund)
    after_lease(clock)

    found = run(effects(server, memory), refund)

    assert isinstance(found, Refund) and found.amount == 2000 and found.payment_intent == payment.id
    assert server.counters()["refunds"] == 1 and server.counters()["lists"] == 1


def test_async_undo_refunds_a_charge_whose_result_was_never_recorded(
    server: LocalStripe, memory: MemoryStore, clock: FakeClock
) -> None:
    crash_before_record(effects(server, memory, guard=crashing_guard(memory)), charge_in("order-11", 6000))
    after_lease(clock)

    async def undo(p: StripeEffects) -> list[Payment | Refund]:
        with scope("order-11/~compensate"):
            return await p.undo_charges_async("order-11")

    undone = run(effects(server, memory), undo)
    again = run(effects(server, memory), undo)  # the compensation runs again: its refund is replayed
    nothing = run(effects(server, memory), lambda p: p.undo_charges_async("order-never"))

    assert [type(u) for u in undone] == [Refund] and undone == again and nothing == []
    assert server.counters()["refunds"] == 1


@dataclass(frozen=True)
class Trip:
    amount: int


def test_the_async_refund_compensation_undoes_the_charge_of_an_async_saga(
    server: LocalStripe, memory: MemoryStore
) -> None:
    payments = effects(server, memory)
    trip = Saga("trip", input=Trip)

    @trip.step(compensate=refund_compensation(payments, use_async=True))
    async def charge(ctx: StepContext, order: Trip) -> Payment:
        return await payments.charge_async(order.amount, "usd", payment_method=CARD)

    @trip.step(compensate=None, retry=Retry(stop=tenacity.stop_after_attempt(1)))
    async def book(ctx: StepContext, order: Trip) -> None:
        raise ProviderRejected("no seats", "airline", 400)

    runner = SagaRunner(
        MemoryJournal(), payments.guard, sleep=lambda s: None, async_sleep=_no_sleep, renewer=False
    )
    outcome = run(payments, lambda p: runner.arun(trip, "trip-1", Trip(8000)))

    assert outcome.state is SagaState.COMPENSATED, outcome
    assert server.counters()["charges"] == 1 and server.counters()["refunds"] == 1


# ------------------------------------------------------------------------------ a real SIGKILL


def _child(config: dict[str, Any], crash_at: str | None) -> subprocess.CompletedProcess[str]:
    root = CHILD.parent.parent
    path = os.pathsep.join(p for p in (str(root), str(CHILD.parent), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path}
    env.pop(CRASH_ENV, None)
    if crash_at is not None:
        env[CRASH_ENV] = crash_at
    return subprocess.run(
        [sys.executable, str(CHILD), json.dumps(config)],
        check=False, stdin=subprocess.DEVNULL, capture_output=True, text=True, env=env, timeout=60,
    )  # fmt: skip


def test_an_async_charge_killed_after_stripe_applied_is_reconciled_once(
    shared_store_factory: StoreFactory, server: LocalStripe
) -> None:
    """SIGKILL between the charge and its record, in a process running ``charge_async``; a fresh
    process charges the same scope again: one charge at the server, found by the async reconciler."""
    scope_id = f"stripe-async-{uuid.uuid4().hex[:10]}"
    config = {"spec": shared_store_factory.spec(), "url": server.api_base, "scope": scope_id, "lease": 0.5}
    identity = EffectIdentity.of(NAMESPACE, scope_id, "stripe.charge", 0)

    killed = _child(config, "before_complete")
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert server.counters()["charges"] == 1
    record = shared_store_factory.open(clock=None).get(identity.key)
    assert record is not None and record.state is State.IN_PROGRESS

    restarted = _child(config, None)

    assert restarted.returncode == EXIT_OK, restarted.stderr
    payment = json.loads(restarted.stdout.strip().splitlines()[-1])
    counters = server.counters()
    assert payment["status"] == "succeeded"
    assert counters["charges"] == 1 and counters["payment_intents"] == 1 and counters["lists"] == 1
    record = shared_store_factory.open(clock=None).get(identity.key)
    assert record is not None and record.state is State.SUCCEEDED
