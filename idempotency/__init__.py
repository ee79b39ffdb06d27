"""sagaguard's effect ledger: calls that change the world happen once.

See docs/concepts.md. The public API is re-exported here; backends live in
``sagaguard.idempotency.stores``.
"""

from sagaguard.idempotency.effect import (
    NOT_APPLIED,
    Applied,
    EffectContext,
    NotAppliedResolution,
    Policy,
    ReconcileRequest,
    Retry,
    Unknown,
    current_effect,
)
from sagaguard.idempotency.errors import (
    AlreadyInProgress,
    CodecError,
    ConfigurationError,
    IdempotencyError,
    KeyConflict,
    LostOwnership,
    NoScope,
    NotApplied,
    OutcomeNotRecorded,
    OutcomeUnknown,
    RecordNotFound,
    ReplayedFailure,
    SchemaVersionMismatch,
    StoreError,
    StoreUnavailable,
)
from sagaguard.idempotency.guard import Guard, Operation
from sagaguard.idempotency.keys import EffectIdentity, Scope, current_scope, derive_key, fingerprint, scope
from sagaguard.idempotency.records import ClaimOutcome, ClaimResult, Disposition, Record, State
from sagaguard.idempotency.store import IdempotencyStore
from sagaguard.idempotency.stores import MemoryStore, open_store

__all__ = [
    "NOT_APPLIED",
    "Applied",
    "EffectContext",
    "Guard",
    "Operation",
    "NotApplied",
    "NotAppliedResolution",
    "Policy",
    "ReconcileRequest",
    "Retry",
    "Unknown",
    "current_effect",
    "AlreadyInProgress",
    "ClaimOutcome",
    "ClaimResult",
    "CodecError",
    "ConfigurationError",
    "Disposition",
    "EffectIdentity",
    "IdempotencyError",
    "IdempotencyStore",
    "KeyConflict",
    "LostOwnership",
    "MemoryStore",
    "NoScope",
    "OutcomeNotRecorded",
    "OutcomeUnknown",
    "Record",
    "RecordNotFound",
    "ReplayedFailure",
    "SchemaVersionMismatch",
    "Scope",
    "State",
    "StoreError",
    "StoreUnavailable",
    "current_scope",
    "derive_key",
    "fingerprint",
    "open_store",
    "scope",
]
