"""Test helpers shipped to users: a service that counts effects, and a store that dies on cue.

Crash tests of code that changes the world need two things: a world that counts what reached it,
in *another* process so that killing the worker does not kill the evidence, and a worker that dies
for real (SIGKILL: no ``finally``, no ``atexit``, no flush) at a chosen point::

    with CounterService() as service:                  # its own process on 127.0.0.1
        env = {**os.environ, CRASH_ENV: "before_complete"}
        subprocess.run([sys.executable, "worker.py", service.url], env=env)  # killed after the POST
        subprocess.run([sys.executable, "worker.py", service.url])           # resolves the doubt
        assert service.count() == 1

and in ``worker.py``::

    guard = Guard(CrashingStore(open_store(url)), lease=0.5)
    client = CounterClient(service_url)

    @guard.effect("charge", reconciler=client.reconciler())
    def charge(order: str, amount: int) -> Charge:
        result = client.charge(order, amount, provider_key=current_effect().provider_key)
        crash_point("after_effect")                     # or let the store die at "before_complete"
        return result

Crash points are not hooks in the guard: :class:`CrashingStore` wraps any store, and
:func:`crash_point` is called by the effect body itself. Production code carries neither.

Run ``python -m idempotency.testing counter --port 0`` to start the service by hand; it prints one
JSON line ``{"url": ..., "port": ...}`` when it listens.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType
from typing import Any, NoReturn, cast

from idempotency.effect import NOT_APPLIED, Applied, NotAppliedResolution, ReconcileRequest, Unknown
from idempotency.keys import EffectIdentity
from idempotency.records import ClaimResult, Disposition, Record, State
from idempotency.store import IdempotencyStore

__all__ = [
    "CRASH_ENV",
    "STORE_CRASH_POINTS",
    "Charge",
    "CounterClient",
    "CounterService",
    "CounterServiceError",
    "CrashingStore",
    "crash_at",
    "crash_point",
    "serve_counter",
    "sigkill",
]

CRASH_ENV = "SAGAGUARD_CRASH_AT"
"""The environment variable that tells a (child) process where to die: a crash point's name."""

STORE_CRASH_POINTS = (
    "before_claim",
    "after_claim",
    "before_complete",
    "after_complete",
    "before_fail",
    "after_fail",
)
"""Where :class:`CrashingStore` can die. ``before_complete`` is "the effect happened, its result was
not recorded": the crash every guard exists for. ``*_fail`` are the same around a failed attempt."""


# ----------------------------------------------------------------------------------- crash points


def crash_at() -> str | None:
    """The crash point named by ``$SAGAGUARD_CRASH_AT``, or None."""
    value = os.environ.get(CRASH_ENV, "").strip()
    return value or None


def sigkill(point: str) -> NoReturn:
    """Kill this process with SIGKILL, saying where on stderr first (SIGKILL itself is silent)."""
    os.write(2, f"sagaguard.testing: SIGKILL at {point} (pid {os.getpid()})\n".encode())
    os.kill(os.getpid(), signal.SIGKILL)
    while True:  # pragma: no cover - the signal is delivered before os.kill returns
        time.sleep(1)


def crash_point(name: str) -> None:
    """Die here, with a real SIGKILL, when ``$SAGAGUARD_CRASH_AT`` names this point.

    Call it from an effect body, e.g. ``crash_point("after_effect")`` right after the HTTP call and
    before returning, to lose a result the world has already acted on. Does nothing otherwise.
    """
    if crash_at() == name:
        sigkill(name)


class CrashingStore:
    """Wraps any :class:`~idempotency.store.IdempotencyStore` and SIGKILLs the process at one point.

    The points are :data:`STORE_CRASH_POINTS`: ``before_claim``, ``after_claim`` (the claim is
    written, the effect has not run), ``before_complete`` (the effect ran, its result is not
    recorded), ``after_complete`` (recorded, the caller has not seen it), and the same two around
    ``fail``. The first call that reaches the point dies; every other call is passed through.

    Args:
        inner: the store to wrap.
        at: the crash point; by default ``$SAGAGUARD_CRASH_AT``. A name that is not a store point
            (say ``after_effect``, meant for :func:`crash_point`) makes this store a plain pass-through.
        kill: what "die" means; the default is :func:`sigkill`. In-process tests may pass a function
            that raises instead (a ``BaseException``, so nothing on the way catches it).

    Raises:
        ValueError: ``at`` was given explicitly and is not one of :data:`STORE_CRASH_POINTS`.
    """

    def __init__(
        self,
        inner: IdempotencyStore,
        at: str | None = None,
        *,
        kill: Callable[[str], NoReturn] = sigkill,
    ) -> None:
        if at is not None and at not in STORE_CRASH_POINTS:
            raise ValueError(f"unknown store crash point {at!r}; choose one of {STORE_CRASH_POINTS}")
        self.inner = inner
        self.at = at if at is not None else crash_at()
        self._kill = kill

    def _point(self, name: str) -> None:
        if self.at == name:
            self._kill(name)

    def now(self) -> float:
        return self.inner.now()

    def claim(self, identity: EffectIdentity, fingerprint: str, lease: float) -> ClaimResult:
        self._point("before_claim")
        result = self.inner.claim(identity, fingerprint, lease)
        self._point("after_claim")
        return result

    def get(self, key: str) -> Record | None:
        return self.inner.get(key)

    def complete(self, key: str, token: int, result: str, retention: float) -> Record:
        self._point("before_complete")
        record = self.inner.complete(key, token, result, retention)
        self._point("after_complete")
        return record

    def fail(
        self, key: str, token: int, disposition: Disposition, error: str, retention: float
    ) -> Record | None:
        self._point("before_fail")
        record = self.inner.fail(key, token, disposition, error, retention)
        self._point("after_fail")
        return record

    def heartbeat(self, key: str, token: int, lease: float) -> float:
        return self.inner.heartbeat(key, token, lease)

    def list(
        self,
        *,
        states: Collection[State] | None = None,
        namespace: str | None = None,
        limit: int = 100,
        after: str | None = None,
    ) -> list[Record]:
        return self.inner.list(states=states, namespace=namespace, limit=limit, after=after)

    def purge(self, *, limit: int = 1000) -> int:
        return self.inner.purge(limit=limit)

    def close(self) -> None:
        self.inner.close()

    def __repr__(self) -> str:
        return f"CrashingStore({self.inner!r}, at={self.at!r})"


