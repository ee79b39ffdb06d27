"""Email over SMTP as a guarded effect: sent after commit through the outbox, or inline.

::

    mail = EmailEffects(guard, SmtpSettings("smtp.example", 587, starttls=True, username=..., password=...),
                        outbox=outbox)

    with Session(engine) as session:                  # through the outbox (the default route)
        session.add(order)
        mail.send(session, Email(to=["ada@example.com"], subject="Receipt", text="..."))
        session.commit()                              # the relay sends it after the commit, once

    with scope("order-42"):
        mail.send_now(Email(...))                     # inline: now, once per identity

    mail.send_later(engine, Email(...))               # in an agent's tool: committed at once, the
                                                      # relay sends it; a rerun finds it queued

The ``Message-ID`` is derived from the effect's provider key (``<sg1p_...@domain>``), so every
attempt of one effect carries the same id. SMTP cannot be asked whether a message was delivered and
does not deduplicate: a send whose answer was lost (connection dropped or timed out after the
message went out) is *in doubt*, and the effect's policy decides. The default is **at most once**:
the send raises ``OutcomeUnknown`` and stays visible for an operator, never sent twice.
``policy="at_least_once"`` sends it again (with the same ``Message-ID``, which many mail clients
collapse). Errors are mapped by the SMTP phase they happen in (:func:`map_smtp_error`):

=================================================  =====================  ==========================
what happened                                      raised as              disposition
=================================================  =====================  ==========================
cannot connect, TLS/HELO fails, before MAIL FROM   ``ProviderUnreachable``  not applied, retryable
authentication refused                             ``ProviderRejected``   not applied, retryable
MAIL/RCPT/DATA refused with 5xx (every recipient)  ``ProviderRejected``   not applied
... refused with 4xx                               ``ProviderRejected``   not applied, retryable
connection lost or timeout after the message body  ``ProviderUnavailable``  ambiguous (policy)
=================================================  =====================  ==========================

The compensation for a sent email is a correction, in reply to the original ``Message-ID``, and it
never reaches anyone before the original: :meth:`EmailEffects.correction` (a saga compensation) and
:meth:`EmailEffects.correction_undo` (an agent saga's undo) cancel an original still waiting in the
outbox, or queue the correction behind it (:mod:`sagaguard.connectors.email_correction`).
"""

from __future__ import annotations

import email.message
import email.utils
import json
import re
import smtplib
import ssl
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from sqlalchemy.orm import Session

from sagaguard.connectors.errors import (
    ProviderRejected,
    ProviderUnavailable,
    ProviderUnreachable,
    classify,
    replayable,
)
from sagaguard.idempotency.checks import count, seconds
from sagaguard.idempotency.codec import Codec
from sagaguard.idempotency.effect import Policy, current_effect
from sagaguard.idempotency.errors import ConfigurationError
from sagaguard.idempotency.guard import Guard
from sagaguard.idempotency.keys import EffectIdentity, current_scope, scope
from sagaguard.idempotency.records import State

if TYPE_CHECKING:
    from sagaguard.idempotency.outbox import Outbox

__all__ = ["SEND", "Email", "EmailEffects", "Sent", "SmtpSettings", "map_smtp_error", "message_id_for"]

SEND = "email.send"
_EOL = re.compile(rb"\r\n|\r|\n")


@dataclass(frozen=True, slots=True)
class Email:
    """One email. Travels as JSON through the outbox, so keep attachments out (link to them)."""

    to: list[str]
    subject: str
    text: str
    sender: str | None = None
    """``From``; default: the connector's ``sender``."""
    cc: list[str] = field(default_factory=list)
    bcc: list[str] = field(default_factory=list)
    html: str | None = None
    reply_to: str | None = None
    in_reply_to: str | None = None
    """The ``Message-ID`` this one answers (a correction sets it)."""
    headers: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Sent:
    """What a send effect records."""

    message_id: str
    accepted: list[str]
    """Recipients the server accepted."""
    refused: dict[str, str] = field(default_factory=dict)
    """Recipients the server refused (others were accepted), with its reply."""


@dataclass(frozen=True, slots=True)
class SmtpSettings:
    """Where and how to connect. The password stays here, never in a message or a record."""

    host: str
    port: int = 25
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    starttls: bool = False
    tls: bool = False
    """Implicit TLS (port 465)."""
    timeout: float = 30.0
    local_hostname: str | None = None

    def __post_init__(self) -> None:
        seconds("timeout", self.timeout)
        count("port", self.port)


