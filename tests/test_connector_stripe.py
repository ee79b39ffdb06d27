"""The Stripe connector (connectors/stripe/__init__.py): the real ``stripe`` SDK against the local server.

The server (``sagaguard.connectors.testing.LocalStripe``) runs in its own process with Stripe's idempotency
semantics, fault injection and counters; its search lags by an hour (as Stripe's may), so every
reconciliation here has to come from the list endpoints unless a test says otherwise. A "crash" is
the state a SIGKILL leaves (the charge applied, its record never written), reached in-process with a
store that raises at ``before_complete``; the real SIGKILLs are in test_connector_crash.py.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import stripe
import tenacity
from _connectorutil import LEASE, after_lease, crash_before_record, crashing_guard
from conftest import FakeClock

from sagaguard.connectors.errors import (
    ProviderKeyConflict,
    ProviderRejected,
    ProviderUnavailable,
    classify,
)
from sagaguard.connectors.stripe import (
    METADATA_KEY,
    Payment,
    Refund,
    StripeEffects,
    map_error,
    refund_compensation,
)
from sagaguard.connectors.testing import LocalStripe
from sagaguard.idempotency import (
    Disposition,
    Guard,
    KeyConflict,
    MemoryStore,
    OutcomeUnknown,
    Retry,
    State,
    scope,
)
from sagaguard.idempotency.keys import EffectIdentity
from sagaguard.idempotency.store import IdempotencyStore
from sagaguard.saga import MemoryJournal, Saga, SagaRunner, SagaState, StepContext

DAY = 86_400.0
CARD = "pm_card_visa"
FAST = Retry(stop=tenacity.stop_after_attempt(3), wait=tenacity.wait_none())

pytestmark = pytest.mark.timeout(60)


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


def effects(server: LocalStripe, store: IdempotencyStore, **options: Any) -> StripeEffects:
    guard = options.pop("guard", None) or Guard(store, lease=LEASE, sleep=lambda s: None)
    options.setdefault("retry", FAST)
    return StripeEffects(guard, api_key=server.api_key, api_base=server.api_base, timeout=2.0, **options)


def sdk(server: LocalStripe) -> stripe.StripeClient:
    return stripe.StripeClient(server.api_key, base_addresses={"api": server.api_base}, max_network_retries=0)


# ------------------------------------------------------------------------------------- charging


def test_charge_runs_once_and_a_rerun_replays(server: LocalStripe, store: IdempotencyStore) -> None:
    payments = effects(server, store)
    with scope("order-1"):
        first = payments.charge(1999, "eur", payment_method=CARD)
    with scope("order-1"):
        again = payments.charge(1999, "eur", payment_method=CARD)

    assert again == first
    assert first.status == "succeeded" and first.amount_received == 1999
    assert server.counters()["charges"] == 1
    assert server.counters()["requests"] == 1, "the replay must not call Stripe"


def test_the_payment_intent_carries_the_provider_key_and_the_effect_identity(
    server: LocalStripe, memory: MemoryStore
) -> None:
    payments = effects(server, memory)
    with scope("order-2"):
        payment = payments.charge(500, "usd", payment_method=CARD, metadata={"order": "2"})
    identity = EffectIdentity.of("default", "order-2", "stripe.charge", 0, memory.ledger_id())

    intent = sdk(server).v1.payment_intents.retrieve(payment.id)
    assert intent.metadata.to_dict() == {
        "order": "2",
        METADATA_KEY: identity.search_key,
        "sagaguard_effect": "stripe.charge",
    }
    # The same request under the effect's provider key is Stripe's replay, not a second charge.
    params: Any = {
        "amount": 500, "currency": "usd", "payment_method": CARD, "confirm": True,
        "capture_method": "automatic", "metadata": intent.metadata.to_dict(),
        "automatic_payment_methods": {"enabled": True, "allow_redirects": "never"},
    }  # fmt: skip
    replay = sdk(server).v1.payment_intents.create(params, {"idempotency_key": identity.provider_key})
    assert replay.id == payment.id
    assert server.counters()["replays"] == 1 and server.counters()["charges"] == 1


def test_the_sdk_network_retries_are_set_on_every_request(server: LocalStripe, memory: MemoryStore) -> None:
    """A client built with 5 network retries still sends one request per guard attempt."""
    client = stripe.StripeClient(
        server.api_key, base_addresses={"api": server.api_base}, max_network_retries=5
    )
    guard = Guard(memory, lease=LEASE, sleep=lambda s: None)
    payments = StripeEffects(
        guard, client, retry=Retry(stop=tenacity.stop_after_attempt(2), wait=tenacity.wait_none())
    )
    server.fault("fail", "/v1/payment_intents", method="POST", status=500, times=1)

    with scope("order-3"):
        payment = payments.charge(700, "usd", payment_method=CARD)

    assert payment.status == "succeeded"
    counters = server.counters()
    assert counters["faults_fired"] == 1
    assert counters["requests"] == 1, "the injected 500 is answered before the app; one request reached it"
    assert counters["charges"] == 1


def test_card_declined_is_not_applied_recorded_and_replayed(server: LocalStripe, memory: MemoryStore) -> None:
    payments = effects(server, memory)
    with scope("order-4"), pytest.raises(ProviderRejected) as declined:
        payments.charge(900, "usd", payment_method="pm_card_chargeDeclined")
    assert (declined.value.status, declined.value.code) == (402, "generic_decline")
    assert isinstance(declined.value.__cause__, stripe.CardError)

    with scope("order-4"), pytest.raises(ProviderRejected) as replayed:
        payments.charge(900, "usd", payment_method="pm_card_chargeDeclined")
    assert replayed.value.code == "generic_decline" and replayed.value.__cause__ is None
    assert server.counters()["requests"] == 1
    record = memory.get(EffectIdentity.of("default", "order-4", "stripe.charge", 0).key)
    assert record is not None and record.state is State.FAILED


def test_validation_error_is_not_applied(server: LocalStripe, memory: MemoryStore) -> None:
    payments = effects(server, memory)
    with scope("order-5"), pytest.raises(ProviderRejected) as invalid:
        payments.charge(0, "usd", payment_method=CARD)
    assert (invalid.value.status, invalid.value.code) == (400, "amount_too_small")
    assert not invalid.value.retryable
    assert server.counters().get("charges", 0) == 0


def test_idempotency_error_is_a_key_conflict(server: LocalStripe, memory: MemoryStore) -> None:
    """Another program used the effect's provider key with other parameters first."""
    identity = EffectIdentity.of("default", "order-6", "stripe.charge", 0, memory.ledger_id())
    other: Any = {"amount": 1, "currency": "usd", "payment_method": CARD, "confirm": True}
    sdk(server).v1.payment_intents.create(other, {"idempotency_key": identity.provider_key})

    with scope("order-6"), pytest.raises(ProviderKeyConflict) as conflict:
        effects(server, memory).charge(1200, "usd", payment_method=CARD)
    assert isinstance(conflict.value, KeyConflict)
    assert conflict.value.key == identity.provider_key
    assert server.counters()["idempotency_errors"] == 1 and server.counters()["charges"] == 1


