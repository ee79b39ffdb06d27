"""Stripe as guarded effects: charge, capture, cancel and refund happen once, whatever crashes.

::

    payments = StripeEffects(guard, api_key=os.environ["STRIPE_KEY"])

    with scope("order-42"):
        payment = payments.charge(1999, "eur", payment_method="pm_card_visa")   # once
        payments.refund(payment.id)                                             # once

Every call is a guarded effect (:class:`~idempotency.guard.Guard`) with:

- **the provider key** (``Idempotency-Key``) derived from the effect key, so a re-send after a
  lost answer is absorbed by Stripe within its key window (24 hours);
- **the effect's identity in the object's metadata** (``sagaguard_key``: the effect key, a hash;
  ``sagaguard_effect``: its name), so the object can be found again after the window;
- **the SDK's own network retries set to 0** on every request (``network_retries=``), so the
  guard's retry budget is the only one and attempts are never multiplied;
- **the error mapping** of :func:`map_error`: card and validation errors are *not applied*;
  connection errors, timeouts, 5xx and 409 ``idempotency_key_in_use`` are *ambiguous*;
  ``IdempotencyError`` is a :class:`~connectors.errors.ProviderKeyConflict`;
- **a reconciler** that settles an in-doubt call by asking Stripe: the list endpoints, filtered by
  creation time and matched on metadata (read-after-write consistent), with search only as a
  fallback (it lags);
- **a compensation**: :meth:`StripeEffects.undo_charges` refunds (or voids) whatever a charge
  effect made, found by its identity even when the charge's result was never recorded;
  :func:`refund_compensation` is that as a saga step compensation.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any, Protocol, TypeVar

import stripe

from connectors._stripe_objects import (
    CANCEL,
    CAPTURE,
    CHARGE,
    KEY_WINDOW,
    METADATA_EFFECT,
    METADATA_KEY,
    MONEY_MOVED,
    REFUND,
    Payment,
    Refund,
    Resolution,
)
from connectors._stripe_objects import plain as _plain
from connectors.errors import (
    ProviderKeyConflict,
    ProviderRejected,
    ProviderUnavailable,
    classify,
    replayable,
)
from idempotency.effect import NOT_APPLIED, Applied, ReconcileRequest, Retry, Unknown
from idempotency.effect import current_effect as _current_effect
from idempotency.guard import Guard
from idempotency.keys import EffectIdentity

__all__ = [
    "CHARGE",
    "KEY_WINDOW",
    "METADATA_KEY",
    "Payment",
    "Refund",
    "StripeEffects",
    "map_error",
    "refund_compensation",
]

T = TypeVar("T")


def map_error(exc: stripe.StripeError, provider_key: str = "") -> Exception:
    """The connector error for an exception of the Stripe SDK.

    =================================================  ===========================  =================
    SDK exception                                      raised as                    disposition
    =================================================  ===========================  =================
    ``CardError`` (402)                                ``ProviderRejected``         not applied
    ``InvalidRequestError`` (400, 404)                 ``ProviderRejected``         not applied
    ``RateLimitError`` (429)                           ``ProviderRejected(retry)``  not applied, retry
    ``AuthenticationError``, ``PermissionError``       ``ProviderRejected(retry)``  not applied, retry
    ``IdempotencyError`` (400 ``idempotency_error``)   ``ProviderKeyConflict``      not applied
    ``APIError`` 409 ``idempotency_key_in_use``        ``ProviderUnavailable``      ambiguous
    ``APIError`` (5xx, other), ``APIConnectionError``  ``ProviderUnavailable``      ambiguous
    =================================================  ===========================  =================

    A refused key or permission is retried, never recorded as FAILED: once the configuration is
    fixed, the same effect must be able to run.
    """
    status = exc.http_status
    message = exc.user_message or str(exc) or type(exc).__name__
    code = exc.code
    if isinstance(exc, stripe.CardError):
        decline = exc.error.decline_code if exc.error is not None else None
        return ProviderRejected(message, "stripe", status, decline or code)
    if isinstance(exc, stripe.IdempotencyError):
        return ProviderKeyConflict(message, "stripe", status, "idempotency_error", provider_key)
    if isinstance(exc, stripe.RateLimitError | stripe.AuthenticationError | stripe.PermissionError):
        return ProviderRejected(message, "stripe", status, code, True)
    if isinstance(exc, stripe.InvalidRequestError):
        return ProviderRejected(message, "stripe", status, code)
    return ProviderUnavailable(message, "stripe", status, code)


def _canonical(metadata: Mapping[str, str] | None) -> str:
    """Metadata as canonical JSON text: a flat argument fingerprints on the guard's fast path."""
    if not metadata:
        return "{}"
    return json.dumps(dict(metadata or {}), sort_keys=True, separators=(",", ":"), ensure_ascii=False)


