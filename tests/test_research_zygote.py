"""The sweep's fork server (``tests/_research/zygote.py``): each run a fresh process, as a script's.

A probe child (written to a temporary directory, started through the zygote) reports what it sees:
its pid and parent, its environment, open fds, signal dispositions, a random number and a
module-level counter; or it dies by SIGKILL, exits, raises or hangs. What is checked is what the
experiment relies on: a run shares imports with the zygote and nothing else.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _research.sweep import Variant, _child_env, _run, stop_zygotes
from _research.zygote import KILLED_AFTER, Zygote, ZygoteError

pytestmark = pytest.mark.timeout(120)

PROBE = textwrap.dedent(
    '''
    """A child for the zygote tests: ``probe(action, config)``."""
    import json, os, random, signal, sys

    from sagaguard.idempotency.testing import sigkill

    RUNS = [0]  # incremented by every run: a fresh process always sees 1

    def probe(action, config):
        RUNS[0] += 1
        if action == "kill":
            sigkill("probe")
        if action == "exit":
            raise SystemExit(config["code"])
        if action == "raise":
            raise ValueError("boom")
        if action == "hang":
            signal.pause()
        fds = {}
        for fd in os.listdir("/proc/self/fd"):
            try:
                fds[int(fd)] = os.readlink(f"/proc/self/fd/{fd}")
            except FileNotFoundError:  # the listing's own fd, closed by now
                pass
        print("before the result line")
        print("on stderr", file=sys.stderr)
        print(json.dumps({
            "pid": os.getpid(), "ppid": os.getppid(), "runs": RUNS[0], "random": random.random(),
            "crash_at": os.environ.get("SAGAGUARD_CRASH_AT"), "argv": sys.argv,
            "open": sorted(fd for fd, target in fds.items() if fd > 2 and not target.startswith("/proc/")),
            "sigint": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
            "sigterm": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
            "sigpipe": signal.getsignal(signal.SIGPIPE) == signal.SIG_IGN,
            "blocked": sorted(signal.pthread_sigmask(signal.SIG_BLOCK, [])),
        }))
        return 0

    if __name__ == "__main__":
        sys.exit(probe(sys.argv[1], json.loads(sys.argv[2])))
    '''
)
IMPOLITE = textwrap.dedent(
    """
    import signal
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a module that changes a disposition at import
    print("imported")  # and prints: the protocol must not see it
    """
)
THREADED = "import threading\nthreading.Thread(target=threading.Event().wait, daemon=True).start()\n"


@pytest.fixture(scope="module")
def probes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("probes")
    for name, text in (("probe.py", PROBE), ("impolite.py", IMPOLITE), ("threaded.py", THREADED)):
        (folder / name).write_text(text)
    return folder


def _env(probes: Path, **extra: str) -> dict[str, str]:
    env = _child_env()
    return {**env, "PYTHONPATH": os.pathsep.join((str(probes), env["PYTHONPATH"])), **extra}


@pytest.fixture(scope="module")
def zygote(probes: Path) -> Iterator[Zygote]:
    # A stale crash point in the zygote's own environment must not reach any run.
    with Zygote("probe:probe", ("impolite",), env=_env(probes, SAGAGUARD_CRASH_AT="stale")) as running:
        yield running


def _info(
    zygote: Zygote, env: dict[str, str] | None = None
) -> tuple[dict[str, Any], subprocess.CompletedProcess[str]]:
    done = zygote.run(("info",), {"n": 1}, env or {}, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1]), done


def test_each_run_is_a_fresh_child_of_the_zygote_with_its_own_output(zygote: Zygote) -> None:
    first, done = _info(zygote)
    second, _ = _info(zygote)
    assert first["pid"] != second["pid"]
    assert first["ppid"] == second["ppid"] == zygote.pid
    assert (first["runs"], second["runs"]) == (1, 1)  # no state carried from one run to the next
    assert first["random"] != second["random"]  # re-seeded: forks would otherwise draw the same numbers
    assert done.stdout.splitlines()[0] == "before the result line"
    assert done.stderr == "on stderr\n"
    assert "imported" not in done.stdout  # printed by the zygote's import, not by the run
    assert first["argv"][1:] == ["info", json.dumps({"n": 1})]
    assert first["argv"][0].endswith("probe.py")


def test_a_run_holds_only_stdin_stdout_stderr_and_fresh_signal_state(zygote: Zygote) -> None:
    info, _ = _info(zygote)
    assert info["open"] == []
    # SIGTERM was ignored by a module the zygote imported; the run has an interpreter's defaults.
    # SIGINT's default depends on how this test was started: a shell's background job inherits it
    # ignored, and a fresh interpreter then keeps it ignored too; the run must match that.
    probe = "import signal; print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)"
    fresh = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    ).stdout.strip() == "True"
    assert (info["sigint"], info["sigterm"], info["sigpipe"], info["blocked"]) == (fresh, True, True, [])


def test_the_crash_point_comes_from_the_request_only(zygote: Zygote) -> None:
    assert _info(zygote)[0]["crash_at"] is None
    assert _info(zygote, {"SAGAGUARD_CRASH_AT": "here"})[0]["crash_at"] == "here"


def test_a_sigkill_kills_the_run_only_and_reads_as_minus_9(zygote: Zygote) -> None:
    done = zygote.run(("kill",), {}, {}, timeout=60)
    assert done.returncode == -signal.SIGKILL
    assert "SIGKILL at probe " in done.stderr
    assert zygote.alive()
    assert _info(zygote)[0]["ppid"] == zygote.pid


def test_exit_status_follows_the_script_rules(zygote: Zygote) -> None:
    assert zygote.run(("exit",), {"code": 3}, {}, timeout=60).returncode == 3
    raised = zygote.run(("raise",), {}, {}, timeout=60)
    assert raised.returncode == 1
    assert "ValueError: boom" in raised.stderr


def test_a_run_past_its_timeout_is_killed_and_the_zygote_goes_on(zygote: Zygote) -> None:
    with pytest.raises(subprocess.TimeoutExpired):
        zygote.run(("hang",), {}, {}, timeout=0.5)
    assert _info(zygote)[0]["runs"] == 1


def test_a_run_killed_after_a_delay_reads_as_minus_9_and_says_so(zygote: Zygote) -> None:
    killed = zygote.run(("hang",), {}, {}, timeout=60, kill_after=0.2)
    assert killed.returncode == -signal.SIGKILL
    assert killed.stderr.endswith(f"{KILLED_AFTER} 0.200 s\n")
    # A run that ends before its kill time is not killed, and nothing says it was.
    done = zygote.run(("info",), {}, {}, timeout=60, kill_after=30)
    assert done.returncode == 0
    assert KILLED_AFTER not in done.stderr
    assert zygote.alive()


def test_a_zygote_whose_imports_start_a_thread_or_fail_refuses_to_start(probes: Path) -> None:
    with pytest.raises(ZygoteError, match="threads after the imports"):
        Zygote("probe:probe", ("threaded",), env=_env(probes))
    with pytest.raises(ZygoteError, match="ModuleNotFoundError"):
        Zygote("no_such_module:main", env=_env(probes))


def test_a_variant_runs_alike_through_the_zygote_and_subprocess(
    probes: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONPATH", str(probes))
    argv = (sys.executable, str(probes / "probe.py"), "info")
    zygoted = Variant("probe", argv, entry="probe:probe", timeout=60)
    try:
        forked = _run(zygoted, {"dir": "x"}, {"SAGAGUARD_CRASH_AT": "p"})
    finally:
        stop_zygotes(zygoted)
    started = _run(Variant("probe", argv, timeout=60), {"dir": "x"}, {"SAGAGUARD_CRASH_AT": "p"})
    assert forked.returncode == started.returncode == 0
    assert forked.stdout.splitlines()[0] == started.stdout.splitlines()[0] == "before the result line"
    seen = [json.loads(done.stdout.splitlines()[-1]) for done in (forked, started)]
    assert [(s["crash_at"], s["argv"], s["open"], s["runs"]) for s in seen] == [
        ("p", [str(probes / "probe.py"), "info", '{"dir": "x"}'], [], 1)
    ] * 2
