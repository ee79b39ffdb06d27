"""The HTTP sessions of ``sagaguard mcp proxy --http``: the SDK's streamable-HTTP app, with each
session's end watched, so that its run ends with it (:func:`~sagaguard.connectors.mcp.proxy.serve_http`).

The MCP SDK (2.3.0) reports no session's end to a server's handlers: a client's ``DELETE`` ends it,
and so does the SDK's own idle timer (``session_idle_timeout``, 30 minutes by default), silently.
The connection's teardown, which would tell, is private to the SDK (``ServerSession._connection``).
So :class:`HttpSessions` follows the sessions at the HTTP layer, where every request of the public
protocol passes: it learns a session from the response that opens it, holds it while any request
of it is in flight (a tool call, an open ``GET`` stream: the SDK's own idle rule), and ends it
either on a ``DELETE`` the SDK accepts or, idle for the limit, itself, through the SDK's app with
an in-process ``DELETE``; then it calls ``ended`` with the session's id. The proxy turns the SDK's
timer off, so there is one timer, and one that tells.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.abc
from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["HttpSessions"]

log = logging.getLogger(__name__)


def _bracketed(host: str) -> str:
    """``host`` as a ``Host`` header spells it (an IPv6 address in brackets)."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


_SESSION_HEADER = b"mcp-session-id"


def _session_of(headers: Any) -> str | None:
    """The ``mcp-session-id`` among ASGI ``headers`` (request or response), if any."""
    for name, value in headers or ():
        if name.lower() == _SESSION_HEADER and value:
            return bytes(value).decode("latin-1")
    return None


@dataclass
class _Session:
    """One HTTP session as the proxy sees it: its requests in flight, and the timer that ends it
    once there are none for the idle limit."""

    in_flight: int = 0
    timer: anyio.CancelScope | None = None


class HttpSessions:
    """The ASGI app the proxy serves: the SDK's app, with the sessions' ends watched.

    The SDK tells nothing of a session's end, so the proxy follows each session through the HTTP
    requests themselves (public protocol, every request passes here): a session is known from the
    response that opens it (the ``mcp-session-id`` the SDK answers a request without one with), is
    held while any request of it is in flight (a tool call, an open ``GET`` stream), and ends with
    a ``DELETE`` the SDK accepts or, idle for ``idle`` seconds, ended here. A request on an id it
    does not know (ended, never opened) goes to the SDK untouched, which answers 404.
    """

    def __init__(
        self,
        app: ASGIApp,
        ended: Callable[[str], Awaitable[None]],
        group: anyio.abc.TaskGroup,
        *,
        idle: float,
        path: str,
        host: str,
        port: int,
    ) -> None:
        self._app = app
        self._ended = ended
        self._group = group
        self._idle = idle
        self._path = path
        self._host = f"{_bracketed(host)}:{port}".encode("latin-1")
        self._sessions: dict[str, _Session] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)  # the lifespan: the SDK's session manager
            return
        asked = _session_of(scope.get("headers"))
        session = self._sessions.get(asked) if asked is not None else None
        if session is not None:
            self._enter(session)
        opened: str | None = None
        status = 0

        async def watched(message: Message) -> None:
            nonlocal session, opened, status
            if message["type"] == "http.response.start":
                status = int(message["status"])
                answered = _session_of(message.get("headers"))
                if asked is None and answered is not None and status < 400 and answered not in self._sessions:
                    # The SDK opened a session with this request (the client's initialize): held
                    # by this request until it is answered, its idle time counted from then on.
                    opened = answered
                    session = self._sessions[answered] = _Session()
                    self._enter(session)
            await send(message)

        try:
            await self._app(scope, receive, watched)
        finally:
            if session is not None:
                self._leave(asked if opened is None else opened, session)
        if asked is not None and scope["method"] == "DELETE" and 200 <= status < 300:
            # The client ended its session cleanly (a DELETE the SDK refused ended nothing: the
            # session goes on, or ends idle).
            self._forget(asked)
            await self._ended(asked)

    def _enter(self, session: _Session) -> None:
        session.in_flight += 1
        if session.timer is not None:
            session.timer.cancel()
            session.timer = None

    def _leave(self, session_id: str | None, session: _Session) -> None:
        session.in_flight -= 1
        if session_id is not None and session.in_flight == 0 and self._sessions.get(session_id) is session:
            session.timer = anyio.CancelScope()
            self._group.start_soon(self._countdown, session_id, session, session.timer)

    def _forget(self, session_id: str) -> None:
        session = self._sessions.pop(session_id, None)
        if session is not None and session.timer is not None:
            session.timer.cancel()

    async def _countdown(self, session_id: str, session: _Session, timer: anyio.CancelScope) -> None:
        with timer:
            await anyio.sleep(self._idle)
        # A request that came meanwhile cancelled the timer (and holds the session): only a timer
        # that ran out with nothing in flight ends it. No await since the check: nothing can
        # come between it and the session being forgotten.
        if timer.cancel_called or session.in_flight or self._sessions.get(session_id) is not session:
            return
        self._forget(session_id)
        try:
            status = await self._delete(session_id)
            if not 200 <= status < 300 and status != 404:  # 404: the SDK had ended it already
                log.warning("mcp proxy: ending idle session %s: the SDK answered %s", session_id, status)
        except Exception as exc:  # the SDK's app is stopping: the run ends all the same
            log.warning("mcp proxy: ending idle session %s failed: %s", session_id, exc)
        # Shielded: a proxy stopping meanwhile does not cut the run's end short.
        with anyio.CancelScope(shield=True):
            await self._ended(session_id)

    async def _delete(self, session_id: str) -> int:
        """End the session at the SDK as its client would: a ``DELETE`` with its id, sent to the
        SDK's app in-process. Returns the HTTP status it answered."""
        scope: Scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "DELETE",
            "scheme": "http", "path": self._path, "raw_path": self._path.encode(), "root_path": "",
            "query_string": b"", "client": None, "server": None,
            "headers": [(b"host", self._host), (_SESSION_HEADER, session_id.encode("latin-1"))],
        }  # fmt: skip
        status = 0
        asked = False

        async def receive() -> Message:
            nonlocal asked
            if asked:
                return {"type": "http.disconnect"}
            asked = True
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])

        await self._app(scope, receive, send)
        return status
