"""HTTP calls as guarded effects, with the ``Idempotency-Key`` header of the IETF draft.

::

    api = IdempotentHttp(guard, httpx.Client(base_url="https://billing.example"))

    with scope("order-42"):
        invoice = api.post("/invoices", json={"order": "42"}, name="billing.invoice").json()

Each write is one guarded effect. The request carries ``Idempotency-Key: "<provider key>"`` (a
structured-field string, as draft-ietf-httpapi-idempotency-key-header defines it), derived from the
effect key, so a re-send after a lost answer is absorbed by a server that honours the header. The
answer is recorded and replayed; errors are mapped (:func:`map_response`, :func:`map_transport_error`):

============================================  ===========================  ==========================
answer                                        raised as                    disposition
============================================  ===========================  ==========================
2xx, 3xx                                      the recorded ``HttpResult``  applied
409 (the key is being processed)              ``ProviderBusy``             in progress: retry later
422 (the key was used with another payload)   ``ProviderKeyConflict``      conflict (a ``KeyConflict``)
401, 403, 408, 429                            ``ProviderRejected(retry)``  not applied, retryable
other 4xx                                     ``ProviderRejected``         not applied
5xx, read/write timeout, connection lost      ``ProviderUnavailable``      ambiguous
connect error, connect or pool timeout        ``ProviderUnreachable``      not applied (nothing sent)
============================================  ===========================  ==========================

With ``server_dedups=True`` (the default) an ambiguous call is re-sent under the same key, within the
guard's retry budget and when a crash left it in doubt; with False the effect's policy decides.
Headers are not part of the fingerprint (tokens rotate), and ``Set-Cookie`` is not recorded.
"""

from __future__ import annotations

import hashlib
import json as _json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

from sagaguard.connectors.errors import (
    ProviderBusy,
    ProviderKeyConflict,
    ProviderRejected,
    ProviderUnavailable,
    ProviderUnreachable,
    classify,
    replayable,
)
from sagaguard.idempotency.checks import seconds
from sagaguard.idempotency.effect import Policy, ReconcileRequest, Retry, current_effect
from sagaguard.idempotency.errors import ConfigurationError
from sagaguard.idempotency.guard import Guard, Operation

__all__ = [
    "HEADER",
    "AsyncIdempotentHttp",
    "HttpResult",
    "IdempotentHttp",
    "header_value",
    "map_response",
    "map_transport_error",
]

HEADER = "Idempotency-Key"
_UNRECORDED = frozenset({"set-cookie", "authorization", "proxy-authorization"})


@dataclass(frozen=True, slots=True)
class HttpResult:
    """An answer as an HTTP effect records it."""

    status_code: int
    headers: dict[str, str] = field(default_factory=dict)
    """Lower-cased names; ``Set-Cookie`` is left out."""
    text: str = ""

    def json(self) -> Any:
        """The body parsed as JSON."""
        return _json.loads(self.text)


def header_value(provider_key: str) -> str:
    """The ``Idempotency-Key`` value: the key as a structured-field string (RFC 8941 sf-string)."""
    return '"' + provider_key.replace("\\", "\\\\").replace('"', '\\"') + '"'


def map_response(response: httpx.Response, provider_key: str = "") -> HttpResult:
    """The recorded result of a 2xx/3xx answer; the connector error of any other (see the table)."""
    status = response.status_code
    if status < 400:
        headers: dict[str, str] = {}
        for raw_name, raw_value in response.headers.raw:  # bytes: cheaper than Headers.items()
            name = raw_name.decode("latin-1").lower()
            if name not in _UNRECORDED:
                value = raw_value.decode("latin-1")
                headers[name] = f"{headers[name]}, {value}" if name in headers else value
        return HttpResult(status, headers, _text(response, headers.get("content-type", "")))
    message = f"{response.request.method} answered {status}"
    if status == 409:
        raise ProviderBusy(message, "http", status)
    if status == 422:
        raise ProviderKeyConflict(message, "http", status, key=provider_key)
    if status in (401, 403, 408, 429):
        raise ProviderRejected(message, "http", status, None, True)
    if status < 500:
        raise ProviderRejected(message, "http", status)
    raise ProviderUnavailable(message, "http", status)


