"""Bulk actions: one action over every item of a filtered list, previewed, then done once.

The preview (``GET /bulk/ACTION?view=..&prefix=..``) lists the items the filter matches now (at
most :data:`MAX_ITEMS`) and hands out a fresh action id; the form posts those very ids back with
it, so the action touches what the operator saw, not what arrived since. The action id is
recorded in the audit trail (an entry ``bulk.ACTION`` on the target ``ACTION_ID``) before the
first item is touched: a resubmitted form (a reload, a double click, a retry of a request that
timed out) finds it and does nothing again, even after the console restarted.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sagaguard.idempotency.bulk import MAX_ITEMS, BulkResult, new_action_id
from sagaguard.idempotency.bulk import run_bulk as shared_bulk
from sagaguard.idempotency.errors import ConfigurationError, IdempotencyError, RecordNotFound
from sagaguard.idempotency.outbox.control import OutboxControl
from sagaguard.idempotency.store import IdempotencyStore
from sagaguard.saga.console.actions import ACTIONS, Context, perform
from sagaguard.saga.console.data import effect_page, saga_page
from sagaguard.saga.errors import SagaError
from sagaguard.saga.journal import SagaJournal

__all__ = ["BULK", "MAX_ITEMS", "BulkResult", "new_action_id", "preview", "run_bulk"]

BULK: dict[str, tuple[str, Mapping[str, str]]] = {
    "effect.resolve": ("effects", {"verdict": "not_applied"}),
    "saga.retry": ("sagas", {}),
    "saga.cancel": ("sagas", {}),
    "saga.reject": ("sagas", {}),
    "outbox.replay": ("outbox", {}),
}
"""The actions that have a bulk form: the list they act on, and the fields they fix (a bulk
resolve is only ever *not applied*: an applied one needs each effect's own result)."""


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


def run_bulk(
    ctx: Context, action: str, action_id: str, targets: Sequence[str], form: Mapping[str, Any]
) -> BulkResult:
    """Run the bulk ``action`` over ``targets`` once per ``action_id``
    (:func:`sagaguard.idempotency.bulk.run_bulk`, which the CLI's ``--all`` commands share).

    Raises:
        ConfigurationError: no bulk form for ``action``, a malformed action id, no targets or too many.
    """
    if action not in BULK:
        raise ConfigurationError(f"no bulk form for {action!r}")
    fields = {**{k: v for k, v in form.items() if k in ACTIONS[action].fields}, **BULK[action][1]}
    return shared_bulk(
        ctx.audit, action, action_id, targets,
        lambda target: perform(ACTIONS[action], ctx, target, fields).outcome,
        actor=ctx.actor, source="console", at=ctx.store.now(),
        refusals=(ConfigurationError, IdempotencyError, RecordNotFound, SagaError),
    )  # fmt: skip
