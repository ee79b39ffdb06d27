"""A fork server for the sweep's child runs: pay the imports once, fork a fresh process per run.

A research-agent child spends 3-5 s of a run importing (langgraph, openai, stripe, sqlmodel...) on a
loaded 2-core machine; a sweep starts ~200 of them per variant. :class:`Zygote` starts this module
once as a server (``python tests/_research/zygote.py '<spec json>'``) that imports the variant's
modules and then, per run request, forks::

    zygote = Zygote("_research.langgraph_child:main", preload=("sagaguard.connectors.llm",), env=env)
    done = zygote.run(("sagaguard",), config, {"SAGAGUARD_CRASH_AT": "charge_applied"}, timeout=180)
    done.returncode  # -9: SIGKILLed, exactly like subprocess's returncode
    zygote.close()

The contract the experiment relies on:

- Every run is a fresh process: a new pid, forked from a server that only imported. The server
  creates nothing (no clients, threads, event loop or connection to the world): it asserts that
  ``threading.active_count() == 1`` before every fork, since forking a process with threads copies
  their locks, not the threads. Only module objects are shared, copy-on-write.
- A kill point's SIGKILL kills the forked run only; the server reports it as ``-9``. So does a
  kill at a time (``run(..., kill_after=1.5)``: the server SIGKILLs the run that long after its fork,
  and says so at the end of its stderr, :data:`KILLED_AFTER`).
- In the run: the server's environment plus the request's (``$SAGAGUARD_CRASH_AT`` and
  ``$SAGAGUARD_RESEARCH_TRACE`` are dropped first, so only the request sets them); stdin
  ``/dev/null``, stdout and stderr to files the server reads back; every other inherited fd closed;
  signal handlers and the signal mask as a fresh interpreter has them; ``random`` re-seeded (forks
  share its state; ``uuid4`` reads ``os.urandom`` and needs nothing); ``sys.argv`` as the script
  would see it. Then ``entry(*args, config)`` (the script's ``main(mode, config)``), and ``os._exit``
  with its status after flushing stdout and stderr: the fork never returns into the server's loop,
  and interpreter shutdown (atexit hooks, joining leftover threads) is skipped, so an entry must
  close what it opened before it returns (the research children do).

The protocol: JSON lines on the server's stdin and stdout (duplicated to private fds at start, so a
module that prints cannot corrupt it). The server answers ``{"ready": ...}`` once the imports are
done (or ``{"error": ...}``), then one response per request, in order.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import io
import json
import os
import random
import select
import signal
import subprocess
import sys
import tempfile
import threading
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

__all__ = ["KILLED_AFTER", "Zygote", "ZygoteError"]

HERE = Path(__file__).resolve().parent
CLEARED = ("SAGAGUARD_CRASH_AT", "SAGAGUARD_RESEARCH_TRACE")
"""Variables a run gets only from its request (the crash point, the trace file)."""
KILLED_AFTER = "zygote: SIGKILL after"
"""How the stderr of a run killed by ``kill_after`` ends (then the delay, ``"1.234 s"``)."""


class ZygoteError(RuntimeError):
    """The server failed to start (an import failed) or died; it says why."""


class Zygote:
    """A running fork server for one entry function (the client side).

    Args:
        entry: ``"module:function"``, the function a run calls as ``function(*args, config)``
            and whose return value is the exit status (a ``SystemExit`` counts as in a script).
        preload: more modules to import before forking (those the entry imports lazily).
        env: the server's environment (the runs inherit it, :data:`CLEARED` removed).
        script: what ``sys.argv[0]`` is in a run; by default the entry module's file.

    Raises:
        ZygoteError: an import failed, or the server started a thread while importing.
    """

    def __init__(
        self,
        entry: str,
        preload: Sequence[str] = (),
        *,
        env: Mapping[str, str] | None = None,
        script: str = "",
    ) -> None:
        self.entry = entry
        spec = {"entry": entry, "preload": list(preload), "script": script}
        self._proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), json.dumps(spec)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=dict(env) if env is not None else None,
        )  # fmt: skip
        ready = self._receive(timeout=300.0)
        if "error" in ready:
            self.close()
            raise ZygoteError(f"zygote for {entry} failed to start:\n{ready['error']}")

    @property
    def pid(self) -> int:
        """The server's pid (runs are its children)."""
        return self._proc.pid

    def alive(self) -> bool:
        """The server is still running."""
        return self._proc.poll() is None

    def run(
        self,
        args: Sequence[str],
        config: Mapping[str, Any],
        env: Mapping[str, str],
        *,
        timeout: float,
        kill_after: float | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Fork one run, wait for it, and return what ``subprocess.run(capture_output=True)`` would.

        Args:
            args: the arguments before the config (the script's ``sys.argv[1:-1]``).
            config: the run's config (``sys.argv[-1]`` as JSON).
            env: variables set for this run only.
            timeout: seconds the run may take; then it is SIGKILLed.
            kill_after: SIGKILL the run this many seconds after its fork (a kill at a random time,
                not at a named point): its returncode is then ``-9`` and its stderr ends with
                :data:`KILLED_AFTER` and the delay. None: no such kill.

        Raises:
            subprocess.TimeoutExpired: the run took longer than ``timeout``.
            ZygoteError: the server died.
        """
        request = {
            "args": list(args), "config": dict(config), "env": dict(env), "timeout": timeout,
            "kill_after": kill_after,
        }  # fmt: skip
        assert self._proc.stdin is not None
        try:
            self._proc.stdin.write(json.dumps(request).encode() + b"\n")
            self._proc.stdin.flush()
        except BrokenPipeError as exc:
            raise ZygoteError(f"zygote for {self.entry} died (exit {self._proc.poll()})") from exc
        done = self._receive(timeout=timeout + 60.0)
        argv = [self.entry, *args, json.dumps(dict(config))]
        if done["timed_out"]:
            raise subprocess.TimeoutExpired(argv, timeout, done["stdout"], done["stderr"])
        return subprocess.CompletedProcess(argv, done["returncode"], done["stdout"], done["stderr"])

    def close(self) -> None:
        """Stop the server (closing its stdin ends its loop) and wait for it."""
        if self._proc.stdin is not None and not self._proc.stdin.closed:
            self._proc.stdin.close()
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        if self._proc.stdout is not None:
            self._proc.stdout.close()

    def __enter__(self) -> Zygote:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _receive(self, timeout: float) -> dict[str, Any]:
        out = self._proc.stdout
        assert out is not None
        # A bound on the wait, so a wedged server fails the sweep instead of hanging it.
        readable, _, _ = select.select([out], [], [], timeout)
        line = out.readline() if readable else b""
        if not line:
            status = self._proc.poll()
            if status is None:
                self._proc.kill()
            raise ZygoteError(f"zygote for {self.entry} stopped answering (exit {self._proc.poll()})")
        return dict(json.loads(line))


# ------------------------------------------------------------------------------ the server


def _resolve(entry: str) -> Callable[..., Any]:
    module, _, name = entry.partition(":")
    found: Callable[..., Any] = getattr(importlib.import_module(module), name)
    return found


def _exit_status(code: object) -> int:
    """``SystemExit.code`` as the interpreter turns it into an exit status."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _child(
    fn: Callable[..., Any],
    request: Mapping[str, Any],
    *,
    script: str,
    out: int,
    err: int,
    handlers: Mapping[int, Any],
) -> NoReturn:
    """The forked run: never returns to the server's loop, whatever happens."""
    status = 1
    try:
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(err, 2)
        # The control pipe, the output files' own fds and anything else the server held.
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, set())
        for name in CLEARED:
            os.environ.pop(name, None)
        os.environ.update(request["env"])
        # CPython already re-seeds the module's generator after a fork (random.py registers an
        # at-fork hook); said here too so the contract does not hang on an implementation detail.
        random.seed()
        config = request["config"]
        sys.argv = [script, *request["args"], json.dumps(config)]
        try:
            status = _exit_status(fn(*request["args"], config))
        except SystemExit as exc:
            status = _exit_status(exc.code)
        except BaseException:
            traceback.print_exc()
            status = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # a closed stream must not keep the run alive
                stream.flush()
        os._exit(status)