def message_id_for(provider_key: str, domain: str) -> str:
    """The ``Message-ID`` of the effect with this provider key."""
    return f"<{provider_key}@{domain}>"


def map_smtp_error(exc: BaseException, phase: str) -> Exception:
    """The connector error for ``exc`` raised in SMTP ``phase`` (connect, session, envelope, data, reply)."""
    code = getattr(exc, "smtp_code", None)
    if isinstance(exc, smtplib.SMTPResponseException):
        reply = exc.smtp_error
        text = reply.decode(errors="replace") if isinstance(reply, bytes) else str(reply)
        message = f"{phase}: the server answered {exc.smtp_code} {text}"
    else:
        message = f"{phase}: {type(exc).__name__}: {exc}"
    if isinstance(exc, smtplib.SMTPAuthenticationError):
        return ProviderRejected(message, "smtp", code, "auth", True)
    if isinstance(code, int) and code >= 400:
        # An explicit refusal, even of the message body, means the server did not take it.
        return ProviderRejected(message, "smtp", code, None, code < 500)
    if phase in ("connect", "session", "envelope", "data"):
        return ProviderUnreachable(message, "smtp", code)
    return ProviderUnavailable(message, "smtp", code)


_EMAIL: Codec[Email] = Codec(Email)


class _Refused(smtplib.SMTPResponseException):
    """A refusal reply at a phase smtplib does not raise for."""


class _HasStepScope(Protocol):
    @property
    def step_scope(self) -> str: ...


