"""Sagas on top of the idempotency guard (docs/sagas.md).

Declare a saga with :class:`Saga`, run it with :class:`SagaRunner` over a :class:`SagaJournal`
(:class:`MemoryJournal`; ``from sagaguard.saga.journals.sql import SqlJournal`` for SQLite and Postgres;
``from sagaguard.saga.journals.redis import RedisJournal``). A crash anywhere resumes the saga; a failure
undoes what was done in reverse order; what cannot be undone is parked as NEEDS_ATTENTION with its
cause. :func:`recover` (or a :class:`RecoveryWorker`) continues sagas whose runner is gone; a step
can wait for a :func:`signal` with no process held; :func:`cancel` undoes a saga before its pivot;
:func:`retry` and :func:`resolve` are an operator's hand on a saga that needs attention, and
:func:`timeline` shows what happened;
a :class:`SagaRegistry` lets old instances finish on the version that started them.
"""

from sagaguard.saga.context import StepContext
from sagaguard.saga.control import NotParked, cancel, resolve, retry, signal
from sagaguard.saga.coordinator import SagaFlow, decide, decide_start, failure_state
from sagaguard.saga.definition import FORWARD_RETRY, Saga, Step
from sagaguard.saga.errors import (
    CompensationsFailed,
    DefinitionError,
    DefinitionMismatch,
    DuplicateStep,
    JournalError,
    JournalUnavailable,
    LostSagaLease,
    RecoveryExhausted,
    ResultUnavailable,
    SagaCancelled,
    SagaConflict,
    SagaDeadlineExceeded,
    SagaError,
    SagaInProgress,
    SagaNotFound,
    SagaSuspended,
    SignalTimeout,
    SignatureError,
    StepMismatch,
    StepOrderError,
    StepTimeout,
    UnknownSaga,
    UnstorableType,
)
from sagaguard.saga.journal import SagaJournal
from sagaguard.saga.journals.memory import MemoryJournal
from sagaguard.saga.records import (
    CancelOutcome,
    CompensationPolicy,
    Phase,
    SagaOutcome,
    SagaRecord,
    SagaSnapshot,
    SagaState,
    SignalOutcome,
    StartOutcome,
    StartResult,
    StepKind,
    StepRecord,
    StepState,
)
from sagaguard.saga.recovery import RecoveryReport, RecoveryWorker, arecover, recover, run_worker
from sagaguard.saga.registry import SagaRegistry
from sagaguard.saga.renewer import LeaseRenewer
from sagaguard.saga.runner import SagaRunner, compensation_key, step_scope
from sagaguard.saga.timeline import Event, render, timeline

__all__ = [
    "FORWARD_RETRY",
    "CancelOutcome",
    "CompensationPolicy",
    "CompensationsFailed",
    "DefinitionError",
    "DefinitionMismatch",
    "DuplicateStep",
    "Event",
    "JournalError",
    "JournalUnavailable",
    "LeaseRenewer",
    "LostSagaLease",
    "MemoryJournal",
    "NotParked",
    "Phase",
    "RecoveryExhausted",
    "RecoveryReport",
    "RecoveryWorker",
    "ResultUnavailable",
    "Saga",
    "SagaCancelled",
    "SagaConflict",
    "SagaDeadlineExceeded",
    "SagaError",
    "SagaFlow",
    "SagaInProgress",
    "SagaJournal",
    "SagaNotFound",
    "SagaOutcome",
    "SagaRecord",
    "SagaRegistry",
    "SagaRunner",
    "SagaSnapshot",
    "SagaState",
    "SagaSuspended",
    "SignalOutcome",
    "SignalTimeout",
    "SignatureError",
    "StartOutcome",
    "StartResult",
    "Step",
    "StepContext",
    "StepKind",
    "StepMismatch",
    "StepOrderError",
    "StepRecord",
    "StepState",
    "StepTimeout",
    "UnknownSaga",
    "UnstorableType",
    "arecover",
    "cancel",
    "compensation_key",
    "decide",
    "decide_start",
    "failure_state",
    "recover",
    "render",
    "resolve",
    "retry",
    "run_worker",
    "signal",
    "step_scope",
    "timeline",
]
