"""Holder identities of real processes on this host, for the lease take-over tests."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from sagaguard.idempotency import holder


def identity_of(pid: int) -> str:
    """The holder identity of the process ``pid`` on this host, read from ``/proc``."""
    me = holder.parse(holder.current())
    assert me is not None
    text = Path(f"/proc/{pid}/stat").read_text()
    return str(holder.Holder(me.host, pid, text[text.rfind(")") + 2 :].split()[19]))


def _sleeper(seconds: int) -> subprocess.Popen[bytes]:
    if not Path("/proc/self/stat").exists():
        pytest.skip("needs Linux /proc")
    return subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({seconds})"])


def dead_holder() -> str:
    """The identity of a real process that ran on this host: SIGKILLed and reaped."""
    proc = _sleeper(60)
    who = identity_of(proc.pid)
    proc.kill()
    proc.wait()
    assert holder.is_dead_on_this_host(who)
    return who


@contextmanager
def live_holder() -> Iterator[str]:
    """The identity of another live process on this host, alive for the block."""
    proc = _sleeper(120)
    try:
        yield identity_of(proc.pid)
    finally:
        proc.kill()
        proc.wait()
