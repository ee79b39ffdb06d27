"""The client side of the counter service: :class:`CounterClient` talks to a running one,
:class:`CounterService` runs one in its own process.
"""

from __future__ import annotations

import contextlib
import json
import select
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from sagaguard.idempotency.effect import NOT_APPLIED, Applied, NotAppliedResolution, ReconcileRequest, Unknown
from sagaguard.idempotency.testing.children import child_environment


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

    The process is ``python -m sagaguard.idempotency.testing counter --port 0``; it listens on a free port
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
        proc = subprocess.Popen(
            [
                sys.executable, "-m", "sagaguard.idempotency.testing", "counter", "--port", "0",
                "--exit-on-stdin-eof",
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=child_environment(),
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
