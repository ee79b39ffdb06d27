"""What the shared database did, read from the server itself: for bench/fleet.py's cost figures.

:func:`pg_reading` reads, on a Postgres that loads ``pg_stat_statements`` (the private cluster of
``bench/round_trips.py``):

- ``commits``: ``pg_stat_database.xact_commit`` of the database (a backend reports it as it goes
  idle, at most once a second, and as it exits: a window's figure, read while its workers still
  run, is close, not exact; the exact counts per unit are ``round_trips.count``'s);
- ``statements``: ``sum(calls)`` of ``pg_stat_statements``, ``BEGIN`` and ``COMMIT`` included, the
  readings' own left out; each is one round trip, as every statement here is sent alone;
- ``wal_bytes``: ``pg_current_wal_lsn()`` as a byte position;
- ``cpu``: the server's own CPU seconds (user + system) from ``/proc``: the postmaster's, its live
  children's (backends, WAL writer, checkpointer...) and, through the postmaster's ``cutime`` and
  ``cstime``, those of every child that has exited (a backend whose client closed).

:func:`redis_reading` reads, on every node of a Redis Cluster: ``statements`` (commands the
primaries ran, from ``INFO commandstats``, the readings' own left out), ``wal_bytes`` (the
primaries' AOF size, ``aof_current_size``; Redis has no commits: the AOF is its log) and ``cpu``
(``used_cpu_user`` + ``used_cpu_sys`` of every node, replicas included).

A difference of two readings, divided by the units done between them, is what one unit cost.

:func:`redis_commands` counts exactly what ``INFO commandstats`` cannot tell apart: the commands
one client of this process sent the primaries (``MONITOR``, which marks those a script ran as
``lua`` and names each client's address: other processes' commands are left out).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path

_TICK = os.sysconf("SC_CLK_TCK")
_ADMIN_COMMANDS = {"info", "cluster", "ping", "config", "command", "client", "hello", "readonly", "script"}
"""Commands the readings and the clients' cluster discovery send: not the workload's."""


def _stat(pid: int) -> list[str]:
    """The fields of ``/proc/<pid>/stat`` after the command name (field 3 is index 0)."""
    text = Path(f"/proc/{pid}/stat").read_text()
    return text[text.rindex(")") + 2 :].split()


def process_tree_cpu(root: int) -> float:
    """CPU seconds of ``root``, its live children, and its reaped children."""
    fields = _stat(root)
    total = sum(int(fields[i]) for i in (11, 12, 13, 14))  # utime, stime, cutime, cstime
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == root:
            continue
        try:
            child = _stat(int(entry.name))
        except (OSError, ValueError):
            continue  # exited meanwhile: counted by the parent's cutime, or not yet
        if int(child[1]) == root:
            total += int(child[11]) + int(child[12])
    return total / _TICK


def postmaster_pid(url: str) -> int:
    """The pid of the postmaster serving ``url`` (the parent of a backend), on this machine."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("SELECT pg_backend_pid()").fetchone()
        assert row is not None
        return int(_stat(int(row[0]))[1])  # while the backend lives: it exits once closed


