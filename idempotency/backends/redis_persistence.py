"""At open, check that the Redis server keeps what it is told: a ledger it forgets re-runs effects.

A Redis server without an append-only file loses every record written since its last snapshot
(all of them with no snapshots) when it restarts; an effect whose record was lost runs again. The
Redis store and the Redis saga journal call :func:`check_persistence` once their scripts are loaded.
It reads ``CONFIG GET appendonly`` and ``CONFIG GET save`` and issues a :class:`DurabilityWarning`
when the server has no append-only file, or when it cannot tell (managed services often refuse
``CONFIG``). It warns rather than refuses: a cache-only Redis is a legitimate choice for tests and
demos. To refuse such a server, turn the warning into an error::

    warnings.simplefilter("error", DurabilityWarning)

On a Redis Cluster every node is checked, primaries and replicas alike (a replica becomes a
primary at a failover), each through the cluster client's own client of that node
(``RedisCluster.get_redis_connection``); a warning names the node.

Each server is checked once per process.
"""

from __future__ import annotations

import threading
import warnings
from typing import Any

import redis
from redis.cluster import RedisCluster

__all__ = ["DurabilityWarning", "check_persistence"]


class DurabilityWarning(UserWarning):
    """The backend may lose acknowledged records on a restart, so an effect may run again."""


_checked: set[tuple[Any, ...]] = set()
_lock = threading.Lock()


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value or "")


def _config(client: redis.Redis, name: str) -> str:
    reply = client.config_get(name)
    for key, value in reply.items():  # one pair; keys are bytes unless the client decodes
        if _text(key) == name:
            return _text(value)
    return ""


def check_persistence(client: redis.Redis | RedisCluster, what: str) -> None:
    """Warn once per server when ``client``'s Redis does not keep an append-only file.

    Args:
        client: a connected client; on a cluster, every node the client knows is checked.
        what: what lives there ("effect store", "saga journal"), named in the warning.

    Warns:
        DurabilityWarning: ``appendonly`` is ``no`` (with or without ``save`` snapshots), or the
            server refused ``CONFIG GET`` so persistence could not be checked.
    """
    if isinstance(client, RedisCluster):
        for node in client.get_nodes():  # type: ignore[no-untyped-call]  # redis-py leaves it untyped
            _check_server(client.get_redis_connection(node), f"{what} (cluster node {node.name})")
        return
    _check_server(client, what)


def _check_server(client: redis.Redis, what: str) -> None:
    kwargs = client.connection_pool.connection_kwargs
    server = (kwargs.get("host"), kwargs.get("port"), kwargs.get("path"), kwargs.get("db"), what)
    with _lock:
        if server in _checked:
            return
    try:
        appendonly, save = _config(client, "appendonly"), _config(client, "save")
    except redis.RedisError as exc:  # CONFIG renamed, disabled or denied by an ACL
        message = (
            f"the Redis {what} cannot check the server's persistence (CONFIG GET refused: {exc}); "
            "make sure it runs with appendonly yes, or a restart loses records and effects run again"
        )
    else:
        if appendonly == "yes":
            _remember(server)
            return
        if save:
            kept = f"only snapshots (save {save!r}): writes since the last one"
        else:
            kept = "no persistence: every record"
        message = (
            f"the Redis {what} runs on a server with {kept} would be lost on a restart, and their "
            "effects would run again; set appendonly yes (see docs/backends.md)"
        )
    warnings.warn(message, DurabilityWarning, stacklevel=4)
    # Only once the warning was let through: a filter that turns it into an error refuses every open.
    _remember(server)


def _remember(server: tuple[Any, ...]) -> None:
    with _lock:
        _checked.add(server)
