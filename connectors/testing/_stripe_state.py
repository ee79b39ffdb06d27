"""The objects of the local Stripe server and what each endpoint does to them. No HTTP here.

The subset the Stripe connector uses: PaymentIntents (create, confirm, capture, cancel, retrieve,
list, search) and Refunds (create, retrieve, list), shaped like Stripe's JSON so the real SDK
builds its objects from them. Failures are :class:`StripeFailure` (status + Stripe's error body);
whether a failure is stored under an idempotency key is the caller's business (a validation error
is not, a card decline is: the endpoint had started executing).
"""

from __future__ import annotations

import itertools
import re
import uuid
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["ACTION_METHODS", "DECLINING_METHODS", "StripeFailure", "StripeState"]

DECLINING_METHODS = frozenset(
    {"pm_card_chargeDeclined", "pm_card_visa_chargeDeclined", "pm_card_chargeDeclinedInsufficientFunds"}
)
"""Test payment methods that are declined (Stripe's own test method names)."""

ACTION_METHODS = frozenset(
    {"pm_card_threeDSecure2Required", "pm_card_threeDSecureRequired", "pm_card_authenticationRequired"}
)
"""Test payment methods that need 3-D Secure: confirming leaves the PaymentIntent ``requires_action``
(no charge yet), as Stripe's own test cards of these names do."""

_CANCELABLE = {"requires_payment_method", "requires_confirmation", "requires_action", "requires_capture"}
_CLAUSE = re.compile(
    r"""^(?:metadata\[['"](?P<mkey>[^'"]+)['"]\]|(?P<field>\w+)):['"](?P<value>[^'"]*)['"]$"""
)


class StripeFailure(Exception):
    """A Stripe error reply.

    Attributes:
        status: the HTTP status.
        body: Stripe's ``{"error": {...}}`` body.
        executed: whether the endpoint had started executing (then the reply is stored under the
            idempotency key and replayed; validation errors are not stored).
    """

    def __init__(self, status: int, error: Mapping[str, Any], *, executed: bool = False) -> None:
        super().__init__(error.get("message", ""))
        self.status = status
        self.body = {"error": dict(error)}
        self.executed = executed


def invalid(message: str, *, param: str | None = None, code: str = "parameter_invalid") -> StripeFailure:
    """A 400 ``invalid_request_error`` raised before the endpoint executes."""
    error = {"type": "invalid_request_error", "code": code, "message": message}
    if param is not None:
        error["param"] = param
    return StripeFailure(400, error)


def _int(params: Mapping[str, Any], name: str, *, required: bool = False) -> int | None:
    value = params.get(name)
    if value is None or value == "":
        if required:
            raise invalid(f"Missing required param: {name}.", param=name, code="parameter_missing")
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        raise invalid(f"Invalid integer: {value}", param=name, code="parameter_invalid_integer") from None


def _metadata(params: Mapping[str, Any]) -> dict[str, str]:
    raw = params.get("metadata") or {}
    if not isinstance(raw, dict):
        raise invalid("Invalid metadata: must be a hash", param="metadata")
    return {str(k): str(v) for k, v in raw.items() if v != ""}


def _may_redirect(params: Mapping[str, Any]) -> bool:
    """Whether a confirmed PaymentIntent could use a redirect-based method and has no ``return_url``
    (an account with such methods enabled: Stripe refuses it)."""
    if params.get("return_url") or params.get("payment_method_types"):
        return False
    automatic = params.get("automatic_payment_methods")
    return not (isinstance(automatic, dict) and automatic.get("allow_redirects") == "never")


def _clause_test(mkey: str | None, fld: str | None, value: str) -> Callable[[Mapping[str, Any]], bool]:
    if mkey is not None:
        return lambda obj: bool(obj["metadata"].get(mkey) == value)
    return lambda obj: str(obj.get(fld or "")) == value