def _handlers() -> dict[int, Any]:
    """The signal handlers now: at the server's start, what a fresh interpreter has (SIGINT raises
    KeyboardInterrupt, SIGPIPE is ignored, ...), which every run gets back."""
    found: dict[int, Any] = {}
    for signum in signal.valid_signals():
        if signum in (signal.SIGKILL, signal.SIGSTOP):
            continue
        handler = signal.getsignal(signum)
        if handler is not None:  # None: set outside Python, left alone
            found[signum] = handler
    return found


def _wait(pid: int, timeout: float, kill_after: float | None = None) -> tuple[int, bool, bool]:
    """Wait for the run ``pid``; SIGKILL it after ``kill_after`` s (when given and shorter), else after
    ``timeout`` s. Its returncode, whether it timed out, and whether ``kill_after`` killed it."""
    planned = kill_after is not None and kill_after < timeout
    pidfd = os.pidfd_open(pid)
    try:
        readable, _, _ = select.select([pidfd], [], [], kill_after if planned else timeout)
    finally:
        os.close(pidfd)
    if not readable:
        os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    # A run that ended on its own in the instant before the kill says so by its status.
    return code, not readable and not planned, not readable and planned and code == -signal.SIGKILL


def _read(fd: int) -> str:
    os.lseek(fd, 0, os.SEEK_SET)
    with open(fd, "rb", closefd=False) as source:
        return source.read().decode("utf-8", "replace")


