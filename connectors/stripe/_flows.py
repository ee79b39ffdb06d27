"""What the Stripe connector decides, free of I/O: the requests it builds and how it reconciles.

The sync and async methods of :class:`sagaguard.connectors.stripe.StripeEffects` are two thin drivers over
this module (the house pattern of ``idempotency/flow.py``): a *flow* is a generator that yields the
reads and undo effects it needs (:class:`Read`, :class:`Undo`) and is sent their answers (or has
their exceptions thrown in); :func:`drive` runs one with sync calls, :func:`adrive` with awaited
ones. Listing, matching on metadata, the search fallback and the choice between refund and void
are written once, here, and so are the writes (:class:`Write`: the effect, its fingerprinted
arguments and its request). The error mapping is :mod:`._mapping`; what a charge's record says
about its last attempt, :mod:`._evidence`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, Generator, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from sagaguard.connectors.errors import ProviderRejected, ProviderUnavailable
from sagaguard.connectors.stripe._errors import MetadataRefused, PaymentActionRequired
from sagaguard.connectors.stripe._evidence import key_in_use
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
from sagaguard.idempotency.records import Record

log = logging.getLogger("sagaguard.connectors.stripe")

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


METADATA_LIMITS = (50, 40, 500)
"""Stripe's metadata limits: keys per object, characters per key, characters per value."""


def check_metadata(metadata: Mapping[str, str] | None) -> None:
    """Refuse metadata that Stripe would refuse or that would hide the effect's identity.

    Raises:
        MetadataRefused: a field the connector writes is given, or Stripe's limits are broken.
    """
    if not metadata:
        return
    ours = sorted({METADATA_KEY, METADATA_EFFECT} & set(metadata))
    if ours:
        raise MetadataRefused(f"metadata field(s) {ours} are written by sagaguard: use other names")
    keys, key_chars, value_chars = METADATA_LIMITS
    if len(metadata) > keys - 2:
        raise MetadataRefused(
            f"{len(metadata)} metadata keys: Stripe allows {keys}, and sagaguard adds 2 of them"
        )
    for name, value in metadata.items():
        if not isinstance(name, str) or not isinstance(value, str):
            raise MetadataRefused(f"metadata {name!r}: keys and values must be strings")
        if len(name) > key_chars or len(value) > value_chars:
            raise MetadataRefused(
                f"metadata {name[:40]!r}: Stripe allows keys up to {key_chars} characters and values"
                f" up to {value_chars}"
            )


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
    return_url: str | None = None
    payment_method_types: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        check_metadata(self.metadata)

    def arguments(self) -> dict[str, Any]:
        """The fingerprinted arguments (flat; also what the reconciler reads back). ``return_url``
        and ``payment_method_types`` only when given, so records made before they existed keep
        their fingerprint."""
        extra: dict[str, Any] = {} if self.return_url is None else {"return_url": self.return_url}
        if self.payment_method_types is not None:
            extra["payment_method_types"] = ",".join(self.payment_method_types)
        return {
            **extra,
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
        # Stripe refuses a confirm that could redirect the customer without a place to return to:
        # the caller gives one, or names the method types, or redirect-based ones are excluded.
        if self.return_url is not None:
            params["return_url"] = self.return_url
        if self.payment_method_types is not None:
            params["payment_method_types"] = list(self.payment_method_types)
        elif self.return_url is None:
            params["automatic_payment_methods"] = {"enabled": True, "allow_redirects": "never"}
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

    def __post_init__(self) -> None:
        check_metadata(self.metadata)

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


def delivered(payment: Payment) -> Payment:
    """The charge's outcome for its caller: the payment, unless it waits for the customer.

    Raises:
        PaymentActionRequired: the PaymentIntent is ``requires_action`` (3-D Secure): not paid.
    """
    if payment.status == "requires_action":
        raise PaymentActionRequired(
            f"PaymentIntent {payment.id} needs the customer to act (3-D Secure) before it is paid",
            "stripe",
            payment.id,
            payment.next_action,
        )
    return payment


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
        # Stripe's two cursors (docs.stripe.com/api/pagination): a search result carries the next
        # page's token in its ``next_page`` field; a list pages on the last object's id (on a list
        # object, ``next_page`` is the SDK's method, never a cursor).
        if method == "search":
            params["page"] = page["next_page"]
        else:
            params["starting_after"] = page.data[-1]["id"]
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


def charge_resolution(
    found: list[dict[str, Any]] | None, record: Record | None = None, key_window: float | None = None
) -> Resolution[Payment]:
    """What the PaymentIntents ``found`` under the key say about an in-doubt charge.

    Applied when one moved money or waits for its customer (``requires_action``); Unknown when
    Stripe cannot tell, or when nothing was found while the key was last seen in progress at
    Stripe (409) within ``key_window`` of the first attempt: that request may still make one.
    Otherwise not applied (a decline found past the key window is logged: it is charged afresh).
    """
    if found is None:
        return Unknown()
    made = [i for i in found if i["status"] in (*MONEY_MOVED, "requires_action")]
    if made:
        return Applied(Payment.of(made[0]))
    if record is None:
        return NOT_APPLIED
    age = record.updated_at - record.created_at
    young = key_window is None or age < key_window
    if not found and key_in_use(record) and young:
        return Unknown()
    if found and not young:
        log.warning(
            "stripe.charge %s: past the key window only %s PaymentIntent(s) %s were found; "
            "charging afresh under the same key",
            record.key[:12], "/".join(sorted({i["status"] for i in found})),
            ", ".join(i["id"] for i in found),
        )  # fmt: skip
    # Nothing, or only declined/canceled attempts: run it (within the key window the decline is
    # replayed by Stripe and recorded as such).
    return NOT_APPLIED


def reconcile_refund(request: ReconcileRequest, max_pages: int) -> Flow[Resolution[Refund]]:
    """Did the in-doubt refund happen? Refunds of the PaymentIntent, matched on metadata."""
    params = {"payment_intent": request.arguments["payment_intent"], "limit": 100}
    found, complete = yield from collect(
        "refunds", "list", params, _made_under(request.identity.search_key), max_pages
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


UNCONFIRMED = ("requires_capture", "requires_action", "requires_confirmation")
"""PaymentIntents that may still move money and are undone by cancelling them: an authorisation,
one waiting for its customer (3-D Secure), one not yet confirmed."""


def undo(intents: list[dict[str, Any]]) -> Flow[list[Payment | Refund]]:
    """Void what is only authorised or waits for the customer, refund what moved money, oldest
    first; skip the rest (already refunded, canceled or declined)."""
    done: list[Payment | Refund] = []
    for intent in sorted(intents, key=lambda i: (i["created"], i["id"])):
        if intent["status"] in UNCONFIRMED:
            done.append((yield Undo(CANCEL, intent["id"])))
        elif intent["status"] in ("succeeded", "processing"):
            try:
                done.append((yield Undo(REFUND, intent["id"])))
            except ProviderRejected as exc:
                if exc.code != "charge_already_refunded":
                    raise
    return done
