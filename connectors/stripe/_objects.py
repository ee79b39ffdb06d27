"""The values the Stripe connector records (:class:`Payment`, :class:`Refund`) and its constants.

No SDK import here: these are plain dataclasses, built from the SDK's objects or their JSON.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeVar

from sagaguard.idempotency.effect import Applied, NotAppliedResolution, Unknown

__all__ = ["CANCEL", "CAPTURE", "CHARGE", "KEY_WINDOW", "METADATA_EFFECT", "METADATA_KEY", "REFUND",
           "Payment", "Refund", "plain"]  # fmt: skip

T = TypeVar("T")

CHARGE, CAPTURE, CANCEL, REFUND = "stripe.charge", "stripe.capture", "stripe.cancel", "stripe.refund"
METADATA_KEY = "sagaguard_key"
"""The metadata field holding the effect key on every object a Stripe effect creates."""
METADATA_EFFECT = "sagaguard_effect"
KEY_WINDOW = 23 * 3600.0
"""How long after the first attempt a re-send under the same key is trusted to be absorbed:
Stripe keeps keys for at least 24 hours; an hour is left for clock skew and slow attempts."""
MONEY_MOVED = ("succeeded", "processing", "requires_capture")
Resolution = Applied[T] | NotAppliedResolution | Unknown


@dataclass(frozen=True, slots=True)
class Payment:
    """A PaymentIntent as a charge effect records it."""

    id: str
    amount: int
    currency: str
    status: str
    """``succeeded``, ``requires_capture`` (authorised, capture=False), ``processing``, ..."""
    amount_received: int
    amount_capturable: int
    customer: str | None
    latest_charge: str | None
    effect_key: str | None
    """The ``sagaguard_key`` metadata: the effect key the PaymentIntent was made under, qualified
    by the ledger id (``key@ledger``: :attr:`sagaguard.idempotency.keys.EffectIdentity.search_key`;
    the bare key in a ledger upgraded from before ledger ids)."""
    next_action: str | None = None
    """``next_action.type`` when the status is ``requires_action`` (3-D Secure), else None."""

    @classmethod
    def of(cls, intent: Any) -> Payment:
        """From a ``stripe.PaymentIntent`` (or its JSON)."""
        return cls(
            id=str(intent["id"]),
            amount=int(intent["amount"]),
            currency=str(intent["currency"]),
            status=str(intent["status"]),
            amount_received=int(_field(intent, "amount_received") or 0),
            amount_capturable=int(_field(intent, "amount_capturable") or 0),
            customer=_id_of(_field(intent, "customer")),
            latest_charge=_id_of(_field(intent, "latest_charge")),
            effect_key=_field(_field(intent, "metadata"), METADATA_KEY),
            next_action=_field(_field(intent, "next_action"), "type"),
        )


@dataclass(frozen=True, slots=True)
class Refund:
    """A Refund as a refund effect records it."""

    id: str
    payment_intent: str | None
    amount: int
    currency: str
    status: str
    effect_key: str | None

    @classmethod
    def of(cls, refund: Any) -> Refund:
        """From a ``stripe.Refund`` (or its JSON)."""
        return cls(
            id=str(refund["id"]),
            payment_intent=_id_of(_field(refund, "payment_intent")),
            amount=int(refund["amount"]),
            currency=str(refund["currency"]),
            status=str(refund["status"]),
            effect_key=_field(_field(refund, "metadata"), METADATA_KEY),
        )


def plain(obj: Any) -> dict[str, Any]:
    """A Stripe object as a plain dict (Stripe objects are not dicts, but have ``to_dict``)."""
    to_dict = getattr(obj, "to_dict", None)
    if callable(to_dict):
        return dict(to_dict())
    return dict(obj)


def _field(obj: Any, name: str) -> Any:
    """``obj[name]``, or None when ``obj`` is None or has no such field (a Stripe object or a dict:
    Stripe objects index like dicts but have no ``get``; converting them with ``to_dict`` costs more
    than the fields read here)."""
    if obj is None:
        return None
    try:
        return obj[name]
    except KeyError:
        return None


def _id_of(value: Any) -> str | None:
    """An expandable field's id (Stripe returns the id, or the object when expanded)."""
    if value is None or isinstance(value, str):
        return value
    return str(value["id"])
