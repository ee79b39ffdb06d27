"""A replicated Postgres on this machine for the tests: a primary and its streaming standby.

:class:`LocalPgPair` runs ``initdb`` for a primary on a free port (trust on 127.0.0.1, replication
allowed), starts it, copies it with ``pg_basebackup -R`` into a standby on another free port
(``standby.signal`` and ``primary_conninfo`` written by ``-R``, ``application_name=standby``), and
starts that. With ``synchronous=True`` the primary has ``synchronous_standby_names = 'standby'``
and the start waits until ``pg_stat_replication`` shows the standby ``sync``: from then on a commit
returns only once the standby has its WAL, so a SIGKILLed primary's acknowledged commits are on the
standby promoted in its place. With ``synchronous=False`` the standby streams asynchronously (the
default of a Postgres replica): the case that can lose acknowledged commits. The standby has
``synchronous_standby_names = ''`` (for when it is promoted) and ``wal_retrieve_retry_interval = 1s``.

initdb refuses to run as root, so as root every server command runs as the ``postgres`` user
(``runuser -u postgres --``), in a temporary directory that user owns. ``fsync = off`` on both: a
SIGKILL of the server process leaves the operating system's page cache intact, which is all these
tests kill, and it spares the shared machine the flushes. Starting a pair takes about 6 s here.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psycopg

__all__ = ["PairStartError", "LocalPgPair", "pair_problem", "pg_bin"]

READY_TIMEOUT = 60.0
"""Seconds the pair may take to come up (a bound, not an expectation: about 6 s here)."""

_TOOLS = ("initdb", "pg_ctl", "pg_basebackup")


class PairStartError(RuntimeError):
    """The local primary and standby did not come up."""


def pg_bin() -> Path | None:
    """The directory holding initdb, pg_ctl and pg_basebackup (Debian keeps the last one out of
    ``PATH``, under ``/usr/lib/postgresql/<version>/bin``), or None."""
    candidates = [os.path.dirname(p) for p in (shutil.which("initdb"),) if p]
    candidates += sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True)
    for folder in candidates:
        if all(os.access(os.path.join(folder, tool), os.X_OK) for tool in _TOOLS):
            return Path(folder)
    return None


def pair_problem() -> str | None:
    """Why a local primary and standby cannot be started here, or None."""
    if pg_bin() is None:
        return f"{', '.join(_TOOLS)} are not installed together (PATH or /usr/lib/postgresql/*/bin)"
    if os.geteuid() == 0 and (shutil.which("runuser") is None or _uid("postgres") is None):
        return "running as root, and there is no postgres user (or runuser) to run initdb as"
    return None


def _uid(user: str) -> int | None:
    import pwd

    try:
        return pwd.getpwnam(user).pw_uid
    except KeyError:
        return None


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
            socks.append(sock)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for sock in socks:
            sock.close()


@dataclass
class LocalPgPair:
    """A local primary and its streaming standby; :meth:`start`, then :meth:`stop`.

    Attributes:
        synchronous: whether the primary waits for the standby at each commit.
        ports: the primary's and the standby's ports.
        root: the temporary directory holding both data directories and their logs.
        started_in: seconds :meth:`start` took.
    """

    synchronous: bool = True
    ports: tuple[int, int] = (0, 0)
    root: Path | None = None
    started_in: float = 0.0
    _bin: Path = field(default=Path("."), repr=False)
    _killed: set[str] = field(default_factory=set, repr=False)

    # -- URLs ------------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """The libpq multi-host URL a client fails over with: both servers, the writable one wins."""
        a, b = self.ports
        return f"postgresql://postgres@127.0.0.1:{a},127.0.0.1:{b}/postgres?target_session_attrs=read-write"

    def node_url(self, index: int) -> str:
        """The URL of one server (0: the first primary, 1: the standby)."""
        return f"postgresql://postgres@127.0.0.1:{self.ports[index]}/postgres"

    # -- life cycle --------------------------------------------------------------------------------

    def start(self) -> LocalPgPair:
        """initdb, start the primary, base-back it up into the standby, start it, wait for streaming.

        Raises:
            PairStartError: a tool failed or the standby did not stream within :data:`READY_TIMEOUT`.
        """
        began = time.monotonic()
        found = pg_bin()
        if found is None:
            raise PairStartError(pair_problem() or "no Postgres server tools")
        self._bin = found
        self.root = Path(tempfile.mkdtemp(prefix="sg-pgpair-"))
        try:
            self._start()
        except BaseException:
            self.stop()  # whatever went wrong, no server outlives the attempt
            raise
        self.started_in = time.monotonic() - began
        return self

    def _start(self) -> None:
        assert self.root is not None
        if os.geteuid() == 0:
            uid = _uid("postgres")
            assert uid is not None
            os.chown(self.root, uid, -1)
        first, second = _free_ports(2)
        self.ports = (first, second)
        primary, standby = self.root / "primary", self.root / "standby"
        self._run("initdb", "-D", str(primary), "-A", "trust", "-U", "postgres", "--no-sync", "-N")
        settings = [
            "listen_addresses = '127.0.0.1'",
            f"port = {self.ports[0]}",
            f"unix_socket_directories = '{self.root}'",
            "wal_level = replica",
            "max_wal_senders = 4",
            "fsync = off",
            "max_connections = 60",
        ]
        if self.synchronous:
            settings.append("synchronous_standby_names = 'standby'")
        with (primary / "postgresql.conf").open("a") as conf:
            conf.write("\n".join(settings) + "\n")
        with (primary / "pg_hba.conf").open("a") as hba:
            hba.write("host replication all 127.0.0.1/32 trust\n")
        self._pg_ctl(primary, "start")
        conninfo = f"host=127.0.0.1 port={self.ports[0]} user=postgres application_name=standby"
        self._run("pg_basebackup", "-d", conninfo, "-D", str(standby), "-R", "-X", "stream", "-c", "fast")
        with (standby / "postgresql.conf").open("a") as conf:
            conf.write(f"port = {self.ports[1]}\n")  # the copy carries the primary's port
            # ... and its synchronous_standby_names: promoted, the standby would wait at every commit
            # for a standby of its own that does not exist, and hang every writer.
            conf.write("synchronous_standby_names = ''\n")
            # PostgreSQL 15 notices a promotion between its attempts to reach the lost primary, every
            # wal_retrieve_retry_interval (5 s by default): measured, 3 promotions in 9 took 5 s.
            conf.write("wal_retrieve_retry_interval = '1s'\n")
        self._pg_ctl(standby, "start")
        deadline = time.monotonic() + READY_TIMEOUT
        want = "sync" if self.synchronous else "async"
        while not self._streaming(want):
            if time.monotonic() > deadline:
                raise PairStartError(f"the standby was not streaming ({want}) in time")
            time.sleep(0.05)

    def _streaming(self, want: str) -> bool:
        with psycopg.connect(self.node_url(0), autocommit=True, connect_timeout=5) as conn:
            rows = conn.execute(
                "SELECT sync_state FROM pg_stat_replication WHERE application_name = 'standby' "
                "AND state = 'streaming'"
            ).fetchall()
        return [r[0] for r in rows] == [want]

    def _as_owner(self, argv: list[str]) -> list[str]:
        return ["runuser", "-u", "postgres", "--", *argv] if os.geteuid() == 0 else argv

    def _run(self, tool: str, *args: str) -> None:
        done = subprocess.run(
            self._as_owner([str(self._bin / tool), *args]),
            capture_output=True,
            text=True,
            timeout=READY_TIMEOUT,
            check=False,
            cwd=self.root,  # runuser keeps the cwd, which the postgres user must be able to enter
        )
        if done.returncode != 0:
            raise PairStartError(f"{tool} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")

    def _pg_ctl(self, data: Path, action: str, *extra: str) -> None:
        self._run("pg_ctl", "-D", str(data), "-l", f"{data}.log", "-w", "-t", "60", action, *extra)

    def _pid(self, data: Path) -> int | None:
        try:
            return int((data / "postmaster.pid").read_text().split("\n", 1)[0])
        except (OSError, ValueError):
            return None

    # -- faults --------------------------------------------------------------------------------------

    def kill_primary(self) -> None:
        """SIGKILL the primary's postmaster (its backends see it die and exit on their own)."""
        assert self.root is not None
        pid = self._pid(self.root / "primary")
        assert pid is not None, "the primary is not running"
        os.kill(pid, signal.SIGKILL)
        self._killed.add("primary")  # a zombie until someone reaps it: pg_ctl cannot stop it

    def promote(self) -> None:
        """``pg_ctl promote`` the standby and wait until it accepts writes."""
        assert self.root is not None
        self._pg_ctl(self.root / "standby", "promote")

    def stop(self) -> None:
        """Stop whatever still runs (immediately: the data is thrown away) and remove the files."""
        if self.root is None:
            return
        for name in ("standby", "primary"):
            data = self.root / name
            pid = self._pid(data)
            if pid is None or name in self._killed:
                continue  # never started, or killed by a test (its backends follow it)
            try:
                self._pg_ctl(data, "stop", "-m", "immediate")
            except PairStartError:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.root, ignore_errors=True)
        self.root = None