def test_a_timeout_after_stripe_applied_is_resent_under_the_same_key(
    server: LocalStripe, memory: MemoryStore
) -> None:
    payments = StripeEffects(
        Guard(memory, lease=LEASE, sleep=lambda s: None), api_key=server.api_key, api_base=server.api_base,
        timeout=0.4, retry=FAST,
    )  # fmt: skip
    server.fault("timeout", "/v1/payment_intents", method="POST", seconds=1.0)

    with scope("order-7"):
        payment = payments.charge(1500, "usd", payment_method=CARD)

    counters = server.counters()
    assert payment.status == "succeeded"
    assert (counters["charges"], counters["replays"]) == (1, 1)


def test_409_in_use_is_ambiguous_and_retried_until_the_first_answer(
    server: LocalStripe, memory: MemoryStore
) -> None:
    """The first request is still running at Stripe (slow) when the client gives up and re-sends:
    Stripe answers 409 ``idempotency_key_in_use`` until the first finishes, then replays it."""
    retry = Retry(stop=tenacity.stop_after_attempt(20), wait=tenacity.wait_fixed(0.1))
    payments = StripeEffects(
        Guard(memory, lease=LEASE), api_key=server.api_key, api_base=server.api_base, timeout=0.3, retry=retry
    )
    server.fault("slow", "/v1/payment_intents", method="POST", seconds=1.0)

    with scope("order-8"):
        payment = payments.charge(1600, "usd", payment_method=CARD)

    counters = server.counters()
    assert payment.status == "succeeded"
    assert counters["in_use"] >= 1 and counters["replays"] == 1 and counters["charges"] == 1


