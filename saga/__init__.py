"""Sagas on top of the idempotency guard (DESIGN.md section 5).

Declare a saga with :class:`Saga`, run it with :class:`SagaRunner` over a :class:`SagaJournal`
(:class:`MemoryJournal`, or ``from saga.journals.sql import SqlJournal`` for SQLite and Postgres).
A crash anywhere resumes the saga; a failure undoes what was done in reverse order; what cannot be
undone is parked as NEEDS_ATTENTION with its cause.
"""

from saga.coordinator import SagaFlow, decide, decide_start, failure_state
from saga.definition import FORWARD_RETRY, Saga, Step, StepContext
from saga.errors import (
    DefinitionError,
    DefinitionMismatch,
    DuplicateStep,
    JournalError,
    JournalUnavailable,
    LostSagaLease,
    ResultUnavailable,
    SagaConflict,
    SagaError,
    SagaInProgress,
    SignatureError,
    StepOrderError,
    UnstorableType,
)
from saga.journal import SagaJournal
from saga.journals.memory import MemoryJournal
from saga.records import (
    Phase,
    SagaOutcome,
    SagaRecord,
    SagaSnapshot,
    SagaState,
    StartOutcome,
    StartResult,
    StepKind,
    StepRecord,
    StepState,
)
from saga.runner import SagaRunner, compensation_key, step_scope

__all__ = [
    "FORWARD_RETRY",
    "DefinitionError",
    "DefinitionMismatch",
    "DuplicateStep",
    "JournalError",
    "JournalUnavailable",
    "LostSagaLease",
    "MemoryJournal",
    "Phase",
    "ResultUnavailable",
    "Saga",
    "SagaConflict",
    "SagaError",
    "SagaFlow",
    "SagaInProgress",
    "SagaJournal",
    "SagaOutcome",
    "SagaRecord",
    "SagaRunner",
    "SagaSnapshot",
    "SagaState",
    "SignatureError",
    "StartOutcome",
    "StartResult",
    "Step",
    "StepContext",
    "StepKind",
    "StepOrderError",
    "StepRecord",
    "StepState",
    "UnstorableType",
    "compensation_key",
    "decide",
    "decide_start",
    "failure_state",
    "step_scope",
]