def _text(response: httpx.Response, content_type: str) -> str:
    """``response.text``, without its parse of the Content-Type header when that names no charset.

    httpx then decodes with the client's default encoding (errors replaced), which is what this does
    directly; a charset in the header, or a default that is a function of the body, goes through
    ``response.text`` itself.
    """
    default = response.default_encoding
    if isinstance(default, str) and "charset" not in content_type.lower():
        return response.content.decode(default or "utf-8", errors="replace")
    return response.text


def map_transport_error(exc: httpx.HTTPError) -> Exception:
    """The connector error for an httpx exception raised while sending."""
    message = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout | httpx.PoolTimeout):
        return ProviderUnreachable(message, "http")
    return ProviderUnavailable(message, "http")


def _body_digest(request: httpx.Request, json: Any, data: Mapping[str, Any] | None) -> str:
    """A digest of what the request says: canonical JSON for ``json=`` and ``data=`` (key order does
    not matter), the bytes otherwise. A flat string keeps the guard's fingerprint on its fast path."""
    if json is not None or data:
        try:
            text = _json.dumps(
                [json, dict(data or {})], sort_keys=True, separators=(",", ":"), ensure_ascii=False
            )
            return "sha256:" + hashlib.sha256(text.encode()).hexdigest()
        except (TypeError, ValueError):
            pass  # keys that do not sort: the encoded body is what counts
    return "sha256:" + hashlib.sha256(request.content).hexdigest()


class _Http:
    """What the sync and async clients share: options, request building, the guard's options."""

    def __init__(
        self,
        guard: Guard,
        *,
        header: str = HEADER,
        server_dedups: bool = True,
        key_window: float | None = None,
        reconciler: Callable[[ReconcileRequest], Any] | None = None,
        policy: Policy | str = Policy.AT_MOST_ONCE,
        retry: Retry | None = None,
    ) -> None:
        self.guard = guard
        self.header = header
        self.server_dedups = server_dedups
        self.key_window = None if key_window is None else seconds("key_window", key_window)
        self.reconciler = reconciler
        self.policy = policy
        self.retry = retry if retry is not None else Retry()  # built once, not per call
        self._operations: dict[tuple[Any, ...], Operation[HttpResult]] = {}

    def _operation(self, effect: str) -> Operation[HttpResult]:
        """The guard's operation for the effect ``effect``, its options checked once per name (and
        again if an option attribute is changed)."""
        cache_key = (effect, self.server_dedups, self.key_window, self.reconciler, self.policy, self.retry)
        found = self._operations.get(cache_key)
        if found is None:
            found = self.guard.operation(effect, result_type=HttpResult, **self._guard_options())
            self._operations[cache_key] = found
        return found

    def _build(
        self,
        client: httpx.Client | httpx.AsyncClient,
        method: str,
        url: str,
        *,
        json: Any,
        content: bytes | str | None,
        data: Mapping[str, Any] | None,
        params: Mapping[str, Any] | None,
        headers: Mapping[str, str] | None,
        name: str | None,
    ) -> tuple[str, httpx.Request, dict[str, Any]]:
        """The effect's name, the request (without the key header) and the fingerprinted arguments.

        Raises:
            ConfigurationError: a URL that is not http(s) (before anything is claimed).
        """
        try:
            request = client.build_request(
                method, url, json=json, content=content, data=data, params=params, headers=headers
            )
        except (httpx.InvalidURL, httpx.UnsupportedProtocol, TypeError) as exc:
            raise ConfigurationError(f"bad HTTP request {method} {url!r}: {exc}") from exc
        if request.url.scheme not in ("http", "https"):
            raise ConfigurationError(f"unsupported URL scheme {request.url.scheme!r} in {url!r}")
        arguments = {
            "method": request.method,
            "url": str(request.url),
            "body": _body_digest(request, json, data),
        }
        return name or f"http.{request.method.lower()}", request, arguments

    def _guard_options(self) -> dict[str, Any]:
        options: dict[str, Any] = {
            "provider_idempotent": self.server_dedups,
            "provider_window": self.key_window,
            "reconciler": self.reconciler,
            "classify": classify,
            "permanent": replayable,
            "policy": self.policy,
            "retry": self.retry,
        }
        return options

    def _keyed(self, request: httpx.Request) -> tuple[httpx.Request, str]:
        provider_key = current_effect().provider_key
        request.headers[self.header] = header_value(provider_key)
        return request, provider_key


