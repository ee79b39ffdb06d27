"""Bulk operator actions: one action over many targets, done once per action id.

The console's bulk forms and the CLI's ``--all`` commands share this: an action id names one bulk
action; it is recorded in the audit trail (an entry ``bulk.ACTION`` on the target ``ACTION_ID``)
before the first item is touched, so a resubmitted form or a rerun command that carries the same
id finds it and does nothing again, even after a restart. Each item then goes through the operator
API like a single action, and is audited on its own; a refused item is counted and the others go on.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sagaguard.idempotency.audit import AuditEntry, AuditLog, TargetKind
from sagaguard.idempotency.errors import ConfigurationError

__all__ = ["MAX_ITEMS", "BulkResult", "check_action_id", "new_action_id", "run_bulk"]

MAX_ITEMS = 500
"""Items one bulk action touches at most (a larger list: narrow the filter, or act again)."""

_ACTION_ID = re.compile(r"[0-9a-f]{32}")


def new_action_id() -> str:
    """A fresh action id (32 hex digits)."""
    return uuid.uuid4().hex


def check_action_id(action_id: str) -> str:
    """``action_id`` if it has the form :func:`new_action_id` makes.

    Raises:
        ConfigurationError: it has another form.
    """
    if not _ACTION_ID.fullmatch(action_id):
        raise ConfigurationError(f"an action id is 32 lowercase hex digits, not {action_id!r}")
    return action_id


@dataclass
class BulkResult:
    """What a bulk action did: per target, its outcome or the refusal's error type.

    Attributes:
        action_id: the bulk action's id.
        repeated: the id was recorded already: nothing was done this time.
        outcomes: the outcome word of each target acted on.
        refused: the error type's name of each target the operator API refused.
    """

    action_id: str
    repeated: bool = False
    outcomes: dict[str, str] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """The result as JSON types."""
        return {
            "action_id": self.action_id,
            "repeated": self.repeated,
            "done": len(self.outcomes),
            "refused": len(self.refused),
            "outcomes": self.outcomes,
            "refusals": self.refused,
        }


def run_bulk(
    audit: AuditLog,
    action: str,
    action_id: str,
    targets: Sequence[str],
    act: Callable[[str], str],
    *,
    actor: str,
    source: str,
    at: float,
    refusals: tuple[type[BaseException], ...],
    args: Mapping[str, Any] | None = None,
) -> BulkResult:
    """Run ``act`` over ``targets`` once per ``action_id``.

    Args:
        audit: the ledger's audit trail, where the action id is recorded.
        action: the single action's name (``saga.retry``); recorded as ``bulk.ACTION``.
        action_id: the bulk action's id (:func:`new_action_id`).
        targets: the ids to act on, at most :data:`MAX_ITEMS`.
        act: one item's action through the operator API; returns its outcome word.
        actor: who acts, as the audit records.
        source: where from (``cli``, ``console``).
        at: the ledger's time now.
        refusals: the errors of ``act`` that refuse one item (counted; the others go on).
        args: recorded with the bulk entry besides the count.

    Returns:
        What was done; ``repeated`` when the action id was recorded before (nothing done).

    Raises:
        ConfigurationError: a malformed action id, no targets or too many.
    """
    check_action_id(action_id)
    if not targets or len(targets) > MAX_ITEMS:
        raise ConfigurationError(f"a bulk action takes 1 to {MAX_ITEMS} targets, not {len(targets)}")
    claim = AuditEntry(
        at=at,
        actor=actor,
        action=f"bulk.{action}",
        kind=TargetKind.BULK,
        target=action_id,
        args={**(args or {}), "count": len(targets)},
        source=source,
    )
    if audit.claim(claim) is None:  # atomic in the ledger: across processes and restarts
        return BulkResult(action_id, repeated=True)
    result = BulkResult(action_id)
    for target in targets:
        try:
            result.outcomes[target] = act(target)
        except refusals as exc:
            result.refused[target] = type(exc).__name__
    return result
