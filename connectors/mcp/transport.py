"""An HTTP transport for the MCP SDK's streamable-HTTP client that tells *not sent* from *lost*.

The SDK runs each request's POST in its transport's task group, so a connection error there (the
server is dead: connection refused) ends the whole session, cancelling the call that waits for the
answer; a guarded call cancelled that way is left in doubt although its request never left. This
transport answers such a request itself, with a JSON-RPC error of code :data:`UNSENT`, which the SDK
hands to the waiting call as an ``MCPError`` and the session survives:

- a connection that could not be made (``ConnectError``, ``ConnectTimeout``): nothing was written,
  whatever the request;
- any transport error of a request other than ``tools/call`` (``tools/list``, the liveness probe
  :class:`~sagaguard.connectors.mcp.session.GuardedSession` sends first, ``initialize``): these
  change nothing, so a lost answer is as good as unsent.

A ``tools/call`` whose connection failed once it was made (reset, read error, read timeout) may
have reached the server: it is answered with the SDK's own ``CONNECTION_CLOSED``, as when a stdio
server's pipe closes under a call, so the guard leaves it in doubt (rightly) and the session lives
on to refuse later calls as not sent. A GET (the server's event stream) is left to the SDK.
"""

from __future__ import annotations

import json
from typing import Any

import httpx2
from mcp import types

__all__ = ["UNSENT", "UnsentAwareTransport", "mcp_http_client"]

UNSENT = -32099
"""The JSON-RPC error code (the implementation-defined server range, unused by the SDK) of a
request this transport answered because it did not reach the server."""

_CONNECT_FAILED = (httpx2.ConnectError, httpx2.ConnectTimeout)
_TIMEOUT = httpx2.Timeout(30.0, read=300.0)
"""The SDK's documented defaults for its own client: 30 s to connect, write and wait for a pooled
connection, 300 s to read (a server may hold a response stream open)."""


def _method(request: httpx2.Request) -> str | None:
    """The JSON-RPC method of a POSTed message, or None (a GET, a batch, not JSON)."""
    if request.method != "POST":
        return None
    try:
        body = json.loads(request.content)
    except (ValueError, httpx2.RequestNotRead):
        return None
    method = body.get("method") if isinstance(body, dict) else None
    return method if isinstance(method, str) else None


def _why(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}"


def _answer(request: httpx2.Request, code: int, message: str) -> httpx2.Response:
    """The JSON-RPC error the SDK hands to the request's waiting caller (it reads an error body at
    any status, and answers it under the request's own id)."""
    error = {"code": code, "message": message}
    return httpx2.Response(503, json={"jsonrpc": "2.0", "id": None, "error": error}, request=request)


class UnsentAwareTransport(httpx2.AsyncBaseTransport):
    """Wraps ``inner`` (default: ``httpx2.AsyncHTTPTransport()``): see the module docstring."""

    def __init__(self, inner: httpx2.AsyncBaseTransport | None = None) -> None:
        self._inner = inner or httpx2.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        """The inner transport's response, or an :data:`UNSENT` error for a request that did not
        reach the server (module docstring)."""
        method = _method(request)
        try:
            return await self._inner.handle_async_request(request)
        except _CONNECT_FAILED as exc:
            if request.method != "POST":
                raise  # the SDK's event stream (GET) handles its own errors
            return _answer(request, UNSENT, f"the server is unreachable ({_why(exc)})")
        except httpx2.TransportError as exc:
            if request.method != "POST":
                raise
            if method is None or method == "tools/call":
                # It may have reached the server: the call is in doubt, as when a stdio server's
                # pipe closes under it (the SDK's CONNECTION_CLOSED), and the session lives on.
                return _answer(
                    request,
                    types.CONNECTION_CLOSED,
                    f"the connection failed after the request left ({_why(exc)})",
                )
            return _answer(request, UNSENT, f"the server is unreachable ({_why(exc)})")

    async def aclose(self) -> None:
        """Close the inner transport."""
        await self._inner.aclose()


def mcp_http_client(**options: Any) -> httpx2.AsyncClient:
    """An ``httpx2.AsyncClient`` for ``streamable_http_client(http_client=...)`` with the SDK's
    default timeouts and :class:`UnsentAwareTransport`; ``options`` (``headers``, ``auth``,
    ``timeout``, ...) go to the client."""
    options.setdefault("timeout", _TIMEOUT)
    return httpx2.AsyncClient(transport=UnsentAwareTransport(), **options)
