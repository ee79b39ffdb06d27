"""The audit trail: who did what to the ledger by hand, when, and how it ended.

Every operator action (resolving an effect in doubt, retrying, cancelling, signalling a saga,
replaying a dead letter), whether from the CLI, the console or the Python API, goes through
:func:`audited`, which records an :class:`AuditEntry` in the ledger's :class:`AuditLog`: a table
beside the effects table on SQL (named after it, versioned as the ``audit`` table set), a list
under the store's prefix on Redis, a list in memory.

::

    log = open_audit("sqlite:///sagaguard.db")
    for entry in log.list(AuditFilter(target="order-42")):
        print(entry.at, entry.actor, entry.action, entry.outcome)
"""

from __future__ import annotations

import getpass
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from sagaguard.idempotency.audit.memory import MemoryAudit
from sagaguard.idempotency.audit.records import AuditEntry, AuditFilter, AuditLog, Outcome, TargetKind
from sagaguard.idempotency.backends.urls import check_url, driver_hint
from sagaguard.idempotency.errors import ConfigurationError

__all__ = [
    "AuditEntry",
    "AuditFilter",
    "AuditLog",
    "MemoryAudit",
    "Outcome",
    "TargetKind",
    "audited",
    "default_actor",
    "open_audit",
]

T = TypeVar("T")


def default_actor() -> str:
    """The OS user's name (``getpass.getuser()``), or ``"unknown"`` where the OS has none."""
    try:
        return getpass.getuser() or "unknown"
    except (OSError, KeyError):  # no login name and no passwd entry (some containers)
        return "unknown"


def open_audit(
    url: str, *, create: bool | None = None, prefix: str = "sg", effects_table: str | None = None
) -> AuditLog:
    """The audit log of the ledger at ``url`` (the store's URL).

    Args:
        url: ``memory://`` (a new, empty log), ``sqlite:///..``, ``postgresql://..`` or ``redis://..``.
        create: on SQL, as the stores': None (the default): create the audit table when
            missing (a new database), at this code's schema revision, and refuse a table at an
            older or newer revision, naming ``sagaguard db upgrade`` (nothing is altered at
            open); True: also upgrade a table when older; False: write no DDL and refuse a table
            missing, older or newer.
        prefix: on Redis, the store's key prefix (the log is ``<prefix>:audit``).
        effects_table: on SQL, the store's effects table (the default ``sagaguard_effects``): the
            audit table is named after it (``shop_effects`` -> ``shop_audit``; see
            :func:`~sagaguard.idempotency.audit.sql_schema.audit_table_for`).

    Raises:
        ConfigurationError: a malformed URL, an unknown scheme, its driver is not installed, or a
            table name that is not valid.
        SchemaVersionMismatch: on SQL, the audit table is newer than this code, older (unless
            ``create`` is True) or missing (``create`` False); the message names
            ``sagaguard db upgrade``.
        StoreUnavailable: the backend cannot be reached.
    """
    scheme = check_url(url, what="store")
    if scheme == "memory":
        return MemoryAudit()
    if scheme in ("sqlite", "postgresql"):
        from sagaguard.idempotency.audit.sql import SqlAudit
        from sagaguard.idempotency.audit.sql_schema import DEFAULT_TABLE, audit_table_for

        audit_table = DEFAULT_TABLE if effects_table is None else audit_table_for(effects_table)
        return SqlAudit(url, table_name=audit_table, create=create)
    try:
        from sagaguard.idempotency.audit.redis import RedisAudit
    except ImportError as exc:
        raise ConfigurationError(f"cannot use store URL: {exc} ({driver_hint(exc)})") from exc
    return RedisAudit(url, prefix=prefix)


def audited(
    log: AuditLog | None,
    *,
    at: float,
    actor: str,
    action: str,
    kind: TargetKind,
    target: str,
    args: Mapping[str, Any],
    source: str,
    act: Callable[[], T],
    refusal: Callable[[T], str | None] = lambda _: None,
) -> T:
    """Run ``act`` and record it in ``log`` (nothing is recorded when ``log`` is None).

    A raised error is recorded as ``refused`` with its type's name and message, then re-raised.
    ``refusal`` turns a returned value that means "not done" (a cancellation that came too late)
    into the tag recorded as the error; the value is returned either way.

    Args:
        log: the audit log.
        at: the ledger's time of the action.
        actor: who acts.
        action: ``layer.verb``.
        kind: what ``target`` is.
        target: the id acted on.
        args: the arguments worth recording (never results or payloads).
        source: ``cli``, ``console`` or ``api``.
        act: the action itself.
        refusal: a returned value's refusal tag, or None when it means done.

    Returns:
        What ``act`` returned.

    Raises:
        ConfigurationError: an empty actor or arguments that are not JSON types (before acting).
    """
    entry = AuditEntry(at=at, actor=actor, action=action, kind=kind, target=target, args=args, source=source)
    try:
        value = act()
    except Exception as exc:
        if log is not None:
            log.record(
                AuditEntry.from_json(
                    {
                        **entry.to_json(),
                        "outcome": "refused",
                        "error": type(exc).__name__,
                        "message": str(exc),
                    }
                )
            )
        raise
    if log is not None:
        tag = refusal(value)
        if tag is not None:
            entry = AuditEntry.from_json({**entry.to_json(), "outcome": "refused", "error": tag})
        log.record(entry)
    return value
