"""A correction never reaches anyone before the email it corrects.

The compensation of a sent email is a correction (``EmailEffects.correction`` for a saga step,
``EmailEffects.correction_undo`` for an agent's tool). Where it goes depends on how the original
was sent:

- **Through the outbox** (``send``, ``send_later``: the step recorded the outbox message id). If no
  relay has claimed the original yet, it is *cancelled* in the outbox
  (:meth:`~sagaguard.idempotency.outbox.OutboxControl.cancel`) and no email at all reaches the recipient
  for it: nothing to correct. Otherwise (a relay is delivering it right now, it was delivered, or
  it is a dead letter that may have gone out) the correction is *enqueued* in the outbox under the
  original's aggregate, its ordering key: the relays deliver one aggregate's messages one at a
  time in id order, and the correction's id sorts after the original's, so it is delivered after
  the original (and stays behind it while the original is a dead letter, until an operator
  replays or discards it). An original that never went out (no send record, or a refusal) and is
  dead is discarded instead, so a later replay cannot send it uncorrected.
- **Inline** (``send_now``: the step recorded :class:`~sagaguard.connectors.email.Sent`). The SMTP server
  accepted the original before the compensation began, so the correction, sent inline now, is
  accepted after it. Past that first server SMTP promises no order; the correction's
  ``In-Reply-To``/``References`` thread it under the original in the recipient's client.

Enqueueing the correction is once per compensation: its dedup key is the compensation's scope and
the effect's ordinal there, so a compensation re-run after a crash finds the message it enqueued.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any

from sqlalchemy.orm import Session

from sagaguard.connectors.email import Email, EmailEffects, message_id_for
from sagaguard.idempotency.codec import Codec
from sagaguard.idempotency.errors import ConfigurationError, IdempotencyError
from sagaguard.idempotency.keys import EffectIdentity, current_scope
from sagaguard.idempotency.outbox import MessageNotFound, MessageStatus, uuid7
from sagaguard.idempotency.records import State

__all__ = ["CORRECTION", "OriginalUnknown", "correct_deferred", "reply_to"]

_EMAIL: Codec[Email] = Codec(Email)

CORRECTION = "correction"
"""The suffix of a correction's name in the compensation's scope (``email.send.correction``)."""


class OriginalUnknown(IdempotencyError):
    """An agent's undo got no result for the email tool's call (a crash landed between the send and
    the tool's record): which message to correct is not known. The run parks for an operator, who
    finds the message (``sagaguard outbox``) and resolves the run."""


def reply_to(fix: Email, original: str) -> Email:
    """``fix`` as a reply to the ``Message-ID`` ``original`` (``In-Reply-To``, ``References``)."""
    refs = " ".join(r for r in (fix.headers.get("References"), original) if r)
    return Email(
        to=fix.to, subject=fix.subject, text=fix.text, sender=fix.sender, cc=fix.cc, bcc=fix.bcc,
        html=fix.html, reply_to=fix.reply_to, in_reply_to=original,
        headers={**fix.headers, "References": refs},
    )  # fmt: skip


def _after(original: uuid.UUID, clock: Callable[[], float] | None) -> uuid.UUID:
    """A fresh UUIDv7 that sorts after ``original``: ids of two processes made in one millisecond
    need not sort by creation, and the relays order an aggregate by id."""
    made = uuid7(None if clock is None else clock())
    if made.int > original.int:
        return made
    return uuid7(((original.int >> 80) + 1) / 1000)  # the original's millisecond, plus one


def correct_deferred(
    mail: EmailEffects, engine: Any, outbox_id: str, build: Callable[[str], Email]
) -> str | None:
    """Cancel the outbox message ``outbox_id`` (an email) if no relay has claimed it, else enqueue
    the correction ``build(original_message_id)`` behind it (see the module docstring). Runs in
    the compensation's scope (the saga runner sets it).

    Returns:
        The correction's outbox message id, or None when nothing needed correcting.

    Raises:
        ConfigurationError: no outbox on ``mail``, no engine, or ``outbox_id`` is not a message id.
        NoScope: no scope is current.
    """
    outbox = mail.outbox
    if outbox is None or engine is None:
        raise ConfigurationError(
            f"{mail.name}: correcting an email sent through the outbox needs the outbox and engine="
        )
    try:
        original = uuid.UUID(str(outbox_id))
    except ValueError:
        raise ConfigurationError(f"{mail.name}: {outbox_id!r} is not an outbox message id") from None
    unit = current_scope()
    control = outbox.control(engine)
    ledger = mail.guard.ledger_id
    identity = EffectIdentity.of(mail.guard.namespace, f"outbox/{original}", mail.name, 0, ledger)
    info: dict[str, Any] | None
    try:
        control.cancel(str(original))
        info = control.get(str(original))
    except MessageNotFound:
        info = None  # purged: settled (delivered or discarded) longer ago than the retention
    record = mail.guard.store.get(identity.key)
    went_out = record is not None and record.state is not State.FAILED
    status = None if info is None else info["status"]
    if not went_out:
        if status in (None, MessageStatus.DISCARDED):
            return None  # cancelled before any relay took it (now, or by an earlier attempt)
        if status == MessageStatus.DEAD:
            control.discard(str(original))  # refused, never sent: a replay must not send it now
            return None
    first = message_id_for(identity.provider_key, mail.domain)
    name = f"{mail.name}.{CORRECTION}"
    dedup = EffectIdentity.of(mail.guard.namespace, unit.id, name, unit.next_ordinal(name)).key
    message_id = _after(original, outbox.clock)
    provider = EffectIdentity.of(
        mail.guard.namespace, f"outbox/{message_id}", mail.name, 0, ledger
    ).provider_key
    # The original's ordering key, so the relays deliver the correction after it.
    kind = None if info is None else str(info["aggregatetype"])
    aggregate = None if info is None else str(info["aggregateid"])
    payload = {"message": json.loads(_EMAIL.encode(reply_to(build(first), first)))}
    with Session(engine) as session:
        found = outbox.enqueue(
            session, mail.name, payload, aggregate_type=kind, aggregate_id=aggregate,
            provider_key=provider, dedup_key=dedup, message_id=message_id,
        )  # fmt: skip
        session.commit()
    return found
