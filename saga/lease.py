"""Who holds a saga's lease, and when a live lease is taken over at once.

Every start, claim and take-over records the lease's holder on the saga row
(:attr:`~sagaguard.saga.records.SagaRecord.holder`): the process's identity ``<host>|<pid>|<start time>``
(:mod:`sagaguard.idempotency.holder`). A saga RUNNING or COMPENSATING under a live lease is normally left to
its holder until the lease runs out; but when the holder is provably dead on this host (same machine
and pid namespace; its pid gone, a zombie, or reused by a process with another start time), waiting
for the lease would only delay the recovery, so the journal takes the saga over at once with
:meth:`~sagaguard.saga.journal.SagaJournal.take_over`: fenced on the token, which it bumps, so the dead
holder's late writes (a process frozen rather than dead cannot be told apart, only a dead one is
taken over) are refused with :class:`~sagaguard.saga.errors.LostSagaLease`.

A holder on another host, on an unknown host (no ``/proc``), or a row with no holder (written
before holders were recorded) is never judged dead: its saga waits for the lease as before.

:func:`verdict` is the decision, free of I/O but for the injected probe; :func:`after_start`,
:func:`after_claim` and :func:`dead_held` are what every journal runs after its own atomic start,
claim and due query, so that the take-over is the same on every backend.

:func:`renewed` is the lease a commit leaves: a commit that finds most of the lease it asks for
still ahead keeps it as it is, so a saga whose phases follow each other quickly does not rewrite
its place in the recovery sweep's index at each one (on Postgres, an update that changes no indexed
column is a heap-only tuple: no index entry, less WAL).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from typing import Protocol

from sagaguard.idempotency import holder as _holder
from sagaguard.saga.records import (
    LIVE_STATES,
    RESUMABLE_STATES,
    SagaRecord,
    SagaSnapshot,
    StartOutcome,
    StartResult,
)

__all__ = [
    "KEPT_WITHIN",
    "LeaseVerdict",
    "after_claim",
    "after_start",
    "current",
    "dead_held",
    "host_prefix",
    "renewed",
    "verdict",
]

Probe = Callable[[str | None], bool]
"""Whether a holder is provably dead on this host
(:func:`sagaguard.idempotency.holder.is_dead_on_this_host`)."""


class LeaseVerdict(enum.Enum):
    """What a saga's lease lets another process do now."""

    DUE = "due"
    """The lease ran out (or a waiting saga's wake-up came): claimable as usual."""
    TAKE_OVER = "take_over"
    """Running or compensating under a live lease whose holder is provably dead on this host:
    taken over at once, fenced on the token."""
    HELD = "held"
    """A live lease whose holder is alive, elsewhere, or unknown (or a waiting saga not due yet)."""
    ENDED = "ended"
    """Not resumable: the saga ended or needs attention."""


def verdict(record: SagaRecord, now: float, *, dead: Probe = _holder.is_dead_on_this_host) -> LeaseVerdict:
    """What the saga's lease allows at journal time ``now``; ``dead`` is probed only for a live
    saga under a live lease (a few microseconds of ``/proc``)."""
    if record.state not in RESUMABLE_STATES:
        return LeaseVerdict.ENDED
    if record.lease_until <= now:
        return LeaseVerdict.DUE
    if record.state in LIVE_STATES and dead(record.holder):
        return LeaseVerdict.TAKE_OVER
    return LeaseVerdict.HELD


KEPT_WITHIN = 0.2
"""The last part of a lease a commit keeps rather than renews: a lease that ends between
``now + lease * (1 - KEPT_WITHIN)`` and ``now + lease`` is left as it is."""


def renewed(lease_until: float, now: float, lease: float) -> float:
    """The lease a commit at journal time ``now`` asking for ``lease`` seconds leaves on a saga whose
    lease ends at ``lease_until``: 0 when ``lease`` is 0 (released); the current one when it already
    ends within the last fifth of ``now + lease`` (at least four fifths of the lease ahead, never
    more than asked); else ``now + lease``.

    The renewer's heartbeats come a third of a lease apart, so a kept lease still has more than
    two fifths of it left at the next one. The SQL and Redis journals compute the same in their
    statements (:data:`KEPT_WITHIN` is formatted into them); the contract test pins all three.
    """
    if lease <= 0:
        return 0.0
    asked = now + lease
    if now + lease * (1 - KEPT_WITHIN) < lease_until <= asked:
        return lease_until
    return asked


def current(holder: str | None = None) -> str:
    """``holder``, or this process's identity when None: what a journal records as the holder."""
    return _holder.current() if holder is None else holder


def host_prefix() -> str | None:
    """The text every holder on this host begins with (``<host>|``); None when the host is unknown,
    where no holder is ever judged dead."""
    me = _holder.parse(_holder.current())
    if me is None or me.host == _holder.UNKNOWN_HOST:
        return None
    return f"{me.host}|"


class _TakesOver(Protocol):
    def load(self, saga_id: str) -> SagaSnapshot | None: ...

    def take_over(
        self, saga_id: str, token: int, *, lease: float, holder: str | None = None
    ) -> SagaSnapshot | None: ...


def _dead_live(record: SagaRecord, dead: Probe) -> bool:
    return record.state in LIVE_STATES and dead(record.holder)


def after_start(
    journal: _TakesOver,
    result: StartResult,
    *,
    name: str,
    version: int,
    fingerprint: str,
    lease: float,
    holder: str | None,
    dead: Probe = _holder.is_dead_on_this_host,
) -> StartResult:
    """A start's answer, with a live saga of the same definition and input whose holder is dead
    taken over (TOOK_OVER). An EXISTING live saga has a live lease (else the start took it over).
    Of racing starts one takes it over; the others answer EXISTING with the saga as it now stands."""
    saga = result.snapshot.saga
    if (
        result.outcome is not StartOutcome.EXISTING
        or (saga.name, saga.version, saga.fingerprint) != (name, version, fingerprint)
        or not _dead_live(saga, dead)
    ):
        return result
    taken = journal.take_over(saga.saga_id, saga.token, lease=lease, holder=holder)
    if taken is not None:
        return StartResult(StartOutcome.TOOK_OVER, taken)
    return StartResult(StartOutcome.EXISTING, journal.load(saga.saga_id) or result.snapshot)


def after_claim(
    journal: _TakesOver,
    saga_id: str,
    *,
    lease: float,
    holder: str | None,
    dead: Probe = _holder.is_dead_on_this_host,
) -> SagaSnapshot | None:
    """What a claim that found the saga not due answers: the saga taken over when it is live and
    its holder dead, else None."""
    found = journal.load(saga_id)
    if found is None or not _dead_live(found.saga, dead):
        return None
    return journal.take_over(saga_id, found.saga.token, lease=lease, holder=holder)


def dead_held(
    records: Iterable[SagaRecord], *, dead: Probe = _holder.is_dead_on_this_host
) -> list[SagaRecord]:
    """Of ``records`` (sagas under a live lease), the running or compensating ones whose holder is
    dead: what a journal's ``due`` adds to the sagas whose lease ran out."""
    return [r for r in records if _dead_live(r, dead)]
