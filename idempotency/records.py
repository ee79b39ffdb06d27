"""The effect record, its states and the outcome of a claim. Plain data, no I/O."""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

__all__ = ["ClaimOutcome", "ClaimResult", "Disposition", "Record", "State"]


class State(enum.StrEnum):
    """Where an effect stands. See docs/concepts.md for the transitions."""

    IN_PROGRESS = "in_progress"
    """Claimed by a worker holding a live lease; the effect may be running."""
    SUCCEEDED = "succeeded"
    """The effect happened; its result is recorded and replayed."""
    FAILED = "failed"
    """The effect was not applied and will not be: the recorded error is replayed."""
    IN_DOUBT = "in_doubt"
    """The effect may have happened (crash or ambiguous error); it must be resolved, not re-run blindly."""


class Disposition(enum.StrEnum):
    """How a failed attempt leaves the record."""

    PERMANENT = "permanent"
    """Not applied and never will be (card declined, validation): the record becomes FAILED."""
    RETRYABLE = "retryable"
    """Not applied, may succeed later: the record is removed and the next attempt claims afresh."""
    AMBIGUOUS = "ambiguous"
    """May have been applied (timeout, reset, 5xx): the record becomes IN_DOUBT."""


@dataclass(frozen=True, slots=True)
class Record:
    """One effect as the store holds it.

    Times are seconds since the epoch on the store's clock. ``result`` and ``error`` are JSON text.
    """

    key: str
    namespace: str
    scope: str
    name: str
    ordinal: int
    fingerprint: str
    state: State
    token: int
    """Fencing token: grows by one on every take-over; every write after the claim must carry it."""
    lease_until: float
    """While ``now < lease_until`` the holder of ``token`` owns the record."""
    attempts: int
    """How many times a worker claimed (or took over) this record."""
    created_at: float
    updated_at: float
    expires_at: float | None = None
    """When a finished record may be purged (retention); None while IN_PROGRESS or IN_DOUBT."""
    result: str | None = None
    error: str | None = None
    holder: str | None = None
    """Who claimed or last took over the record (:mod:`sagaguard.idempotency.holder`); None in records
    written before holders were recorded."""
    result_type: str | None = None
    """The declared type of the effect's result, as :func:`~sagaguard.idempotency.result_types.type_name`
    names it (``"sagaguard.connectors.stripe.Payment"``, ``"builtins.dict"``), written by the claim; an
    operator's result is checked against it. None: no type declared (``Any``), one that cannot be named
    by import, or a record written before result types were recorded."""

    def lease_live(self, now: float) -> bool:
        """Whether the current holder's lease has not yet run out at ``now``."""
        return now < self.lease_until

    def evolve(self, **changes: object) -> Record:
        """A copy with ``changes`` applied."""
        return replace(self, **changes)  # type: ignore[arg-type]


class ClaimOutcome(enum.StrEnum):
    """What a claim did."""

    CLAIMED = "claimed"
    """No live record existed: the caller now owns a fresh IN_PROGRESS record and must run the effect."""
    TOOK_OVER = "took_over"
    """The previous holder's lease ran out (it crashed), its holder is dead (see
    :meth:`~sagaguard.idempotency.store.IdempotencyStore.take_over`) or the record was left IN_DOUBT: the
    caller owns the record under a new token and must resolve it before running anything."""
    EXISTING = "existing"
    """A record exists that the caller does not own: replay it, wait for it, or report a conflict."""


@dataclass(frozen=True, slots=True)
class ClaimResult:
    """The outcome of :meth:`IdempotencyStore.claim` with the record as it stands after the claim."""

    outcome: ClaimOutcome
    record: Record
