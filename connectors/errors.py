"""Errors the connectors raise, one tree for every provider.

A connector maps its SDK's exceptions onto these, so code that wraps several providers handles one
set of types, and a recorded failure replays as the same type as the first call raised::

    IdempotencyError                      (sagaguard.idempotency.errors)
    ├── NotApplied
    │   ├── ProviderRejected              refused before changing anything: card declined, validation,
    │   │                                 any other 4xx; retryable=True when asking again may work (429)
    │   ├── ProviderBusy                  the provider is still processing this key (HTTP 409): retry later
    │   └── ProviderUnreachable           no connection was made: nothing was sent; retry later
    ├── KeyConflict
    │   └── ProviderKeyConflict           the provider saw the provider key with other parameters
    │                                     (Stripe 400 idempotency_error, IETF draft 422)
    └── ConnectorError
        └── ProviderUnavailable           timeout, connection lost, 5xx: the call may have been applied

Every class below also derives from :class:`ConnectorError`, so ``except ConnectorError`` catches
whatever a connector raised. The SDK's own exception is chained as ``__cause__`` on the first call;
a replay of a recorded failure has no cause, only the attributes (``provider``, ``status``, ``code``).
"""

from __future__ import annotations

from sagaguard.idempotency.errors import IdempotencyError, KeyConflict, NotApplied
from sagaguard.idempotency.records import Disposition

__all__ = [
    "ConnectorError",
    "ProviderBusy",
    "ProviderKeyConflict",
    "ProviderRejected",
    "ProviderUnavailable",
    "ProviderUnreachable",
    "classify",
    "replayable",
]


class ConnectorError(IdempotencyError):
    """Root of the errors a connector raises.

    Attributes:
        provider: which connector (``"stripe"``, ``"smtp"``, ``"http"``, ``"llm"``).
        status: the provider's status (HTTP status, SMTP reply code), or None when nothing answered.
        code: the provider's error code (``card_declined``), or None.
    """

    provider: str = ""
    status: int | None = None
    code: str | None = None

    def _keep(self, message: str, provider: str, status: int | None, code: str | None) -> None:
        # ``args`` holds every field, so the guard's record of a permanent failure rebuilds the
        # same exception with ``type(exc)(*exc.args)`` when it is replayed.
        self.args = (message, provider, status, code)
        self.message = message
        self.provider = provider
        self.status = status
        self.code = code

    def __str__(self) -> str:
        where = f"{self.provider} " if self.provider else ""
        status = f"{self.status} " if self.status is not None else ""
        code = f" ({self.code})" if self.code else ""
        return f"{where}{status}{self.message}{code}".strip()


class ProviderRejected(NotApplied, ConnectorError):
    """The provider refused the call before changing anything.

    ``retryable`` is False for refusals that will not change (card declined, invalid request,
    authentication): the effect is recorded FAILED and replayed as this error. True for refusals
    that may pass later (rate limited): the guard retries within its budget, then releases the key.

    Args:
        message: the provider's message.
        provider: the connector's name.
        status: the provider's status code.
        code: the provider's error code.
        retryable: whether asking again later may succeed.
    """

    def __init__(
        self,
        message: str = "rejected",
        provider: str = "",
        status: int | None = None,
        code: str | None = None,
        retryable: bool = False,
    ) -> None:
        NotApplied.__init__(self, message, retryable=retryable)
        self._keep(message, provider, status, code)
        self.args = (*self.args, retryable)


class ProviderBusy(NotApplied, ConnectorError):
    """The provider is still processing a request with the same provider key (HTTP 409).

    Nothing was applied by *this* request, and the provider stored nothing for it: ask again later
    (the guard retries within its budget; the first request's response is then replayed).
    """

    def __init__(
        self,
        message: str = "a request with this key is in progress",
        provider: str = "",
        status: int | None = 409,
        code: str | None = None,
    ) -> None:
        NotApplied.__init__(self, message, retryable=True)
        self._keep(message, provider, status, code)


class ProviderUnreachable(NotApplied, ConnectorError):
    """No connection to the provider could be made, so nothing was sent: retry later.

    Only raised where the client can tell (httpx ``ConnectError``/``ConnectTimeout``, SMTP connect);
    a connection lost *after* sending is :class:`ProviderUnavailable`.
    """

    def __init__(
        self,
        message: str = "cannot connect",
        provider: str = "",
        status: int | None = None,
        code: str | None = None,
    ) -> None:
        NotApplied.__init__(self, message, retryable=True)
        self._keep(message, provider, status, code)


class ProviderKeyConflict(KeyConflict, ConnectorError):
    """The provider saw this call's provider key before, with other parameters.

    The guard's own fingerprint check found no conflict, so the provider key was used by another
    call (another program, or arguments left out of the fingerprint). Nothing was applied by this
    call; the effect is recorded FAILED and replayed as this error.

    Attributes:
        key: the provider key (Stripe ``Idempotency-Key``, the HTTP header).
    """

    def __init__(
        self,
        message: str = "provider key reused with other parameters",
        provider: str = "",
        status: int | None = None,
        code: str | None = None,
        key: str = "",
    ) -> None:
        IdempotencyError.__init__(self, message)
        self._keep(message, provider, status, code)
        self.args = (*self.args, key)
        self.key = key
        self.recorded_fingerprint = ""
        """Unknown: the provider does not say which parameters it saw first."""
        self.fingerprint = ""


class ProviderUnavailable(ConnectorError):
    """Timeout, lost connection or a 5xx: the provider may or may not have applied the call.

    Ambiguous: the guard records the effect IN_DOUBT (or re-sends it under the same provider key
    when the provider deduplicates), never runs it again blindly.
    """

    def __init__(
        self,
        message: str = "no answer",
        provider: str = "",
        status: int | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self._keep(message, provider, status, code)


replayable: tuple[type[BaseException], ...] = (ProviderRejected, ProviderKeyConflict)
"""The connector errors a guard records as FAILED and replays as themselves (pass as ``permanent=``)."""


def classify(exc: BaseException) -> Disposition | None:
    """The guard classifier (``classify=``) for connector errors; None for anything else.

    ``ProviderRejected`` is not applied: permanent, or retryable when it says so; ``ProviderBusy``
    and ``ProviderUnreachable`` are retryable; ``ProviderKeyConflict`` is permanent;
    ``ProviderUnavailable`` is ambiguous.
    """
    if isinstance(exc, ProviderBusy | ProviderUnreachable) or (
        isinstance(exc, ProviderRejected) and exc.retryable
    ):
        return Disposition.RETRYABLE
    if isinstance(exc, replayable):
        return Disposition.PERMANENT
    if isinstance(exc, ProviderUnavailable):
        return Disposition.AMBIGUOUS
    return None
