"""Who holds a claim: this process's identity, and whether another holder is provably dead.

A holder is the text ``<host>|<pid>|<start>``:

- ``host``: the machine and the pid namespace the process lives in, ``<machine>/<pidns>``. The
  machine is the kernel's boot id (``/proc/sys/kernel/random/boot_id``: new at every boot), else
  ``/etc/machine-id``; ``$SAGAGUARD_HOST_ID``, when set, replaces it. The pid namespace is the inode
  of ``/proc/self/ns/pid``: containers on one machine share the boot id but each usually has a pid
  namespace of its own, where pid 7 is another process than pid 7 next door, so a pid is only
  probed from inside the namespace it was read in.
- ``pid`` and ``start``: the process id and its start time (field 22 of ``/proc/<pid>/stat``, in
  clock ticks since boot), so a pid reused by a later process is told apart from the holder.

Without ``/proc`` (macOS, Windows, a locked-down sandbox) the host is unknown (``?``) and no holder
is ever judged dead: claims are then freed by lease expiry only.

The identity is computed once per process, and again in a child after a fork.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Final

__all__ = ["HOST_ENV", "Holder", "current", "is_dead_on_this_host", "parse", "refresh"]

HOST_ENV: Final = "SAGAGUARD_HOST_ID"
"""Environment variable that names the machine in place of its boot id (tests play "another host"
with it). Two machines must never share a value: a holder on the other would be probed here."""

UNKNOWN_HOST: Final = "?"
"""The host of a process that cannot tell where it runs: never equal to any host, even itself."""

_PROC = "/proc"


@dataclass(frozen=True, slots=True)
class Holder:
    """A parsed holder identity."""

    host: str
    pid: int
    start: str
    """The process's start time as ``/proc`` prints it; empty when unknown."""

    def __str__(self) -> str:
        return f"{self.host}|{self.pid}|{self.start}"


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read().strip() or None
    except OSError:
        return None


def _stat(pid: int) -> tuple[str, str] | None:
    """The state and start time (fields 3 and 22) of ``/proc/<pid>/stat``, None if there is none."""
    text = _read(f"{_PROC}/{pid}/stat")
    if text is None:
        return None
    # Field 2, the command, is in parentheses and may hold spaces and parentheses itself.
    fields = text[text.rfind(")") + 2 :].split()
    if len(fields) < 20:
        return None
    return fields[0], fields[19]


def _host() -> str:
    machine = (
        os.environ.get(HOST_ENV) or _read(f"{_PROC}/sys/kernel/random/boot_id") or _read("/etc/machine-id")
    )
    try:
        pidns = os.stat(f"{_PROC}/self/ns/pid").st_ino
    except OSError:
        return UNKNOWN_HOST
    if machine is None or "|" in machine:
        return UNKNOWN_HOST
    return f"{machine}/{pidns}"


def _build() -> Holder:
    pid = os.getpid()
    host = _host()
    stat = _stat(pid) if host != UNKNOWN_HOST else None
    return Holder(host, pid, "" if stat is None else stat[1])


_this: Holder | None = None
_text: str | None = None


def refresh() -> str:
    """Compute this process's identity again (after changing ``$SAGAGUARD_HOST_ID``); returns it.

    Done automatically in a child after a fork.
    """
    global _this, _text  # noqa: PLW0603 - a per-process cache, reset by fork
    _this = _build()
    _text = str(_this)
    return _text


def _forget() -> None:
    global _this, _text
    _this, _text = None, None


os.register_at_fork(after_in_child=_forget)


def current() -> str:
    """This process's holder identity (computed on first use, and again after a fork)."""
    return _text if _text is not None else refresh()


def _current_holder() -> Holder:
    if _this is None:
        refresh()
    assert _this is not None
    return _this


def parse(text: str) -> Holder | None:
    """A holder identity read back, or None when ``text`` is not one (say, written by hand)."""
    parts = text.rsplit("|", 2)
    if len(parts) != 3 or not parts[1].isdigit() or not (parts[2] == "" or parts[2].isdigit()):
        return None
    return Holder(parts[0], int(parts[1]), parts[2])


def is_dead_on_this_host(holder: str | None) -> bool:
    """Whether ``holder`` is a process on this host (same machine, same pid namespace) that is
    provably no longer alive: its pid is gone, is a zombie, or belongs to a process with another
    start time (the pid was reused).

    False whenever that cannot be proven: no or malformed holder, another host, an unknown host or
    start time (no ``/proc``), or a live process with the holder's start time. A False costs a
    caller only the wait for the lease, a wrong True would hand a live call's claim to another.
    Reads ``/proc`` (a few microseconds); never raises.
    """
    if not holder:
        return False
    other = parse(holder)
    me = _current_holder()
    if other is None or me.host == UNKNOWN_HOST or other.host != me.host or not other.start or not me.start:
        return False
    if other.pid == me.pid:
        return other.start != me.start
    stat = _stat(other.pid)
    if stat is None:
        # Either gone, or /proc went away under us: only a gone pid proves death.
        return os.path.isdir(f"{_PROC}/self")
    state, start = stat
    return state in ("Z", "X") or start != other.start
