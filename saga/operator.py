"""Operator actions on sagas and agent runs, audited: shared by the CLI, the console and scripts.

::

    cancel_saga(journal, "order-43", reason="customer withdrew", actor="ana", audit=log)
    retry_saga(journal, "order-44", fresh=True, actor="ana", audit=log)
    skip_compensation(journal, "order-45", "book_hotel", note="refunded by phone", actor="ana", audit=log)
    signal_saga(journal, "order-46", "approval", {"ok": True}, actor="ana", audit=log)
    reject_run(journal, "run-7", reason="wrong customer", actor="ana", audit=log)

Each is the :mod:`sagaguard.saga.control` function of the same effect, read at the journal's clock
and recorded in ``audit`` (an :class:`~sagaguard.idempotency.audit.AuditLog`, None for none): ok,
or refused with the error type, or with the outcome's tag (``too_late``, ``duplicate``) when the
journal did not act. A signal's payload is never recorded.
"""

from __future__ import annotations

from typing import Any

from sagaguard.idempotency.audit import AuditLog, TargetKind, audited
from sagaguard.idempotency.codec import encode_error
from sagaguard.saga.agent.errors import AgentRunRejected
from sagaguard.saga.checks import check_saga_id
from sagaguard.saga.control import NotParked, cancel, resolve, retry, signal
from sagaguard.saga.errors import SagaNotFound
from sagaguard.saga.journal import SagaJournal
from sagaguard.saga.records import CancelOutcome, SagaRecord, SagaState, SignalOutcome

__all__ = ["cancel_saga", "reject_run", "retry_saga", "signal_saga", "skip_compensation"]


def _not_done(outcome: CancelOutcome | SignalOutcome) -> str | None:
    return outcome.value if outcome.value in ("too_late", "duplicate", "already") else None


def cancel_saga(
    journal: SagaJournal, saga_id: str, *, reason: str = "cancelled by an operator", actor: str,
    audit: AuditLog | None = None, source: str = "api",
) -> CancelOutcome:  # fmt: skip
    """Cancel a saga or an agent run (it compensates), audited; see :func:`sagaguard.saga.control.cancel`.

    Returns:
        REQUESTED, ALREADY or TOO_LATE (the last two recorded as refused with that tag).

    Raises:
        SagaNotFound: no saga has this id.
        ConfigurationError: a malformed saga id or actor.
        JournalError: the journal failed.
    """
    return audited(
        audit, at=journal.now(), actor=actor, action="saga.cancel", kind=TargetKind.SAGA, target=saga_id,
        args={"reason": reason}, source=source, act=lambda: cancel(journal, saga_id, reason=reason),
        refusal=_not_done,
    )  # fmt: skip


def retry_saga(
    journal: SagaJournal, saga_id: str, *, fresh: bool = False, actor: str, audit: AuditLog | None = None,
    source: str = "api",
) -> SagaRecord:  # fmt: skip
    """Retry a NEEDS_ATTENTION saga, audited; see :func:`sagaguard.saga.control.retry`.

    Raises:
        SagaNotFound: no saga has this id.
        NotParked: it does not need attention.
        JournalError: the journal failed.
    """
    return audited(
        audit, at=journal.now(), actor=actor, action="saga.retry", kind=TargetKind.SAGA, target=saga_id,
        args={"fresh": fresh}, source=source, act=lambda: retry(journal, saga_id, fresh=fresh),
    )  # fmt: skip


def skip_compensation(
    journal: SagaJournal, saga_id: str, step: str, *, note: str = "resolved by an operator", actor: str,
    audit: AuditLog | None = None, source: str = "api",
) -> SagaRecord:  # fmt: skip
    """Mark a step's failed compensation as done by hand and compensate on, audited; see
    :func:`sagaguard.saga.control.resolve`.

    Raises:
        SagaNotFound: no saga has this id.
        NotParked: it does not need attention, or the step's compensation did not fail.
        JournalError: the journal failed.
    """
    return audited(
        audit, at=journal.now(), actor=actor, action="saga.skip", kind=TargetKind.SAGA, target=saga_id,
        args={"step": step, "note": note}, source=source,
        act=lambda: resolve(journal, saga_id, step, note=note),
    )  # fmt: skip


def signal_saga(
    journal: SagaJournal, saga_id: str, name: str, payload: Any = None, *, actor: str,
    audit: AuditLog | None = None, source: str = "api",
) -> SignalOutcome:  # fmt: skip
    """Deliver a signal, audited (its name, never its payload); see :func:`sagaguard.saga.control.signal`.

    Returns:
        DELIVERED, DUPLICATE or TOO_LATE (the last two recorded as refused with that tag).

    Raises:
        SagaNotFound: no saga has this id.
        ConfigurationError: a malformed name, saga id or payload.
        JournalError: the journal failed.
    """
    return audited(
        audit, at=journal.now(), actor=actor, action="saga.signal", kind=TargetKind.SAGA, target=saga_id,
        args={"name": name}, source=source, act=lambda: signal(journal, saga_id, name, payload),
        refusal=_not_done,
    )  # fmt: skip


def _reject(journal: SagaJournal, run_id: str, reason: str) -> CancelOutcome:
    snapshot = journal.load(check_saga_id(run_id))
    if snapshot is None:
        raise SagaNotFound(run_id)
    if snapshot.saga.state is not SagaState.WAITING:
        raise NotParked(
            run_id, snapshot.saga.state, f"run {run_id!r} is {snapshot.saga.state.value}, not waiting"
        )
    return journal.cancel(run_id, encode_error(AgentRunRejected(reason)))


def reject_run(
    journal: SagaJournal, run_id: str, *, reason: str = "rejected", actor: str, audit: AuditLog | None = None,
    source: str = "api",
) -> CancelOutcome:  # fmt: skip
    """Reject an agent run (or saga) WAITING at an approval, audited: it is cancelled with the cause
    :class:`~sagaguard.saga.agent.errors.AgentRunRejected`, so the next recovery sweep undoes its
    tool calls in reverse order, from any process (no agent definition needed here).

    Returns:
        REQUESTED, ALREADY or TOO_LATE (past its pivot).

    Raises:
        SagaNotFound: no run has this id.
        NotParked: the run is not waiting.
        JournalError: the journal failed.
    """
    return audited(
        audit, at=journal.now(), actor=actor, action="saga.reject", kind=TargetKind.SAGA, target=run_id,
        args={"reason": reason}, source=source, act=lambda: _reject(journal, run_id, reason),
        refusal=_not_done,
    )  # fmt: skip
