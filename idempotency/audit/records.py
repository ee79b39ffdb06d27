"""What the audit trail holds: one :class:`AuditEntry` per operator action, and the log's protocol.

An entry says who acted (``actor``), when (``at``: the ledger's own clock, as read by the action),
what (``action``, the ``target`` it touched and its ``args``, never a result or a payload: those
may hold personal data) and the outcome: ``ok``, or ``refused`` with the error's type and message.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from sagaguard.idempotency.errors import ConfigurationError

__all__ = ["AuditEntry", "AuditFilter", "AuditLog", "Outcome", "TargetKind"]

_MAX_MESSAGE = 500


class Outcome(enum.StrEnum):
    """How an operator action ended."""

    OK = "ok"
    """It was done."""
    REFUSED = "refused"
    """It was refused (the entry names the error type); nothing changed."""


class TargetKind(enum.StrEnum):
    """What an action acts on."""

    EFFECT = "effect"
    SAGA = "saga"
    MESSAGE = "message"
    BULK = "bulk"
    """A bulk action: its target is the action id."""


@dataclass(frozen=True)
class AuditEntry:
    """One operator action.

    Attributes:
        at: when, in seconds since the epoch, by the ledger's clock.
        actor: who (the console's user, the CLI's ``--actor``, or the OS user).
        action: what, as ``layer.verb`` (``effect.resolve``, ``saga.cancel``, ``outbox.replay``).
        kind: what the target is.
        target: the effect key, saga id or message id.
        args: the action's arguments, JSON types only (never a result or a payload).
        outcome: ok or refused.
        error: the error type's name when refused (``NotParked``), or the refusal's tag (``too_late``).
        message: the refusal's message, clipped.
        source: where the action came from (``cli``, ``console``, ``api``).
        id: the log's own id of the entry (empty until recorded).
    """

    at: float
    actor: str
    action: str
    kind: TargetKind
    target: str
    args: Mapping[str, Any] = field(default_factory=dict)
    outcome: Outcome = Outcome.OK
    error: str | None = None
    message: str | None = None
    source: str = "api"
    id: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.actor, str) or not self.actor.strip():
            raise ConfigurationError("an audit entry needs an actor (a non-empty name)")
        try:
            json.dumps(dict(self.args))
        except (TypeError, ValueError) as exc:
            raise ConfigurationError(f"audit args must be JSON types: {exc}") from None
        if self.message is not None and len(self.message) > _MAX_MESSAGE:
            object.__setattr__(self, "message", self.message[: _MAX_MESSAGE - 3] + "...")

    def to_json(self) -> dict[str, Any]:
        """The entry as plain JSON types."""
        return {
            "id": self.id, "at": self.at, "actor": self.actor, "action": self.action,
            "kind": self.kind.value, "target": self.target, "args": dict(self.args),
            "outcome": self.outcome.value, "error": self.error, "message": self.message,
            "source": self.source,
        }  # fmt: skip

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> AuditEntry:
        """The entry :meth:`to_json` wrote."""
        return cls(
            at=float(data["at"]), actor=str(data["actor"]), action=str(data["action"]),
            kind=TargetKind(data["kind"]), target=str(data["target"]), args=dict(data.get("args") or {}),
            outcome=Outcome(data["outcome"]), error=data.get("error"), message=data.get("message"),
            source=str(data.get("source") or "api"), id=str(data.get("id") or ""),
        )  # fmt: skip


@dataclass(frozen=True)
class AuditFilter:
    """Which entries to list; every field left empty matches all.

    Attributes:
        target: entries on this target (exact).
        target_prefix: entries whose target starts with this.
        actor: entries by this actor.
        action: entries of this action (``saga.cancel``) or layer (``saga.``: a trailing dot).
        since: entries at or after this time.
        until: entries before this time.
    """

    target: str | None = None
    target_prefix: str | None = None
    actor: str | None = None
    action: str | None = None
    since: float | None = None
    until: float | None = None

    def matches(self, entry: AuditEntry) -> bool:
        """Whether ``entry`` passes the filter."""
        if self.target is not None and entry.target != self.target:
            return False
        if self.target_prefix and not entry.target.startswith(self.target_prefix):
            return False
        if self.actor is not None and entry.actor != self.actor:
            return False
        if self.action:
            layer = self.action.endswith(".")
            if (layer and not entry.action.startswith(self.action)) or (
                not layer and entry.action != self.action
            ):
                return False
        if self.since is not None and entry.at < self.since:
            return False
        return self.until is None or entry.at < self.until


class AuditLog(Protocol):
    """Where operator actions are recorded: append-only, listed newest first."""

    def record(self, entry: AuditEntry) -> AuditEntry:
        """Append ``entry``; returns it with its id.

        Raises:
            ConfigurationError: a bulk action's entry (:meth:`claim` records those).
            StoreError: the backend failed (StoreUnavailable when it cannot be reached).
        """
        ...

    def claim(self, entry: AuditEntry) -> AuditEntry | None:
        """Record a bulk action's ``entry`` (kind :attr:`TargetKind.BULK`, its action id the target)
        unless that action id is recorded already; returns it with its id, or None when the id was
        taken. Atomic in the backend itself: of any number of processes claiming one id at once,
        exactly one gets the entry back.

        Raises:
            ConfigurationError: ``entry`` is not a bulk action's.
            StoreError: the backend failed (StoreUnavailable when it cannot be reached).
        """
        ...

    def list(self, where: AuditFilter | None = None, *, limit: int = 100) -> Sequence[AuditEntry]:
        """At most ``limit`` entries matching ``where``, newest first."""
        ...

    def close(self) -> None:
        """Release the backend's connections."""
        ...
