"""The console's ASGI application: server-rendered pages, and the same routes as a JSON API.

Every page answers JSON to a request that accepts ``application/json``. Pages read; the only
writes are ``POST /act/{action}`` (after the confirmation page ``GET /confirm/{action}``), and the
login. See :mod:`sagaguard.saga.console.security` for who may act.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import secrets
from collections.abc import AsyncIterator, Mapping
from importlib.resources import files
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.sessions import SessionMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates

from sagaguard.idempotency.audit import AuditFilter, AuditLog
from sagaguard.idempotency.audit_cli import entry_json, rfc3339
from sagaguard.idempotency.backends.urls import masked
from sagaguard.idempotency.cliutil import duration
from sagaguard.idempotency.errors import ConfigurationError, IdempotencyError, RecordNotFound
from sagaguard.idempotency.operator import holder_gone, needs_resolution
from sagaguard.idempotency.outbox.control import OutboxControl
from sagaguard.idempotency.records import Record
from sagaguard.idempotency.store import IdempotencyStore
from sagaguard.saga.console.actions import ACTIONS, Context, perform
from sagaguard.saga.console.bulk import BULK, MAX_ITEMS, new_action_id, preview, run_bulk
from sagaguard.saga.console.data import (
    EFFECT_LISTS,
    PAGE,
    SAGA_LISTS,
    effect_counts,
    effect_page,
    saga_counts,
    saga_page,
    saga_view,
)
from sagaguard.saga.console.security import Refused, bearer_actor, check_csrf, csrf_token, session_user
from sagaguard.saga.console.settings import ConsoleSettings
from sagaguard.saga.errors import SagaError, SagaNotFound
from sagaguard.saga.journal import SagaJournal
from sagaguard.saga.records import SagaRecord

__all__ = ["create_app"]

_HIDDEN = "hidden (start the console with --show-payloads to see it)"


def _seconds(request: Request, name: str) -> float | None:
    """The query parameter ``name`` as seconds (``3600``, ``90m``, ``2h``, ``1d``), or None.

    Raises:
        ConfigurationError: not a number of seconds, minutes, hours or days.
    """
    text = request.query_params.get(name, "").strip().lower()
    if not text:
        return None
    unit = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}.get(text[-1])
    try:
        value = float(text[:-1] if unit else text) * (unit or 1.0)
    except ValueError:
        raise ConfigurationError(f"{name} must be a number of seconds, or with m, h or d: {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise ConfigurationError(f"{name} must be a finite, non-negative duration")
    return value


def _wants_json(request: Request) -> bool:
    return "application/json" in request.headers.get("accept", "")


def _effect_json(record: Record, show: bool, now: float) -> dict[str, Any]:
    data = dataclasses.asdict(record)
    data["state"] = record.state.value
    data["needs_resolution"] = needs_resolution(record, now)
    data["holder_dead"] = holder_gone(record, now)
    data["created"] = rfc3339(record.created_at)
    if not show:
        data["result"] = data["error"] = None
        data["payloads_hidden"] = True
    return data


def _saga_json(record: SagaRecord, show: bool) -> dict[str, Any]:
    data = dataclasses.asdict(record)
    data["state"] = record.state.value
    data["created"] = rfc3339(record.created_at)
    if not show:
        data["input"] = None
        data["payloads_hidden"] = True
    return data


class Console:
    """The routes, bound to one ledger and journal."""

    def __init__(
        self, settings: ConsoleSettings, store: IdempotencyStore, journal: SagaJournal, audit: AuditLog,
        outbox: OutboxControl | None = None,
    ) -> None:  # fmt: skip
        self.outbox = outbox
        self.settings = settings
        self.store = store
        self.journal = journal
        self.audit = audit
        self.templates = Jinja2Templates(directory=str(files("sagaguard.saga.console") / "templates"))
        self.templates.env.globals.update(duration=duration, rfc3339=rfc3339, hidden=_HIDDEN)

    # -- rendering -----------------------------------------------------------------------------

    def page(self, request: Request, name: str, data: Mapping[str, Any], status: int = 200) -> Response:
        """``name`` rendered with ``data``, or ``data`` as JSON when the request asks for it."""
        if _wants_json(request):
            return JSONResponse(data.get("json", {}), status_code=status)
        context = {
            "store": masked(self.settings.store_url),
            "settings": self.settings,
            "user": session_user(request),
            "csrf": csrf_token(request),
            "flash": request.session.pop("flash", None),
            "now": self.store.now(),
            **{k: v for k, v in data.items() if k != "json"},
        }
        return self.templates.TemplateResponse(request, name, context, status_code=status)

    def error(self, request: Request, status: int, error: str, message: str) -> Response:
        """A refusal, as a page or as JSON."""
        data = {"ok": False, "error": error, "message": message}
        return self.page(request, "error.html", {"json": data, **data, "status": status}, status)

    # -- pages ---------------------------------------------------------------------------------

    def home(self, request: Request) -> Response:
        effects, sagas = effect_counts(self.store), saga_counts(self.journal)
        outbox = None if self.outbox is None else self.outbox.status()
        data = {
            "outbox": None if outbox is None else {**dataclasses.asdict(outbox), "depth": outbox.depth},
            "store": masked(self.settings.store_url),
            "effects": [dataclasses.asdict(c) | {"shown": c.shown} for c in effects],
            "sagas": [dataclasses.asdict(c) | {"shown": c.shown} for c in sagas],
            "read_only": not self.settings.can_act,
        }
        return self.page(
            request, "home.html", {"json": data, "effects": effects, "sagas": sagas, "outbox": outbox}
        )

    def effects(self, request: Request) -> Response:
        view = request.query_params.get("view", "in_doubt")
        if view not in EFFECT_LISTS:
            return self.error(request, 400, "ConfigurationError", f"no effect list {view!r}")
        prefix = request.query_params.get("prefix", "")
        try:
            older, newer = _seconds(request, "older"), _seconds(request, "newer")
        except ConfigurationError as exc:
            return self.error(request, 400, type(exc).__name__, str(exc))
        holder = request.query_params.get("holder", "")
        if holder not in ("", "dead"):
            message = f"holder must be 'dead' or empty, not {holder!r}"
            return self.error(request, 400, "ConfigurationError", message)
        after = request.query_params.get("after") or None
        dead = holder == "dead"
        page = effect_page(
            self.store, view, prefix=prefix, after=after, older=older, newer=newer, dead_holder=dead
        )
        now = self.store.now()
        show = self.settings.show_payloads
        data = {"items": [_effect_json(r, show, now) for r in page.items], "next_after": page.next_after}
        return self.page(
            request, "effects.html",
            {"json": data, "page": page, "view": view, "prefix": prefix, "views": list(EFFECT_LISTS),
             "ages": self._ages(request), "holder": holder, "holder_gone": holder_gone},
        )  # fmt: skip

    @staticmethod
    def _ages(request: Request) -> dict[str, str]:
        return {name: request.query_params.get(name, "") for name in ("older", "newer")}

    def effect(self, request: Request) -> Response:
        key = request.path_params["key"]
        record = self.store.get(key)
        if record is None:
            return self.error(request, 404, "RecordNotFound", f"no effect record {key!r}")
        now = self.store.now()
        entries = self.audit.list(AuditFilter(target=record.key), limit=50)
        data = {
            **_effect_json(record, self.settings.show_payloads, now),
            "audit": [entry_json(e) for e in entries],
        }
        return self.page(
            request, "effect.html",
            {"json": data, "record": record, "resolvable": needs_resolution(record, now), "audit": entries},
        )  # fmt: skip

    def sagas(self, request: Request) -> Response:
        view = request.query_params.get("view", "needs_attention")
        if view not in SAGA_LISTS:
            return self.error(request, 400, "ConfigurationError", f"no saga list {view!r}")
        prefix, name = request.query_params.get("prefix", ""), request.query_params.get("name", "")
        after = request.query_params.get("after") or None
        try:
            older, newer = _seconds(request, "older"), _seconds(request, "newer")
        except ConfigurationError as exc:
            return self.error(request, 400, type(exc).__name__, str(exc))
        page = saga_page(self.journal, view, prefix=prefix, name=name, after=after, older=older, newer=newer)
        show = self.settings.show_payloads
        data = {"items": [_saga_json(r, show) for r in page.items], "next_after": page.next_after}
        return self.page(
            request, "sagas.html",
            {"json": data, "page": page, "view": view, "prefix": prefix, "name": name,
             "ages": self._ages(request),
             "views": list(SAGA_LISTS)},
        )  # fmt: skip

    def saga(self, request: Request) -> Response:
        saga_id = request.path_params["saga_id"]
        view = saga_view(self.journal, self.store, self.audit, saga_id, namespace=self.settings.namespace)
        if view is None:
            return self.error(request, 404, "SagaNotFound", f"no saga {saga_id!r}")
        show = self.settings.show_payloads
        now = view.now
        data = {
            **_saga_json(view.snapshot.saga, show),
            "steps": [
                {
                    "index": s.index, "name": s.name, "kind": s.kind, "state": s.state, "tool": s.tool,
                    "call_outcome": s.call_outcome, "trace_id": s.trace_id,
                    "effects": [_effect_json(r, show, now) for r in s.effects],
                    **({"compensation": s.arguments, "result": s.result} if show else {}),
                }
                for s in view.steps
            ],
            "timeline": [
                {"at": e.at, "time": rfc3339(e.at), "step": e.step, "what": e.what, "detail": e.detail,
                 "operator": e.operator}
                for e in view.events
            ],
            "signals": sorted(view.snapshot.signals),
            "audit": [entry_json(e) for e in view.audit],
        }  # fmt: skip
        return self.page(request, "saga.html", {"json": data, "view": view})

    def outbox_page(self, request: Request) -> Response:
        if self.outbox is None:
            data: dict[str, Any] = {"outbox": None}
            empty: dict[str, Any] = {"json": data, "status": None, "letters": [], "after": None}
            return self.page(request, "outbox.html", empty)
        after = request.query_params.get("after") or None
        blocked_after = request.query_params.get("blocked_after") or None
        status = self.outbox.status()
        try:
            letters = self.outbox.dead_letters(limit=PAGE + 1, after=after)
            blocked = self.outbox.blocked_messages(limit=PAGE + 1, after=blocked_after)
        except ConfigurationError as exc:  # a page parameter that is not a message id
            return self.error(request, 400, type(exc).__name__, str(exc))
        more = letters[PAGE - 1].id if len(letters) > PAGE else None
        more_blocked = blocked[PAGE - 1].id if len(blocked) > PAGE else None
        letters, blocked = letters[:PAGE], blocked[:PAGE]
        data = {
            "status": {**dataclasses.asdict(status), "depth": status.depth},
            "dead_letters": [dataclasses.asdict(d) for d in letters],
            "next_after": more,
            "blocked_messages": [dataclasses.asdict(b) for b in blocked],
            "blocked_next_after": more_blocked,
        }
        shown = {
            "json": data, "status": status, "letters": letters, "after": more, "blocked": blocked,
            "blocked_after": more_blocked,
        }  # fmt: skip
        return self.page(request, "outbox.html", shown)

    def audit_page(self, request: Request) -> Response:
        q = request.query_params
        where = AuditFilter(
            target=q.get("target") or None, target_prefix=q.get("prefix") or None,
            actor=q.get("actor") or None, action=q.get("action") or None,
        )  # fmt: skip
        entries = self.audit.list(where, limit=200)
        data = {"items": [entry_json(e) for e in entries]}
        return self.page(request, "audit.html", {"json": data, "entries": entries, "where": where})

    # -- acting --------------------------------------------------------------------------------

    def confirm(self, request: Request) -> Response:
        action = ACTIONS.get(request.path_params["action"])
        if action is None:
            return self.error(request, 404, "ConfigurationError", "no such action")
        fields = {name: request.query_params.get(name, "") for name in action.fields}
        data = {"action": action.name, "target": request.query_params.get("target", ""), "fields": fields}
        return self.page(request, "confirm.html", {"json": data, **data, "action": action})

    async def act(self, request: Request) -> Response:
        action = ACTIONS.get(request.path_params["action"])
        if action is None:
            return self.error(request, 404, "ConfigurationError", "no such action")
        form: dict[str, Any]
        try:
            if request.headers.get("content-type", "").startswith("application/json"):
                body = await request.json()
                form = dict(body) if isinstance(body, dict) else {}
            else:
                form = dict(await request.form())
            actor = self._actor(request, form)
        except Refused as exc:
            return self.error(request, exc.status, "Refused", exc.reason)
        except ValueError:
            return self.error(request, 400, "ConfigurationError", "the body is not a JSON object")
        target = str(form.get("target", ""))
        ctx = Context(self.store, self.journal, self.audit, actor, self.outbox)
        try:
            done = perform(action, ctx, target, form)
        except ConfigurationError as exc:
            return self.error(request, 400, type(exc).__name__, str(exc))
        except (RecordNotFound, SagaNotFound) as exc:
            return self.error(request, 404, type(exc).__name__, str(exc))
        except (IdempotencyError, SagaError) as exc:
            return self.error(request, 409, type(exc).__name__, str(exc))
        if _wants_json(request):
            return JSONResponse(
                {"ok": True, "action": action.name, "target": target, "outcome": done.outcome}
            )
        request.session["flash"] = f"{action.title} {target}: {done.outcome}"
        return RedirectResponse(done.back, status_code=303)

    def bulk_preview(self, request: Request) -> Response:
        name = request.path_params["action"]
        q = request.query_params
        view = q.get("view", "")
        try:
            targets = preview(
                self.store, self.journal, name, view=view, prefix=q.get("prefix", ""), name=q.get("name", ""),
                outbox=self.outbox,
            )  # fmt: skip
        except ConfigurationError as exc:
            return self.error(request, 400, type(exc).__name__, str(exc))
        action_id = new_action_id()
        data = {
            "action": name,
            "action_id": action_id,
            "count": len(targets),
            "targets": targets,
            "capped": len(targets) >= MAX_ITEMS,
        }
        return self.page(
            request, "bulk.html",
            {"json": data, **data, "action": ACTIONS[name], "view": view, "fixed": BULK[name][1]},
        )  # fmt: skip

    async def bulk_run(self, request: Request) -> Response:
        name = request.path_params["action"]
        form: dict[str, Any]
        try:
            if request.headers.get("content-type", "").startswith("application/json"):
                body = await request.json()
                form = dict(body) if isinstance(body, dict) else {}
            else:
                raw = await request.form()
                form = {**dict(raw), "targets": raw.getlist("targets")}
            actor = self._actor(request, form)
        except Refused as exc:
            return self.error(request, exc.status, "Refused", exc.reason)
        except ValueError:
            return self.error(request, 400, "ConfigurationError", "the body is not a JSON object")
        targets = form.get("targets")
        if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
            return self.error(request, 400, "ConfigurationError", "targets must be a list of ids")
        ctx = Context(self.store, self.journal, self.audit, actor, self.outbox)
        try:
            result = run_bulk(ctx, name, str(form.get("action_id", "")), targets, form)
        except ConfigurationError as exc:
            return self.error(request, 400, type(exc).__name__, str(exc))
        if _wants_json(request):
            return JSONResponse({"ok": True, "action": name, **result.to_json()})
        if result.repeated:
            request.session["flash"] = f"bulk {name} {result.action_id[:8]}: already done, nothing done again"
        else:
            done, refused = len(result.outcomes), len(result.refused)
            request.session["flash"] = f"bulk {name} {result.action_id[:8]}: {done} done, {refused} refused"
        return RedirectResponse(f"/audit?target={result.action_id}", status_code=303)

    def _actor(self, request: Request, form: Mapping[str, Any]) -> str:
        actor = bearer_actor(request, self.settings)
        if actor is not None:
            return actor
        if not self.settings.can_act:
            raise Refused(403, "read-only: this console was started without a token (or with --read-only)")
        check_csrf(request, form.get("csrf"))
        user = session_user(request)
        if user is None:
            raise Refused(401, "log in with the console's token to act")
        return user

    async def login(self, request: Request) -> Response:
        if request.method == "GET":
            return self.page(request, "login.html", {"json": {"can_act": self.settings.can_act}})
        form = await request.form()
        try:
            check_csrf(request, form.get("csrf"))
        except Refused as exc:
            return self.error(request, exc.status, "Refused", exc.reason)
        token, name = str(form.get("token", "")), str(form.get("name", "")).strip()[:100]
        if not self.settings.can_act or self.settings.token is None:
            return self.error(request, 403, "Refused", "read-only: this console takes no login")
        if not name or not secrets.compare_digest(token.encode(), self.settings.token.encode()):
            return self.error(request, 403, "Refused", "a name and the right token are needed")
        request.session["user"] = name
        request.session["csrf"] = secrets.token_urlsafe(32)  # a new session: a new CSRF token
        request.session["flash"] = f"logged in as {name}"
        return RedirectResponse("/", status_code=303)

    async def logout(self, request: Request) -> Response:
        form = await request.form()
        try:
            check_csrf(request, form.get("csrf"))
        except Refused as exc:
            return self.error(request, exc.status, "Refused", exc.reason)
        request.session.clear()
        return RedirectResponse("/", status_code=303)


def create_app(
    settings: ConsoleSettings, *, store: IdempotencyStore, journal: SagaJournal, audit: AuditLog,
    outbox: OutboxControl | None = None, close: bool = False,
) -> Starlette:  # fmt: skip
    """The console as an ASGI application.

    Args:
        settings: what it shows and who may act.
        store: the ledger it reads and acts on.
        journal: the saga journal.
        audit: the audit log actions are recorded in.
        outbox: the outbox's control, when the ledger's database holds one (its pages and actions).
        close: close the three when the application shuts down.
    """
    console = Console(settings, store, journal, audit, outbox)

    @contextlib.asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        try:
            yield
        finally:
            if close:
                for thing in (audit, journal, store):
                    with contextlib.suppress(Exception):
                        thing.close()

    routes = [
        Route("/", console.home),
        Route("/effects", console.effects),
        Route("/effects/{key}", console.effect),
        Route("/sagas", console.sagas),
        Route("/sagas/{saga_id:path}", console.saga),
        Route("/audit", console.audit_page),
        Route("/outbox", console.outbox_page),
        Route("/confirm/{action}", console.confirm),
        Route("/act/{action}", console.act, methods=["POST"]),
        Route("/bulk/{action}", console.bulk_preview, methods=["GET"]),
        Route("/bulk/{action}", console.bulk_run, methods=["POST"]),
        Route("/login", console.login, methods=["GET", "POST"]),
        Route("/logout", console.logout, methods=["POST"]),
        Mount(
            "/static", StaticFiles(directory=str(files("sagaguard.saga.console") / "static")), name="static"
        ),
    ]
    middleware = [
        # The CSRF token and the logged-in user live in this signed cookie; SameSite=strict keeps
        # other sites' pages from sending it at all.
        Middleware(
            SessionMiddleware, secret_key=settings.secret, same_site="strict", session_cookie="sagaguard_ui"
        )
    ]
    return Starlette(routes=routes, middleware=middleware, lifespan=lifespan)
