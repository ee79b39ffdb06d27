"""What a charge's ledger record says about its last attempt at Stripe, and what it holds.

The guard records the last error of an in-doubt effect (as :func:`~sagaguard.idempotency.codec.
encode_error` JSON, never code); the Stripe connector reads it back here to tell a key still in
progress at Stripe (409) or a 5xx Stripe replays under the key from any other doubt.
"""

from __future__ import annotations

import functools
from typing import Any

from sagaguard.connectors.errors import ProviderUnavailable
from sagaguard.connectors.stripe._mapping import REPLAYED_5XX
from sagaguard.connectors.stripe._objects import Payment
from sagaguard.idempotency.codec import Codec, decode_error
from sagaguard.idempotency.errors import CodecError
from sagaguard.idempotency.records import Record, State

__all__ = ["key_in_use", "recorded_payment", "replayed_5xx", "settled"]


def _last_error(record: Record) -> tuple[str, list[Any]] | None:
    """The type name and arguments of the record's last recorded error, if readable."""
    if not record.error:
        return None
    try:
        info = decode_error(record.error)
    except CodecError:
        return None
    return info.type_name, info.args


def _last_code(record: Record, status_at_least: int = 0) -> str | None:
    """The code of the record's last :class:`ProviderUnavailable` (a status below
    ``status_at_least`` counts as none)."""
    last = _last_error(record)
    if last is None or not last[0].endswith("ProviderUnavailable") or len(last[1]) < 4:
        return None
    status = last[1][2]
    if status_at_least and not (isinstance(status, int) and status >= status_at_least):
        return None
    code = last[1][3]
    return code if isinstance(code, str) else None


def key_in_use(record: Record) -> bool:
    """Whether the record's last attempt was answered 409 ``idempotency_key_in_use``: a request
    under its key was still executing at Stripe, so an empty listing proves nothing yet."""
    return _last_code(record) == "idempotency_key_in_use"


def replayed_5xx(record: Record, provider_key: str) -> bool:
    """Whether the record's last attempt got a 5xx that Stripe replayed under ``provider_key`` (the
    charge's newest attempt key): the first request under that key has finished, and every re-send
    under it gets the same answer. A replay under an older key proves nothing about the newest."""
    last = _last_error(record)
    if last is None or _last_code(record, 500) != REPLAYED_5XX:
        return False
    message = last[1][0] if last[1] else ""
    return isinstance(message, str) and message.endswith(f"Idempotency-Key {provider_key})")


@functools.cache
def _payment_codec() -> Codec[Payment]:
    return Codec(Payment)


def recorded_payment(record: Record) -> Payment | None:
    """The Payment a SUCCEEDED charge record holds (a charge that needs customer action is one:
    its caller got :class:`PaymentActionRequired`, so a saga compensation gets no result), else
    None."""
    if record.state is not State.SUCCEEDED or record.result is None:
        return None
    try:
        return _payment_codec().decode(record.result)
    except CodecError:
        return None  # not a Payment (another effect's record): found by the listing instead


def settled(record: Record, found: list[dict[str, Any]], now: float, key_window: float) -> None:
    """Refuse to trust an empty listing for a charge whose key was last seen in progress at Stripe
    (409) less than ``key_window`` ago: that request may still make a PaymentIntent, so the
    compensation must be retried later, never end as "nothing to undo".

    Raises:
        ProviderUnavailable: the charge may still be in progress at Stripe.
    """
    young = now - record.created_at < key_window
    if not found and record.state is not State.SUCCEEDED and key_in_use(record) and young:
        raise ProviderUnavailable(
            "the charge's idempotency key was still in progress at Stripe (409): what it made "
            "cannot be known yet; retry the compensation later",
            "stripe",
            409,
            "idempotency_key_in_use",
        )
