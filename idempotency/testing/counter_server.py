"""The server side of the counter service: the ledger of charges and its HTTP handler, run as
``python -m sagaguard.idempotency.testing counter``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import sys
import threading
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Mapping
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, cast


class _Ledger:
    """The service's state: every charge, and the first reply per idempotency key."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.charges: list[dict[str, Any]] = []
        self.by_key: dict[str, int] = {}
        self.replies: dict[str, tuple[str, dict[str, Any]]] = {}

    def charge(
        self, body: Mapping[str, Any], idempotency_key: str | None, dedup: bool
    ) -> tuple[int, Any, bool]:
        """Returns (status, reply, replayed)."""
        key, amount = body.get("key"), body.get("amount")
        if not isinstance(key, str) or not key or not isinstance(amount, int) or isinstance(amount, bool):
            return HTTPStatus.BAD_REQUEST, {"error": "need a JSON body {key: str, amount: int}"}, False
        provider_key = body.get("provider_key")
        if provider_key is not None and not isinstance(provider_key, str):
            return HTTPStatus.BAD_REQUEST, {"error": "provider_key must be a string"}, False
        params = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
        with self.lock:
            if idempotency_key and dedup and idempotency_key in self.replies:
                first_params, reply = self.replies[idempotency_key]
                if first_params != params:
                    # Stripe: "Keys for idempotent requests can only be used with the same parameters".
                    return (
                        HTTPStatus.BAD_REQUEST,
                        {"error": "idempotency key reused with other parameters"},
                        False,
                    )
                return HTTPStatus.OK, reply, True
            self.by_key[key] = self.by_key.get(key, 0) + 1
            reply = {
                "charge_id": f"ch_{uuid.uuid4().hex[:12]}",
                "key": key,
                "amount": amount,
                "count": len(self.charges) + 1,
                "provider_key": provider_key,
                "idempotency_key": idempotency_key,
            }
            self.charges.append(reply)
            if idempotency_key and dedup:
                self.replies[idempotency_key] = (params, reply)
            return HTTPStatus.OK, reply, False

    def count(self) -> dict[str, Any]:
        with self.lock:
            return {"count": len(self.charges), "by_key": dict(self.by_key)}

    def find(self, provider_key: str | None, key: str | None) -> dict[str, Any]:
        with self.lock:
            found = [
                c
                for c in self.charges
                if (provider_key is None or provider_key in (c["provider_key"], c["idempotency_key"]))
                and (key is None or c["key"] == key)
            ]
        return {"charges": found}

    def reset(self) -> None:
        with self.lock:
            self.charges.clear()
            self.by_key.clear()
            self.replies.clear()


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int]) -> None:
        super().__init__(address, _Handler)
        self.ledger = _Ledger()


class _Handler(BaseHTTPRequestHandler):
    server_version = "sagaguard-counter/1"

    def log_message(self, format: str, *args: Any) -> None:
        pass  # quiet: tests read stderr for real errors only

    @property
    def _ledger(self) -> _Ledger:
        return cast(_Server, self.server).ledger

    def _reply(self, status: int, payload: Any, extra: Mapping[str, str] | None = None) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, value in (extra or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> Any:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b"{}"
        return json.loads(raw)

    def do_GET(self) -> None:
        url = urllib.parse.urlsplit(self.path)
        query = dict(urllib.parse.parse_qsl(url.query))
        if url.path == "/count":
            self._reply(HTTPStatus.OK, self._ledger.count())
        elif url.path == "/charges":
            self._reply(HTTPStatus.OK, self._ledger.find(query.get("provider_key"), query.get("key")))
        elif url.path == "/health":
            self._reply(HTTPStatus.OK, {"ok": True})
        else:
            self._reply(HTTPStatus.NOT_FOUND, {"error": f"no such path {url.path}"})

    def do_POST(self) -> None:
        url = urllib.parse.urlsplit(self.path)
        query = dict(urllib.parse.parse_qsl(url.query))
        try:
            body = self._body()
        except ValueError:
            self._reply(HTTPStatus.BAD_REQUEST, {"error": "the body is not JSON"})
            return
        if url.path == "/charge":
            if not isinstance(body, dict):
                self._reply(HTTPStatus.BAD_REQUEST, {"error": "the body must be a JSON object"})
                return
            dedup = query.get("dedup", "on").lower() not in ("off", "0", "false", "no")
            status, reply, replayed = self._ledger.charge(body, self.headers.get("Idempotency-Key"), dedup)
            self._reply(status, reply, {"Idempotent-Replayed": "true"} if replayed else None)
        elif url.path == "/reset":
            self._ledger.reset()
            self._reply(HTTPStatus.OK, {"count": 0})
        else:
            self._reply(HTTPStatus.NOT_FOUND, {"error": f"no such path {url.path}"})


def serve_counter(
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    port_file: str | None = None,
    exit_on_stdin_eof: bool = False,
) -> None:
    """Run the counter service in this process until it is stopped.

    Prints ``{"url": ..., "port": ...}`` as one JSON line once it listens (and writes the port to
    ``port_file`` if given). With ``exit_on_stdin_eof`` it stops when its stdin closes, which is how
    :class:`CounterService` stops it, and how it never outlives a parent that was killed.
    """
    server = _Server((host, port))
    bound = int(server.server_address[1])
    url = f"http://{host}:{bound}"
    if port_file:
        Path(port_file).write_text(f"{bound}\n")
    print(json.dumps({"url": url, "port": bound}), flush=True)
    if exit_on_stdin_eof:

        def watch() -> None:
            with contextlib.suppress(OSError, ValueError):
                while sys.stdin.buffer.read(4096):
                    pass
            server.shutdown()

        threading.Thread(target=watch, name="stdin-watch", daemon=True).start()
    try:
        server.serve_forever(poll_interval=0.1)
    finally:
        server.server_close()


def main(argv: list[str] | None = None) -> int:
    """``python -m sagaguard.idempotency.testing counter [--host H] [--port P] [--port-file F]``."""
    parser = argparse.ArgumentParser(prog="python -m sagaguard.idempotency.testing")
    commands = parser.add_subparsers(dest="command", required=True)
    counter = commands.add_parser("counter", help="run the counter service")
    counter.add_argument("--host", default="127.0.0.1")
    counter.add_argument("--port", type=int, default=0, help="0 picks a free port")
    counter.add_argument("--port-file", help="also write the chosen port to this file")
    counter.add_argument("--exit-on-stdin-eof", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        serve_counter(
            args.host, args.port, port_file=args.port_file, exit_on_stdin_eof=args.exit_on_stdin_eof
        )
    return 0
