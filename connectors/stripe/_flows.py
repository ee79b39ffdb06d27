"""What the Stripe connector decides, free of I/O: the requests it builds and how it reconciles.

The sync and async methods of :class:`sagaguard.connectors.stripe.StripeEffects` are two thin drivers over
this module (the house pattern of ``idempotency/flow.py``): a *flow* is a generator that yields the
reads and undo effects it needs (:class:`Read`, :class:`Undo`) and is sent their answers (or has
their exceptions thrown in); :func:`drive` runs one with sync calls, :func:`adrive` with awaited
ones. Listing, matching on metadata, the search fallback and the choice between refund and void
are written once, here, and so are the writes (:class:`Write`: the effect, its fingerprinted
arguments and its request) and the error mapping (:func:`map_error`).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Generator, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import stripe

from sagaguard.connectors.errors import ProviderKeyConflict, ProviderRejected, ProviderUnavailable
from sagaguard.connectors.stripe._objects import (
    CANCEL,
    CAPTURE,
    CHARGE,
    METADATA_EFFECT,
    METADATA_KEY,
    MONEY_MOVED,
    REFUND,
    Payment,
    Refund,
    Resolution,
    plain,
)
from sagaguard.idempotency.effect import NOT_APPLIED, Applied, ReconcileRequest, Unknown

T = TypeVar("T")
R = TypeVar("R", Payment, Refund)


@dataclass(frozen=True, slots=True)
class Read:
    """A read the driver makes: ``client.v1.<resource>.<method>(*args)`` (``<method>_async`` when
    async), with the SDK's network retries set; its answer is sent back into the flow."""

    resource: str
    """``payment_intents`` or ``refunds``."""
    method: str
    """``retrieve``, ``list`` or ``search``."""
    args: tuple[Any, ...]


@dataclass(frozen=True, slots=True)
class Undo:
    """A guarded effect the driver runs in the current scope: ``cancel`` or ``refund`` of a
    PaymentIntent; its result (or exception) goes back into the flow."""

    effect: str
    """:data:`CANCEL` or :data:`REFUND`."""
    payment_intent: str


Op = Read | Undo
Flow = Generator[Op, Any, T]


def drive(flow: Flow[T], do: Callable[[Op], Any]) -> T:
    """Run ``flow`` to its end, answering each op with ``do(op)`` (its exception is thrown in)."""
    answer: Any = None
    error: Exception | None = None
    while True:
        try:
            op = flow.send(answer) if error is None else flow.throw(error)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        answer, error = None, None
        try:
            answer = do(op)
        except Exception as exc:
            error = exc


async def adrive(flow: Flow[T], do: Callable[[Op], Awaitable[Any]]) -> T:
    """The async twin of :func:`drive`: each op is answered with ``await do(op)``."""
    answer: Any = None
    error: Exception | None = None
    while True:
        try:
            op = flow.send(answer) if error is None else flow.throw(error)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        answer, error = None, None
        try:
            answer = await do(op)
        except Exception as exc:
            error = exc


# -- errors ---------------------------------------------------------------------------------------


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


# -- requests -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Write(Generic[R]):
    """One guarded write to Stripe, decided once for its sync and its async method: the driver runs
    ``effect`` under the guard with ``arguments`` and, as its body, sends the request
    ``client.v1.<resource>.<method>(*ids, params(effect_key), options)`` and reads the answer as
    ``result_type``."""

    effect: str
    """The effect's name (:data:`CHARGE`, :data:`CAPTURE`, :data:`CANCEL`, :data:`REFUND`)."""
    arguments: dict[str, Any]
    """What is fingerprinted (flat; also what the reconcilers read back)."""
    result_type: type[R]
    resource: str
    method: str
    ids: tuple[str, ...]
    params: Callable[[str], dict[str, Any]]
    """The request's parameters, given the effect key (known only once the effect runs)."""