def _serve(spec: Mapping[str, Any], requests: io.BufferedReader, answers: io.BufferedWriter) -> None:
    def answer(message: Mapping[str, Any]) -> None:
        answers.write(json.dumps(message).encode() + b"\n")
        answers.flush()

    try:
        handlers = _handlers()
        for module in spec["preload"]:
            importlib.import_module(module)
        fn = _resolve(spec["entry"])
        threads = threading.active_count()
        if threads != 1:
            raise RuntimeError(f"{threads} threads after the imports: forking would copy their locks")
    except BaseException:
        answer({"error": traceback.format_exc()})
        return
    script = spec["script"] or str(getattr(sys.modules[spec["entry"].partition(":")[0]], "__file__", ""))
    # The imported objects never change again: keep them out of the collector, so runs do not
    # copy-on-write every page just by collecting garbage (the gc.freeze() use the docs describe).
    gc.freeze()
    answer({"ready": True, "pid": os.getpid(), "modules": len(sys.modules)})
    for line in requests:
        request = json.loads(line)
        if threading.active_count() != 1:  # not an assert: it must hold under python -O too
            raise RuntimeError("a thread started in the zygote after its imports; it must only import")
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _child(fn, request, script=script, out=out.fileno(), err=err.fileno(), handlers=handlers)
            kill_after = request.get("kill_after")
            returncode, timed_out, killed = _wait(pid, float(request["timeout"]), kill_after)
            stderr = _read(err.fileno())
            if killed:  # said as a kill point's SIGKILL says where it landed
                stderr += f"{KILLED_AFTER} {kill_after:.3f} s\n"
            answer({
                "returncode": returncode, "timed_out": timed_out, "pid": pid,
                "stdout": _read(out.fileno()), "stderr": stderr,
            })  # fmt: skip


def main(argv: Sequence[str]) -> int:
    """The server: ``zygote.py '{"entry": ..., "preload": [...], "script": ...}'``."""
    for entry in (HERE.parent.parent, HERE.parent):  # the project root and tests/
        if str(entry) not in sys.path:
            sys.path.insert(0, str(entry))
    # The protocol gets private fds; fd 0 becomes /dev/null and fd 1 the server's stderr, so an
    # import that reads or prints cannot break it.
    requests = os.fdopen(os.dup(0), "rb")
    answers = os.fdopen(os.dup(1), "wb")
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)
    _serve(json.loads(argv[0]), requests, answers)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
