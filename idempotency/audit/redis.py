"""The audit log in the ledger's Redis: one list ``<prefix>:audit`` of JSON entries, newest first.

A single key (its own hash slot on a cluster); each entry is JSON text, never pickle. Listing reads
the list from its head and filters in the client: the audit trail is an operator's, not a hot path.
The bulk actions' ids are claimed in a hash ``{<prefix>:audit}:bulk`` (its hash tag puts it in the
list's slot) by one script that sets the id only when absent (``HSETNX``) and pushes the entry,
so two consoles racing on one action id cannot both act. On a Redis Cluster the claim waits for a
replica as the store's claim does (:mod:`sagaguard.idempotency.backends.redis_replicas`), so a
failover cannot lose a claimed action id and let a resubmitted form act again.
"""

from __future__ import annotations

import contextlib
import json
import uuid

import redis

from sagaguard.idempotency.audit.records import AuditEntry, AuditFilter, TargetKind
from sagaguard.idempotency.backends.redis_client import ERRORS, connect
from sagaguard.idempotency.backends.redis_replicas import ReplicaWait
from sagaguard.idempotency.errors import ConfigurationError, StoreError, StoreUnavailable

__all__ = ["RedisAudit"]

_PAGE = 500
# KEYS: the list, the claims' hash; ARGV: the action id, the entry's JSON. 1 claimed, 0 taken.
_CLAIM = """
if redis.call('HSETNX', KEYS[2], ARGV[1], ARGV[2]) == 0 then return 0 end
redis.call('LPUSH', KEYS[1], ARGV[2])
return 1
"""
# The same keys and arguments: take back a claim too few replicas acknowledged (if still this one).
_UNCLAIM = """
if redis.call('HGET', KEYS[2], ARGV[1]) ~= ARGV[2] then return 0 end
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('LREM', KEYS[1], 1, ARGV[2])
return 1
"""


class RedisAudit:
    """An :class:`~sagaguard.idempotency.audit.records.AuditLog` in a Redis list.

    Args:
        url_or_client: the ledger's ``redis://`` URL or a client (then left open by :meth:`close`).
        prefix: the store's prefix (``sg``); the list is ``<prefix>:audit``.
        wait_replicas: replicas that must hold a bulk action's claim before :meth:`claim` grants
            it, as the store's ``wait_replicas``: None (the default) is 1 on a Redis Cluster, 0 on
            one server.
        replica_timeout: seconds the claim waits for them.

    Raises:
        ConfigurationError: a malformed URL, prefix, ``wait_replicas`` or ``replica_timeout``.
    """

    def __init__(
        self,
        url_or_client: str | redis.Redis,
        *,
        prefix: str = "sg",
        wait_replicas: int | None = None,
        replica_timeout: float = 1.0,
    ) -> None:
        replicas = ReplicaWait.of(wait_replicas, replica_timeout)
        self._client, self._owned = connect(url_or_client, prefix, max_connections=4)
        self._replicas = replicas.on(self._client)
        self._key = f"{prefix}:audit"
        self._claims = f"{{{prefix}:audit}}:bulk"
        self._claim = self._client.register_script(_CLAIM)
        self._unclaim = self._client.register_script(_UNCLAIM)

    def record(self, entry: AuditEntry) -> AuditEntry:
        """Push ``entry`` at the head of the list; its id is a fresh UUID.

        Raises:
            ConfigurationError: a bulk action's entry (:meth:`claim` records those).
        """
        if entry.kind is TargetKind.BULK:
            raise ConfigurationError("a bulk action's entry is recorded by claim()")
        stored = AuditEntry.from_json({**entry.to_json(), "id": uuid.uuid4().hex})
        try:
            self._client.lpush(self._key, json.dumps(stored.to_json(), separators=(",", ":")))
        except redis.ConnectionError as exc:
            raise StoreUnavailable(f"Redis audit log unavailable: {exc}") from exc
        except redis.RedisError as exc:
            raise StoreError(f"Redis audit log failed: {exc}") from exc
        return stored

    def claim(self, entry: AuditEntry) -> AuditEntry | None:
        """Push the bulk action's ``entry`` unless its action id is taken (None then): one script,
        atomic on the server.

        Raises:
            ConfigurationError: ``entry`` is not a bulk action's.
            StoreUnavailable: Redis cannot be reached, or fewer replicas than ``wait_replicas``
                acknowledged the claim (it is taken back, best effort: the action may be tried
                again under its id).
        """
        if entry.kind is not TargetKind.BULK:
            raise ConfigurationError("only a bulk action's entry is claimed")
        stored = AuditEntry.from_json({**entry.to_json(), "id": uuid.uuid4().hex})
        text = json.dumps(stored.to_json(), separators=(",", ":"))
        keys, args = [self._key, self._claims], [entry.target, text]
        try:
            if self._replicas.count:
                claimed, acked = self._replicas.run(self._client, self._claim, keys, args)
                if acked < self._replicas.count:
                    with contextlib.suppress(*ERRORS):
                        self._unclaim(keys=keys, args=args)
                    raise StoreUnavailable(
                        f"redis: {acked} of {self._replicas.count} replicas acknowledged the claim of "
                        f"bulk action {entry.target!r} within {self._replicas.timeout:g} s; it is not run"
                    )
            else:
                claimed = self._claim(keys=keys, args=args)
        except redis.ConnectionError as exc:
            raise StoreUnavailable(f"Redis audit log unavailable: {exc}") from exc
        except redis.RedisError as exc:
            raise StoreError(f"Redis audit log failed: {exc}") from exc
        return stored if int(claimed) == 1 else None

    def list(self, where: AuditFilter | None = None, *, limit: int = 100) -> list[AuditEntry]:
        """At most ``limit`` entries matching ``where``, newest first."""
        where = where or AuditFilter()
        found: list[AuditEntry] = []
        start = 0
        try:
            while len(found) < limit:
                page = self._client.lrange(self._key, start, start + _PAGE - 1)
                for text in page:
                    entry = AuditEntry.from_json(json.loads(text))
                    if where.matches(entry):
                        found.append(entry)
                if len(page) < _PAGE:
                    break
                start += _PAGE
        except redis.ConnectionError as exc:
            raise StoreUnavailable(f"Redis audit log unavailable: {exc}") from exc
        except redis.RedisError as exc:
            raise StoreError(f"Redis audit log failed: {exc}") from exc
        return found[:limit]

    def close(self) -> None:
        """Close the client the log made (a given client is left alone)."""
        if self._owned:
            self._client.close()
