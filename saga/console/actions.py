"""The console's actions: each one a call of the shared operator API, described for its confirmation.

The console adds nothing to what an action does: :func:`perform` parses the form (or JSON body)
and calls :mod:`sagaguard.idempotency.operator` or :mod:`sagaguard.saga.operator`, which record
the audit entry under the console user's name.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from sagaguard.idempotency.audit import AuditLog
from sagaguard.idempotency.errors import ConfigurationError
from sagaguard.idempotency.operator import resolve_effect
from sagaguard.idempotency.outbox.control import OutboxControl
from sagaguard.idempotency.outbox.operator import discard_dead, replay_dead
from sagaguard.idempotency.store import IdempotencyStore
from sagaguard.saga.journal import SagaJournal
from sagaguard.saga.operator import cancel_saga, reject_run, retry_saga, signal_saga, skip_compensation

__all__ = ["ACTIONS", "Action", "Done", "perform"]


@dataclass(frozen=True)
class Done:
    """What an action did: its outcome's word and the page to go back to."""

    outcome: str
    back: str


@dataclass(frozen=True)
class Context:
    """What an action runs against and on whose behalf."""

    store: IdempotencyStore
    journal: SagaJournal
    audit: AuditLog
    actor: str
    outbox: OutboxControl | None = None


@dataclass(frozen=True)
class Action:
    """One operator action of the console.

    Attributes:
        name: its route name (``effect.resolve``).
        title: the button's words.
        kind: ``effect`` or ``saga``: what its ``target`` names.
        warning: what the confirmation page says it will do.
        fields: the form fields it takes besides ``target``.
        run: the call of the operator API.
    """

    name: str
    title: str
    kind: str
    warning: str
    fields: tuple[str, ...]
    run: Callable[[Context, str, Mapping[str, str]], Done]


def _flag(form: Mapping[str, str], name: str) -> bool:
    return str(form.get(name, "")).lower() in ("1", "true", "yes", "on")


def _text(form: Mapping[str, str], name: str, default: str) -> str:
    value = str(form.get(name, "") or "").strip()
    return value or default


def _resolve(ctx: Context, target: str, form: Mapping[str, str]) -> Done:
    applied = form.get("verdict") == "applied"
    if form.get("verdict") not in ("applied", "not_applied"):
        raise ConfigurationError("verdict must be applied or not_applied")
    result = str(form.get("result", "")) if applied else None
    record = resolve_effect(
        ctx.store, target, applied=applied, result=result, force=_flag(form, "force"), actor=ctx.actor,
        audit=ctx.audit, source="console",
    )  # fmt: skip
    return Done("applied" if applied else "not_applied", f"/effects/{record.key}")


def _cancel(ctx: Context, target: str, form: Mapping[str, str]) -> Done:
    reason = _text(form, "reason", "cancelled by an operator")
    outcome = cancel_saga(
        ctx.journal, target, reason=reason, actor=ctx.actor, audit=ctx.audit, source="console"
    )
    return Done(outcome.value, f"/sagas/{target}")


def _retry(ctx: Context, target: str, form: Mapping[str, str]) -> Done:
    record = retry_saga(
        ctx.journal, target, fresh=_flag(form, "fresh"), actor=ctx.actor, audit=ctx.audit, source="console"
    )
    return Done(record.state.value, f"/sagas/{target}")


def _skip(ctx: Context, target: str, form: Mapping[str, str]) -> Done:
    step = _text(form, "step", "")
    if not step:
        raise ConfigurationError("skip needs the step whose compensation failed")
    note = _text(form, "note", "resolved by an operator")
    record = skip_compensation(
        ctx.journal, target, step, note=note, actor=ctx.actor, audit=ctx.audit, source="console"
    )
    return Done(record.state.value, f"/sagas/{target}")


def _signal(ctx: Context, target: str, form: Mapping[str, str]) -> Done:
    text = str(form.get("payload", "") or "null")
    try:
        payload = json.loads(text)
    except ValueError as exc:
        raise ConfigurationError(f"the payload is not valid JSON: {exc}") from None
    outcome = signal_saga(
        ctx.journal,
        target,
        _text(form, "name", ""),
        payload,
        actor=ctx.actor,
        audit=ctx.audit,
        source="console",
    )
    return Done(outcome.value, f"/sagas/{target}")


