"""What every local test server shares: fault injection, counters, a clock, and how it is run.

A server is a :class:`App` (pure request handling over its own state) behind :class:`Handler`
(HTTP/1.1 with keep-alive on :class:`~http.server.ThreadingHTTPServer`). The admin endpoints under
``/_sagaguard/`` are the same on every server:

- ``GET /_sagaguard/counters``: the app's counters (JSON object of ints).
- ``POST /_sagaguard/faults``: add a fault rule (JSON :class:`FaultRule` fields); ``DELETE`` clears.
- ``POST /_sagaguard/clock``: ``{"advance": seconds}`` moves the server's clock forward.
- ``POST /_sagaguard/reset``: forget every object, key, counter and fault.

:class:`LocalService` runs a server in its own process (the default: the evidence survives a worker
that is SIGKILLed, and the server does not share the client's GIL) or in a thread.
"""

from __future__ import annotations

import contextlib
import json
import select
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any, Self, cast

from sagaguard.idempotency.testing.children import child_environment

__all__ = ["App", "FaultRule", "Faults", "LocalService", "Reply", "Request", "ServerClock", "serve"]

ADMIN = "/_sagaguard/"


@dataclass(frozen=True, slots=True)
class Reply:
    """An HTTP reply: status, JSON body (or raw text), extra headers."""

    status: int
    body: Any
    headers: Mapping[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class FaultRule:
    """One injected fault.

    Attributes:
        mode: ``"fail"``: answer ``status`` without applying anything; ``"timeout"``: apply the
            request, then stall ``seconds`` and close the connection without an answer (the
            crash every connector exists for); ``"slow"``: wait ``seconds``, then handle normally;
            ``"error"``: the app starts executing the request and fails with ``status`` without
            applying anything, so an app that stores answers under idempotency keys stores and
            replays this one (Stripe saves a 500 that way); elsewhere it is ``"fail"``.
        path: applies to request paths starting with this.
        method: applies to this method only (``"POST"``), or to any when empty.
        times: how many requests it hits before it is used up.
        seconds: the stall for ``timeout`` and ``slow``.
        status: the status ``fail`` answers.
    """

    mode: str
    path: str = "/"
    method: str = ""
    times: int = 1
    seconds: float = 5.0
    status: int = 500

    def __post_init__(self) -> None:
        if self.mode not in ("fail", "timeout", "slow", "error"):
            raise ValueError(f"unknown fault mode {self.mode!r}: fail, timeout, slow or error")


class Faults:
    """The server's fault rules; :meth:`take` hands each out ``times`` times. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rules: list[FaultRule] = []
        self.fired = 0

    def add(self, rule: FaultRule) -> None:
        """Add a rule (after the others: the first live matching rule is used)."""
        with self._lock:
            self._rules.append(rule)

    def clear(self) -> None:
        """Remove every rule and zero the count of faults fired."""
        with self._lock:
            self._rules.clear()
            self.fired = 0

    def take(self, method: str, path: str) -> FaultRule | None:
        """The first live rule matching the request, used once; None when none matches."""
        with self._lock:
            for rule in self._rules:
                if rule.times > 0 and path.startswith(rule.path) and rule.method in ("", method):
                    rule.times -= 1
                    self.fired += 1
                    return rule
        return None


class ServerClock:
    """Wall-clock seconds plus an offset the tests can advance (say, past a key window)."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.time() + self.offset


@dataclass(frozen=True, slots=True)
class Request:
    """One request as an :class:`App` sees it.

    Attributes:
        delay: seconds a ``slow`` fault asks the app to spend *while* handling it (an app with an
            idempotency layer waits with the key marked in progress, so a concurrent duplicate sees
            409); call :meth:`pause` at that point.
    """

    method: str
    path: str
    query: str
    headers: Mapping[str, str]
    """Lower-cased names."""
    body: bytes
    delay: float = 0.0
    error: int = 0
    """The status an ``error`` fault makes the app fail with once it started executing (0: none)."""

    def pause(self) -> None:
        """Spend the ``slow`` fault's delay, if any."""
        if self.delay > 0:
            time.sleep(self.delay)


class App:
    """The request handling of one local server. Subclasses implement :meth:`handle`.

    Attributes:
        faults: the fault rules, applied by the handler around :meth:`handle`: ``fail`` answers
            before the app sees the request, ``slow`` is the request's ``delay``, ``timeout`` lets
            the app apply the request and then hangs up without its answer.
        clock: the server's clock.
        lock: guards the app's state (the admin endpoints take it too).
    """

    saves_errors = False
    """Whether the app honours ``error`` faults (an app without stored answers gets ``fail``)."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        self.config = dict(config)
        self.faults = Faults()
        self.clock = ServerClock()
        self.lock = threading.RLock()

    def handle(self, request: Request) -> Reply:
        """Answer one request (admin paths excluded)."""
        raise NotImplementedError

    def counters(self) -> dict[str, int]:
        """What the server counted (JSON ints)."""
        raise NotImplementedError

    def reset(self) -> None:
        """Forget everything."""
        raise NotImplementedError


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], app: App) -> None:
        super().__init__(address, Handler)
        self.app = app


class Handler(BaseHTTPRequestHandler):
    """HTTP/1.1 keep-alive front of an :class:`App`, with the admin endpoints and the faults."""

    protocol_version = "HTTP/1.1"
    server_version = "sagaguard-local/1"
    disable_nagle_algorithm = True  # headers and body are two writes: no 40 ms delayed-ACK stall

    def log_message(self, format: str, *args: Any) -> None:
        pass  # quiet: tests read stderr for real errors only

    @property
    def app(self) -> App:
        return cast(_Server, self.server).app

    def _send(self, reply: Reply) -> None:
        body = reply.body
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(reply.status)
        self.send_header("Content-Type", reply.headers.get("Content-Type", "application/json"))
        self.send_header("Content-Length", str(len(data)))
        for name, value in reply.headers.items():
            if name != "Content-Type":
                self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    def _dispatch(self) -> None:
        url = urllib.parse.urlsplit(self.path)
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        if url.path.startswith(ADMIN):
            self._send(self._admin(url.path[len(ADMIN) :], body))
            return
        app = self.app
        rule = app.faults.take(self.command, url.path)
        if rule is not None and (rule.mode == "fail" or (rule.mode == "error" and not app.saves_errors)):
            self._send(Reply(rule.status, {"error": {"type": "api_error", "message": "injected fault"}}))
            return
        delay = rule.seconds if rule is not None and rule.mode == "slow" else 0.0
        headers = {k.lower(): v for k, v in self.headers.items()}
        error = rule.status if rule is not None and rule.mode == "error" else 0
        reply = app.handle(Request(self.command, url.path, url.query, headers, body, delay, error))
        if rule is not None and rule.mode == "timeout":
            # Applied, answer lost: wait past the client's timeout, then hang up.
            time.sleep(rule.seconds)
            self.close_connection = True
            return
        self._send(reply)

    def _admin(self, what: str, body: bytes) -> Reply:
        app = self.app
        if what == "counters" and self.command == "GET":
            with app.lock:
                return Reply(HTTPStatus.OK, {**app.counters(), "faults_fired": app.faults.fired})
        if what == "faults" and self.command == "POST":
            try:
                app.faults.add(FaultRule(**json.loads(body or b"{}")))
            except (TypeError, ValueError) as exc:
                return Reply(HTTPStatus.BAD_REQUEST, {"error": str(exc)})
            return Reply(HTTPStatus.OK, {"ok": True})
        if what == "faults" and self.command == "DELETE":
            app.faults.clear()
            return Reply(HTTPStatus.OK, {"ok": True})
        if what == "clock" and self.command == "POST":
            app.clock.offset += float(json.loads(body or b"{}").get("advance", 0))
            return Reply(HTTPStatus.OK, {"now": app.clock()})
        if what == "reset" and self.command == "POST":
            with app.lock:
                app.reset()
            app.faults.clear()
            app.clock.offset = 0.0
            return Reply(HTTPStatus.OK, {"ok": True})
        if what == "health":
            return Reply(HTTPStatus.OK, {"ok": True})
        return Reply(HTTPStatus.NOT_FOUND, {"error": f"no admin endpoint {what!r}"})

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _dispatch


def serve(app: App, host: str = "127.0.0.1", port: int = 0, *, exit_on_stdin_eof: bool = False) -> None:
    """Run ``app`` in this process until stopped; prints ``{"url": ..., "port": ...}`` once listening."""
    server = _Server((host, port), app)
    bound = int(server.server_address[1])
    print(json.dumps({"url": f"http://{host}:{bound}", "port": bound}), flush=True)
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


class LocalService:
    """Runs one local server (``kind``) in its own process or in a thread, as a context manager.

    Args:
        kind: the server (``"stripe"``, ``"http"``, ``"chat"``); see
            ``python -m sagaguard.connectors.testing``.
        config: the server's options (JSON-able).
        in_process: run in a daemon thread of this process instead (no process start, but the
            server shares the GIL with the client, and dies with a killed test process).
        startup_timeout: seconds to wait for the server to listen.
    """

    def __init__(
        self,
        kind: str,
        config: Mapping[str, Any] | None = None,
        *,
        in_process: bool = False,
        startup_timeout: float = 15.0,
    ) -> None:
        self.kind = kind
        self.config = dict(config or {})
        self.in_process = in_process
        self.startup_timeout = startup_timeout
        self._proc: subprocess.Popen[str] | None = None
        self._server: _Server | None = None
        self._url: str | None = None

    @property
    def url(self) -> str:
        """The base URL, e.g. ``http://127.0.0.1:41234``.

        Raises:
            RuntimeError: the server is not running.
        """
        if self._url is None:
            raise RuntimeError(f"the local {self.kind} server is not running: use it as a context manager")
        return self._url

    def command(self) -> list[str]:
        """The server process's command line (this checkout is on its ``PYTHONPATH``): it prints
        ``{"url": ...}`` as its first line once it listens, and exits when its stdin closes."""
        argv = [sys.executable, "-m", "sagaguard.connectors.testing", self.kind]
        argv += ["--port", "0", "--exit-on-stdin-eof"]
        return [*argv, "--config", json.dumps(self.config)]

    def start(self) -> Self:
        """Start the server and wait until it listens. Returns self."""
        if self._url is not None:
            return self
        if self.in_process:
            from sagaguard.connectors.testing.__main__ import make_app

            server = _Server(("127.0.0.1", 0), make_app(self.kind, self.config))
            threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True).start()
            self._server = server
            self._url = f"http://127.0.0.1:{server.server_address[1]}"
            return self
        proc = subprocess.Popen(
            self.command(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=child_environment(),
        )
        self._proc = proc
        try:
            assert proc.stdout is not None
            ready, _, _ = select.select([proc.stdout], [], [], self.startup_timeout)
            line = proc.stdout.readline() if ready else ""
            if not line.strip():
                proc.kill()
                err = proc.stderr.read() if proc.stderr is not None else ""
                raise RuntimeError(f"the local {self.kind} server did not start:\n{err}")
            self._url = str(json.loads(line)["url"])
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop the server. Idempotent."""
        self._url = None
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        proc, self._proc = self._proc, None
        if proc is None:
            return
        with contextlib.suppress(OSError):
            if proc.stdin is not None:
                proc.stdin.close()
        try:
            proc.wait(timeout=3)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, tp: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # -- admin ---------------------------------------------------------------------------------

    def _admin(self, method: str, what: str, payload: Mapping[str, Any] | None = None) -> Any:
        data = None if payload is None else json.dumps(payload).encode()
        request = urllib.request.Request(self.url + ADMIN + what, data=data, method=method)
        request.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:
            raise RuntimeError(f"{what}: HTTP {exc.code}: {exc.read().decode(errors='replace')}") from exc

    def counters(self) -> dict[str, int]:
        """What the server counted so far (see the server's docs for the names)."""
        return {str(k): int(v) for k, v in self._admin("GET", "counters").items()}

    def fault(
        self,
        mode: str,
        path: str = "/",
        *,
        method: str = "",
        times: int = 1,
        seconds: float = 5.0,
        status: int = 500,
    ) -> None:
        """Inject a fault (see :class:`FaultRule`)."""
        rule = FaultRule(mode, path, method, times, seconds, status)
        self._admin("POST", "faults", asdict(rule))

    def clear_faults(self) -> None:
        """Remove every fault rule."""
        self._admin("DELETE", "faults")

    def advance_clock(self, seconds: float) -> float:
        """Move the server's clock forward; returns its new time."""
        return float(self._admin("POST", "clock", {"advance": seconds})["now"])

    def reset(self) -> None:
        """Forget every object, key, counter and fault."""
        self._admin("POST", "reset", {})
