"""Operator actions on the outbox's dead letters, audited: shared by the CLI and scripts.

::

    replay_dead(control, message_id, actor="ana", audit=log)   # back to the relays
    discard_dead(control, message_id, actor="ana", audit=log)  # given up for good
    replay_all_dead(control, actor="ana", audit=log)           # every dead letter

Each reads the database's clock, acts through :class:`~sagaguard.idempotency.outbox.control.OutboxControl`,
and records an :class:`~sagaguard.idempotency.audit.AuditEntry` (never the payload) in ``audit``.
"""

from __future__ import annotations

from sagaguard.idempotency.audit import AuditLog, TargetKind, audited
from sagaguard.idempotency.outbox.control import OutboxControl

__all__ = ["ALL", "discard_dead", "replay_all_dead", "replay_dead"]

ALL = "*"
"""The target an action on every dead letter is recorded under."""


def replay_dead(
    control: OutboxControl, message_id: str, *, actor: str, audit: AuditLog | None = None, source: str = "api"
) -> None:
    """Give a dead letter back to the relays (attempts from zero), audited.

    Raises:
        MessageNotFound: no message has this id.
        NotDead: the message is not dead.
    """
    audited(
        audit, at=control.now(), actor=actor, action="outbox.replay", kind=TargetKind.MESSAGE,
        target=message_id, args={}, source=source, act=lambda: control.replay(message_id),
    )  # fmt: skip


def discard_dead(
    control: OutboxControl, message_id: str, *, actor: str, audit: AuditLog | None = None, source: str = "api"
) -> None:
    """Give up on a dead letter for good, audited.

    Raises:
        MessageNotFound: no message has this id.
        NotDead: the message is not dead.
    """
    audited(
        audit, at=control.now(), actor=actor, action="outbox.discard", kind=TargetKind.MESSAGE,
        target=message_id, args={}, source=source, act=lambda: control.discard(message_id),
    )  # fmt: skip


def replay_all_dead(
    control: OutboxControl, *, actor: str, audit: AuditLog | None = None, source: str = "api"
) -> int:
    """Replay every dead letter, audited under the target ``*``; returns how many."""
    return audited(
        audit, at=control.now(), actor=actor, action="outbox.replay_all", kind=TargetKind.MESSAGE,
        target=ALL, args={}, source=source, act=control.replay_all,
    )  # fmt: skip
