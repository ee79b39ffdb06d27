"""A real Redis Cluster on this machine for the tests: three primaries, three replicas.

:class:`LocalCluster` starts six ``redis-server --cluster-enabled yes --appendonly yes`` on free
ports (each with its own directory and an explicit cluster-bus port, since the default bus port,
the client port plus 10,000, may not exist for a high ephemeral port), joins them with
``redis-cli --cluster create ... --cluster-replicas 1``, and waits until every node reports
``cluster_state:ok`` and knows every replica, and every primary has its replica online (about four
seconds here). ``conftest.py``'s session-scoped ``redis_cluster`` fixture owns one; tests take it
and use their own key prefixes.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import redis

__all__ = ["ClusterStartError", "LocalCluster", "cluster_problem"]

NODES = 6
"""Three primaries and their three replicas."""

READY_TIMEOUT = 60.0
"""Seconds a cluster may take to come up before the fixture gives up (a bound, not an expectation:
it takes about four seconds here)."""


class ClusterStartError(RuntimeError):
    """The local cluster did not come up."""


def cluster_problem() -> str | None:
    """Why a local cluster cannot be started here (a missing tool), or None."""
    for tool in ("redis-server", "redis-cli"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    return None


def _free_ports(n: int) -> list[int]:
    """``n`` distinct local ports nothing listens on (all held open until chosen, so distinct)."""
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
class LocalCluster:
    """Six local redis-servers joined into one cluster; :meth:`start`, then :meth:`stop`.

    Attributes:
        root: the directory under which each node keeps its files.
        ports: the nodes' client ports, in start order.
    """

    root: Path
    ports: list[int] = field(default_factory=list)
    _procs: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict, repr=False)
    _argv: dict[int, list[str]] = field(default_factory=dict, repr=False)

    @property
    def url(self) -> str:
        """The ``redis+cluster://`` URL that lists every node."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def start(self) -> LocalCluster:
        """Start the nodes, create the cluster, wait until it serves every slot.

        Raises:
            ClusterStartError: a node exited, ``redis-cli --cluster create`` failed, or the cluster
                was not ok within :data:`READY_TIMEOUT`.
        """
        try:
            return self._start()
        except BaseException:
            self.stop()  # whatever went wrong, no node outlives the attempt
            raise

    def _start(self) -> LocalCluster:
        ports = _free_ports(2 * NODES)
        self.ports, buses = ports[:NODES], ports[NODES:]
        for port, bus in zip(self.ports, buses, strict=True):
            folder = self.root / str(port)
            folder.mkdir(parents=True, exist_ok=True)
            # A replica syncs at once (by default a primary waits 5 s for more replicas to join), and
            # is listed by CLUSTER SLOTS once its replication offset moved past 0, which on an idle
            # cluster takes the primary's next ping (every 10 s by default).
            # fmt: off
            argv = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", str(folder),
                    "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                    "--cluster-port", str(bus), "--cluster-node-timeout", "2000",
                    "--appendonly", "yes", "--save", "",
                    "--repl-diskless-sync-delay", "0", "--repl-ping-replica-period", "1"]
            # fmt: on
            self._argv[port] = argv
            self._procs[port] = subprocess.Popen(
                argv,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        deadline = time.monotonic() + READY_TIMEOUT
        for port in self.ports:
            self._wait(port, deadline, lambda c: bool(c.ping()))
        nodes = [f"127.0.0.1:{p}" for p in self.ports]
        create = subprocess.run(
            ["redis-cli", "--cluster", "create", *nodes, "--cluster-replicas", "1", "--cluster-yes"],
            capture_output=True,
            text=True,
            timeout=READY_TIMEOUT,
            check=False,
        )
        if create.returncode != 0:
            raise ClusterStartError(f"redis-cli --cluster create failed:\n{create.stdout}\n{create.stderr}")
        for port in self.ports:
            self._wait(port, deadline, _ready)
        return self

    def _wait(self, port: int, deadline: float, ready: Callable[[redis.Redis], bool]) -> None:
        client = redis.Redis(port=port, socket_timeout=2, socket_connect_timeout=2)
        try:
            while True:
                try:
                    if ready(client):
                        return
                except redis.RedisError:
                    pass
                proc = self._procs[port]
                if proc.poll() is not None:
                    raise ClusterStartError(f"redis-server on port {port} exited with {proc.returncode}")
                if time.monotonic() > deadline:
                    raise ClusterStartError(f"the cluster node on port {port} was not ready in time")
                time.sleep(0.05)
        finally:
            client.close()

    def pause(self, port: int) -> None:
        """SIGSTOP the node on ``port``: it neither answers nor acknowledges replication."""
        self._procs[port].send_signal(signal.SIGSTOP)

    def resume(self, port: int) -> None:
        """SIGCONT the node on ``port``."""
        self._procs[port].send_signal(signal.SIGCONT)

    def replica_of(self, port: int) -> int:
        """The port of the replica of the primary on ``port`` (from its ``INFO replication``)."""
        client = redis.Redis(port=port, socket_timeout=2, decode_responses=True)
        try:
            info = client.info("replication")
        finally:
            client.close()
        return int(info["slave0"]["port"])

    def kill(self, port: int) -> None:
        """SIGKILL the node on ``port``."""
        proc = self._procs[port]
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)

    def restart(self, port: int) -> None:
        """Start the killed node on ``port`` again, on its own files: it rejoins the cluster (a
        primary that was failed over comes back as a replica of the node promoted in its place)."""
        self._procs[port] = subprocess.Popen(
            self._argv[port], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        self._wait(port, time.monotonic() + READY_TIMEOUT, lambda c: bool(c.ping()))

    def stop(self) -> None:
        """Kill every node still running: its data is thrown away with it, and a primary told to
        shut down would wait up to ten seconds for replicas that are going away too."""
        for proc in self._procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)  # a paused node too
                proc.kill()
        for proc in self._procs.values():
            proc.wait(timeout=10)


def _ready(client: redis.Redis) -> bool:
    """Whether a node sees the cluster ok, knows a replica for each of the three slot ranges (what
    a client learns the topology from: ``CLUSTER SLOTS``), and, if it is a primary, has a replica
    online."""
    info = client.execute_command("CLUSTER", "INFO")  # the text of CLUSTER INFO (or its parse)
    text = info.decode() if isinstance(info, bytes) else str(info)
    if "cluster_state:ok" not in text and "'cluster_state': 'ok'" not in text:
        return False
    ranges = client.execute_command("CLUSTER SLOTS")
    if len(ranges) != NODES // 2 or any(len(entry) < 4 for entry in ranges):
        return False
    role = client.info("replication")
    return role.get("role") != "master" or int(role.get("connected_slaves", 0)) >= 1
