"""Stripe as guarded effects: charge, capture, cancel and refund happen once, whatever crashes.

::

    payments = StripeEffects(guard, api_key=os.environ["STRIPE_KEY"])

    with scope("order-42"):
        payment = payments.charge(1999, "eur", payment_method="pm_card_visa")   # once
        payments.refund(payment.id)                                             # once

Every call is a guarded effect (:class:`~sagaguard.idempotency.guard.Guard`) with:

- **the provider key** (``Idempotency-Key``) derived from the effect key, so a re-send after a
  lost answer is absorbed by Stripe within its key window (24 hours);
- **the effect's identity in the object's metadata** (``sagaguard_key``: the effect key, a hash;
  ``sagaguard_effect``: its name), so the object can be found again after the window;
- **the SDK's own network retries set to 0** on every request (``network_retries=``), so the
  guard's retry budget is the only one and attempts are never multiplied;
- **the error mapping** of :func:`map_error`: card and validation errors and refused connections
  are *not applied*; other connection errors, timeouts, 5xx and 409 ``idempotency_key_in_use``
  are *ambiguous*; ``IdempotencyError`` is a :class:`~sagaguard.connectors.errors.ProviderKeyConflict`;
- **customer action as its own outcome**: a PaymentIntent left ``requires_action`` (3-D Secure)
  raises :class:`PaymentActionRequired`, and the compensation cancels it;
- **a reconciler** that settles an in-doubt call by asking Stripe: the list endpoints, filtered by
  creation time, paged by ``starting_after`` and matched on metadata (read-after-write
  consistent), with search only as a fallback (it lags); an empty listing proves nothing while the
  key was last seen in progress (409), and a key stuck on a replayed 5xx moves to a new attempt
  key recorded in the ledger;
- **a compensation**: :meth:`StripeEffects.undo_charges` refunds (or voids) whatever a charge
  effect made, found by its identity even when the charge's result was never recorded;
  :func:`refund_compensation` is that as a saga step compensation.

Every method has an async twin with the SDK's suffix (``charge_async``, ``refund_async``,
``undo_charges_async``, ``reconcile_charge_async``, ...) on the SDK's async API: the same effect,
key and record, so a charge made by one is replayed by the other. The requests, the error mapping
and the reconciling decisions are written once (:mod:`sagaguard.connectors.stripe._flows`); the sync and async
methods only drive them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Literal, Protocol, TypeVar, overload

import stripe

from sagaguard.connectors.stripe import _attempts as attempts
from sagaguard.connectors.stripe import _evidence as evidence
from sagaguard.connectors.stripe import _flows as flows
from sagaguard.connectors.stripe._async import AsyncStripeMethods
from sagaguard.connectors.stripe._errors import MetadataRefused, PaymentActionRequired
from sagaguard.connectors.stripe._mapping import map_error
from sagaguard.connectors.stripe._objects import (
    CANCEL,
    CHARGE,
    KEY_WINDOW,
    METADATA_KEY,
    Payment,
    Refund,
    Resolution,
)
from sagaguard.idempotency.effect import NotAppliedResolution, ReconcileRequest
from sagaguard.idempotency.effect import current_effect as _current_effect
from sagaguard.idempotency.keys import EffectIdentity

__all__ = [
    "CHARGE",
    "KEY_WINDOW",
    "METADATA_KEY",
    "MetadataRefused",
    "Payment",
    "PaymentActionRequired",
    "Refund",
    "StripeEffects",
    "map_error",
    "refund_compensation",
]

R = TypeVar("R", Payment, Refund)


class _HasStepScope(Protocol):
    @property
    def step_scope(self) -> str: ...


class StripeEffects(AsyncStripeMethods):
    """Stripe's money-moving calls as guarded effects (charge, capture, cancel, refund).

    Each method runs as one effect in the current scope (``with scope(...)``, a saga step) or under
    ``key=``; a re-run of the scope replays the recorded result instead of calling Stripe. Each has
    an ``_async`` twin (``await payments.charge_async(...)``) for async code.

    Args:
        guard: the guard the effects run under.
        client: a ``stripe.StripeClient``, used by the sync and the async methods (its HTTP client
            needs async support for the latter: the SDK's default has it); by default one is built
            from ``api_key`` / ``api_base`` (``requests`` for sync calls, and at the first async
            call, httpx's async client, which :meth:`aclose` closes).
        api_key: the secret key, when ``client`` is not given.
        api_base: another API address (the local test server), when ``client`` is not given.
        timeout: seconds per HTTP request, when ``client`` is not given.
        network_retries: the SDK's own retries, set on every request (default 0: the guard's
            ``retry`` is the only budget; re-sends carry the same idempotency key).
        retry: the guard's retry budget for ambiguous and rate-limited calls.
        key_window: seconds a re-send under the same key is trusted (:data:`KEY_WINDOW`); older
            in-doubt calls are settled only by the reconciler or an operator.
        search_margin: seconds before the record's creation that the reconciler lists from
            (clock skew between the store and Stripe).
        max_list_pages: pages of 100 the reconciler lists before it falls back to search.
        search_lag: seconds after which search is trusted to be complete (default two hours:
            Stripe's index lags up to an hour in outages, and an hour is left as margin); a search
            miss on a younger record is "unknown".
    """

    # -- effects --------------------------------------------------------------------------------

    def charge(
        self,
        amount: int,
        currency: str,
        *,
        payment_method: str,
        customer: str | None = None,
        capture: bool = True,
        description: str | None = None,
        metadata: Mapping[str, str] | None = None,
        return_url: str | None = None,
        payment_method_types: Sequence[str] | None = None,
        key: str | None = None,
    ) -> Payment:
        """Create and confirm a PaymentIntent (one request, ``confirm=true``): the effect ``stripe.charge``.

        Without ``return_url`` or ``payment_method_types`` the PaymentIntent excludes
        redirect-based payment methods (``automatic_payment_methods[allow_redirects]=never``), which
        Stripe requires of a confirm without a return address; cards that need 3-D Secure still
        work, through :class:`PaymentActionRequired`.

        Args:
            amount: in the currency's smallest unit.
            currency: three-letter ISO code.
            payment_method: the PaymentMethod to charge.
            customer: the Customer, if any (also narrows the reconciler's listing).
            capture: False authorises only (``capture_method=manual``); :meth:`capture` later.
            description: shown in the dashboard.
            metadata: your own metadata (up to 48 keys); ``sagaguard_key`` and ``sagaguard_effect``
                are added.
            return_url: where a redirect-based payment method returns the customer.
            payment_method_types: the method types allowed (``["card"]``) instead of
                ``automatic_payment_methods`` (servers without it, such as localstripe).
            key: an explicit effect key instead of scope + ordinal.

        Raises:
            PaymentActionRequired: the PaymentIntent waits for the customer (3-D Secure): not
                paid; recorded, replayed as this error, cancelled by the charge's compensation.
            MetadataRefused: ``metadata`` uses the connector's fields or breaks Stripe's limits
                (nothing sent).
            ProviderRejected: declined or invalid (not applied; recorded and replayed).
            ProviderKeyConflict: the idempotency key was used with other parameters.
            OutcomeUnknown: the charge may have happened and nothing could settle it yet.
        """
        request = flows.ChargeRequest(
            amount, currency, payment_method, customer, capture, description, metadata, return_url,
            None if payment_method_types is None else tuple(payment_method_types),
        )  # fmt: skip
        return flows.delivered(self._write(request.write(), key, self.reconcile_charge))

    def capture(self, payment_intent: str, *, amount: int | None = None, key: str | None = None) -> Payment:
        """Capture an authorised PaymentIntent: the effect ``stripe.capture``."""
        return self._write(flows.capture(payment_intent, amount), key, self._reconcile_status("succeeded"))

    def cancel(self, payment_intent: str, *, key: str | None = None) -> Payment:
        """Cancel a PaymentIntent (void an authorisation): the effect ``stripe.cancel``."""
        return self._write(flows.cancel(payment_intent), key, self._reconcile_status("canceled"))

    def refund(
        self,
        payment_intent: str,
        *,
        amount: int | None = None,
        reason: str | None = None,
        metadata: Mapping[str, str] | None = None,
        key: str | None = None,
    ) -> Refund:
        """Refund a PaymentIntent (all that is left of it by default): the effect ``stripe.refund``."""
        request = flows.RefundRequest(payment_intent, amount, reason, metadata)
        return self._write(request.write(), key, self.reconcile_refund)

    # -- compensation -----------------------------------------------------------------------------

    def undo_charges(
        self, scope: str, *, effect: str = CHARGE, ordinal: int = 0, result: Payment | None = None
    ) -> list[Payment | Refund]:
        """Refund (or void, when only authorised) what the charge effect ``effect`` #``ordinal`` of
        ``scope`` made. Run it inside a scope of its own: the refunds are guarded effects there.

        The charge is found by its identity: the recorded ``result`` if given, else every
        PaymentIntent whose metadata carries the effect's key (so a charge whose result was never
        recorded is refunded too). One waiting for its customer (3-D Secure) or not yet confirmed is
        cancelled. Already refunded or canceled PaymentIntents are skipped.

        Returns:
            The refunds and voided payments made (replayed ones included).

        Raises:
            ProviderUnavailable: Stripe cannot be asked, or cannot tell yet (among others: the
                charge's key was last seen in progress at Stripe and nothing is listed yet):
                retry later.
        """
        identity = EffectIdentity.of(self.guard.namespace, scope, effect, ordinal, self.guard.ledger_id)
        found = None
        if result is None:
            record = self.guard.store.get(identity.key)
            if record is None:
                return []  # never claimed: the charge was not attempted
            result = evidence.recorded_payment(record)
            if result is None:
                found = self.find_payments(identity.search_key, since=record.created_at - self.search_margin)
                if found is not None:
                    evidence.settled(record, found, self.guard.store.now(), self.key_window)
        intents = flows.drive(flows.charged_intents(result, found), self._do)
        return flows.drive(flows.undo(intents), self._do)

    # -- reconcilers ------------------------------------------------------------------------------

    def reconcile_charge(self, request: ReconcileRequest) -> Resolution[Payment]:
        """Did the in-doubt charge make a PaymentIntent? Found by the effect key in its metadata.

        When nothing was made and the key's answer is a 5xx Stripe replays, the next attempt key is
        recorded in the ledger first (:mod:`sagaguard.connectors.stripe._attempts`), so the re-send
        gets past it.
        """
        query = flows.charge_query(request, self.search_margin)
        found = self.find_payments(request.identity.search_key, **query)
        resolution = flows.charge_resolution(found, request.record, self.key_window)
        if isinstance(resolution, NotAppliedResolution):
            self._next_attempt_if_stuck(request)
        return resolution

    def _next_attempt_if_stuck(self, request: ReconcileRequest) -> None:
        """Record the next attempt key when the newest one is stuck on a replayed 5xx."""
        identity = request.identity
        generation = attempts.current_attempt(self.guard, identity)
        if evidence.replayed_5xx(request.record, attempts.attempt_key(identity.provider_key, generation)):
            new_key = attempts.attempt_key(identity.provider_key, generation + 1)
            self.guard.run(attempts.ATTEMPT, lambda: new_key, **attempts.marker(identity, generation + 1))

    def reconcile_refund(self, request: ReconcileRequest) -> Resolution[Refund]:
        """Did the in-doubt refund happen? Refunds of the PaymentIntent, matched on metadata."""
        return flows.drive(flows.reconcile_refund(request, self.max_list_pages), self._do)

    def _reconcile_status(self, status: str) -> Callable[[ReconcileRequest], Resolution[Payment]]:
        def reconcile(request: ReconcileRequest) -> Resolution[Payment]:
            return flows.drive(flows.reconcile_status(request, status), self._do)

        return reconcile

    def find_payments(
        self, effect_key: str, *, since: float, customer: str | None = None, age: float | None = None
    ) -> list[dict[str, Any]] | None:
        """The PaymentIntents (as dicts) made under ``effect_key``, or None when Stripe cannot tell yet.

        Lists PaymentIntents created since ``since`` (newest first, up to ``max_list_pages`` pages
        of 100) and matches the metadata; the list endpoints are read-after-write consistent, so a
        complete listing without a match means there is none. Only a longer listing falls back to
        search, which lags: a search miss is trusted only for a record older than ``search_lag``
        (``age``, the record's age).
        """
        flow = flows.find_payments(
            effect_key, since=since, customer=customer, age=age, max_pages=self.max_list_pages,
            search_lag=self.search_lag,
        )  # fmt: skip
        return flows.drive(flow, self._do)

    # -- plumbing ---------------------------------------------------------------------------------

    def _write(
        self, write: flows.Write[R], key: str | None, reconciler: Callable[[ReconcileRequest], Any]
    ) -> R:
        def call() -> R:
            effect = _current_effect()
            method = getattr(getattr(self.client.v1, write.resource), write.method)
            params = write.params(effect.identity.search_key)
            provider_key = effect.provider_key
            if write.effect == CHARGE and effect.token > 1:  # taken over: a new attempt key may exist
                generation = attempts.current_attempt(self.guard, effect.identity)
                provider_key = attempts.attempt_key(provider_key, generation)
            try:
                answer = method(*write.ids, params, self._options(provider_key))
            except stripe.StripeError as exc:
                raise map_error(exc, provider_key) from exc
            return write.result_type.of(answer)

        return self.guard.run(write.effect, call, **self._write_options(write, key, reconciler))

    def _do(self, op: flows.Op) -> Any:
        if isinstance(op, flows.Undo):
            return self.cancel(op.payment_intent) if op.effect == CANCEL else self.refund(op.payment_intent)
        try:
            return getattr(getattr(self.client.v1, op.resource), op.method)(*op.args, options=self._options())
        except stripe.StripeError as exc:
            raise map_error(exc) from exc


Compensation = Callable[[_HasStepScope, Any, Payment | None], None]
AsyncCompensation = Callable[[_HasStepScope, Any, Payment | None], Awaitable[None]]


@overload
def refund_compensation(
    payments: StripeEffects, *, effect: str = ..., ordinal: int = ..., use_async: Literal[False] = ...
) -> Compensation: ...
@overload
def refund_compensation(
    payments: StripeEffects, *, effect: str = ..., ordinal: int = ..., use_async: Literal[True]
) -> AsyncCompensation: ...
def refund_compensation(
    payments: StripeEffects, *, effect: str = CHARGE, ordinal: int = 0, use_async: bool = False
) -> Compensation | AsyncCompensation:
    """A saga step compensation that refunds what the step's charge made.

    ::

        @trip.step(compensate=refund_compensation(payments))
        def charge(ctx: StepContext, order: Order) -> Payment:
            return payments.charge(order.amount, "eur", payment_method=order.card)

    The compensation is called as ``(ctx, input, result)``; ``result`` is None when a crash came
    between the charge and its record, and the PaymentIntent is then found by the step's identity
    (``ctx.step_scope``, ``effect``, ``ordinal``). It runs inside the compensation's own scope, so its
    refunds are guarded effects that happen once. With ``use_async=True`` it is an ``async def``
    over :meth:`StripeEffects.undo_charges_async`, for sagas run with ``SagaRunner.arun``.
    """
    name = f"refund_{effect.replace('.', '_')}"
    if use_async:

        async def acompensate(ctx: _HasStepScope, input: Any, result: Payment | None) -> None:
            await payments.undo_charges_async(ctx.step_scope, effect=effect, ordinal=ordinal, result=result)

        acompensate.__name__ = name
        return acompensate

    def compensate(ctx: _HasStepScope, input: Any, result: Payment | None) -> None:
        payments.undo_charges(ctx.step_scope, effect=effect, ordinal=ordinal, result=result)

    compensate.__name__ = name
    return compensate