def _reject(ctx: Context, target: str, form: Mapping[str, str]) -> Done:
    reason = _text(form, "reason", "rejected")
    outcome = reject_run(
        ctx.journal, target, reason=reason, actor=ctx.actor, audit=ctx.audit, source="console"
    )
    return Done(outcome.value, f"/sagas/{target}")


def _outbox(ctx: Context) -> OutboxControl:
    if ctx.outbox is None:
        raise ConfigurationError("this console has no outbox (start it on the outbox's database)")
    return ctx.outbox


def _replay(ctx: Context, target: str, form: Mapping[str, str]) -> Done:
    replay_dead(_outbox(ctx), target, actor=ctx.actor, audit=ctx.audit, source="console")
    return Done("replayed", "/outbox")


def _discard(ctx: Context, target: str, form: Mapping[str, str]) -> Done:
    discard_dead(_outbox(ctx), target, actor=ctx.actor, audit=ctx.audit, source="console")
    return Done("discarded", "/outbox")


ACTIONS: dict[str, Action] = {
    action.name: action
    for action in (
        Action(
            "effect.resolve",
            "Resolve",
            "effect",
            "Settle this effect by hand. Applied: it is recorded as succeeded with the result you give, "
            "and every later run replays it. Not applied: the record is removed and the next run "
            "executes the effect again. Check the outside world first.",
            ("verdict", "result", "force"),
            _resolve,
        ),
        Action(
            "saga.cancel",
            "Cancel",
            "saga",
            "Stop this saga and undo what it did: its compensations run in reverse order (at its "
            "runner's next step boundary, or at the next recovery sweep).",
            ("reason",),
            _cancel,
        ),
        Action(
            "saga.retry",
            "Retry",
            "saga",
            "Try again what made this saga need attention: a failed compensation is due again, or "
            "the step after the pivot runs again. Fresh: the compensation's effects are sent again "
            "under new keys.",
            ("fresh",),
            _retry,
        ),
        Action(
            "saga.skip",
            "Mark compensation done",
            "saga",
            "Count this step's failed compensation as done by hand (your note is recorded), then "
            "compensate the steps before it.",
            ("step", "note"),
            _skip,
        ),
        Action(
            "saga.signal",
            "Send signal",
            "saga",
            "Deliver this signal: a saga waiting for it resumes at the next recovery sweep. Each "
            "name is delivered once.",
            ("name", "payload"),
            _signal,
        ),
        Action(
            "saga.reject",
            "Reject",
            "saga",
            "Reject this run at its approval: it is cancelled and its tool calls are undone in "
            "reverse order at the next recovery sweep.",
            ("reason",),
            _reject,
        ),
        Action(
            "outbox.replay", "Replay", "message",
            "Give this dead letter back to the relays, its attempts counted from zero: its handler "
            "runs again (under the same provider key), and the messages blocked behind it drain.",
            (), _replay,
        ),
        Action(
            "outbox.discard", "Discard", "message",
            "Give up on this dead letter for good: it is never delivered, and the messages blocked "
            "behind it drain.",
            (), _discard,
        ),
    )
}
"""The console's actions by name."""


def perform(action: Action, ctx: Context, target: str, form: Mapping[str, Any]) -> Done:
    """Run ``action`` on ``target`` with the form's fields.

    Raises:
        ConfigurationError: bad input (a missing verdict, malformed JSON).
        IdempotencyError: the operator API refused (OperatorRefused, RecordNotFound) or the store failed.
        SagaError: the saga layer refused (NotParked, SagaNotFound) or the journal failed.
    """
    if not target:
        raise ConfigurationError("an action needs its target")
    fields = {name: "" if form.get(name) is None else str(form.get(name)) for name in action.fields}
    for name in ("fresh", "force"):
        if isinstance(form.get(name), bool):
            fields[name] = "true" if form.get(name) else ""
    if "payload" in fields and not isinstance(form.get("payload"), str) and form.get("payload") is not None:
        fields["payload"] = json.dumps(form.get("payload"))
    if "result" in fields and not isinstance(form.get("result"), str) and "result" in form:
        fields["result"] = json.dumps(form.get("result"))
    return action.run(ctx, target, fields)