class _HasStepScope(Protocol):
    @property
    def step_scope(self) -> str: ...


class StripeEffects:
    """Stripe's money-moving calls as guarded effects (charge, capture, cancel, refund).

    Each method runs as one effect in the current scope (``with scope(...)``, a saga step) or under
    ``key=``; a re-run of the scope replays the recorded result instead of calling Stripe.

    Args:
        guard: the guard the effects run under.
        client: a ``stripe.StripeClient``; by default one is built from ``api_key`` / ``api_base``.
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
        search_lag: seconds after which search is trusted to be complete (Stripe: up to an hour
            in outages); a search miss on a younger record is "unknown".
    """

    def __init__(
        self,
        guard: Guard,
        client: stripe.StripeClient | None = None,
        *,
        api_key: str | None = None,
        api_base: str | None = None,
        timeout: float = 30.0,
        network_retries: int = 0,
        retry: Retry | None = None,
        key_window: float = KEY_WINDOW,
        search_margin: float = 600.0,
        max_list_pages: int = 10,
        search_lag: float = 3600.0,
    ) -> None:
        if client is None:
            if not api_key:
                raise ValueError("StripeEffects needs a client or an api_key")
            client = stripe.StripeClient(
                api_key,
                base_addresses={"api": api_base} if api_base else None,
                max_network_retries=network_retries,
                http_client=stripe.RequestsClient(timeout=timeout),
            )
        self.guard = guard
        self.client = client
        self.network_retries = network_retries
        self.retry = retry if retry is not None else Retry()  # built once, not per call
        self.key_window = key_window
        self.search_margin = search_margin
        self.max_list_pages = max_list_pages
        self.search_lag = search_lag

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
        key: str | None = None,
    ) -> Payment:
        """Create and confirm a PaymentIntent (one request, ``confirm=true``): the effect ``stripe.charge``.

        Args:
            amount: in the currency's smallest unit.
            currency: three-letter ISO code.
            payment_method: the PaymentMethod to charge.
            customer: the Customer, if any (also narrows the reconciler's listing).
            capture: False authorises only (``capture_method=manual``); :meth:`capture` later.
            description: shown in the dashboard.
            metadata: your own metadata; ``sagaguard_key`` and ``sagaguard_effect`` are added.
            key: an explicit effect key instead of scope + ordinal.

        Raises:
            ProviderRejected: declined or invalid (not applied; recorded and replayed).
            ProviderKeyConflict: the idempotency key was used with other parameters.
            OutcomeUnknown: the charge may have happened and nothing could settle it yet.
        """
        arguments = {
            "amount": amount,
            "currency": currency,
            "payment_method": payment_method,
            "customer": customer,
            "capture": capture,
            "description": description,
            "metadata": _canonical(metadata),
        }

        def call() -> Payment:
            effect = _current_effect()
            params: dict[str, Any] = {
                "amount": amount,
                "currency": currency,
                "payment_method": payment_method,
                "confirm": True,
                "capture_method": "automatic" if capture else "manual",
                "metadata": {**(metadata or {}), METADATA_KEY: effect.key, METADATA_EFFECT: CHARGE},
            }
            if customer is not None:
                params["customer"] = customer
            if description is not None:
                params["description"] = description
            return Payment.of(self._post(self.client.v1.payment_intents.create, params))

        return self._run(
            CHARGE, call, arguments=arguments, key=key, result_type=Payment, reconciler=self.reconcile_charge
        )

    def capture(self, payment_intent: str, *, amount: int | None = None, key: str | None = None) -> Payment:
        """Capture an authorised PaymentIntent: the effect ``stripe.capture``."""

        def call() -> Payment:
            params = {} if amount is None else {"amount_to_capture": amount}
            return Payment.of(self._post(self.client.v1.payment_intents.capture, params, payment_intent))

        arguments = {"payment_intent": payment_intent, "amount": amount}
        reconciler = self._reconcile_status("succeeded")
        return self._run(
            CAPTURE, call, arguments=arguments, key=key, result_type=Payment, reconciler=reconciler
        )

    def cancel(self, payment_intent: str, *, key: str | None = None) -> Payment:
        """Cancel a PaymentIntent (void an authorisation): the effect ``stripe.cancel``."""

        def call() -> Payment:
            return Payment.of(self._post(self.client.v1.payment_intents.cancel, {}, payment_intent))

        arguments = {"payment_intent": payment_intent}
        reconciler = self._reconcile_status("canceled")
        return self._run(
            CANCEL, call, arguments=arguments, key=key, result_type=Payment, reconciler=reconciler
        )

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
        arguments = {
            "payment_intent": payment_intent,
            "amount": amount,
            "reason": reason,
            "metadata": _canonical(metadata),
        }

        def call() -> Refund:
            effect = _current_effect()
            params: dict[str, Any] = {
                "payment_intent": payment_intent,
                "metadata": {**(metadata or {}), METADATA_KEY: effect.key, METADATA_EFFECT: REFUND},
            }
            if amount is not None:
                params["amount"] = amount
            if reason is not None:
                params["reason"] = reason
            return Refund.of(self._post(self.client.v1.refunds.create, params))

        return self._run(
            REFUND, call, arguments=arguments, key=key, result_type=Refund, reconciler=self.reconcile_refund
        )

    # -- compensation -----------------------------------------------------------------------------

    def undo_charges(
        self, scope: str, *, effect: str = CHARGE, ordinal: int = 0, result: Payment | None = None
    ) -> list[Payment | Refund]:
        """Refund (or void, when only authorised) what the charge effect ``effect`` #``ordinal`` of
        ``scope`` made. Run it inside a scope of its own: the refunds are guarded effects there.

        The charge is found by its identity: the recorded ``result`` if given, else every
        PaymentIntent whose metadata carries the effect's key (so a charge whose result was never
        recorded is refunded too). Already refunded or canceled PaymentIntents are skipped.

        Returns:
            The refunds and voided payments made (replayed ones included).

        Raises:
            ProviderUnavailable: Stripe cannot be asked, or cannot tell yet: retry later.
        """
        identity = EffectIdentity.of(self.guard.namespace, scope, effect, ordinal)
        if result is not None:
            intents = [_plain(self._get(self.client.v1.payment_intents.retrieve, result.id))]
        else:
            record = self.guard.store.get(identity.key)
            if record is None:
                return []  # never claimed: the charge was not attempted
            found = self.find_payments(identity.key, since=record.created_at - self.search_margin)
            if found is None:
                raise ProviderUnavailable("cannot tell yet which payments the charge made", "stripe")
            intents = found
        done: list[Payment | Refund] = []
        for intent in sorted(intents, key=lambda i: (i["created"], i["id"])):
            if intent["status"] == "requires_capture":
                done.append(self.cancel(intent["id"]))
            elif intent["status"] in ("succeeded", "processing"):
                try:
                    done.append(self.refund(intent["id"]))
                except ProviderRejected as exc:
                    if exc.code != "charge_already_refunded":
                        raise
        return done

    # -- reconcilers ------------------------------------------------------------------------------

    def reconcile_charge(self, request: ReconcileRequest) -> Resolution[Payment]:
        """Did the in-doubt charge make a PaymentIntent? Found by the effect key in its metadata."""
        record = request.record
        found = self.find_payments(
            request.identity.key,
            since=record.created_at - self.search_margin,
            customer=request.arguments.get("customer"),
            age=record.updated_at - record.created_at,
        )
        if found is None:
            return Unknown()
        moved = [i for i in found if i["status"] in MONEY_MOVED]
        if moved:
            return Applied(Payment.of(moved[0]))
        # Nothing, or only declined/canceled attempts: run it (within the key window the decline
        # is replayed by Stripe and recorded as such).
        return NOT_APPLIED

    def reconcile_refund(self, request: ReconcileRequest) -> Resolution[Refund]:
        """Did the in-doubt refund happen? Refunds of the PaymentIntent, matched on metadata."""
        key = request.identity.key
        params = {"payment_intent": request.arguments["payment_intent"], "limit": 100}
        found, complete = self._collect(
            self.client.v1.refunds.list, params, lambda r: (r.get("metadata") or {}).get(METADATA_KEY) == key
        )
        if found:
            return Applied(Refund.of(found[0]))
        return NOT_APPLIED if complete else Unknown()

    def _reconcile_status(self, status: str) -> Callable[[ReconcileRequest], Resolution[Payment]]:
        def reconcile(request: ReconcileRequest) -> Resolution[Payment]:
            intent = _plain(
                self._get(self.client.v1.payment_intents.retrieve, request.arguments["payment_intent"])
            )
            return Applied(Payment.of(intent)) if intent["status"] == status else NOT_APPLIED

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

        def mine(intent: Any) -> bool:
            return bool((intent.get("metadata") or {}).get(METADATA_KEY) == effect_key)

        params: dict[str, Any] = {"created": {"gte": max(0, int(since))}, "limit": 100}
        if customer:
            params["customer"] = customer
        found, complete = self._collect(self.client.v1.payment_intents.list, params, mine)
        if complete or found:
            return found
        query = {"query": f"metadata['{METADATA_KEY}']:'{effect_key}'", "limit": 100}
        searched, _ = self._collect(self.client.v1.payment_intents.search, query, mine)
        if searched or (age is not None and age > self.search_lag):
            return searched
        return None

    # -- plumbing ---------------------------------------------------------------------------------

    def _run(
        self,
        name: str,
        call: Callable[[], T],
        *,
        arguments: Mapping[str, Any],
        key: str | None,
        result_type: type[T],
        reconciler: Callable[[ReconcileRequest], Any],
    ) -> T:
        return self.guard.run(
            name,
            call,
            arguments=arguments,
            key=key,
            result_type=result_type,
            reconciler=reconciler,
            provider_idempotent=True,
            provider_window=self.key_window,
            classify=classify,
            permanent=replayable,
            retry=self.retry,
        )

    def _options(self, idempotency_key: str | None = None) -> Any:
        options: dict[str, Any] = {"max_network_retries": self.network_retries}
        if idempotency_key is not None:
            options["idempotency_key"] = idempotency_key
        return options

    def _post(self, method: Callable[..., Any], params: Mapping[str, Any], *ids: str) -> Any:
        provider_key = _current_effect().provider_key
        try:
            return method(*ids, params, self._options(provider_key))
        except stripe.StripeError as exc:
            raise map_error(exc, provider_key) from exc

    def _get(self, method: Callable[..., Any], *args: Any) -> Any:
        try:
            return method(*args, options=self._options())
        except stripe.StripeError as exc:
            raise map_error(exc) from exc

    def _collect(
        self, method: Callable[..., Any], params: Mapping[str, Any], match: Callable[[Any], bool]
    ) -> tuple[list[dict[str, Any]], bool]:
        """The matching objects of a list or search, page by page, and whether it was exhausted
        within ``max_list_pages`` pages."""
        params = dict(params)
        found: list[dict[str, Any]] = []
        for _ in range(self.max_list_pages):
            page = self._get(method, params)
            found.extend(obj for obj in map(_plain, page.data) if match(obj))
            if not page.has_more or not page.data:
                return found, True
            if getattr(page, "next_page", None):
                params["page"] = page.next_page  # search
            else:
                params["starting_after"] = page.data[-1]["id"]  # list
        return found, False


def refund_compensation(
    payments: StripeEffects, *, effect: str = CHARGE, ordinal: int = 0
) -> Callable[[_HasStepScope, Any, Payment | None], None]:
    """A saga step compensation that refunds what the step's charge made.

    ::

        @trip.step(compensate=refund_compensation(payments))
        def charge(ctx: StepContext, order: Order) -> Payment:
            return payments.charge(order.amount, "eur", payment_method=order.card)

    The compensation is called as ``(ctx, input, result)``; ``result`` is None when a crash came
    between the charge and its record, and the PaymentIntent is then found by the step's identity
    (``ctx.step_scope``, ``effect``, ``ordinal``). It runs inside the compensation's own scope, so its
    refunds are guarded effects that happen once.
    """

    def compensate(ctx: _HasStepScope, input: Any, result: Payment | None) -> None:
        payments.undo_charges(ctx.step_scope, effect=effect, ordinal=ordinal, result=result)

    compensate.__name__ = f"refund_{effect.replace('.', '_')}"
    return compensate
