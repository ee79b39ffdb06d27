"""The Stripe connector's own errors: a payment that waits for its customer, and refused metadata.

::

    ValueError
    └── MetadataRefused             the caller's metadata cannot go to Stripe as given
    ConnectorError
    └── PaymentActionRequired       the PaymentIntent exists and waits for the customer (3-D Secure)
"""

from __future__ import annotations

from sagaguard.connectors.errors import ConnectorError

__all__ = ["MetadataRefused", "PaymentActionRequired"]


class PaymentActionRequired(ConnectorError):
    """The charge made a PaymentIntent that needs the customer to act (``requires_action``, e.g.
    3-D Secure): no money has moved yet, but it will if the customer authenticates.

    Neither a success nor "not applied": the effect is recorded as done (its result is the
    PaymentIntent, replayed as this same error), and a saga step that raises it is compensated,
    which cancels the PaymentIntent (:meth:`~sagaguard.connectors.stripe.StripeEffects.undo_charges`).
    Hand ``client_secret`` to the customer's browser to finish it instead.

    Attributes:
        payment_intent: the PaymentIntent's id.
        next_action: Stripe's ``next_action.type`` (``use_stripe_sdk``, ``redirect_to_url``, ...).
    """

    def __init__(self, message: str, provider: str, payment_intent: str, next_action: str | None) -> None:
        super().__init__(message)
        self._keep(message, provider, None, "requires_action")
        self.payment_intent = payment_intent
        self.next_action = next_action
        self.args = (message, provider, payment_intent, next_action)


class MetadataRefused(ValueError):
    """The caller's metadata was refused before anything was sent: it uses a field the connector
    writes (``sagaguard_key``, ``sagaguard_effect``) or breaks Stripe's limits (50 keys, the
    connector's two included; keys up to 40 characters, values up to 500)."""
