"""Wait for replicas before a write is acknowledged, so a failover cannot lose it.

Redis replicates asynchronously: a primary acknowledges a write before any replica has it, and if it
dies then, the replica promoted in its place never saw the write. For a claim that means the record
is gone while its effect runs, and the next worker to ask claims it afresh and runs the effect
again; for a saga's journal, a step registered with its compensation, a phase or the saga itself
is forgotten. ``WAIT n timeout`` blocks the connection that wrote until ``n`` replicas acknowledged
every write it made, so the store and the saga journal send it right behind the write's script, on
the same connection (one pipelined round trip to the slot's primary; on a cluster through the
cluster client's own client of that node, ``RedisCluster.get_redis_connection``). A write fewer
replicas acknowledged is refused (the store's :class:`~sagaguard.idempotency.errors.StoreUnavailable`,
the journal's ``JournalUnavailable``): its effect does not run.

``WAIT`` narrows the window rather than closing it in every case (Redis does not promise that a
replica that acknowledged is the one promoted, and a replica's own restart without persistence
loses what it had), but with one replica per primary, as a cluster usually runs, the promoted
replica is the one that acknowledged.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis
from redis.cluster import RedisCluster
from redis.commands.core import Script
from redis.exceptions import AskError, NoScriptError

from sagaguard.idempotency.backends.redis_client import ERRORS, RedisClient
from sagaguard.idempotency.errors import ConfigurationError, StoreUnavailable

__all__ = ["ReplicaWait"]


@dataclass(frozen=True)
class ReplicaWait:
    """How many replicas a write waits for, and for how long.

    Attributes:
        count: replicas that must acknowledge a write (0: no wait); None until :meth:`on` resolves
            the default for a client.
        timeout: seconds ``WAIT`` waits.
    """

    count: int | None
    timeout: float

    @staticmethod
    def of(count: object, timeout: object) -> ReplicaWait:
        """The checked settings.

        Raises:
            ConfigurationError: ``count`` is not None or an integer from 0 up, or ``timeout`` is
                not a finite number of seconds above 0.
        """
        if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 0):
            raise ConfigurationError(f"wait_replicas must be None or an integer >= 0, not {count!r}")
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, int | float)
            or not math.isfinite(timeout)
            or timeout <= 0
        ):
            raise ConfigurationError(f"replica_timeout must be a number of seconds > 0, not {timeout!r}")
        return ReplicaWait(count, float(timeout))

    def on(self, client: RedisClient) -> ReplicaWait:
        """The settings for ``client``: the default count is 1 on a cluster, 0 on one server."""
        if self.count is not None:
            return self
        return ReplicaWait(1 if isinstance(client, RedisCluster) else 0, self.timeout)

    def run(
        self,
        client: RedisClient,
        script: Script,
        keys: Sequence[str],
        args: Sequence[Any],
        *,
        first: tuple[str, Sequence[Any]] | None = None,
    ) -> tuple[Any, int]:
        """Run ``script`` on ``keys`` (all in one slot) and ``WAIT`` on the same connection.

        Args:
            first: a command to send before the script, and the key it writes: in the script's
                pipeline when that key's primary is the script's (always on one server), else in a
                pipeline of its own with its own ``WAIT``, before the script's (on a cluster whose
                slots put the two keys on different primaries: one more round trip). The script
                is not sent when fewer replicas than :attr:`count` acknowledged ``first``.

        Returns:
            The script's reply (None when it was not sent) and the fewest replicas that
            acknowledged a pipeline.

        Raises:
            redis.RedisError: as the client raises them (a ``RedisClusterException`` too).
            StoreUnavailable: the server keeps refusing the script (``NOSCRIPT`` after loading it) or
                redirecting it (``MOVED`` three times).
        """
        name = keys[0]
        script_call = ("EVALSHA", script.sha, len(keys), *keys, *args)
        if first is not None and not _same_primary(client, first[0], name):
            _, acked = self._send(client, first[0], [first[1]], None)
            if acked < (self.count or 0):
                return None, acked
            first = None
        commands = [script_call] if first is None else [first[1], script_call]
        replies, acked = self._send(client, name, commands, script)
        return replies[-1], acked

    def _send(
        self, client: RedisClient, name: str, commands: Sequence[Sequence[Any]], script: Script | None
    ) -> tuple[list[Any], int]:
        """``commands`` then ``WAIT``, one pipeline on one connection of ``name``'s primary."""
        wait_ms = max(1, math.ceil(self.timeout * 1000))
        for _ in range(3):
            node: redis.Redis = client if not isinstance(client, RedisCluster) else _primary(client, name)
            pipe = node.pipeline(transaction=False)  # one connection for every command
            for command in commands:
                pipe.execute_command(*command)  # type: ignore[no-untyped-call]  # redis-py: untyped
            pipe.wait(self.count or 0, wait_ms)
            try:
                *replies, acked = pipe.execute()
            except NoScriptError:  # a promoted replica or a restarted server: the script did not run
                if script is None:
                    raise
                node.script_load(script.script)
                continue
            except AskError:  # MOVED or ASK: the slot is served elsewhere now, nothing ran
                _refresh(client, name)
                continue
            except (redis.ConnectionError, redis.TimeoutError):
                _refresh(client, name)
                raise
            return replies, int(acked)
        raise StoreUnavailable("redis keeps refusing (NOSCRIPT) or redirecting (MOVED) the write")


def _same_primary(client: RedisClient, one: str, other: str) -> bool:
    """Whether one primary serves both keys' slots (one server serves every key)."""
    if not isinstance(client, RedisCluster):
        return True
    nodes = [client.get_node_from_key(key) for key in (one, other)]  # type: ignore[no-untyped-call]
    return bool(nodes[0].name == nodes[1].name)


def _primary(client: RedisCluster, name: str) -> redis.Redis:
    """The cluster client's own client of the primary that serves ``name``'s slot."""
    node = client.get_node_from_key(name)  # type: ignore[no-untyped-call]  # redis-py: untyped
    return client.get_redis_connection(node)


def _refresh(client: RedisClient, name: str) -> None:
    """After a node failed or redirected: one command on ``name`` through the cluster client, which
    follows ``MOVED`` (and so learns the slot's new primary) or, on a dead node, has its view of the
    slots refreshed by its next command. A single server has nothing to learn."""
    if isinstance(client, RedisCluster):
        with contextlib.suppress(*ERRORS):
            client.exists(name)
