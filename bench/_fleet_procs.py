"""Starting and driving bench/fleet.py's worker processes (bench/_fleet_worker.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
WORKER = BENCH / "_fleet_worker.py"
READY_TIMEOUT = 120.0
"""Seconds a worker may take to import, connect and warm up on a busy machine (a bound only)."""


class WorkerFailed(RuntimeError):
    """A worker process exited or answered other than as its protocol says."""


def spawn(config: dict[str, Any], host: str | None = None) -> subprocess.Popen[str]:
    """A worker process for ``config``; ``host``: its ``SAGAGUARD_HOST_ID`` (another "host")."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("SAGAGUARD_HOST_ID", None)
    if host is not None:
        env["SAGAGUARD_HOST_ID"] = host
    # stderr to a file: a pipe nobody reads until the end could fill and block the worker.
    err = tempfile.TemporaryFile("w+")  # noqa: SIM115 (kept open for the process's life: errors())
    proc = subprocess.Popen(
        [sys.executable, str(WORKER), json.dumps(config)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True, env=env, cwd=ROOT,
    )  # fmt: skip
    _STDERR[proc.pid] = err
    return proc


_STDERR: dict[int, IO[str]] = {}


def errors(proc: subprocess.Popen[str]) -> str:
    """The end of what ``proc`` wrote to stderr."""
    err = _STDERR.get(proc.pid)
    if err is None:
        return ""
    err.seek(0)
    return err.read()[-3000:]


def _line(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        proc.wait(timeout=30)
        raise WorkerFailed(f"worker {proc.pid} exited with {proc.returncode}: {errors(proc)}")
    return line.strip()


@dataclass
class Fleet:
    """``n`` load workers of one config (each its own ``tag``), started together, ready for the
    config's ``kinds`` of work."""

    config: dict[str, Any]
    n: int
    host: str | None = None
    procs: list[subprocess.Popen[str]] = field(default_factory=list)
    dead: set[int] = field(default_factory=set)
    """Indexes of workers SIGKILLed on purpose."""

    def start(self) -> Fleet:
        """Start every worker and wait until each has warmed up (``ready``)."""
        for i in range(self.n):
            self.procs.append(spawn({**self.config, "tag": f"{self.config['tag']}-w{i}"}, self.host))
        for proc in self.procs:
            if (line := _line(proc)) != "ready":
                raise WorkerFailed(f"worker {proc.pid} said {line!r}, not ready")
        return self

    def _send(self, line: str) -> None:
        for i, proc in enumerate(self.procs):
            if i not in self.dead and proc.stdin is not None:
                proc.stdin.write(line + "\n")
                proc.stdin.flush()

    def go(self, kind: str) -> None:
        """Every live worker starts a window of ``kind``."""
        self._send(f"go {kind}")

    def stop(self) -> None:
        """Every live worker ends its open-ended window after the unit in hand."""
        self._send("stop")

    def collect(self) -> list[dict[str, Any]]:
        """Each live worker's figures for the window that ended."""
        return [json.loads(_line(p)) for i, p in enumerate(self.procs) if i not in self.dead]

    def run(self, kind: str) -> list[dict[str, Any]]:
        """One window of ``kind`` on every worker; their figures."""
        self.go(kind)
        return self.collect()

    def kill(self, i: int) -> None:
        """SIGKILL worker ``i`` and reap it."""
        self.procs[i].kill()
        self.procs[i].wait(timeout=30)
        self.dead.add(i)

    def close(self) -> None:
        """Let every live worker close its connections and exit; a failure to is an error."""
        self._send("exit")
        for i, proc in enumerate(self.procs):
            if i not in self.dead and proc.wait(timeout=60) != 0:
                raise WorkerFailed(f"worker {proc.pid} exited with {proc.returncode}: {errors(proc)}")

    def kill_all(self) -> None:
        """SIGKILL whatever still runs (after a failure)."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