def pg_reading(url: str, postmaster: int) -> dict[str, float]:
    """Commits, statements, WAL position and server CPU of the Postgres at ``url``, now."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT (SELECT coalesce(sum(calls), 0) FROM pg_stat_statements"
            "        WHERE query NOT LIKE '%pg_stat%' AND query NOT LIKE '%pg_backend_pid%'"
            "          AND query NOT LIKE '%pg_current_wal_lsn%'),"
            "       (SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()),"
            "       pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')"
        ).fetchone()
    assert row is not None
    return {
        "statements": float(row[0]),
        "commits": float(row[1]),
        "wal_bytes": float(row[2]),
        "cpu": process_tree_cpu(postmaster),
    }


def redis_reading(ports: list[int]) -> dict[str, float]:
    """Commands, AOF bytes and CPU of the cluster whose nodes listen on ``ports``, now."""
    import redis

    found = {"statements": 0.0, "wal_bytes": 0.0, "cpu": 0.0}
    for port in ports:
        client = redis.Redis(port=port, decode_responses=True)
        try:
            info = client.info("all")
        finally:
            client.close()
        found["cpu"] += float(info["used_cpu_user"]) + float(info["used_cpu_sys"])
        if info.get("role") != "master":
            continue
        found["wal_bytes"] += float(info.get("aof_current_size", 0))
        for name, value in info.items():
            if (
                name.startswith("cmdstat_")
                and name.removeprefix("cmdstat_").split("|")[0] not in _ADMIN_COMMANDS
            ):
                found["statements"] += float(value["calls"])
    return found


_SENTINEL = "fleet-monitor-done"


def own_connections() -> set[tuple[int, int]]:
    """This process's TCP connections, as (local port, remote port) pairs (``/proc``: the sockets
    among its file descriptors, their addresses from ``/proc/self/net/tcp``)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # closed meanwhile
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    found = set()
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                local, peer, inode = fields[1], fields[2], fields[9]
                if inode in inodes:
                    found.add((int(local.rsplit(":", 1)[1], 16), int(peer.rsplit(":", 1)[1], 16)))
    return found


def redis_commands(ports: list[int], run: Callable[[], None]) -> float:
    """Commands this process's clients sent the cluster's primaries while ``run()`` ran, admin
    commands left out.

    ``MONITOR`` shows every client's commands; only those on this process's connections
    (:func:`own_connections`, taken as ``run()`` returns, before its clients close) are counted,
    so another process's commands (a worker of an earlier window still exiting, a reading) are not.
    Commands, not round trips: the server does not show which came pipelined in one write (the
    store sends a claim's script and its ``WAIT`` together)."""
    import redis

    primaries = []
    for port in ports:
        client = redis.Redis(port=port, decode_responses=True)
        try:
            if client.info("replication")["role"] == "master":
                primaries.append(port)
        finally:
            client.close()
    seen_by: list[Counter[int]] = [Counter() for _ in primaries]
    watching = threading.Barrier(len(primaries) + 1)

    def watch(i: int, port: int) -> None:
        client = redis.Redis(port=port, decode_responses=True)
        try:
            with client.monitor() as monitor:
                watching.wait()
                while True:
                    seen = monitor.next_command()
                    words = str(seen["command"]).split()
                    if words[:2] == ["ECHO", _SENTINEL]:
                        return
                    if seen["client_type"] == "tcp" and words and words[0].lower() not in _ADMIN_COMMANDS:
                        seen_by[i][int(seen["client_port"])] += 1
        finally:
            client.close()

    threads = [threading.Thread(target=watch, args=(i, p), daemon=True) for i, p in enumerate(primaries)]
    for thread in threads:
        thread.start()
    watching.wait()
    run()
    mine = own_connections()
    for port in primaries:
        client = redis.Redis(port=port, decode_responses=True)
        try:
            client.echo(_SENTINEL)
        finally:
            client.close()
    for thread in threads:
        thread.join(timeout=60)
        if thread.is_alive():
            raise RuntimeError("a MONITOR never saw its end mark")
    pairs = zip(primaries, seen_by, strict=True)
    return float(sum(n for node, counts in pairs for port, n in counts.items() if (port, node) in mine))


def difference(before: dict[str, float], after: dict[str, float], units: int) -> dict[str, float]:
    """Per unit: ``(after - before) / units`` for each figure (zeros when nothing was done).

    Raises:
        RuntimeError: a counter went down (a Redis AOF rewritten during the window, a server
            restarted): the window measured nothing it could report.
    """
    fallen = sorted(k for k in after if after[k] < before[k])
    if fallen:
        raise RuntimeError(f"counters went down during the window: {fallen}")
    return {k: (after[k] - before[k]) / units if units else 0.0 for k in after}
