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
    │   └── StepMismatch           the journal's step at a position has another name than the definition's
    ├── UnknownSaga                no registered definition has this name and version (also a LookupError)
    ├── SagaNotFound               no saga has this id (also a LookupError)
    ├── SagaConflict               same saga id, other input (also an idempotency KeyConflict)
    ├── SagaInProgress             a live runner holds the saga past the attach bound
    ├── LostSagaLease              a fenced journal write carried a stale token: another runner took over
    ├── ResultUnavailable          a step asked for a result that is not recorded (also a LookupError)
    ├── SagaCancelled              recorded cause: the saga was cancelled before its pivot
    ├── RecoveryExhausted          recorded cause: taken over more often than the recovery cap allows
    ├── CompensationsFailed        recorded cause: several compensations exhausted their retries
    ├── StepTimeout                a step ran past its timeout: it failed *maybe applied* (TimeoutError)
    ├── SagaDeadlineExceeded       recorded cause: the saga's deadline passed before its pivot (TimeoutError)
    ├── SignalTimeout              a wait's deadline passed without its signal: *not applied* (TimeoutError)
    ├── NothingToUndo              a step's effect provably never happened: its compensation is skipped
    └── JournalError               the journal backend failed
        └── JournalUnavailable     the journal cannot be reached; transient

    SagaSuspended (BaseException)  raised by ``ctx.wait_for`` to park the saga; never an error

Errors carry their data as attributes (``saga_id``, ``step``), never only in the message.
"""

from __future__ import annotations

from sagaguard.idempotency.errors import CodecError, KeyConflict

__all__ = [
    "CompensationsFailed",
    "DefinitionError",
    "DefinitionMismatch",
    "DuplicateStep",
    "JournalError",
    "JournalUnavailable",
    "LostSagaLease",
    "NothingToUndo",
    "RecoveryExhausted",
    "ResultUnavailable",
    "SagaCancelled",
    "SagaConflict",
    "SagaDeadlineExceeded",
    "SagaError",
    "SagaInProgress",
    "SagaNotFound",
    "SagaSuspended",
    "SignalTimeout",
    "SignatureError",
    "StepMismatch",
    "StepOrderError",
    "StepTimeout",
    "UnknownSaga",
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


class StepMismatch(DefinitionMismatch):
    """The journal's step at ``index`` is ``recorded`` but the definition has ``expected`` there.

    The definition changed under the same name and version: register the new steps as a new
    version so that running instances finish on the old one.
    """

    def __init__(self, saga_id: str, index: int, recorded: str, expected: str | None) -> None:
        where = "no step" if expected is None else f"step {expected!r}"
        super().__init__(
            saga_id,
            f"journal step {index} is {recorded!r} but the definition has {where} there "
            "(changed steps need a new saga version)",
        )
        self.index = index
        self.recorded = recorded
        self.expected = expected


class UnknownSaga(SagaError, LookupError):
    """No definition with this name and version is registered (in this process)."""

    def __init__(self, name: str, version: int) -> None:
        super().__init__(f"no saga definition {name!r} version {version} is registered")
        self.name = name
        self.version = version


class SagaNotFound(SagaError, LookupError):
    """The journal holds no saga with this id."""

    def __init__(self, saga_id: str) -> None:
        super().__init__(f"no saga {saga_id!r}")
        self.saga_id = saga_id


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
    """The journal cannot be reached, or too few replicas acknowledged a write. Transient.

    Nothing is acknowledged: a write whose reply was lost, or that the replicas did not
    acknowledge, may stand or not, and the saga goes on from what the journal holds when resumed.
    """

    transient = True


class SagaCancelled(SagaError):
    """The cause a cancelled saga records: :func:`saga.cancel` asked for it to be undone."""

    def __init__(self, reason: str = "cancelled") -> None:
        super().__init__(reason)
        self.reason = reason


class RecoveryExhausted(SagaError):
    """The cause recorded when a saga was taken over more often than the recovery cap allows.

    Each take-over follows a runner that lost its lease (a crash, a hang, a step past its timeout).
    A saga that keeps doing that is parked for an operator instead of crashing workers forever.
    """

    def __init__(self, saga_id: str, recoveries: int, limit: int) -> None:
        super().__init__(
            f"saga {saga_id!r} was taken over {recoveries} times (limit {limit}): parked for an operator"
        )
        self.saga_id = saga_id
        self.recoveries = recoveries
        self.limit = limit


class CompensationsFailed(SagaError):
    """The cause recorded when, with ``on_compensation_failure="continue"``, more than one
    compensation exhausted its retries (one failure records that compensation's own error).

    ``failures`` maps each step whose compensation failed to its error's message, latest step first
    (the order the compensations ran in).
    """

    def __init__(self, saga_id: str, failures: dict[str, str]) -> None:
        listed = "; ".join(f"{step}: {message}" for step, message in failures.items())
        super().__init__(f"saga {saga_id!r}: {len(failures)} compensations failed ({listed})")
        self.saga_id = saga_id
        self.failures = dict(failures)


class StepTimeout(SagaError, TimeoutError):
    """A step ran past its timeout. It may have changed the world (its compensation gets None)."""

    def __init__(self, step: str, timeout: float) -> None:
        super().__init__(f"step {step!r} did not finish within {timeout:g} s")
        self.step = step
        self.timeout = timeout


class SagaDeadlineExceeded(SagaError, TimeoutError):
    """The cause recorded when a saga's deadline passed before its pivot started."""

    def __init__(self, saga_id: str) -> None:
        super().__init__(f"saga {saga_id!r} passed its deadline before its pivot")
        self.saga_id = saga_id


class SignalTimeout(SagaError, TimeoutError):
    """A step's wait for a signal passed its deadline. The wait changed nothing (*not applied*)."""

    def __init__(self, signal: str) -> None:
        super().__init__(f"signal {signal!r} did not arrive before the wait's deadline")
        self.signal = signal


class NothingToUndo(SagaError):
    """A step's effect provably never happened (:meth:`~sagaguard.saga.step.Step.never_applied`): the step is
    marked *not applied* instead of compensated, and its compensation does not run.

    Attributes:
        step: the step's name.
    """

    def __init__(self, step: str) -> None:
        super().__init__(f"step {step!r} never claimed its effect: nothing to undo")
        self.step = step


class SagaSuspended(BaseException):
    """Raised by :meth:`StepContext.wait_for` to park the saga until a signal arrives.

    Derives from BaseException because it is not an error: an ``except Exception`` in the step must
    not swallow it. The runner turns it into a WAITING saga and returns.

    Attributes:
        signal: the awaited signal's name.
        timeout: seconds from the first wait to its deadline, or None.
        deadline: an absolute deadline (journal time), or None.
    """

    def __init__(self, signal: str, timeout: float | None = None, deadline: float | None = None) -> None:
        super().__init__(f"waiting for signal {signal!r}")
        self.signal = signal
        self.timeout = timeout
        self.deadline = deadline
