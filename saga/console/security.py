"""Who may act: the token (a Bearer header, or a login that puts the user in the signed session)
and the CSRF token every form carries.

A request acts when the console has a token and is not read-only, and either its
``Authorization: Bearer`` header carries the token (scripts: no cookie, so no CSRF to fear), or
its session (a cookie signed by Starlette's SessionMiddleware) holds a logged-in user and its form
carries the session's CSRF token.
"""

from __future__ import annotations

import secrets

from starlette.requests import Request

from sagaguard.saga.console.settings import ConsoleSettings

__all__ = ["Refused", "bearer_actor", "csrf_token", "check_csrf", "session_user"]

ACTOR_HEADER = "X-Sagaguard-Actor"
"""The header that names a script's actor (default: ``token``)."""


class Refused(Exception):
    """A request not allowed to act: ``status`` 401 (no credentials), 403 (read-only, bad token,
    CSRF)."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


def csrf_token(request: Request) -> str:
    """The session's CSRF token, made on first use."""
    token = request.session.get("csrf")
    if not isinstance(token, str):
        token = secrets.token_urlsafe(32)
        request.session["csrf"] = token
    return token


def check_csrf(request: Request, sent: object) -> None:
    """Refuse a form whose CSRF field is not the session's.

    Raises:
        Refused: 403, the field is missing or wrong.
    """
    expected = request.session.get("csrf")
    if (
        not isinstance(sent, str)
        or not isinstance(expected, str)
        or not secrets.compare_digest(sent, expected)
    ):
        raise Refused(403, "csrf: the form's token is missing or stale; reload the page and try again")


def bearer_actor(request: Request, settings: ConsoleSettings) -> str | None:
    """The actor of a request that carries ``Authorization: Bearer <token>``; None without one.

    Raises:
        Refused: 403, the token is wrong, or the console is read-only.
    """
    header = request.headers.get("authorization", "")
    if not header.lower().startswith("bearer "):
        return None
    if not settings.can_act or settings.token is None:
        raise Refused(403, "read-only: this console was started without a token (or with --read-only)")
    if not secrets.compare_digest(header[7:].strip().encode(), settings.token.encode()):
        raise Refused(403, "the token is wrong")
    return (request.headers.get(ACTOR_HEADER) or "token").strip()[:100] or "token"


def session_user(request: Request) -> str | None:
    """The logged-in user's name, or None."""
    user = request.session.get("user")
    return user if isinstance(user, str) and user else None