class IdempotentHttp(_Http):
    """Writes over an ``httpx.Client`` as guarded effects with the ``Idempotency-Key`` header.

    Args:
        guard: the guard the effects run under.
        client: the httpx client (base URL, auth, timeouts are its business); by default a new one.
        header: the header's name.
        server_dedups: the server honours the header, so an ambiguous call may be re-sent under
            the same key (False: the effect's ``policy`` settles an in-doubt call).
        key_window: seconds the server keeps a key (None: forever); older in-doubt calls are not
            re-sent.
        reconciler: asks the server whether an in-doubt call happened (optional).
        policy: what settles an in-doubt call nothing else can.
        retry: the guard's retry budget (409, 401/403/408/429, connect errors, and ambiguous errors
            when ``server_dedups``).

    Raises:
        ConfigurationError: ``key_window`` is not None or a finite number of seconds > 0.
    """

    def __init__(self, guard: Guard, client: httpx.Client | None = None, **options: Any) -> None:
        super().__init__(guard, **options)
        self.client = client if client is not None else httpx.Client()

    def request(
        self,
        method: str,
        url: str,
        *,
        name: str | None = None,
        json: Any = None,
        content: bytes | str | None = None,
        data: Mapping[str, Any] | None = None,
        params: Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None,
        key: str | None = None,
    ) -> HttpResult:
        """Send one write as the effect ``name`` (default ``http.<method>``).

        Raises:
            ProviderRejected, ProviderBusy, ProviderKeyConflict, ProviderUnreachable: see the table.
            OutcomeUnknown: the call may have been applied and nothing could settle it.
            ConfigurationError: a malformed request (nothing was claimed or sent).
        """
        effect, request, arguments = self._build(
            self.client, method, url, json=json, content=content, data=data, params=params,
            headers=headers, name=name,
        )  # fmt: skip

        def call() -> HttpResult:
            sent, provider_key = self._keyed(request)
            try:
                response = self.client.send(sent)
            except httpx.HTTPError as exc:
                raise map_transport_error(exc) from exc
            return map_response(response, provider_key)

        return self._operation(effect).run(call, arguments=arguments, key=key)

    def post(self, url: str, **kwargs: Any) -> HttpResult:
        """``request("POST", url, ...)``."""
        return self.request("POST", url, **kwargs)

    def put(self, url: str, **kwargs: Any) -> HttpResult:
        """``request("PUT", url, ...)``."""
        return self.request("PUT", url, **kwargs)

    def patch(self, url: str, **kwargs: Any) -> HttpResult:
        """``request("PATCH", url, ...)``."""
        return self.request("PATCH", url, **kwargs)

    def delete(self, url: str, **kwargs: Any) -> HttpResult:
        """``request("DELETE", url, ...)``."""
        return self.request("DELETE", url, **kwargs)


class AsyncIdempotentHttp(_Http):
    """The async twin of :class:`IdempotentHttp`, over an ``httpx.AsyncClient``."""

    def __init__(self, guard: Guard, client: httpx.AsyncClient | None = None, **options: Any) -> None:
        super().__init__(guard, **options)
        self.client = client if client is not None else httpx.AsyncClient()

    async def request(
        self,
        method: str,
        url: str,
        *,
        name: str | None = None,
        json: Any = None,
        content: bytes | str | None = None,
        data: Mapping[str, Any] | None = None,
        params: Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None,
        key: str | None = None,
    ) -> HttpResult:
        """See :meth:`IdempotentHttp.request`."""
        effect, request, arguments = self._build(
            self.client, method, url, json=json, content=content, data=data, params=params,
            headers=headers, name=name,
        )  # fmt: skip

        async def call() -> HttpResult:
            sent, provider_key = self._keyed(request)
            try:
                response = await self.client.send(sent)
            except httpx.HTTPError as exc:
                raise map_transport_error(exc) from exc
            return map_response(response, provider_key)

        return await self._operation(effect).arun(call, arguments=arguments, key=key)

    async def post(self, url: str, **kwargs: Any) -> HttpResult:
        """``await request("POST", url, ...)``."""
        return await self.request("POST", url, **kwargs)

    async def put(self, url: str, **kwargs: Any) -> HttpResult:
        """``await request("PUT", url, ...)``."""
        return await self.request("PUT", url, **kwargs)

    async def patch(self, url: str, **kwargs: Any) -> HttpResult:
        """``await request("PATCH", url, ...)``."""
        return await self.request("PATCH", url, **kwargs)

    async def delete(self, url: str, **kwargs: Any) -> HttpResult:
        """``await request("DELETE", url, ...)``."""
        return await self.request("DELETE", url, **kwargs)
