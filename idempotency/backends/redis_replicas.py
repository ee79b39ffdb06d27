"""Wait for replicas before a claim is handed to the guard, so a failover cannot lose it.

Redis replicates asynchronously: a primary acknowledges a write before any replica has it, and if it
dies then, the replica promoted in its place never saw the write. For a claim that means the record
is gone while its effect runs, and the next worker to ask claims it afresh and runs the effect
again. ``WAIT n timeout`` blocks the connection that wrote until ``n`` replicas acknowledged every
write it made, so the store sends it right behind the claim's script, on the same connection (one
pipelined round trip to the slot's primary; on a cluster through the cluster client's own client of
that node, ``RedisCluster.get_redis_connection``). A claim fewer replicas acknowledged is refused
as :class:`~sagaguard.idempotency.errors.StoreUnavailable`: its effect does not run.

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
from redis.exceptions import NoScriptError

from sagaguard.idempotency.backends.redis_client import ERRORS, RedisClient
from sagaguard.idempotency.errors import ConfigurationError, StoreError

__all__ = ["ReplicaWait"]


@dataclass(frozen=True)
class ReplicaWait:
    """How many replicas a claim waits for, and for how long.

    Attributes:
        count: replicas that must acknowledge a claim (0: no wait); None until :meth:`on` resolves
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

    def run(self, client: RedisClient, script: Script, name: str, args: Sequence[Any]) -> tuple[Any, int]:
        """Run ``script`` on the key ``name`` and ``WAIT`` on the same connection.

        Returns:
            The script's reply and how many replicas acknowledged it.

        Raises:
            redis.RedisError: as the client raises them (a ``RedisClusterException`` too).
            StoreError: the server keeps refusing the script (``NOSCRIPT`` after loading it).
        """
        cluster = isinstance(client, RedisCluster)
        node = client
        if isinstance(client, RedisCluster):
            slot_primary = client.get_node_from_key(name)  # type: ignore[no-untyped-call]  # redis-py: untyped
            node = client.get_redis_connection(slot_primary)
        wait_ms = max(1, math.ceil(self.timeout * 1000))
        try:
            for _ in range(2):
                pipe = node.pipeline(transaction=False)  # one connection for both commands
                pipe.evalsha(script.sha, 1, name, *args)
                pipe.execute_command("WAIT", self.count, wait_ms)
                try:
                    reply, acked = pipe.execute()
                except NoScriptError:  # a promoted replica or a restarted server: nothing ran
                    node.script_load(script.script)
                    continue
                return reply, int(acked)
        except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError):
            if cluster:
                # The slot's primary is gone or moved: a command through the cluster client makes
                # it refresh its view of the slots, so a later claim finds the new primary.
                with contextlib.suppress(*ERRORS):
                    client.exists(name)
            raise
        raise StoreError("redis keeps refusing the store's scripts (NOSCRIPT)")