class StripeState:
    """Every PaymentIntent and Refund of the server, and the counters. Not thread-safe: the server
    calls it under its lock."""

    def __init__(
        self, clock: Callable[[], float], *, search_lag: float = 0.0, redirect_methods: bool = False
    ) -> None:
        self.clock = clock
        self.search_lag = search_lag
        self.redirect_methods = redirect_methods
        self.intents: dict[str, dict[str, Any]] = {}
        self.refunds: dict[str, dict[str, Any]] = {}
        self.refunded: dict[str, int] = {}
        self.counters: dict[str, int] = {}
        self._seq = itertools.count()
        self._order: dict[str, int] = {}

    def count(self, name: str, n: int = 1) -> None:
        """Add ``n`` to the counter ``name``."""
        self.counters[name] = self.counters.get(name, 0) + n

    def _new_id(self, prefix: str) -> str:
        return f"{prefix}_{uuid.uuid4().hex[:24]}"

    def _stamp(self, obj: dict[str, Any]) -> dict[str, Any]:
        self._order[obj["id"]] = next(self._seq)
        return obj

    # -- payment intents -----------------------------------------------------------------------

    def create_intent(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """POST /v1/payment_intents (with ``confirm=true``: confirmed in the same call)."""
        amount = _int(params, "amount", required=True)
        assert amount is not None
        if amount < 1:
            raise invalid("Amount must be at least 1.", param="amount", code="amount_too_small")
        currency = str(params.get("currency") or "")
        if not currency:
            raise invalid("Missing required param: currency.", param="currency", code="parameter_missing")
        capture_method = str(params.get("capture_method") or "automatic")
        if capture_method not in ("automatic", "automatic_async", "manual"):
            raise invalid(f"Invalid capture_method: {capture_method}", param="capture_method")
        confirm = str(params.get("confirm", "false")).lower() == "true"
        method = params.get("payment_method") or None
        if confirm and method is None:
            raise invalid(
                "You cannot confirm this PaymentIntent because it's missing a payment method.",
                param="payment_method",
                code="payment_intent_unexpected_state",
            )
        if confirm and self.redirect_methods and _may_redirect(params):
            raise invalid(
                "This PaymentIntent is configured to accept payment methods enabled in your Dashboard. "
                "Because some of these payment methods might redirect your customer off of your page, "
                "you must provide a `return_url`. If you don't want to accept redirect-based payment "
                "methods, set `automatic_payment_methods[enabled]` to `true` and "
                "`automatic_payment_methods[allow_redirects]` to `never`.",
                param="return_url",
            )
        intent = self._stamp(
            {
                "id": self._new_id("pi"),
                "object": "payment_intent",
                "amount": amount,
                "amount_capturable": 0,
                "amount_received": 0,
                "capture_method": capture_method,
                "confirmation_method": "automatic",
                "created": int(self.clock()),
                "currency": currency.lower(),
                "customer": params.get("customer") or None,
                "description": params.get("description") or None,
                "last_payment_error": None,
                "latest_charge": None,
                "livemode": False,
                "metadata": _metadata(params),
                "payment_method": method,
                "status": "requires_confirmation" if method else "requires_payment_method",
            }
        )
        self.intents[intent["id"]] = intent
        self.count("payment_intents")
        if confirm:
            self._confirm(intent)
        return intent

    def intent(self, intent_id: str) -> dict[str, Any]:
        """The PaymentIntent ``intent_id``, or a 404 failure."""
        found = self.intents.get(intent_id)
        if found is None:
            raise StripeFailure(
                404,
                {
                    "type": "invalid_request_error",
                    "code": "resource_missing",
                    "param": "intent",
                    "message": f"No such payment_intent: '{intent_id}'",
                },
            )
        return found

    def confirm_intent(self, intent_id: str, params: Mapping[str, Any]) -> dict[str, Any]:
        """POST /v1/payment_intents/{id}/confirm."""
        intent = self.intent(intent_id)
        if intent["status"] not in ("requires_confirmation", "requires_payment_method"):
            raise self._unexpected(intent, "confirm")
        method = params.get("payment_method") or intent["payment_method"]
        if method is None:
            raise invalid("You cannot confirm this PaymentIntent because it's missing a payment method.")
        intent["payment_method"] = method
        self._confirm(intent)
        return intent

    def _confirm(self, intent: dict[str, Any]) -> None:
        if intent["payment_method"] in ACTION_METHODS:
            # 3-D Secure: nothing is charged until the customer authenticates.
            self.count("actions")
            intent["status"] = "requires_action"
            intent["next_action"] = {"type": "use_stripe_sdk", "use_stripe_sdk": {}}
            return
        if intent["payment_method"] in DECLINING_METHODS:
            self.count("declines")
            error = {
                "type": "card_error",
                "code": "card_declined",
                "decline_code": "insufficient_funds"
                if intent["payment_method"].endswith("InsufficientFunds")
                else "generic_decline",
                "message": "Your card was declined.",
            }
            intent["status"] = "requires_payment_method"
            intent["last_payment_error"] = dict(error)
            raise StripeFailure(402, {**error, "payment_intent": dict(intent)}, executed=True)
        intent["latest_charge"] = self._new_id("ch")
        intent["last_payment_error"] = None
        self.count("charges")
        if intent["capture_method"] == "manual":
            intent["status"] = "requires_capture"
            intent["amount_capturable"] = intent["amount"]
        else:
            intent["status"] = "succeeded"
            intent["amount_received"] = intent["amount"]

    def capture_intent(self, intent_id: str, params: Mapping[str, Any]) -> dict[str, Any]:
        """POST /v1/payment_intents/{id}/capture."""
        intent = self.intent(intent_id)
        if intent["status"] != "requires_capture":
            raise self._unexpected(intent, "capture")
        amount = _int(params, "amount_to_capture")
        amount = intent["amount_capturable"] if amount is None else amount
        if not 0 < amount <= intent["amount_capturable"]:
            raise invalid(
                "amount_to_capture must be at most the capturable amount.", param="amount_to_capture"
            )
        intent.update(status="succeeded", amount_received=amount, amount_capturable=0)
        self.count("captures")
        return intent

    def cancel_intent(self, intent_id: str, params: Mapping[str, Any]) -> dict[str, Any]:
        """POST /v1/payment_intents/{id}/cancel."""
        intent = self.intent(intent_id)
        if intent["status"] not in _CANCELABLE:
            raise self._unexpected(intent, "cancel")
        intent.update(status="canceled", amount_capturable=0)
        intent["cancellation_reason"] = params.get("cancellation_reason") or None
        self.count("cancels")
        return intent

    def _unexpected(self, intent: Mapping[str, Any], action: str) -> StripeFailure:
        return StripeFailure(
            400,
            {
                "type": "invalid_request_error",
                "code": "payment_intent_unexpected_state",
                "message": f"You cannot {action} this PaymentIntent because it has a status of "
                f"{intent['status']}.",
            },
            executed=True,
        )

    # -- refunds -------------------------------------------------------------------------------

    def create_refund(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """POST /v1/refunds (of a PaymentIntent or a charge; the rest of it by default)."""
        intent_id = params.get("payment_intent")
        charge_id = params.get("charge")
        if not intent_id and charge_id:
            intent_id = next(
                (i["id"] for i in self.intents.values() if i["latest_charge"] == charge_id), None
            )
            if intent_id is None:
                raise invalid(f"No such charge: '{charge_id}'", param="charge", code="resource_missing")
        if not intent_id:
            raise invalid("One of the following params should be provided: charge, payment_intent.")
        intent = self.intent(str(intent_id))
        if intent["status"] != "succeeded":
            raise invalid(
                "This PaymentIntent does not have a successful charge to refund.",
                param="payment_intent",
                code="charge_not_refundable",
            )
        left = intent["amount_received"] - self.refunded.get(intent["id"], 0)
        amount = _int(params, "amount")
        amount = left if amount is None else amount
        if left <= 0:
            raise StripeFailure(
                400,
                {
                    "type": "invalid_request_error",
                    "code": "charge_already_refunded",
                    "message": f"Charge {intent['latest_charge']} has already been refunded.",
                },
                executed=True,
            )
        if not 0 < amount <= left:
            raise invalid(
                f"Refund amount ({amount}) is greater than unrefunded amount on charge ({left})",
                param="amount",
                code="amount_too_large",
            )
        refund = self._stamp(
            {
                "id": self._new_id("re"),
                "object": "refund",
                "amount": amount,
                "charge": intent["latest_charge"],
                "created": int(self.clock()),
                "currency": intent["currency"],
                "metadata": _metadata(params),
                "payment_intent": intent["id"],
                "reason": params.get("reason") or None,
                "status": "succeeded",
            }
        )
        self.refunds[refund["id"]] = refund
        self.refunded[intent["id"]] = self.refunded.get(intent["id"], 0) + amount
        self.count("refunds")
        return refund

    def refund(self, refund_id: str) -> dict[str, Any]:
        """The Refund ``refund_id``, or a 404 failure."""
        found = self.refunds.get(refund_id)
        if found is None:
            raise StripeFailure(
                404,
                {
                    "type": "invalid_request_error",
                    "code": "resource_missing",
                    "message": f"No such refund: '{refund_id}'",
                },
            )
        return found

    # -- listing and search ----------------------------------------------------------------------

    def listing(self, kind: str, params: Mapping[str, Any], url: str) -> dict[str, Any]:
        """A Stripe list: newest first, ``limit`` (1..100, default 10), ``starting_after`` paging,
        ``created`` bounds, and equality filters (``customer``, ``payment_intent``, ``charge``)."""
        self.count("lists")
        objects = list((self.intents if kind == "payment_intent" else self.refunds).values())
        objects.sort(key=lambda o: (o["created"], self._order[o["id"]]), reverse=True)
        for name in ("customer", "payment_intent", "charge"):
            if params.get(name):
                objects = [o for o in objects if o.get(name) == params[name]]
        created = params.get("created")
        if isinstance(created, dict):
            for op, test in (
                ("gt", int.__gt__),
                ("gte", int.__ge__),
                ("lt", int.__lt__),
                ("lte", int.__le__),
            ):
                bound = _int(created, op)
                if bound is not None:
                    objects = [o for o in objects if test(o["created"], bound)]
        elif created not in (None, ""):
            exact = _int(params, "created")
            objects = [o for o in objects if o["created"] == exact]
        after = params.get("starting_after")
        if after:
            ids = [o["id"] for o in objects]
            if after not in ids:
                raise invalid(f"No such object: '{after}'", param="starting_after", code="resource_missing")
            objects = objects[ids.index(after) + 1 :]
        limit = _int(params, "limit") or 10
        if not 1 <= limit <= 100:
            raise invalid("limit must be between 1 and 100", param="limit")
        return {"object": "list", "data": objects[:limit], "has_more": len(objects) > limit, "url": url}

    def search(self, params: Mapping[str, Any], url: str) -> dict[str, Any]:
        """PaymentIntent search: ``metadata['k']:'v'`` and ``field:'v'`` clauses joined by AND.

        An object becomes searchable ``search_lag`` seconds after it was created, as on Stripe,
        whose search index lags behind writes.
        """
        self.count("searches")
        query = str(params.get("query") or "")
        clauses = [c.strip() for c in re.split(r"\s+AND\s+", query) if c.strip()]
        if not clauses:
            raise invalid("query is required", param="query", code="parameter_missing")
        tests: list[Callable[[Mapping[str, Any]], bool]] = []
        for clause in clauses:
            match = _CLAUSE.match(clause)
            if match is None:
                raise invalid(f"unsupported search clause {clause!r}", param="query")
            tests.append(_clause_test(match["mkey"], match["field"], match["value"]))
        visible = self.clock() - self.search_lag
        found = [o for o in self.intents.values() if o["created"] <= visible and all(t(o) for t in tests)]
        found.sort(key=lambda o: (o["created"], self._order[o["id"]]), reverse=True)
        start = _int(params, "page") or 0
        limit = _int(params, "limit") or 10
        page = found[start : start + limit]
        more = len(found) > start + limit
        return {
            "object": "search_result",
            "data": page,
            "has_more": more,
            "next_page": str(start + limit) if more else None,
            "url": url,
        }