def canonical(metadata: Mapping[str, str] | None) -> str:
    """Metadata as canonical JSON text: a flat argument fingerprints on the guard's fast path."""
    if not metadata:
        return "{}"
    return json.dumps(dict(metadata), sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def stamped(metadata: Mapping[str, str] | None, effect_key: str, effect: str) -> dict[str, str]:
    """The caller's metadata with the effect's identity added: what :func:`find_payments` and the
    reconcilers match on (:func:`_made_under`), so the object is found again after the key window."""
    return {**(metadata or {}), METADATA_KEY: effect_key, METADATA_EFFECT: effect}


@dataclass(frozen=True, slots=True)
class ChargeRequest:
    """A charge's arguments: what is fingerprinted, and the PaymentIntent create parameters."""

    amount: int
    currency: str
    payment_method: str
    customer: str | None
    capture: bool
    description: str | None
    metadata: Mapping[str, str] | None

    def arguments(self) -> dict[str, Any]:
        """The fingerprinted arguments (flat; also what the reconciler reads back)."""
        return {
            "amount": self.amount,
            "currency": self.currency,
            "payment_method": self.payment_method,
            "customer": self.customer,
            "capture": self.capture,
            "description": self.description,
            "metadata": canonical(self.metadata),
        }

    def params(self, effect_key: str) -> dict[str, Any]:
        """Create and confirm in one request, with the effect's identity in the metadata."""
        params: dict[str, Any] = {
            "amount": self.amount,
            "currency": self.currency,
            "payment_method": self.payment_method,
            "confirm": True,
            "capture_method": "automatic" if self.capture else "manual",
            "metadata": stamped(self.metadata, effect_key, CHARGE),
        }
        if self.customer is not None:
            params["customer"] = self.customer
        if self.description is not None:
            params["description"] = self.description
        return params

    def write(self) -> Write[Payment]:
        """The charge as a :class:`Write`: the effect :data:`CHARGE`."""
        return Write(CHARGE, self.arguments(), Payment, "payment_intents", "create", (), self.params)


@dataclass(frozen=True, slots=True)
class RefundRequest:
    """A refund's arguments: what is fingerprinted, and the Refund create parameters."""

    payment_intent: str
    amount: int | None
    reason: str | None
    metadata: Mapping[str, str] | None

    def arguments(self) -> dict[str, Any]:
        """The fingerprinted arguments (flat; the reconciler reads ``payment_intent`` back)."""
        return {
            "payment_intent": self.payment_intent,
            "amount": self.amount,
            "reason": self.reason,
            "metadata": canonical(self.metadata),
        }

    def params(self, effect_key: str) -> dict[str, Any]:
        """The Refund parameters, with the effect's identity in the metadata."""
        params: dict[str, Any] = {
            "payment_intent": self.payment_intent,
            "metadata": stamped(self.metadata, effect_key, REFUND),
        }
        if self.amount is not None:
            params["amount"] = self.amount
        if self.reason is not None:
            params["reason"] = self.reason
        return params

    def write(self) -> Write[Refund]:
        """The refund as a :class:`Write`: the effect :data:`REFUND`."""
        return Write(REFUND, self.arguments(), Refund, "refunds", "create", (), self.params)


def capture(payment_intent: str, amount: int | None) -> Write[Payment]:
    """Capture an authorised PaymentIntent: all that is capturable unless ``amount`` says less."""

    def params(_: str) -> dict[str, Any]:
        return {} if amount is None else {"amount_to_capture": amount}

    arguments = {"payment_intent": payment_intent, "amount": amount}
    return Write(CAPTURE, arguments, Payment, "payment_intents", "capture", (payment_intent,), params)


def cancel(payment_intent: str) -> Write[Payment]:
    """Cancel a PaymentIntent (void an authorisation)."""
    arguments = {"payment_intent": payment_intent}
    return Write(CANCEL, arguments, Payment, "payment_intents", "cancel", (payment_intent,), lambda _: {})


# -- reconciling ----------------------------------------------------------------------------------


def collect(
    resource: str, method: str, params: Mapping[str, Any], match: Callable[[Any], bool], max_pages: int
) -> Flow[tuple[list[dict[str, Any]], bool]]:
    """The matching objects of a list or search, page by page, and whether it was exhausted within
    ``max_pages`` pages."""
    params = dict(params)
    found: list[dict[str, Any]] = []
    for _ in range(max_pages):
        page = yield Read(resource, method, (dict(params),))
        found.extend(obj for obj in map(plain, page.data) if match(obj))
        if not page.has_more or not page.data:
            return found, True
        if getattr(page, "next_page", None):
            params["page"] = page.next_page  # search
        else:
            params["starting_after"] = page.data[-1]["id"]  # list
    return found, False


def _made_under(effect_key: str) -> Callable[[Any], bool]:
    def mine(obj: Any) -> bool:
        return bool((obj.get("metadata") or {}).get(METADATA_KEY) == effect_key)

    return mine


def find_payments(
    effect_key: str,
    *,
    since: float,
    customer: str | None,
    age: float | None,
    max_pages: int,
    search_lag: float,
) -> Flow[list[dict[str, Any]] | None]:
    """The PaymentIntents made under ``effect_key``, or None when Stripe cannot tell yet (see
    :meth:`sagaguard.connectors.stripe.StripeEffects.find_payments`)."""
    mine = _made_under(effect_key)
    params: dict[str, Any] = {"created": {"gte": max(0, int(since))}, "limit": 100}
    if customer:
        params["customer"] = customer
    found, complete = yield from collect("payment_intents", "list", params, mine, max_pages)
    if complete or found:
        return found
    query = {"query": f"metadata['{METADATA_KEY}']:'{effect_key}'", "limit": 100}
    searched, _ = yield from collect("payment_intents", "search", query, mine, max_pages)
    if searched or (age is not None and age > search_lag):
        return searched
    return None


def charge_query(request: ReconcileRequest, search_margin: float) -> dict[str, Any]:
    """The :func:`find_payments` arguments that settle an in-doubt charge: created since the record
    (less the clock-skew margin), of its customer, with the record's age for the search fallback."""
    record = request.record
    return {
        "since": record.created_at - search_margin,
        "customer": request.arguments.get("customer"),
        "age": record.updated_at - record.created_at,
    }


def charge_resolution(found: list[dict[str, Any]] | None) -> Resolution[Payment]:
    """Applied when a PaymentIntent made under the key moved money; Unknown when Stripe cannot tell."""
    if found is None:
        return Unknown()
    moved = [i for i in found if i["status"] in MONEY_MOVED]
    if moved:
        return Applied(Payment.of(moved[0]))
    # Nothing, or only declined/canceled attempts: run it (within the key window the decline is
    # replayed by Stripe and recorded as such).
    return NOT_APPLIED


def reconcile_refund(request: ReconcileRequest, max_pages: int) -> Flow[Resolution[Refund]]:
    """Did the in-doubt refund happen? Refunds of the PaymentIntent, matched on metadata."""
    params = {"payment_intent": request.arguments["payment_intent"], "limit": 100}
    found, complete = yield from collect(
        "refunds", "list", params, _made_under(request.identity.key), max_pages
    )
    if found:
        return Applied(Refund.of(found[0]))
    return NOT_APPLIED if complete else Unknown()


def reconcile_status(request: ReconcileRequest, status: str) -> Flow[Resolution[Payment]]:
    """Did the in-doubt capture or cancel happen? The PaymentIntent's status says."""
    intent = plain((yield Read("payment_intents", "retrieve", (request.arguments["payment_intent"],))))
    return Applied(Payment.of(intent)) if intent["status"] == status else NOT_APPLIED


# -- undoing --------------------------------------------------------------------------------------


def charged_intents(result: Payment | None, found: list[dict[str, Any]] | None) -> Flow[list[dict[str, Any]]]:
    """The PaymentIntents a charge made: the recorded ``result`` read afresh, else those ``found``
    by its key (None: Stripe cannot tell yet)."""
    if result is not None:
        return [plain((yield Read("payment_intents", "retrieve", (result.id,))))]
    if found is None:
        raise ProviderUnavailable("cannot tell yet which payments the charge made", "stripe")
    return found


def undo(intents: list[dict[str, Any]]) -> Flow[list[Payment | Refund]]:
    """Void what is only authorised, refund what moved money, oldest first; skip the rest (already
    refunded or canceled)."""
    done: list[Payment | Refund] = []
    for intent in sorted(intents, key=lambda i: (i["created"], i["id"])):
        if intent["status"] == "requires_capture":
            done.append((yield Undo(CANCEL, intent["id"])))
        elif intent["status"] in ("succeeded", "processing"):
            try:
                done.append((yield Undo(REFUND, intent["id"])))
            except ProviderRejected as exc:
                if exc.code != "charge_already_refunded":
                    raise
    return done
