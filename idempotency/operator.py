"""Operator actions on the effect ledger, shared by the CLI, the console and scripts.

::

    record = find_effect(store, "3f9a0c1d")                    # a key or a unique prefix of it
    resolve_effect(store, record.key, applied=True, result='{"id": "pi_1"}', actor="ana", audit=log)
    resolve_effect(store, record.key, applied=False, actor="ana", audit=log)

Each action reads the ledger's clock, acts, and records an
:class:`~sagaguard.idempotency.audit.AuditEntry` (ok, or refused with the error's type) in
``audit`` when one is given. The recorded arguments never include the result.
"""

from __future__ import annotations

import json
from typing import Any

from sagaguard.idempotency.audit import AuditLog, TargetKind, audited
from sagaguard.idempotency.cliutil import duration
from sagaguard.idempotency.errors import ConfigurationError, IdempotencyError, LostOwnership, RecordNotFound
from sagaguard.idempotency.holder import is_dead_on_this_host
from sagaguard.idempotency.records import Disposition, Record, State
from sagaguard.idempotency.result_types import ResultMismatch, ResultTypeUnavailable, check_result
from sagaguard.idempotency.store import IdempotencyStore

__all__ = [
    "DEFAULT_RETENTION",
    "AmbiguousKey",
    "EffectBusy",
    "NothingToResolve",
    "OperatorRefused",
    "ResolveConflict",
    "ResultMismatch",
    "ResultTypeUnavailable",
    "find_effect",
    "holder_gone",
    "needs_resolution",
    "resolve_effect",
    "result_json",
]

DEFAULT_RETENTION = 7 * 86_400.0
"""How long a result resolved as applied is kept and replayed: 7 days."""
LIVE = (State.IN_DOUBT, State.IN_PROGRESS)
_MIN_PREFIX = 8
_SHORT = 16


class OperatorRefused(IdempotencyError):
    """An operator action the ledger's state does not allow; nothing was changed."""


class AmbiguousKey(OperatorRefused):
    """A key prefix matches more than one record."""


class NothingToResolve(OperatorRefused):
    """The effect has finished (succeeded or failed): there is nothing in doubt to resolve."""


class EffectBusy(OperatorRefused):
    """A worker's lease on the effect is still live (resolve with ``force`` if that worker is gone)."""


class ResolveConflict(OperatorRefused):
    """The record changed while resolving it: another worker took it over (its token is stale)."""


def find_effect(store: IdempotencyStore, key: str) -> Record:
    """The record under ``key``, or the one record whose key starts with it (8 characters or more).

    Raises:
        RecordNotFound: no record matches.
        AmbiguousKey: several records match the prefix.
    """
    record = store.get(key)
    if record is not None:
        return record
    if len(key) >= _MIN_PREFIX:
        # Keys sort lexicographically and every key that starts with ``key`` sorts after it.
        found = [r for r in store.list(after=key, limit=2) if r.key.startswith(key)]
        if len(found) == 1:
            return found[0]
        if len(found) > 1:
            raise AmbiguousKey(f"key prefix {key!r} is ambiguous: give more characters")
    raise RecordNotFound(key)


def holder_gone(record: Record, now: float) -> bool:
    """Whether ``record`` is held under a live lease by a process provably dead on this host (as a
    claimant on this host would take it over at once; see :mod:`sagaguard.idempotency.holder`)."""
    return record.state in LIVE and record.lease_live(now) and is_dead_on_this_host(record.holder)


def needs_resolution(record: Record, now: float) -> bool:
    """Whether an operator may settle ``record`` without forcing it: in doubt, or in progress with
    its lease run out or its holder gone."""
    if record.state is State.IN_DOUBT:
        return True
    return record.state is State.IN_PROGRESS and (not record.lease_live(now) or holder_gone(record, now))


