"""The audit log in the ledger's Redis: one list ``<prefix>:audit`` of JSON entries, newest first.

A single key (its own hash slot on a cluster); each entry is JSON text, never pickle. Listing reads
the list from its head and filters in the client: the audit trail is an operator's, not a hot path.
The bulk actions' ids are claimed in a hash ``{<prefix>:audit}:bulk`` (its hash tag puts it in the
list's slot) by one script that sets the id only when absent (``HSETNX``) and pushes the entry,
so two consoles racing on one action id cannot both act.
"""

from __future__ import annotations

import json
import uuid

import redis

from sagaguard.idempotency.audit.records import AuditEntry, AuditFilter, TargetKind
from sagaguard.idempotency.backends.redis_client import connect
from sagaguard.idempotency.errors import ConfigurationError, StoreError, StoreUnavailable

__all__ = ["RedisAudit"]

_PAGE = 500
# KEYS: the list, the claims' hash; ARGV: the action id, the entry's JSON. 1 claimed, 0 taken.
_CLAIM = """
if redis.call('HSETNX', KEYS[2], ARGV[1], ARGV[2]) == 0 then return 0 end
redis.call('LPUSH', KEYS[1], ARGV[2])
return 1
"""


class RedisAudit:
    """An :class:`~sagaguard.idempotency.audit.records.AuditLog` in a Redis list.

    Args:
        url_or_client: the ledger's ``redis://`` URL or a client (then left open by :meth:`close`).
        prefix: the store's prefix (``sg``); the list is ``<prefix>:audit``.

    Raises:
        ConfigurationError: a malformed URL or prefix.
    """

    def __init__(self, url_or_client: str | redis.Redis, *, prefix: str = "sg") -> None:
        self._client, self._owned = connect(url_or_client, prefix, max_connections=4)
        self._key = f"{prefix}:audit"
        self._claims = f"{{{prefix}:audit}}:bulk"
        self._claim = self._client.register_script(_CLAIM)

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
        """
        if entry.kind is not TargetKind.BULK:
            raise ConfigurationError("only a bulk action's entry is claimed")
        stored = AuditEntry.from_json({**entry.to_json(), "id": uuid.uuid4().hex})
        text = json.dumps(stored.to_json(), separators=(",", ":"))
        try:
            claimed = self._claim(keys=[self._key, self._claims], args=[entry.target, text])
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