class EmailEffects:
    """Email as a guarded effect (``email.send``), through an outbox or inline.

    Args:
        guard: the guard the sends run under.
        smtp: the server.
        outbox: an :class:`sagaguard.idempotency.outbox.Outbox`: :meth:`send` enqueues there, and the
            message type ``name`` is registered on it with :meth:`deliver` as the handler.
        sender: the default ``From``.
        domain: the right-hand side of the ``Message-ID`` (default: the sender's domain).
        name: the effect's name (and the outbox message type).
        policy: what settles a send whose answer was lost (default at most once).
    """

    def __init__(
        self,
        guard: Guard,
        smtp: SmtpSettings,
        *,
        outbox: Outbox | None = None,
        sender: str = "noreply@localhost",
        domain: str | None = None,
        name: str = SEND,
        policy: Policy | str = Policy.AT_MOST_ONCE,
    ) -> None:
        self.guard = guard
        self.smtp = smtp
        self.sender = sender
        self.domain = domain or sender.rpartition("@")[2] or "localhost"
        self.name = name
        self.outbox = outbox
        options: dict[str, Any] = {
            "policy": policy,
            "classify": classify,
            "permanent": replayable,
            "result_type": Sent,
        }
        if outbox is not None:
            self._effect: Any = outbox.effect(guard, name, **options)(self._transmit)
        else:
            self._effect = guard.effect(name, **options)(self._transmit)

    # -- the routes -------------------------------------------------------------------------------

    def send(self, session: Any, message: Email) -> str:
        """Enqueue ``message`` in ``session`` (the caller's transaction): a relay sends it after the
        commit, once. Returns the outbox message id.

        Inside a scope (a saga step) it is enqueued once per effect: a re-run of the step, after its
        transaction committed or not, finds the message it enqueued instead of adding another
        (:meth:`sagaguard.idempotency.outbox.DeferredEffect.defer`).

        Raises:
            ConfigurationError: no outbox was given, or ``session`` is an ``AsyncSession`` inside a
                scope (use :meth:`asend`).
            KeyConflict: this send was enqueued before with another message.
        """
        return str(self._deferrable().defer(session, message))

    async def asend(self, session: Any, message: Email) -> str:
        """:meth:`send` into an ``AsyncSession`` (the row is inserted at once, in its transaction)."""
        return str(await self._deferrable().adefer(session, message))

    def send_later(self, engine: Any, message: Email) -> str:
        """Enqueue ``message`` in a transaction of its own and commit it: the email recipe for an
        agent's tool, which has no business transaction to join. Returns the outbox message id.

        The tool returns as soon as the message is committed; the relay delivers it. Enqueued once
        per effect of the current scope (an agent adapter's tool-call scope): a rerun of the tool
        after a crash, before or after the commit, returns the message already there. A delivery
        left in doubt is parked at the relay (a dead letter, its effect in doubt for an operator),
        never in the agent.

        Args:
            engine: the SQLAlchemy engine of the outbox's database.
            message: the email.

        Raises:
            NoScope: no scope is current (a rerun could not find the message it enqueued).
            ConfigurationError: no outbox was given.
            KeyConflict: this send was enqueued before with another message.
        """
        current_scope()  # raises NoScope: without one, a rerun would enqueue the email again
        with Session(engine) as session:
            outbox_id = self.send(session, message)
            session.commit()
        return outbox_id

    def _deferrable(self) -> Any:
        if self.outbox is None:
            raise ConfigurationError("EmailEffects.send needs an outbox=; use send_now to send inline")
        return self._effect

    def send_now(self, message: Email) -> Sent:
        """Send ``message`` now, as one effect of the current scope: a re-run replays the record.

        Raises:
            ProviderRejected, ProviderUnreachable: not sent (see the table).
            OutcomeUnknown: it may have been sent and the policy forbids sending it again.
        """
        return self._effect(message)  # type: ignore[no-any-return]

    def deliver(self, message: Any) -> Sent:
        """The outbox handler: send what an outbox relay hands over (an
        :class:`sagaguard.idempotency.outbox.Message` whose ``payload`` is ``{"message": <Email as JSON>}``)
        as the effect of scope ``outbox/<message id>``, so a redelivery replays the record and the
        ``Message-ID`` is derived from ``message.provider_key``. Registered on ``outbox``
        automatically; call it from your own relay otherwise."""
        payload = message.payload
        if not isinstance(payload, dict) or "message" not in payload:
            raise ConfigurationError(f"{self.name}: the outbox payload is not {{'message': Email}}")
        mail = _EMAIL.decode(json.dumps(payload["message"]))
        with scope(f"outbox/{message.id}"):
            return self.send_now(mail)

    # -- the compensation --------------------------------------------------------------------------

    def correction(
        self,
        build: Callable[[Any, str], Email],
        *,
        effect: str | None = None,
        ordinal: int = 0,
        engine: Any = None,
    ) -> Callable[[_HasStepScope, Any, Sent | str | None], None]:
        """A saga step compensation that corrects the step's email, never ahead of it.

        ``build(input, original_message_id)`` makes the correction, which answers the original
        (``In-Reply-To``/``References``). By the step's result:

        - an outbox message id (the step used :meth:`send`): an original no relay has claimed yet is
          cancelled in the outbox, and no email reaches anyone for it; otherwise the correction is
          enqueued under the original's ordering key (its aggregate), so the relay delivers it after
          the original, once (:mod:`sagaguard.connectors.email_correction`). Needs ``engine``.
        - :class:`Sent` (the step used :meth:`send_now`): the server accepted the original before
          the compensation began; the correction is sent inline now, once.
        - None (a crash between the send and its record): the original is found by the step's
          identity: no record or a recorded refusal means nothing was sent and nothing is
          corrected; an in-doubt send is corrected inline (it may have arrived).

        Args:
            build: the correction, from the saga input and the original's ``Message-ID``.
            effect: the send's effect name, when not this connector's ``name``.
            ordinal: which send of the step (0: the first).
            engine: the SQLAlchemy engine of the outbox's database (for sends through the outbox).
        """
        name = effect or self.name

        def compensate(ctx: _HasStepScope, input: Any, result: Sent | str | None) -> None:
            from sagaguard.connectors.email_correction import correct_deferred, reply_to

            if isinstance(result, str):
                correct_deferred(self, engine, result, lambda original: build(input, original))
                return
            if isinstance(result, Sent):
                original = result.message_id
            else:
                identity = EffectIdentity.of(self.guard.namespace, ctx.step_scope, name, ordinal)
                record = self.guard.store.get(identity.key)
                if record is None or record.state is State.FAILED:
                    return  # never attempted, or refused: nothing went out
                original = message_id_for(self.guard.provider_key(identity), self.domain)
            self.send_now(reply_to(build(input, original), original))

        compensate.__name__ = f"correct_{name.replace('.', '_')}"
        return compensate

    def correction_undo(
        self, build: Callable[[Any, str], Email], *, engine: Any = None
    ) -> Callable[[Any, Any], None]:
        """An agent saga's undo (``undo(arguments, result)``) that corrects the email an agent's
        tool sent, with the ordering of :meth:`correction`: register it in the agent saga's
        ``UndoRegistry`` and name it in the tool's ``changes_world(undo=...)``.

        ``build(arguments, original_message_id)`` makes the correction from the tool call's
        arguments. The tool's result says which email it sent: the outbox message id that
        :meth:`send_later` returned (the recipe), or a :class:`Sent` as JSON (``{"message_id": ...}``,
        :meth:`send_now`).

        Raises (when it runs):
            OriginalUnknown: the result is None (the tool's outcome was never recorded), so the
                run parks for an operator instead of guessing.
            ConfigurationError: a result that names no email, or an outbox id with no ``engine``.
        """

        def undo(arguments: Any, result: Any) -> None:
            from sagaguard.connectors.email_correction import OriginalUnknown, correct_deferred, reply_to

            if result is None:
                raise OriginalUnknown(f"{self.name}: the tool call's result was never recorded")
            if isinstance(result, str):
                correct_deferred(self, engine, result, lambda original: build(arguments, original))
                return
            original = result.get("message_id") if isinstance(result, dict) else None
            if not isinstance(original, str):
                raise ConfigurationError(
                    f"{self.name}: the tool's result {result!r} names no email (return send_later's id)"
                )
            self.send_now(reply_to(build(arguments, original), original))

        undo.__name__ = f"correct_{self.name.replace('.', '_')}"
        return undo

    # -- SMTP ----------------------------------------------------------------------------------------

    def build(self, message: Email, message_id: str) -> email.message.EmailMessage:
        """The MIME message for ``message`` with this ``Message-ID``."""
        mime = email.message.EmailMessage()
        mime["From"] = message.sender or self.sender
        mime["To"] = ", ".join(message.to)
        if message.cc:
            mime["Cc"] = ", ".join(message.cc)
        if message.reply_to:
            mime["Reply-To"] = message.reply_to
        mime["Subject"] = message.subject
        mime["Message-ID"] = message_id
        mime["Date"] = email.utils.formatdate(localtime=False)
        if message.in_reply_to:
            mime["In-Reply-To"] = message.in_reply_to
        for header, value in message.headers.items():
            mime[header] = value
        mime.set_content(message.text)
        if message.html is not None:
            mime.add_alternative(message.html, subtype="html")
        return mime

    def _transmit(self, message: Email) -> Sent:
        message_id = message_id_for(current_effect().provider_key, self.domain)
        mime = self.build(message, message_id)
        recipients = [*message.to, *message.cc, *message.bcc]
        refused: dict[str, str] = {}
        phase = "connect"
        settings = self.smtp
        try:
            cls = smtplib.SMTP_SSL if settings.tls else smtplib.SMTP
            with cls(settings.host, settings.port, local_hostname=settings.local_hostname,
                     timeout=settings.timeout) as smtp:  # fmt: skip
                phase = "session"
                smtp.ehlo()
                if settings.starttls:
                    smtp.starttls(context=ssl.create_default_context())
                    smtp.ehlo()
                if settings.username:
                    smtp.login(settings.username, settings.password or "")
                phase = "envelope"
                _check(smtp.mail(message.sender or self.sender))
                for rcpt in recipients:
                    code, reply = smtp.rcpt(rcpt)
                    if code not in (250, 251):
                        refused[rcpt] = f"{code} {reply.decode(errors='replace')}"
                if len(refused) == len(recipients):
                    worst = max(int(r.split()[0]) for r in refused.values())
                    raise _Refused(worst, b"every recipient was refused")
                phase = "data"
                _check(smtp.docmd("DATA"), expect=354)
                phase = "reply"  # the body goes out now: from here on, a lost answer is ambiguous
                smtp.send(_dot_stuffed(mime.as_bytes()))
                _check(smtp.getreply())
                phase = "quit"
                accepted = [r for r in recipients if r not in refused]
            return Sent(message_id, accepted, refused)
        except (smtplib.SMTPException, OSError) as exc:
            if phase == "quit":
                return Sent(message_id, [r for r in recipients if r not in refused], refused)
            raise map_smtp_error(exc, phase) from exc


def _check(reply: tuple[int, bytes], expect: int | Sequence[int] = 250) -> None:
    code, text = reply
    if code != expect and (isinstance(expect, int) or code not in expect):
        raise _Refused(code, text)


def _dot_stuffed(raw: bytes) -> bytes:
    """The message as SMTP DATA: CRLF line ends, leading dots doubled, ending in CRLF.CRLF."""
    data = _EOL.sub(b"\r\n", raw)
    if data.startswith(b"."):
        data = b"." + data
    data = data.replace(b"\r\n.", b"\r\n..")
    if not data.endswith(b"\r\n"):
        data += b"\r\n"
    return data + b".\r\n"
