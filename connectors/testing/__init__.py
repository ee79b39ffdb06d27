"""Test helpers shipped to users: local servers that speak the providers' protocols, with faults
and counters, so tests run the real SDKs against them.

::

    from sagaguard.connectors.testing import LocalStripe

    with LocalStripe() as server:                    # its own process: survives a SIGKILLed worker
        payments = StripeEffects(guard, api_key=server.api_key, api_base=server.api_base)
        server.fault("timeout", "/v1/payment_intents", method="POST")  # applied, answer lost
        ...
        assert server.counters()["charges"] == 1

- :class:`LocalStripe`: PaymentIntents and Refunds with Stripe's idempotency semantics.
- :class:`LocalIdempotentApi`: any JSON API honouring the IETF ``Idempotency-Key`` header.
- :class:`LocalChatModel`: OpenAI-compatible chat completions (stored completions included).
- :class:`SmtpSink` (:mod:`sagaguard.connectors.testing.smtp`, needs ``aiosmtpd``): a real SMTP server in a
  thread that counts what it accepts.

Every HTTP server takes faults (:meth:`LocalService.fault`: ``fail``, ``timeout`` after applying,
``slow``), counts (:meth:`LocalService.counters`), moves its clock (:meth:`LocalService.advance_clock`)
and resets. Crash points for workers are :func:`sagaguard.idempotency.testing.crash_point` and
:class:`sagaguard.idempotency.testing.CrashingStore`, re-exported here. ``python -m
sagaguard.connectors.testing KIND`` runs a server by hand.
"""

from sagaguard.connectors.testing._service import FaultRule, LocalService
from sagaguard.connectors.testing.chat_server import LocalChatModel
from sagaguard.connectors.testing.http_server import LocalIdempotentApi
from sagaguard.connectors.testing.stripe_server import LocalStripe
from sagaguard.idempotency.testing import CRASH_ENV, CrashingStore, crash_point, sigkill

__all__ = [
    "CRASH_ENV",
    "CrashingStore",
    "FaultRule",
    "LocalChatModel",
    "LocalIdempotentApi",
    "LocalService",
    "LocalStripe",
    "crash_point",
    "sigkill",
]
