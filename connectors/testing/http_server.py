"""A local HTTP API that honours the ``Idempotency-Key`` header as the IETF draft defines it.

::

    with LocalIdempotentApi() as api:
        httpx.post(api.url + "/orders", json={...}, headers={"Idempotency-Key": '"k1"'})
        assert api.counters()["applied"] == 1

Every POST, PUT, PATCH or DELETE creates one *resource* (``{"id", "method", "path", "body", "key"}``)
and answers 201 with it. The draft's rules (draft-ietf-httpapi-idempotency-key-header):

- the header is a structured-field string (``"..."``); a bare token is accepted too;
- missing where required (``require_key``, default True): 400;
- the same key with another payload (method, path or body): 422;
- the same key while the first request is still processing: 409;
- a retry after completion gets the first response again (``Idempotent-Replayed: true``).

``POST /status/{code}`` answers ``code`` without applying anything (for error-mapping tests), and
``GET /resources?key=K`` lists the resources made under key ``K`` (a reconciler can ask it).
Counters: ``requests``, ``applied``, ``replays``, ``conflicts`` (422), ``in_use`` (409),
``missing_key`` (400), ``faults_fired``.
"""

from __future__ import annotations

import hashlib
import json
import re
import urllib.parse
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from sagaguard.connectors.testing._service import App, LocalService, Reply, Request

__all__ = ["IdempotentApiApp", "LocalIdempotentApi", "parse_key"]

_STATUS = re.compile(r"^/status/(?P<code>\d{3})$")
_WRITES = ("POST", "PUT", "PATCH", "DELETE")


def parse_key(value: str | None) -> str | None:
    """The key of an ``Idempotency-Key`` header: a structured-field string, or a bare token."""
    if value is None:
        return None
    value = value.strip()
    if len(value) >= 2 and value[0] == value[-1] == '"':
        return value[1:-1].replace('\\"', '"').replace("\\\\", "\\")
    return value or None


@dataclass
class _Entry:
    fingerprint: str
    reply: Reply | None = None


class IdempotentApiApp(App):
    """The request handling of :class:`LocalIdempotentApi`."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__(config)
        self.require_key = bool(config.get("require_key", True))
        self.keys: dict[str, _Entry] = {}
        self.resources: list[dict[str, Any]] = []
        self.count: dict[str, int] = {}

    def _inc(self, name: str) -> None:
        self.count[name] = self.count.get(name, 0) + 1

    def counters(self) -> dict[str, int]:
        return dict(self.count)

    def reset(self) -> None:
        self.keys.clear()
        self.resources.clear()
        self.count.clear()

    def handle(self, request: Request) -> Reply:
        with self.lock:
            self._inc("requests")
        if request.method == "GET":
            return self._read(request)
        if request.method not in _WRITES:
            return Reply(HTTPStatus.METHOD_NOT_ALLOWED, {"error": "method not allowed"})
        key = parse_key(request.headers.get("idempotency-key"))
        status = _STATUS.match(request.path)
        if key is None:
            if self.require_key and status is None:
                with self.lock:
                    self._inc("missing_key")
                return Reply(HTTPStatus.BAD_REQUEST, {"error": "Idempotency-Key header is required"})
            request.pause()
            with self.lock:
                return self._apply(request, None)
        fingerprint = hashlib.sha256(
            json.dumps([request.method, request.path, request.body.decode(errors="replace")]).encode()
        ).hexdigest()
        with self.lock:
            entry = self.keys.get(key)
            if entry is not None and entry.fingerprint != fingerprint:
                self._inc("conflicts")
                return Reply(
                    HTTPStatus.UNPROCESSABLE_ENTITY, {"error": "Idempotency-Key reused with another payload"}
                )
            if entry is not None and entry.reply is None:
                self._inc("in_use")
                return Reply(
                    HTTPStatus.CONFLICT, {"error": "a request with this Idempotency-Key is being processed"}
                )
            if entry is not None and entry.reply is not None:
                self._inc("replays")
                return Reply(entry.reply.status, entry.reply.body, {"Idempotent-Replayed": "true"})
            entry = _Entry(fingerprint)
            self.keys[key] = entry
        try:
            request.pause()
            with self.lock:
                reply = self._apply(request, key)
        except BaseException:
            with self.lock:
                self.keys.pop(key, None)
            raise
        with self.lock:
            if status is not None:
                self.keys.pop(key, None)  # refused before processing: nothing stored
            else:
                entry.reply = reply
        return reply

    def _apply(self, request: Request, key: str | None) -> Reply:
        status = _STATUS.match(request.path)
        if status is not None:
            return Reply(int(status["code"]), {"error": f"asked for {status['code']}"})
        try:
            body = json.loads(request.body) if request.body else None
        except ValueError:
            body = request.body.decode(errors="replace")
        resource = {
            "id": f"res_{uuid.uuid4().hex[:16]}",
            "method": request.method,
            "path": request.path,
            "body": body,
            "key": key,
        }
        self.resources.append(resource)
        self._inc("applied")
        return Reply(HTTPStatus.CREATED, resource, {"Location": f"/resources/{resource['id']}"})

    def _read(self, request: Request) -> Reply:
        query = dict(urllib.parse.parse_qsl(request.query))
        if request.path == "/resources":
            with self.lock:
                found = [r for r in self.resources if "key" not in query or r["key"] == query["key"]]
            return Reply(HTTPStatus.OK, {"resources": found})
        return Reply(HTTPStatus.NOT_FOUND, {"error": f"no such path {request.path}"})


class LocalIdempotentApi(LocalService):
    """The IETF-draft API server, in its own process (or a thread), as a context manager.

    Args:
        require_key: answer 400 to a write without an ``Idempotency-Key`` header.
        in_process: run in a thread of this process instead of its own process.
    """

    def __init__(self, *, require_key: bool = True, in_process: bool = False) -> None:
        super().__init__("http", {"require_key": require_key}, in_process=in_process)