# ------------------------------------------------------------------------- the counting service


@dataclass(frozen=True, slots=True)
class Charge:
    """One charge as the counter service reports it (storable as an effect result)."""

    charge_id: str
    key: str
    """The business key the caller charged for (an order id), counted in ``by_key``."""
    amount: int
    count: int
    """The service's total number of charges right after this one was made."""
    provider_key: str | None = None
    """Metadata: the caller's provider key, searchable by a reconciler."""
    idempotency_key: str | None = None
    """The ``Idempotency-Key`` header the charge was made under, if any."""
    replayed: bool = False
    """True when the service answered a repeated ``Idempotency-Key`` with the first response."""


class CounterServiceError(RuntimeError):
    """The counter service refused a request or could not be reached.

    Attributes:
        status: the HTTP status, or None when nothing answered.
        body: the response body (JSON text), if any.
    """

    def __init__(self, message: str, status: int | None = None, body: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.body = body


class CounterClient:
    """Talks to a running counter service. Usable from any process that knows the URL.

    Args:
        url: the service's base URL (``CounterService.url``).
        timeout: seconds per request.
    """

    def __init__(self, url: str, *, timeout: float = 10.0) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout

    def _request(
        self,
        method: str,
        path: str,
        body: Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> tuple[Any, Mapping[str, str]]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method=method)
        request.add_header("Content-Type", "application/json")
        for name, value in (headers or {}).items():
            request.add_header(name, value)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                text = response.read().decode()
                return json.loads(text), dict(response.headers.items())
        except urllib.error.HTTPError as exc:
            text = exc.read().decode(errors="replace")
            raise CounterServiceError(f"{method} {path}: HTTP {exc.code}: {text}", exc.code, text) from exc
        except (urllib.error.URLError, OSError) as exc:
            raise CounterServiceError(f"{method} {path}: {exc}") from exc

    def charge(
        self,
        key: str,
        amount: int,
        *,
        provider_key: str | None = None,
        idempotency_key: str | None = None,
        dedup: bool = True,
    ) -> Charge:
        """``POST /charge``: make one charge (the effect being counted).

        Args:
            key: the business key, e.g. an order id.
            amount: anything; recorded with the charge.
            provider_key: metadata a reconciler can later search for (``GET /charges``).
            idempotency_key: sent as the ``Idempotency-Key`` header: the service then answers a repeat
                with the first response instead of charging again, as Stripe does.
            dedup: False sends the header but asks the service to ignore it (``?dedup=off``): a
                provider that does not deduplicate.

        Raises:
            CounterServiceError: refused (400 for an idempotency key reused with other arguments)
                or unreachable.
        """
        body: dict[str, Any] = {"key": key, "amount": amount}
        if provider_key is not None:
            body["provider_key"] = provider_key
        headers = {} if idempotency_key is None else {"Idempotency-Key": idempotency_key}
        path = "/charge" if dedup else "/charge?dedup=off"
        data, reply_headers = self._request("POST", path, body, headers)
        replayed = reply_headers.get("Idempotent-Replayed", "").lower() == "true"
        return _charge(data, replayed=replayed)

    def count(self, key: str | None = None) -> int:
        """How many charges the service made: in all, or for the business key ``key``."""
        data, _ = self._request("GET", "/count")
        if key is None:
            return int(data["count"])
        return int(data["by_key"].get(key, 0))

    def counts(self) -> dict[str, int]:
        """Charges made per business key."""
        data, _ = self._request("GET", "/count")
        return {str(k): int(v) for k, v in data["by_key"].items()}

    def charges(self, *, provider_key: str | None = None, key: str | None = None) -> list[Charge]:
        """``GET /charges``: the charges made, optionally those with this provider key (metadata or
        ``Idempotency-Key``) or this business key, oldest first."""
        query = {k: v for k, v in (("provider_key", provider_key), ("key", key)) if v is not None}
        path = "/charges" + ("?" + urllib.parse.urlencode(query) if query else "")
        data, _ = self._request("GET", path)
        return [_charge(item) for item in data["charges"]]

    def reset(self) -> None:
        """Forget every charge and idempotency key."""
        self._request("POST", "/reset", {})

    def reconciler(self) -> Callable[[ReconcileRequest], Applied[Charge] | NotAppliedResolution | Unknown]:
        """A reconciler for effects that charge through this client with ``provider_key=``.

        It asks ``GET /charges?provider_key=...``: a charge found is ``Applied(charge)``, none is
        ``NOT_APPLIED``; an unreachable service raises, which the guard counts as unknown.
        """

        def reconcile(request: ReconcileRequest) -> Applied[Charge] | NotAppliedResolution | Unknown:
            found = self.charges(provider_key=request.provider_key)
            return Applied(found[0]) if found else NOT_APPLIED

        return reconcile


def _charge(data: Mapping[str, Any], *, replayed: bool = False) -> Charge:
    return Charge(
        charge_id=str(data["charge_id"]),
        key=str(data["key"]),
        amount=int(data["amount"]),
        count=int(data["count"]),
        provider_key=data.get("provider_key"),
        idempotency_key=data.get("idempotency_key"),
        replayed=replayed,
    )


class CounterService:
    """Runs the counter service in a separate process on 127.0.0.1, as a context manager.

    The process is ``python -m idempotency.testing counter --port 0``; it listens on a free port
    and exits when this object stops it or when the process that started it dies (its stdin closes).

    Endpoints: ``POST /charge`` (JSON ``{"key", "amount", "provider_key"?}``, optional
    ``Idempotency-Key`` header, ``?dedup=off``), ``GET /count``, ``GET /charges?provider_key=&key=``,
    ``POST /reset``, ``GET /health``.

    Args:
        startup_timeout: seconds to wait for the process to listen.
    """

    def __init__(self, *, startup_timeout: float = 15.0) -> None:
        self.startup_timeout = startup_timeout
        self._proc: subprocess.Popen[str] | None = None
        self._client: CounterClient | None = None

    @property
    def url(self) -> str:
        """The base URL, e.g. ``http://127.0.0.1:41234``.

        Raises:
            RuntimeError: the service is not running.
        """
        return self.client.url

    @property
    def client(self) -> CounterClient:
        """A client for the running service."""
        if self._client is None:
            raise RuntimeError("the counter service is not running: use `with CounterService() as s:`")
        return self._client

    @property
    def pid(self) -> int | None:
        """The service process's id while it runs."""
        return None if self._proc is None else self._proc.pid

    def start(self) -> CounterService:
        """Start the process and wait until it listens. Returns self.

        Raises:
            RuntimeError: it did not come up within ``startup_timeout``.
        """
        if self._proc is not None:
            return self
        root = str(Path(__file__).resolve().parent.parent)
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
        proc = subprocess.Popen(
            [sys.executable, "-m", "idempotency.testing", "counter", "--port", "0", "--exit-on-stdin-eof"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path},
        )
        self._proc = proc
        try:
            line = _read_line(proc, self.startup_timeout)
            self._client = CounterClient(json.loads(line)["url"])
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop the process (close its stdin, then terminate, then kill). Idempotent."""
        proc, self._proc, self._client = self._proc, None, None
        if proc is None:
            return
        with contextlib.suppress(OSError):
            if proc.stdin is not None:
                proc.stdin.close()
        try:
            proc.wait(timeout=3)
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                proc.wait(timeout=3)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()

    def __enter__(self) -> CounterService:
        return self.start()

    def __exit__(
        self, tp: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def count(self, key: str | None = None) -> int:
        """See :meth:`CounterClient.count`."""
        return self.client.count(key)

    def counts(self) -> dict[str, int]:
        """See :meth:`CounterClient.counts`."""
        return self.client.counts()

    def charges(self, *, provider_key: str | None = None, key: str | None = None) -> list[Charge]:
        """See :meth:`CounterClient.charges`."""
        return self.client.charges(provider_key=provider_key, key=key)

    def reset(self) -> None:
        """See :meth:`CounterClient.reset`."""
        self.client.reset()


def _read_line(proc: subprocess.Popen[str], timeout: float) -> str:
    """The child's first stdout line, or RuntimeError with its stderr."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    line = proc.stdout.readline() if ready else ""
    if not line.strip():
        proc.kill()
        err = proc.stderr.read() if proc.stderr is not None else ""
        raise RuntimeError(f"the counter service did not start within {timeout} s:\n{err}")
    return line


# ----------------------------------------------------------------------------- the server side


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
    """``python -m idempotency.testing counter [--host H] [--port P] [--port-file F]``."""
    parser = argparse.ArgumentParser(prog="python -m idempotency.testing")
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


if __name__ == "__main__":
    sys.exit(main())