def test_rate_limited_is_retried_then_released(server: LocalStripe, memory: MemoryStore) -> None:
    payments = effects(server, memory)
    server.fault("fail", "/v1/payment_intents", method="POST", status=429, times=3)
    with scope("order-9"), pytest.raises(ProviderRejected) as limited:
        payments.charge(100, "usd", payment_method=CARD)
    assert limited.value.retryable and limited.value.status == 429
    assert memory.get(EffectIdentity.of("default", "order-9", "stripe.charge", 0).key) is None

    with scope("order-9"):
        assert payments.charge(100, "usd", payment_method=CARD).status == "succeeded"


# ------------------------------------------------------------------------------ reconciliation


def test_in_doubt_charge_is_reconciled_from_the_list_endpoint(
    server: LocalStripe, store: IdempotencyStore, clock: FakeClock
) -> None:
    crashing = effects(server, store, guard=crashing_guard(store))
    with scope("order-10"):
        crash_before_record(lambda: crashing.charge(2500, "usd", payment_method=CARD))
    assert server.counters()["charges"] == 1
    after_lease(clock)

    with scope("order-10"):
        payment = effects(server, store).charge(2500, "usd", payment_method=CARD)

    counters = server.counters()
    assert payment.amount_received == 2500
    assert counters["charges"] == 1 and counters["lists"] == 1
    assert counters.get("searches", 0) == 0, "search lags: the list endpoint must have found it"
    record = store.get(EffectIdentity.of("default", "order-10", "stripe.charge", 0).key)
    assert record is not None and record.state is State.SUCCEEDED


def test_in_doubt_charge_after_the_key_window_is_found_not_charged_again(
    server: LocalStripe, memory: MemoryStore, clock: FakeClock
) -> None:
    crashing = effects(server, memory, guard=crashing_guard(memory))
    with scope("order-11"):
        crash_before_record(lambda: crashing.charge(3000, "usd", payment_method=CARD))
    clock.advance(2 * DAY)  # the store's clock: the record is two days old
    server.advance_clock(2 * DAY)  # Stripe has forgotten the idempotency key

    with scope("order-11"):
        payment = effects(server, memory).charge(3000, "usd", payment_method=CARD)

    assert payment.amount_received == 3000
    assert server.counters()["charges"] == 1


def test_in_doubt_charge_that_never_reached_stripe_runs_after_the_window(
    server: LocalStripe, memory: MemoryStore, clock: FakeClock
) -> None:
    crashing = effects(server, memory, guard=crashing_guard(memory, at="after_claim"))
    with scope("order-12"):
        crash_before_record(lambda: crashing.charge(3100, "usd", payment_method=CARD))
    clock.advance(2 * DAY)
    server.advance_clock(2 * DAY)

    with scope("order-12"):
        payment = effects(server, memory).charge(3100, "usd", payment_method=CARD)

    assert payment.status == "succeeded"
    assert server.counters()["charges"] == 1


