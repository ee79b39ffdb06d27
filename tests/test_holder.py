"""Holder identities (idempotency/holder.py): who holds a claim, and when it is provably dead.

Real processes are started, killed and reaped; nothing is mocked but the location of ``/proc`` (to
play a platform without it) and ``$SAGAGUARD_HOST_ID`` (to play another host).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from sagaguard.idempotency import holder

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")


@pytest.fixture(autouse=True)
def fresh_identity(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv(holder.HOST_ENV, raising=False)
    holder.refresh()
    yield
    monkeypatch.undo()
    holder.refresh()


def start_time(pid: int) -> str:
    text = Path(f"/proc/{pid}/stat").read_text()
    return text[text.rfind(")") + 2 :].split()[19]


def identity_of(proc: subprocess.Popen[bytes]) -> str:
    me = holder.parse(holder.current())
    assert me is not None
    return str(holder.Holder(me.host, proc.pid, start_time(proc.pid)))


def sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_current_names_this_process_and_round_trips() -> None:
    text = holder.current()
    parsed = holder.parse(text)
    assert parsed is not None
    assert parsed.pid == os.getpid()
    assert parsed.start == start_time(os.getpid())
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    assert parsed.host == f"{boot}/{os.stat('/proc/self/ns/pid').st_ino}"
    assert str(parsed) == text
    assert holder.current() is text  # computed once


@pytest.mark.parametrize("text", ["", "x", "a|b|c", "host|12", "host|-1|5", "host|1|x"])
def test_parse_refuses_what_is_not_a_holder(text: str) -> None:
    assert holder.parse(text) is None
    assert not holder.is_dead_on_this_host(text)


def test_parse_keeps_a_host_with_separators() -> None:
    assert holder.parse("a|b/7|12|34") == holder.Holder("a|b/7", 12, "34")


def test_this_process_is_alive() -> None:
    assert not holder.is_dead_on_this_host(holder.current())
    assert not holder.is_dead_on_this_host(None)


def test_a_live_process_is_alive_and_a_killed_one_dead() -> None:
    proc = sleeper()
    try:
        who = identity_of(proc)
        assert not holder.is_dead_on_this_host(who)
        proc.send_signal(signal.SIGKILL)
        os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)  # dead, not yet reaped: a zombie
        assert holder.is_dead_on_this_host(who)
    finally:
        proc.kill()
        proc.wait()
    assert holder.is_dead_on_this_host(who)  # reaped: the pid is gone


def test_a_reused_pid_is_told_apart_by_its_start_time() -> None:
    me = holder.parse(holder.current())
    assert me is not None
    earlier = holder.Holder(me.host, me.pid, str(int(me.start) - 1))
    assert holder.is_dead_on_this_host(str(earlier))
    proc = sleeper()
    try:
        other = holder.Holder(me.host, proc.pid, str(int(start_time(proc.pid)) + 1))
        assert holder.is_dead_on_this_host(str(other))
    finally:
        proc.kill()
        proc.wait()


def test_a_holder_on_another_host_is_never_judged_dead() -> None:
    proc = sleeper()
    proc.kill()
    proc.wait()
    me = holder.parse(holder.current())
    assert me is not None
    for host in ("another-machine/" + me.host.split("/")[1], me.host.split("/")[0] + "/1"):
        assert not holder.is_dead_on_this_host(str(holder.Holder(host, proc.pid, "1")))


def test_host_id_from_the_environment_makes_another_host(monkeypatch: pytest.MonkeyPatch) -> None:
    proc = sleeper()
    try:
        before = identity_of(proc)
    finally:
        proc.kill()
        proc.wait()
    assert holder.is_dead_on_this_host(before)
    monkeypatch.setenv(holder.HOST_ENV, "host-b")
    after = holder.parse(holder.refresh())
    assert after is not None
    assert after.host.startswith("host-b/")
    assert not holder.is_dead_on_this_host(before)  # written on "another host"


def test_without_proc_no_holder_is_ever_judged_dead(monkeypatch: pytest.MonkeyPatch) -> None:
    proc = sleeper()
    dead = identity_of(proc)
    proc.kill()
    proc.wait()
    assert holder.is_dead_on_this_host(dead)
    monkeypatch.setattr(holder, "_PROC", "/nonexistent-proc")
    mine = holder.parse(holder.refresh())
    assert mine == holder.Holder(holder.UNKNOWN_HOST, os.getpid(), "")
    assert not holder.is_dead_on_this_host(dead)
    assert not holder.is_dead_on_this_host(str(mine))


def test_a_forked_child_has_an_identity_of_its_own() -> None:
    parent = holder.current()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.write(write, holder.current().encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        child = pipe.read()
    os.waitpid(pid, 0)
    parsed = holder.parse(child)
    assert parsed is not None and parsed.pid == pid
    assert child != parent
    assert holder.current() == parent
    assert holder.is_dead_on_this_host(child)
