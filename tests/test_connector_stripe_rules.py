"""The Stripe connector by Stripe's own rules: paging, keys in progress, 3-D Secure, saved 5xx.

Each test drives the real ``stripe`` SDK against the local server, which behaves here as Stripe
documents it: lists of 100 per page with ``starting_after``, 409 while a key's first request still
runs, a 5xx stored under its key and replayed, ``requires_action`` for 3-D Secure test cards, and an
account with redirect-based payment methods (a confirm without ``return_url`` is refused). Effects
are counted at the server, never in the code under test.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import stripe
import tenacity
from _connectorutil import LEASE, after_lease, crash_before_record, crashing_guard
from conftest import FakeClock

from sagaguard.connectors.errors import ProviderUnavailable, ProviderUnreachable
from sagaguard.connectors.stripe import (
    KEY_WINDOW,
    MetadataRefused,
    Payment,
    PaymentActionRequired,
    StripeEffects,
    refund_compensation,
)
from sagaguard.connectors.stripe import _evidence as evidence
from sagaguard.connectors.stripe import _flows as flows
from sagaguard.connectors.stripe._attempts import ATTEMPT, attempt_key, marker_key
from sagaguard.connectors.testing import LocalStripe
from sagaguard.idempotency import Guard, MemoryStore, OutcomeUnknown, Retry, State, scope
from sagaguard.idempotency.codec import encode_error
from sagaguard.idempotency.effect import NOT_APPLIED, Applied, Unknown
from sagaguard.idempotency.keys import EffectIdentity
from sagaguard.idempotency.records import Record
from sagaguard.idempotency.store import IdempotencyStore
from sagaguard.saga import MemoryJournal, Saga, SagaRunner, SagaState, StepContext
from sagaguard.saga.recovery import recover

CARD = "pm_card_visa"
THREE_DS = "pm_card_threeDSecure2Required"
FAST = Retry(stop=tenacity.stop_after_attempt(3), wait=tenacity.wait_none())
TWO = Retry(stop=tenacity.stop_after_attempt(2), wait=tenacity.wait_none())

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def server() -> Iterator[LocalStripe]:
    with LocalStripe(search_lag=3600, redirect_methods=True) as running:
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
    options.setdefault("timeout", 2.0)
    return StripeEffects(guard, api_key=server.api_key, api_base=server.api_base, **options)


def sdk(server: LocalStripe) -> stripe.StripeClient:
    return stripe.StripeClient(server.api_key, base_addresses={"api": server.api_base}, max_network_retries=0)


def charge_key(scope_name: str) -> str:
    return EffectIdentity.of("default", scope_name, "stripe.charge", 0).key


def until(done: Callable[[], bool]) -> None:
    """Poll the server until ``done`` (the test's 60 s timeout bounds it; no threshold)."""
    while not done():
        time.sleep(0.02)  # a poll interval, not a timing assumption: spares the shared cores


# ------------------------------------------------------------------------- 1. past one page


def bury(server: LocalStripe, n: int = 150) -> None:
    """``n`` newer PaymentIntents in the lookup's window: the lost one is on page 2."""
    client = sdk(server)
    for i in range(n):
        client.v1.payment_intents.create({"amount": 100 + i, "currency": "usd"})


def test_an_in_doubt_charge_is_found_past_the_first_page(
    server: LocalStripe, memory: MemoryStore, clock: FakeClock
) -> None:
    crashing = effects(server, memory, guard=crashing_guard(memory))
    with scope("page-1"):
        crash_before_record(lambda: crashing.charge(4100, "usd", payment_method=CARD))
    bury(server)
    after_lease(clock)

    with scope("page-1"):
        payment = effects(server, memory).charge(4100, "usd", payment_method=CARD)

    counters = server.counters()
    assert payment.amount == 4100
    assert counters["charges"] == 1 and counters.get("replays", 0) == 0, "found by the listing, not re-sent"
    assert counters["lists"] == 2 and counters.get("searches", 0) == 0, "page 2 by starting_after"


def test_the_compensation_refunds_a_lost_charge_past_the_first_page(
    server: LocalStripe, memory: MemoryStore, clock: FakeClock
) -> None:
    crashing = effects(server, memory, guard=crashing_guard(memory))
    with scope("page-2"):
        crash_before_record(lambda: crashing.charge(4200, "usd", payment_method=CARD))
    bury(server)
    after_lease(clock)

    with scope("page-2/~compensate"):
        undone = effects(server, memory).undo_charges("page-2")

    assert [u.amount for u in undone] == [4200]
    assert server.counters()["refunds"] == 1


# ------------------------------------------------------------------- 2. a key still in progress


def test_a_charge_whose_key_is_in_progress_is_not_compensated_as_not_applied(
    server: LocalStripe, memory: MemoryStore
) -> None:
    """The charge's request is still running at Stripe (slow): the client timed out, its re-send got
    409. The compensation lists nothing yet, and must not end "nothing to undo": it raises to be
    retried, and once Stripe finishes, it refunds."""
    server.fault("slow", "/v1/payment_intents", method="POST", seconds=2.0)
    payments = effects(server, memory, timeout=0.3, retry=TWO)
    with scope("busy-1"), pytest.raises((OutcomeUnknown, ProviderUnavailable)):
        payments.charge(4300, "usd", payment_method=CARD)
    record = memory.get(charge_key("busy-1"))
    assert record is not None and record.state is State.IN_DOUBT and evidence.key_in_use(record)
    assert server.counters()["in_use"] == 1

    with scope("busy-1/~compensate"), pytest.raises(ProviderUnavailable, match="in progress"):
        effects(server, memory).undo_charges("busy-1")

    until(lambda: server.counters().get("charges") == 1)  # Stripe finishes the first request
    with scope("busy-1/~compensate"):
        undone = effects(server, memory).undo_charges("busy-1")
    assert [u.amount for u in undone] == [4300]
    assert server.counters()["refunds"] == 1


def test_a_saga_whose_charge_key_is_in_progress_does_not_end_compensated(
    server: LocalStripe, memory: MemoryStore, clock: FakeClock
) -> None:
    """Parked COMPENSATING (retried later by the worker), never COMPENSATED on an empty listing;
    the worker's retry after Stripe finished refunds the charge, once."""
    server.fault("slow", "/v1/payment_intents", method="POST", seconds=2.0)
    payments = effects(server, memory, timeout=0.3, retry=TWO)
    trip = Saga("trip-busy", input=int)

    @trip.step(compensate=refund_compensation(payments), retry=Retry(stop=tenacity.stop_after_attempt(1)))
    def charge(ctx: StepContext, amount: int) -> Payment:
        return payments.charge(amount, "usd", payment_method=CARD)

    journal = MemoryJournal(clock=clock)
    runner = SagaRunner(journal, payments.guard, sleep=lambda s: None, renewer=False)
    outcome = runner.run(trip, "busy-2", 4400)
    assert outcome.state is SagaState.COMPENSATING, outcome  # the charge may still land

    until(lambda: server.counters().get("charges") == 1)  # Stripe finishes the first request
    snapshot = journal.load("busy-2")
    assert snapshot is not None
    clock.advance(max(snapshot.saga.lease_until - clock.now, 0.0) + 0.001)  # the retry is due
    report = recover(journal, payments.guard, trip, sleep=lambda s: None)
    assert report.outcomes["busy-2"].state is SagaState.COMPENSATED
    assert server.counters()["refunds"] == 1


# --------------------------------------------------------------------------------- 3. 3-D Secure


def test_a_charge_that_needs_3ds_is_its_own_outcome_and_replayed(
    server: LocalStripe, memory: MemoryStore
) -> None:
    payments = effects(server, memory)
    with scope("3ds-1"), pytest.raises(PaymentActionRequired) as first:
        payments.charge(4500, "usd", payment_method=THREE_DS)
    with scope("3ds-1"), pytest.raises(PaymentActionRequired) as again:
        payments.charge(4500, "usd", payment_method=THREE_DS)

    assert first.value.payment_intent == again.value.payment_intent
    assert first.value.next_action == "use_stripe_sdk"
    counters = server.counters()
    assert (counters["requests"], counters["actions"], counters.get("charges", 0)) == (1, 1, 0)


def test_the_compensation_cancels_a_payment_waiting_for_3ds(server: LocalStripe, memory: MemoryStore) -> None:
    payments = effects(server, memory)
    trip = Saga("trip-3ds", input=int)

    @trip.step(compensate=refund_compensation(payments), retry=Retry(stop=tenacity.stop_after_attempt(1)))
    def charge(ctx: StepContext, amount: int) -> Payment:
        return payments.charge(amount, "usd", payment_method=THREE_DS)

    runner = SagaRunner(MemoryJournal(), payments.guard, sleep=lambda s: None, renewer=False)
    outcome = runner.run(trip, "3ds-2", 4600)

    assert outcome.state is SagaState.COMPENSATED, outcome
    intents = sdk(server).v1.payment_intents.list({"limit": 10}).data
    assert [i.status for i in intents] == ["canceled"]
    assert server.counters()["cancels"] == 1 and server.counters().get("charges", 0) == 0


def test_an_in_doubt_charge_found_waiting_for_3ds_is_not_charged_again(
    server: LocalStripe, memory: MemoryStore, clock: FakeClock
) -> None:
    crashing = effects(server, memory, guard=crashing_guard(memory))
    with scope("3ds-3"):
        crash_before_record(lambda: crashing.charge(4700, "usd", payment_method=THREE_DS))
    clock.advance(2 * 86_400)  # past the key window: only the reconciler can tell
    server.advance_clock(2 * 86_400)

    with scope("3ds-3"), pytest.raises(PaymentActionRequired):
        effects(server, memory).charge(4700, "usd", payment_method=THREE_DS)
    assert server.counters()["payment_intents"] == 1


# ----------------------------------------------------------------------------- 5. a saved 5xx


def test_a_saved_500_moves_to_a_new_attempt_key_recorded_in_the_ledger(
    server: LocalStripe, store: IdempotencyStore, clock: FakeClock
) -> None:
    memory = store  # every backend: the attempt key is a record of the ledger
    server.fault("error", "/v1/payment_intents", method="POST", status=500)
    payments = effects(server, memory)
    with scope("saved-1"), pytest.raises((OutcomeUnknown, ProviderUnavailable)):
        payments.charge(4800, "usd", payment_method=CARD)
    assert server.counters()["replays"] == 2, "Stripe replays the saved 500 under the key"
    after_lease(clock)

    with scope("saved-1"):
        payment = payments.charge(4800, "usd", payment_method=CARD)
    with scope("saved-1"):
        assert payments.charge(4800, "usd", payment_method=CARD) == payment  # replayed, no request

    counters = server.counters()
    assert payment.status == "succeeded" and counters["charges"] == 1 and counters["replays"] == 2
    identity = EffectIdentity.of("default", "saved-1", "stripe.charge", 0, memory.ledger_id())
    marker = memory.get(EffectIdentity.explicit("default", marker_key(identity.key, 1), ATTEMPT).key)
    assert marker is not None and marker.state is State.SUCCEEDED
    assert attempt_key(identity.provider_key, 1) in (marker.result or "")


def test_a_replay_under_an_older_attempt_key_does_not_move_on_again(
    server: LocalStripe, memory: MemoryStore, clock: FakeClock
) -> None:
    """Attempt key 1 was recorded (and may have been sent: the process died) after key 0's saved
    500: the next resolution re-sends under key 1, never skips to key 2 while 1 may be in flight."""
    server.fault("error", "/v1/payment_intents", method="POST", status=500)
    payments = effects(server, memory)
    with scope("saved-2"), pytest.raises((OutcomeUnknown, ProviderUnavailable)):
        payments.charge(5200, "usd", payment_method=CARD)
    identity = EffectIdentity.of("default", "saved-2", "stripe.charge", 0, memory.ledger_id())
    first_attempt = attempt_key(identity.provider_key, 1)
    payments.guard.run(ATTEMPT, lambda: first_attempt, key=marker_key(identity.key, 1), result_type=str)
    after_lease(clock)

    with scope("saved-2"):
        assert payments.charge(5200, "usd", payment_method=CARD).status == "succeeded"

    second = EffectIdentity.explicit("default", marker_key(identity.key, 2), ATTEMPT).key
    assert memory.get(second) is None and server.counters()["charges"] == 1


# ------------------------------------------------------------------------------------ lower


def test_metadata_with_our_fields_or_past_stripes_limit_is_refused(
    server: LocalStripe, memory: MemoryStore
) -> None:
    payments = effects(server, memory)
    with scope("meta-1"), pytest.raises(MetadataRefused, match="sagaguard_key"):
        payments.charge(100, "usd", payment_method=CARD, metadata={"sagaguard_key": "mine"})
    with scope("meta-1"), pytest.raises(MetadataRefused, match="50"):
        payments.charge(100, "usd", payment_method=CARD, metadata={f"k{i}": "v" for i in range(49)})
    with scope("meta-1"), pytest.raises(MetadataRefused):
        payments.refund("pi_x", metadata={"k" * 41: "v"})
    assert server.counters().get("requests", 0) == 0 and memory.get(charge_key("meta-1")) is None


def test_a_refused_connection_is_not_applied(memory: MemoryStore) -> None:
    with LocalStripe() as gone:
        address = gone.api_base  # a port nobody listens on once it stopped
    payments = StripeEffects(Guard(memory, lease=LEASE, sleep=lambda s: None), api_key="sk_test_x",
                             api_base=address, retry=FAST)  # fmt: skip
    with scope("refused-1"), pytest.raises(ProviderUnreachable):
        payments.charge(100, "usd", payment_method=CARD)
    assert memory.get(charge_key("refused-1")) is None, "nothing was sent: nothing in doubt"


def test_a_confirm_on_an_account_with_redirect_methods(server: LocalStripe, memory: MemoryStore) -> None:
    """Stripe refuses ``confirm=true`` without ``return_url`` where redirect-based methods are on;
    the connector sends ``allow_redirects=never``, or the caller's ``return_url``."""
    with pytest.raises(stripe.InvalidRequestError, match="return_url"):
        sdk(server).v1.payment_intents.create(
            {"amount": 100, "currency": "usd", "payment_method": CARD, "confirm": True}
        )
    payments = effects(server, memory)
    with scope("redirect-1"):
        assert payments.charge(100, "usd", payment_method=CARD).status == "succeeded"
    with scope("redirect-2"):
        paid = payments.charge(100, "usd", payment_method=CARD, return_url="https://shop.example/back")
    assert paid.status == "succeeded" and server.counters()["charges"] == 2


def test_the_search_lag_has_a_margin_over_stripes_worst_case(memory: MemoryStore) -> None:
    payments = StripeEffects(Guard(memory), api_key="sk_test_x")
    assert payments.search_lag > 3600


def _record(age: float, error: BaseException | None = None) -> Record:
    return Record(
        key="k" * 64, namespace="default", scope="s", name="stripe.charge", ordinal=0, fingerprint="f",
        state=State.IN_PROGRESS, token=2, lease_until=age + 30, attempts=2, created_at=0.0,
        updated_at=age, error=None if error is None else encode_error(error),
    )  # fmt: skip


IN_USE = ProviderUnavailable("in use", "stripe", 409, "idempotency_key_in_use")


@pytest.mark.parametrize(
    ("found", "record", "expected"),
    [
        (None, _record(60), Unknown()),
        ([], _record(60), NOT_APPLIED),
        ([], _record(60, IN_USE), Unknown()),
        ([], _record(KEY_WINDOW + 1, IN_USE), NOT_APPLIED),
        ([{"id": "pi_1", "status": "canceled"}], _record(60, IN_USE), NOT_APPLIED),
    ],
    ids=["cannot-tell", "nothing", "key-in-use", "in-use-past-window", "only-canceled"],
)
def test_charge_resolution(found: Any, record: Record, expected: Any) -> None:
    assert flows.charge_resolution(found, record, KEY_WINDOW) == expected


def test_a_decline_found_past_the_key_window_is_said(caplog: pytest.LogCaptureFixture) -> None:
    found = [{"id": "pi_declined", "status": "requires_payment_method"}]
    with caplog.at_level(logging.WARNING, logger="sagaguard.connectors.stripe"):
        assert flows.charge_resolution(found, _record(KEY_WINDOW + 1), KEY_WINDOW) == NOT_APPLIED
    assert "pi_declined" in caplog.text and "afresh" in caplog.text


def test_a_found_payment_is_applied() -> None:
    intent = {"id": "pi_1", "status": "requires_action", "amount": 1, "currency": "usd",
              "next_action": {"type": "use_stripe_sdk"}}  # fmt: skip
    resolution = flows.charge_resolution([intent], _record(60), KEY_WINDOW)
    assert isinstance(resolution, Applied) and resolution.result.next_action == "use_stripe_sdk"


# ------------------------------------------------------------------------- the async twins


def test_async_3ds_saved_500_and_key_in_progress(
    server: LocalStripe, memory: MemoryStore, clock: FakeClock
) -> None:
    """The ``_async`` methods drive the same decisions: 3-D Secure raised and cancelled, a saved 500
    moved to an attempt key, a compensation refusing to trust a key still in progress."""

    async def main() -> None:
        payments = effects(server, memory)
        try:
            with scope("async-3ds"), pytest.raises(PaymentActionRequired):
                await payments.charge_async(4900, "usd", payment_method=THREE_DS)
            with scope("async-3ds/~compensate"):
                cancelled = await payments.undo_charges_async("async-3ds")
            assert [c.status for c in cancelled] == ["canceled"]

            server.fault("error", "/v1/payment_intents", method="POST", status=500)
            with scope("async-500"), pytest.raises((OutcomeUnknown, ProviderUnavailable)):
                await payments.charge_async(5000, "usd", payment_method=CARD)
            after_lease(clock)
            with scope("async-500"):
                paid = await payments.charge_async(5000, "usd", payment_method=CARD)
            assert paid.status == "succeeded"

            server.fault("slow", "/v1/payment_intents", method="POST", seconds=2.0)
            busy = effects(server, memory, timeout=0.3, retry=TWO)
            try:
                with scope("async-busy"), pytest.raises((OutcomeUnknown, ProviderUnavailable)):
                    await busy.charge_async(5100, "usd", payment_method=CARD)
                with scope("async-busy/~compensate"), pytest.raises(ProviderUnavailable, match="in progress"):
                    await payments.undo_charges_async("async-busy")
            finally:
                await busy.aclose()
        finally:
            await payments.aclose()

    asyncio.run(main())
    until(lambda: server.counters().get("charges") == 2)  # the slow charge lands; none other
    counters = server.counters()
    assert (counters["cancels"], counters["charges"], counters.get("refunds", 0)) == (1, 2, 0)