def test_past_the_key_window_an_unknown_charge_is_not_resent(
    server: LocalStripe, memory: MemoryStore, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reconciler cannot tell (Stripe's list fails) and the key is gone: at most once."""
    crashing = effects(server, memory, guard=crashing_guard(memory))
    with scope("order-13"):
        crash_before_record(lambda: crashing.charge(3200, "usd", payment_method=CARD))
    clock.advance(2 * DAY)
    server.advance_clock(2 * DAY)
    payments = effects(server, memory)

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise ProviderUnavailable("list failed", "stripe")

    monkeypatch.setattr(payments, "find_payments", broken)
    with scope("order-13"), pytest.raises(OutcomeUnknown, match="window"):
        payments.charge(3200, "usd", payment_method=CARD)
    assert server.counters()["charges"] == 1


def test_within_the_key_window_an_unknown_charge_is_resent_and_absorbed(
    server: LocalStripe, memory: MemoryStore, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    crashing = effects(server, memory, guard=crashing_guard(memory))
    with scope("order-14"):
        crash_before_record(lambda: crashing.charge(3300, "usd", payment_method=CARD))
    after_lease(clock)
    payments = effects(server, memory)
    monkeypatch.setattr(payments, "find_payments", lambda *a, **k: None)  # "cannot tell yet"

    with scope("order-14"):
        payment = payments.charge(3300, "usd", payment_method=CARD)
    assert payment.status == "succeeded"
    assert (server.counters()["charges"], server.counters()["replays"]) == (1, 1)


def test_search_is_only_the_fallback_for_a_listing_too_long(
    server: LocalStripe, memory: MemoryStore, clock: FakeClock
) -> None:
    crashing = effects(server, memory, guard=crashing_guard(memory))
    with scope("order-15"):
        crash_before_record(lambda: crashing.charge(3400, "usd", payment_method=CARD))
    client = sdk(server)
    for i in range(101):  # newer PaymentIntents push the lost one off the first page
        client.v1.payment_intents.create({"amount": 100 + i, "currency": "usd"})
    server.advance_clock(7200)  # past the search index's lag
    after_lease(clock)

    with scope("order-15"):
        payment = effects(server, memory, max_list_pages=1).charge(3400, "usd", payment_method=CARD)

    assert payment.amount == 3400
    assert server.counters()["searches"] == 1 and server.counters()["charges"] == 1


# ------------------------------------------------------------------------ capture, refund, undo


def test_authorise_then_capture_once(server: LocalStripe, memory: MemoryStore) -> None:
    payments = effects(server, memory)
    with scope("order-16"):
        held = payments.charge(4000, "usd", payment_method=CARD, capture=False)
        captured = payments.capture(held.id)
    with scope("order-16"):
        assert payments.charge(4000, "usd", payment_method=CARD, capture=False) == held
        assert payments.capture(held.id) == captured
    assert held.status == "requires_capture" and held.amount_capturable == 4000
    assert captured.status == "succeeded" and captured.amount_received == 4000
    assert server.counters()["captures"] == 1


def test_refund_once_and_an_in_doubt_refund_is_found(
    server: LocalStripe, memory: MemoryStore, clock: FakeClock
) -> None:
    payments = effects(server, memory)
    with scope("order-17"):
        payment = payments.charge(5000, "usd", payment_method=CARD)
    crashing = effects(server, memory, guard=crashing_guard(memory))
    with scope("order-17/refund"):
        crash_before_record(lambda: crashing.refund(payment.id, amount=2000))
    after_lease(clock)

    with scope("order-17/refund"):
        refund = payments.refund(payment.id, amount=2000)

    assert isinstance(refund, Refund) and refund.amount == 2000
    assert server.counters()["refunds"] == 1


def test_undo_refunds_a_charge_whose_result_was_never_recorded(
    server: LocalStripe, memory: MemoryStore, clock: FakeClock
) -> None:
    crashing = effects(server, memory, guard=crashing_guard(memory))
    with scope("order-18"):
        crash_before_record(lambda: crashing.charge(6000, "usd", payment_method=CARD))
    after_lease(clock)
    payments = effects(server, memory)

    with scope("order-18/~compensate"):
        undone = payments.undo_charges("order-18")
    with scope("order-18/~compensate"):  # the compensation runs again: its refund is replayed
        again = payments.undo_charges("order-18")

    assert [type(u) for u in undone] == [Refund] and undone == again
    assert server.counters()["refunds"] == 1


def test_undo_voids_an_authorisation_and_skips_what_never_ran(
    server: LocalStripe, memory: MemoryStore
) -> None:
    payments = effects(server, memory)
    with scope("order-19"):
        held = payments.charge(7000, "usd", payment_method=CARD, capture=False)
    with scope("order-19/~compensate"):
        undone = payments.undo_charges("order-19", result=held)
        nothing = payments.undo_charges("order-never")

    assert [u.status for u in undone] == ["canceled"] and nothing == []
    assert server.counters()["cancels"] == 1 and server.counters().get("refunds", 0) == 0


@dataclass(frozen=True)
class Trip:
    amount: int


def test_refund_compensation_undoes_the_charge_when_a_later_step_fails(
    server: LocalStripe, memory: MemoryStore
) -> None:
    payments = effects(server, memory)
    trip = Saga("trip", input=Trip)

    @trip.step(compensate=refund_compensation(payments))
    def charge(ctx: StepContext, order: Trip) -> Payment:
        return payments.charge(order.amount, "usd", payment_method=CARD)

    @trip.step(compensate=None, retry=Retry(stop=tenacity.stop_after_attempt(1)))
    def book(ctx: StepContext, order: Trip) -> None:
        raise ProviderRejected("no seats", "airline", 400)

    runner = SagaRunner(MemoryJournal(), payments.guard, sleep=lambda s: None, renewer=False)
    outcome = runner.run(trip, "trip-1", Trip(8000))

    assert outcome.state is SagaState.COMPENSATED, outcome
    assert server.counters()["charges"] == 1 and server.counters()["refunds"] == 1


# ------------------------------------------------------------------------------- error mapping


def _api_error(status: int, code: str | None = None) -> stripe.StripeError:
    return stripe.APIError("boom", http_status=status, code=code)


@pytest.mark.parametrize(
    ("exc", "expected", "disposition"),
    [
        (
            stripe.CardError("declined", None, "card_declined", http_status=402),
            ProviderRejected,
            Disposition.PERMANENT,
        ),
        (
            stripe.InvalidRequestError("bad", "amount", http_status=400),
            ProviderRejected,
            Disposition.PERMANENT,
        ),
        (stripe.AuthenticationError("key", http_status=401), ProviderRejected, Disposition.RETRYABLE),
        (stripe.PermissionError("no", http_status=403), ProviderRejected, Disposition.RETRYABLE),
        (stripe.RateLimitError("slow down", http_status=429), ProviderRejected, Disposition.RETRYABLE),
        (
            stripe.IdempotencyError("other params", http_status=400),
            ProviderKeyConflict,
            Disposition.PERMANENT,
        ),
        (_api_error(409, "idempotency_key_in_use"), ProviderUnavailable, Disposition.AMBIGUOUS),
        (_api_error(500), ProviderUnavailable, Disposition.AMBIGUOUS),
        (_api_error(503), ProviderUnavailable, Disposition.AMBIGUOUS),
        (stripe.APIConnectionError("reset"), ProviderUnavailable, Disposition.AMBIGUOUS),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, Exception) else str(v),
)
def test_error_mapping(exc: stripe.StripeError, expected: type[Exception], disposition: Disposition) -> None:
    mapped = map_error(exc, "sg1p_k")
    assert type(mapped) is expected
    assert classify(mapped) is disposition
    rebuilt = type(mapped)(*mapped.args)  # how the guard replays a recorded failure
    assert str(rebuilt) == str(mapped) and rebuilt.args == mapped.args


def test_the_local_server_replays_and_refuses_like_stripe(server: LocalStripe) -> None:
    """The server's own contract, through the SDK: replay, 400 on other parameters, key expiry."""
    client = sdk(server)
    params: Any = {"amount": 100, "currency": "usd", "payment_method": CARD, "confirm": True}
    first = client.v1.payment_intents.create(params, {"idempotency_key": "k-1"})
    assert client.v1.payment_intents.create(params, {"idempotency_key": "k-1"}).id == first.id
    with pytest.raises(stripe.IdempotencyError):
        client.v1.payment_intents.create({**params, "amount": 101}, {"idempotency_key": "k-1"})
    server.advance_clock(DAY + 1)
    assert client.v1.payment_intents.create(params, {"idempotency_key": "k-1"}).id != first.id
    started = time.perf_counter()
    found = client.v1.payment_intents.search({"query": f"metadata['{METADATA_KEY}']:'nothing'"})
    assert found.data == [] and time.perf_counter() - started < 5
