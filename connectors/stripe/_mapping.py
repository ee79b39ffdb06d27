"""How the Stripe SDK's exceptions become the connector's errors (:func:`map_error`)."""

from __future__ import annotations

import stripe

from sagaguard.connectors.errors import (
    ProviderKeyConflict,
    ProviderRejected,
    ProviderUnavailable,
    ProviderUnreachable,
)

__all__ = ["REPLAYED_5XX", "map_error"]


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
    ``APIConnectionError`` from a refused connection   ``ProviderUnreachable``      not applied, retry
    =================================================  ===========================  =================

    A refused key or permission is retried, never recorded as FAILED: once the configuration is
    fixed, the same effect must be able to run. A 5xx that Stripe replays under the key
    (``Idempotent-Replayed: true``) has the code :data:`REPLAYED_5XX`: the first request under that
    key finished with it, which is what lets the reconciler move to a new attempt key.
    """
    status = exc.http_status
    message = exc.user_message or str(exc) or type(exc).__name__
    # The SDK leaves ``code`` unset on an APIError (409 and 5xx): Stripe's body still has it.
    code = exc.code or (exc.error.code if exc.error is not None else None)
    if isinstance(exc, stripe.CardError):
        decline = exc.error.decline_code if exc.error is not None else None
        return ProviderRejected(message, "stripe", status, decline or code)
    if isinstance(exc, stripe.IdempotencyError):
        return ProviderKeyConflict(message, "stripe", status, "idempotency_error", provider_key)
    if isinstance(exc, stripe.RateLimitError | stripe.AuthenticationError | stripe.PermissionError):
        return ProviderRejected(message, "stripe", status, code, True)
    if isinstance(exc, stripe.InvalidRequestError):
        return ProviderRejected(message, "stripe", status, code)
    if isinstance(exc, stripe.APIConnectionError) and _refused(exc):
        return ProviderUnreachable(message, "stripe", None, "connection_refused")
    if status is not None and status >= 500 and _replayed(exc):
        # The key goes into the recorded message: the reconciler moves on only from the newest one.
        replayed = f"{message} (replayed by Stripe under Idempotency-Key {provider_key})"
        return ProviderUnavailable(replayed, "stripe", status, REPLAYED_5XX)
    return ProviderUnavailable(message, "stripe", status, code)


REPLAYED_5XX = "idempotent_replayed"
"""The code of a 5xx Stripe replayed under its idempotency key (see :func:`map_error`)."""


def _refused(exc: BaseException) -> bool:
    """Whether a connection error was a refused connection (nothing was sent), by its causes."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, ConnectionRefusedError):
            return True
        cause = cause.__cause__ or cause.__context__
    return False


def _replayed(exc: stripe.StripeError) -> bool:
    headers = exc.headers or {}
    return any(k.lower() == "idempotent-replayed" and str(v).lower() == "true" for k, v in headers.items())
