"""Errors raised by the saga layer.

Every error derives from one root, so callers can catch the whole package at once::

    SagaError
    ├── DefinitionError            a malformed saga definition, found when it is declared (ValueError)
    │   ├── DuplicateStep          two steps share a name
    │   ├── StepOrderError         a compensatable step after the pivot, a retriable one before it, ...
    │   ├── SignatureError         an action or compensation cannot take the arguments it will be given
    │   └── UnstorableType         an input or result type cannot round-trip through JSON
    │                              (also an idempotency CodecError)
    ├── DefinitionMismatch         the journal holds this saga id under another name, version or steps
    ├── SagaConflict               same saga id, other input (also an idempotency KeyConflict)
    ├── SagaInProgress             a live runner holds the saga past the attach bound
    ├── LostSagaLease              a fenced journal write carried a stale token: another runner took over
    ├── ResultUnavailable          a step asked for a result that is not recorded (also a LookupError)
    └── JournalError               the journal backend failed
        └── JournalUnavailable     the journal cannot be reached; transient

Errors carry their data as attributes (``saga_id``, ``step``), never only in the message.
"""

from __future__ import annotations

from idempotency.errors import CodecError, KeyConflict

__all__ = [
    "DefinitionError",
    "DefinitionMismatch",
    "DuplicateStep",
    "JournalError",
    "JournalUnavailable",
    "LostSagaLease",
    "ResultUnavailable",
    "SagaConflict",
    "SagaError",
    "SagaInProgress",
    "SignatureError",
    "StepOrderError",
    "UnstorableType",
]


class SagaError(Exception):
    """Root of every error this package raises."""


class DefinitionError(SagaError, ValueError):
    """A saga definition is malformed. Raised while it is declared, before anything ran."""


class DuplicateStep(DefinitionError):
    """Two steps of one saga share a name (step names are part of effect scopes and journal rows)."""

    def __init__(self, saga: str, step: str) -> None:
        super().__init__(f"saga {saga!r} already has a step named {step!r}")
        self.saga = saga
        self.step = step


class StepOrderError(DefinitionError):
    """A step's kind does not fit its position (compensatable after the pivot, retriable before it,
    a second pivot) or a step lacks the compensation its kind needs."""


class SignatureError(DefinitionError):
    """An action or compensation cannot be called with the arguments the runner will pass."""


class UnstorableType(DefinitionError, CodecError):
    """A saga input or step result type cannot be stored as JSON and read back."""


class DefinitionMismatch(SagaError):
    """The journal records this saga id with another saga name, version or step at a position.

    Resuming would silently re-run or skip steps, so the runner refuses.
    """

    def __init__(self, saga_id: str, detail: str) -> None:
        super().__init__(f"saga {saga_id!r} does not match its journal: {detail}")
        self.saga_id = saga_id
        self.detail = detail


class SagaConflict(SagaError, KeyConflict):
    """The saga id is already recorded with another input (an idempotency :class:`KeyConflict`)."""

    def __init__(self, saga_id: str, recorded_fingerprint: str, fingerprint: str) -> None:
        KeyConflict.__init__(self, saga_id, recorded_fingerprint, fingerprint)
        self.args = (
            f"saga {saga_id!r} was started with another input "
            f"(fingerprint {recorded_fingerprint[:12]} != {fingerprint[:12]})",
        )
        self.saga_id = saga_id


class SagaInProgress(SagaError):
    """Another runner holds a live lease on the saga and it did not finish within the attach bound.

    Safe to retry later: nothing was written.
    """

    def __init__(self, saga_id: str) -> None:
        super().__init__(f"saga {saga_id!r} is running elsewhere")
        self.saga_id = saga_id


class LostSagaLease(SagaError):
    """A fenced journal write was refused: another runner took the saga over (or it already ended)."""

    def __init__(self, saga_id: str, token: int, detail: str = "") -> None:
        super().__init__(
            f"lost the lease of saga {saga_id!r} (token {token})" + (f": {detail}" if detail else "")
        )
        self.saga_id = saga_id
        self.token = token


class ResultUnavailable(SagaError, LookupError):
    """A step asked for the result of a step that has not succeeded (yet)."""

    def __init__(self, step: str) -> None:
        super().__init__(f"step {step!r} has no recorded result")
        self.step = step


class JournalError(SagaError):
    """The journal backend failed. ``transient`` says whether retrying may help."""

    transient: bool = False


class JournalUnavailable(JournalError):
    """The journal cannot be reached. Transient; nothing was written."""

    transient = True