def result_json(text: str) -> str:
    """``text`` checked as JSON and made compact.

    Raises:
        ConfigurationError: not valid JSON (NaN and Infinity included).
    """

    def refuse(constant: str) -> Any:
        raise ValueError(f"{constant} is not valid JSON")

    try:
        value = json.loads(text, parse_constant=refuse)
    except ValueError as exc:
        raise ConfigurationError(f"the result is not valid JSON: {exc}") from None
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _settle(
    store: IdempotencyStore, record: Record, result: str | None, retention: float, force: bool
) -> Record:
    now = store.now()
    short = record.key[:_SHORT]
    if record.state not in LIVE:
        raise NothingToResolve(
            f"effect {record.name!r} ({short}) is already {record.state.value}: nothing to resolve"
        )
    if record.lease_live(now) and not force and not holder_gone(record, now):
        holder = "is running it" if record.state is State.IN_PROGRESS else "is resolving it"
        raise EffectBusy(
            f"effect {record.name!r} ({short}) is {record.state.value} and a worker {holder} "
            f"(token {record.token}, lease {duration(record.lease_until - now)} left); "
            "wait for the lease to run out, or force it if that worker is gone"
        )
    if result is not None and record.result_type is not None:
        # What is written here is what every later run replays: a result that does not read back as
        # the declared type would fail each of them (CodecError), with the record settled for good.
        check_result(record.result_type, result)
    try:
        if result is not None:
            return store.complete(record.key, record.token, result, retention)
        note = json.dumps(
            {"type": "sagaguard.operator", "message": "resolved as not applied by an operator", "args": []}
        )
        store.fail(record.key, record.token, Disposition.RETRYABLE, note, retention)
        return record
    except LostOwnership as exc:
        raise ResolveConflict(
            f"effect {record.name!r} ({short}) changed while resolving (token {record.token} is stale): "
            "another worker took it over; look at it again"
        ) from exc


def resolve_effect(
    store: IdempotencyStore,
    key: str,
    *,
    applied: bool,
    result: str | None = None,
    retention: float = DEFAULT_RETENTION,
    force: bool = False,
    token: int | None = None,
    actor: str,
    audit: AuditLog | None = None,
    source: str = "api",
) -> Record:
    """Settle an effect in doubt after checking the outside world, and audit it.

    ``applied=True`` records it SUCCEEDED with ``result`` (JSON text, as its return type stores it),
    which every later run replays; the result must read back as the result type the record names
    (:attr:`Record.result_type <sagaguard.idempotency.records.Record.result_type>`, written by the
    claim), else nothing is written (records without one, written before types were recorded or
    of effects declaring none, take any JSON); ``applied=False`` removes the record, so the next run executes
    the effect.

    Args:
        store: the ledger.
        key: the effect's key or a unique prefix of it.
        applied: whether the effect happened.
        result: with ``applied``: the result's JSON text (``"null"`` for nothing).
        retention: how long the result is kept.
        force: settle even though a worker's lease is live (not needed when the worker holding it
            is provably dead on this host).
        token: the fencing token the operator saw (the CLI's read, the console's page): when the
            record has another one now, someone else acted in between and nothing is done.
        actor: who acts (recorded).
        audit: where to record the action (None: not recorded).
        source: ``api``, ``cli`` or ``console`` (recorded).

    Returns:
        The record after the write (for ``applied=False``, the record as it was before its removal).

    Raises:
        ConfigurationError: ``applied`` without ``result``, ``result`` without ``applied``, or a
            result that is not JSON.
        ResultMismatch: the result does not read back as the record's result type (nothing
            written; the message shows the expected JSON shape).
        ResultTypeUnavailable: the record's result type cannot be imported in this process.
        RecordNotFound: no such record.
        AmbiguousKey: the prefix matches several records.
        NothingToResolve: the effect has finished.
        EffectBusy: a worker's lease is live and ``force`` is not set.
        ResolveConflict: another worker took the record over meanwhile (or since ``token``).
        StoreError: the store failed.
    """
    if applied and result is None:
        raise ConfigurationError("resolving as applied needs the result (JSON; null for nothing)")
    if not applied and result is not None:
        raise ConfigurationError("a result goes with resolving as applied")
    compact = None if result is None else result_json(result)
    try:
        record = find_effect(store, key)
    except IdempotencyError as exc:  # recorded as refused, under the key as given
        failure = exc

        def again() -> Record:
            raise failure

        return audited(
            audit, at=store.now(), actor=actor, action="effect.resolve", kind=TargetKind.EFFECT,
            target=key, args={"applied": applied}, source=source, act=again,
        )  # fmt: skip
    args: dict[str, Any] = {"applied": applied, "name": record.name, "token": record.token}
    if force:
        args["force"] = True

    def act() -> Record:
        if token is not None and record.token != token:
            raise ResolveConflict(
                f"effect {record.name!r} ({record.key[:_SHORT]}) changed since it was read (token "
                f"{token}, now {record.token}): another worker took it over; look at it again"
            )
        return _settle(store, record, compact, retention, force)

    return audited(
        audit, at=store.now(), actor=actor, action="effect.resolve", kind=TargetKind.EFFECT,
        target=record.key, args=args, source=source, act=act,
    )  # fmt: skip
