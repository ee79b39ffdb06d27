"""Bulk actions: one action over every item of a filtered list, previewed, then done once.

The preview (``GET /bulk/ACTION?view=..&prefix=..``) lists the items the filter matches now (at
most :data:`MAX_ITEMS`) and hands out a fresh action id; the form posts those very ids back with
it, so the action touches what the operator saw, not what arrived since. The action id is
claimed in the audit trail (an entry ``bulk.ACTION`` on the target ``ACTION_ID``, through
:meth:`~sagaguard.idempotency.audit.AuditLog.claim`) before the first item is touched: a
resubmitted form (a reload, a double click, a retry of a request that timed out) finds it taken and
does nothing again, even after the console restarted, and of two console processes racing on one
id exactly one acts (the ledger itself decides: a unique index on SQL, a script on Redis).
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sagaguard.idempotency.audit import AuditEntry, TargetKind
from sagaguard.idempotency.errors import ConfigurationError, IdempotencyError, RecordNotFound
from sagaguard.idempotency.outbox.control import OutboxControl
from sagaguard.idempotency.store import IdempotencyStore
from sagaguard.saga.console.actions import ACTIONS, Context, perform
from sagaguard.saga.console.data import effect_page, saga_page
from sagaguard.saga.errors import SagaError
from sagaguard.saga.journal import SagaJournal

__all__ = ["BULK", "MAX_ITEMS", "BulkResult", "new_action_id", "preview", "run_bulk"]

MAX_ITEMS = 500
"""Items one bulk action touches at most (a larger list: narrow the filter, or act again)."""

BULK: dict[str, tuple[str, Mapping[str, str]]] = {
    "effect.resolve": ("effects", {"verdict": "not_applied"}),
    "saga.retry": ("sagas", {}),
    "saga.cancel": ("sagas", {}),
    "saga.reject": ("sagas", {}),
    "outbox.replay": ("outbox", {}),
}
"""The actions that have a bulk form: the list they act on, and the fields they fix (a bulk
resolve is only ever *not applied*: an applied one needs each effect's own result)."""

_ACTION_ID = re.compile(r"[0-9a-f]{32}")


def new_action_id() -> str:
    """A fresh action id for a preview."""
    return uuid.uuid4().hex


def preview(
    store: IdempotencyStore, journal: SagaJournal, action: str, *, view: str, prefix: str = "",
    name: str = "", outbox: OutboxControl | None = None,
) -> list[str]:  # fmt: skip
    """The ids of the items the bulk ``action`` would touch now, at most :data:`MAX_ITEMS`.

    Raises:
        ConfigurationError: no bulk form for ``action``, or an unknown list ``view``.
    """
    if action not in BULK:
        raise ConfigurationError(f"no bulk form for {action!r}")
    try:
        if BULK[action][0] == "outbox":
            if outbox is None:
                raise ConfigurationError("this console has no outbox")
            letters = outbox.dead_letters(limit=MAX_ITEMS)
            return [d.id for d in letters if (d.aggregatetype + "/" + d.aggregateid).startswith(prefix)]
        if BULK[action][0] == "effects":
            return [r.key for r in effect_page(store, view, prefix=prefix, size=MAX_ITEMS).items]
        return [r.saga_id for r in saga_page(journal, view, prefix=prefix, name=name, size=MAX_ITEMS).items]
    except KeyError:
        raise ConfigurationError(f"no list {view!r}") from None


@dataclass
class BulkResult:
    """What a bulk action did: per target, its outcome or the refusal's error type."""

    action_id: str
    repeated: bool = False
    outcomes: dict[str, str] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "action_id": self.action_id, "repeated": self.repeated, "done": len(self.outcomes),
            "refused": len(self.refused), "outcomes": self.outcomes, "refusals": self.refused,
        }  # fmt: skip


def run_bulk(
    ctx: Context, action: str, action_id: str, targets: Sequence[str], form: Mapping[str, Any]
) -> BulkResult:
    """Run the bulk ``action`` over ``targets`` once per ``action_id``.

    Each item goes through the same operator API as a single action (and is audited on its own);
    a refused item is counted and the others go on.

    Raises:
        ConfigurationError: no bulk form for ``action``, a malformed action id, no targets or too many.
    """
    if action not in BULK:
        raise ConfigurationError(f"no bulk form for {action!r}")
    if not _ACTION_ID.fullmatch(action_id):
        raise ConfigurationError("a bulk action needs the action id of its preview")
    if not targets or len(targets) > MAX_ITEMS:
        raise ConfigurationError(f"a bulk action takes 1 to {MAX_ITEMS} targets")
    claim = AuditEntry(
        at=ctx.store.now(),
        actor=ctx.actor,
        action=f"bulk.{action}",
        kind=TargetKind.BULK,
        target=action_id,
        args={"count": len(targets)},
        source="console",
    )
    if ctx.audit.claim(claim) is None:  # atomic in the ledger: across console processes too
        return BulkResult(action_id, repeated=True)
    fields = {**{k: v for k, v in form.items() if k in ACTIONS[action].fields}, **BULK[action][1]}
    result = BulkResult(action_id)
    for target in targets:
        try:
            result.outcomes[target] = perform(ACTIONS[action], ctx, target, fields).outcome
        except (ConfigurationError, IdempotencyError, RecordNotFound, SagaError) as exc:
            result.refused[target] = type(exc).__name__
    return result
