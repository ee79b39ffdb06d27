"""The Stripe connector against ``localstripe`` (PyPI), a Stripe fake that this project did not write.

The project's own server (``sagaguard.connectors.testing.LocalStripe``) is written from Stripe's
docs by the same hands as the connector; this module checks the connector against a second,
independent reading of Stripe: localstripe, run as its own process on 127.0.0.1 on a free port.

What localstripe lacks, and so what this module cannot check (docs/connectors.md says the same):

- **idempotency keys**: it ignores ``Idempotency-Key``, so a re-send after a lost answer makes a
  second PaymentIntent (:func:`test_localstripe_ignores_idempotency_keys` shows it). Crash and
  re-send paths are tested against the project's server, which keeps keys as Stripe does;
- **listing by ``created``**: it refuses the filter (400), so the reconciler cannot list there;
- ``automatic_payment_methods``: it refuses the parameter; the charges here name
  ``payment_method_types=["card"]``;
- ``amount_received``: it leaves it 0 on a succeeded PaymentIntent.

Skipped, with the reason, where localstripe is not installed or does not start; under ``CI=true`` a
missing package is a failure (it is in the ``dev`` extra).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import pytest
import stripe
import tenacity
from _localservers import DidNotStart, localstripe_installed, localstripe_server

from sagaguard.connectors.stripe import PaymentActionRequired, Refund, StripeEffects
from sagaguard.idempotency import Guard, MemoryStore, Retry, scope

pytestmark = pytest.mark.timeout(60)

CARD_TYPES = ["card"]
FAST = Retry(stop=tenacity.stop_after_attempt(2), wait=tenacity.wait_none())
API_KEY = "sk_test_sagaguard_localstripe"


@pytest.fixture(scope="module")
def localstripe(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """localstripe's address, in its own process (ended when the module is done)."""
    if not localstripe_installed():
        reason = "localstripe is not installed (pip install -e '.[dev]')"
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    with contextlib.ExitStack() as stack:
        try:
            url = stack.enter_context(localstripe_server(tmp_path_factory.mktemp("localstripe")))
        except DidNotStart as error:
            pytest.skip(str(error))
        yield url


@pytest.fixture
def memory() -> MemoryStore:
    return MemoryStore()


def sdk(url: str) -> stripe.StripeClient:
    return stripe.StripeClient(API_KEY, base_addresses={"api": url}, max_network_retries=0)


def effects(url: str, store: MemoryStore) -> StripeEffects:
    return StripeEffects(Guard(store, sleep=lambda s: None), api_key=API_KEY, api_base=url, retry=FAST)


def intents(url: str, payment_intent_ids: set[str]) -> list[Any]:
    """The PaymentIntents with these ids (localstripe keeps every test's objects)."""
    listed = sdk(url).v1.payment_intents.list({"limit": 100}).auto_paging_iter()
    return [i for i in listed if i.id in payment_intent_ids]


def test_charge_once_and_a_rerun_replays_from_the_ledger(localstripe: str, memory: MemoryStore) -> None:
    payments = effects(localstripe, memory)
    with scope("ls-1"):
        first = payments.charge(1200, "usd", payment_method="pm_card_visa", payment_method_types=CARD_TYPES)
    with scope("ls-1"):
        again = payments.charge(1200, "usd", payment_method="pm_card_visa", payment_method_types=CARD_TYPES)

    assert first == again and first.status == "succeeded"  # (localstripe leaves amount_received 0)
    stored = sdk(localstripe).v1.payment_intents.retrieve(first.id)
    assert stored.metadata["sagaguard_key"] == first.effect_key


def test_refund_once(localstripe: str, memory: MemoryStore) -> None:
    payments = effects(localstripe, memory)
    with scope("ls-2"):
        paid = payments.charge(1300, "usd", payment_method="pm_card_visa", payment_method_types=CARD_TYPES)
    with scope("ls-2/refund"):
        refund = payments.refund(paid.id)
    with scope("ls-2/refund"):
        assert payments.refund(paid.id) == refund

    assert isinstance(refund, Refund) and refund.amount == 1300
    refunds = sdk(localstripe).v1.refunds.list({"payment_intent": paid.id, "limit": 100}).data
    assert [r.id for r in refunds] == [refund.id]


def test_an_authorisation_is_voided_by_the_compensation(localstripe: str, memory: MemoryStore) -> None:
    payments = effects(localstripe, memory)
    with scope("ls-3"):
        held = payments.charge(
            1400, "usd", payment_method="pm_card_visa", capture=False, payment_method_types=CARD_TYPES
        )
    with scope("ls-3/~compensate"):
        undone = payments.undo_charges("ls-3", result=held)

    assert held.status == "requires_capture" and [u.status for u in undone] == ["canceled"]


def test_3ds_is_its_own_outcome_and_cancelled_by_the_compensation(
    localstripe: str, memory: MemoryStore
) -> None:
    card = {"number": "4000002760003184", "exp_month": 12, "exp_year": 2030, "cvc": "123"}
    method = sdk(localstripe).v1.payment_methods.create({"type": "card", "card": card})  # type: ignore[typeddict-item]
    payments = effects(localstripe, memory)
    with scope("ls-4"), pytest.raises(PaymentActionRequired) as needs:
        payments.charge(1500, "usd", payment_method=method.id, payment_method_types=CARD_TYPES)
    with scope("ls-4/~compensate"):
        undone = payments.undo_charges("ls-4", result=None)

    assert [u.status for u in undone] == ["canceled"]
    assert [i.status for i in intents(localstripe, {needs.value.payment_intent})] == ["canceled"]


def test_localstripe_ignores_idempotency_keys(localstripe: str) -> None:
    """Why crash tests run against the project's server: the same key makes a second PaymentIntent
    here, where Stripe replays the first."""
    params: Any = {"amount": 100, "currency": "usd", "payment_method": "pm_card_visa", "confirm": True,
                   "payment_method_types": CARD_TYPES}  # fmt: skip
    client = sdk(localstripe)
    first = client.v1.payment_intents.create(params, {"idempotency_key": "same"})
    second = client.v1.payment_intents.create(params, {"idempotency_key": "same"})
    assert first.id != second.id
