"""What the sync and async Stripe methods share: the settings, the clients and the guard's options.

:class:`sagaguard.connectors.stripe.StripeEffects` is this base, the async methods of
:mod:`sagaguard.connectors.stripe._async` and the sync ones of its own module.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import stripe

from sagaguard.connectors.errors import classify, replayable
from sagaguard.connectors.stripe._flows import Write
from sagaguard.connectors.stripe._objects import KEY_WINDOW
from sagaguard.idempotency.checks import count, seconds
from sagaguard.idempotency.effect import ReconcileRequest, Retry
from sagaguard.idempotency.guard import Guard
from sagaguard.idempotency.options import RunArguments


class StripeBase:
    """The settings and clients of :class:`sagaguard.connectors.stripe.StripeEffects` (see there).

    Raises:
        ConfigurationError: a duration that is not a finite number of seconds (> 0; ``search_lag``
            >= 0) or a count that is not an int, naming the option.
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
        search_lag: float = 7200.0,
    ) -> None:
        for label, value in (
            ("key_window", key_window),
            ("search_margin", search_margin),
            ("timeout", timeout),
        ):
            seconds(label, value)
        seconds("search_lag", search_lag, zero_ok=True)
        count("network_retries", network_retries, minimum=0)
        count("max_list_pages", max_list_pages)
        if client is None:
            if not api_key:
                raise ValueError("StripeEffects needs a client or an api_key")
            client = self._client(api_key, api_base, timeout, network_retries, stripe.RequestsClient)
            self._async_client: stripe.StripeClient | None = None  # built at the first async call
        else:
            self._async_client = client  # a client of the caller's: its own async HTTP client serves
        self._api = (api_key, api_base, timeout)
        self._async_http: stripe.HTTPClient | None = None
        self.guard = guard
        self.client = client
        self.network_retries = network_retries
        self.retry = retry if retry is not None else Retry()  # built once, not per call
        self.key_window = key_window
        self.search_margin = search_margin
        self.max_list_pages = max_list_pages
        self.search_lag = search_lag

    def _client(
        self,
        api_key: str,
        api_base: str | None,
        timeout: float,
        network_retries: int,
        http: Callable[..., stripe.HTTPClient],
    ) -> stripe.StripeClient:
        return stripe.StripeClient(
            api_key,
            base_addresses={"api": api_base} if api_base else None,
            max_network_retries=network_retries,
            http_client=http(timeout=timeout),
        )

    @property
    def async_client(self) -> stripe.StripeClient:
        """The client of the ``_async`` methods: the given ``client``, or one built on httpx's async
        client at the first async call (so sync users never pay for it). It keeps connections for
        the event loop that made them: use one loop, and :meth:`aclose` it when done."""
        if self._async_client is None:
            api_key, api_base, timeout = self._api
            assert api_key is not None
            http = stripe.HTTPXClient(timeout=timeout)
            self._async_http = http
            self._async_client = self._client(
                api_key, api_base, timeout, self.network_retries, lambda **_: http
            )
        return self._async_client

    async def aclose(self) -> None:
        """Close the async HTTP client this object built (a given ``client`` is the caller's)."""
        http, self._async_http = self._async_http, None
        if http is not None:
            self._async_client = None
            await http.close_async()  # type: ignore[no-untyped-call]

    def _write_options(
        self, write: Write[Any], key: str | None, reconciler: Callable[[ReconcileRequest], Any]
    ) -> RunArguments:
        """What the sync and async drivers pass ``Guard.run``/``arun`` with ``write``'s effect: its
        fingerprinted arguments, the key, its result type and the connector's options."""
        return {
            "arguments": write.arguments,
            "key": key,
            "result_type": write.result_type,
            "reconciler": reconciler,
            "provider_idempotent": True,
            "provider_window": self.key_window,
            "classify": classify,
            "permanent": replayable,
            "retry": self.retry,
        }

    def _options(self, idempotency_key: str | None = None) -> Any:
        # Set on every request, whatever the client was built with: the guard owns the budget.
        options: dict[str, Any] = {"max_network_retries": self.network_retries}
        if idempotency_key is not None:
            options["idempotency_key"] = idempotency_key
        return options
