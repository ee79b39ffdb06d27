"""The guard's decisions, written once, free of I/O.

:func:`decide` maps a claim result to what the guard does next; it is a pure function and is
table-tested. :class:`Flow` strings the decisions together as a generator that *yields* the I/O it
needs (:class:`Claim`, :class:`Execute`, :class:`Complete`, ...) and receives the answers, so the sync
and the async drivers in :mod:`sagaguard.idempotency.driving` are each a short loop (the httpx ``auth_flow``
pattern) and can never drift apart.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Generator, Mapping
from dataclasses import dataclass
from typing import Any, Generic, NamedTuple, TypeVar, cast

from sagaguard.idempotency.codec import Codec, decode_error, encode_error, names_type
from sagaguard.idempotency.effect import (
    Applied,
    Classifier,
    NotApplied,
    NotAppliedResolution,
    Policy,
    ReconcileRequest,
    Resolution,
    Retry,
    classify,
)
from sagaguard.idempotency.errors import (
    AlreadyInProgress,
    CodecError,
    KeyConflict,
    OutcomeNotRecorded,
    OutcomeUnknown,
    ReplayedFailure,
    StoreError,
)
from sagaguard.idempotency.keys import EffectIdentity
from sagaguard.idempotency.records import ClaimOutcome, ClaimResult, Disposition, Record, State
from sagaguard.idempotency.telemetry import Outcome

__all__ = ["Action", "EffectSpec", "Flow", "abandon", "decide"]

T = TypeVar("T")

_CRASH_NOTE = json.dumps(
    {
        "type": "sagaguard.crash",
        "message": "the worker holding the claim stopped before recording an outcome",
        "args": [],
    }
)


class Action(enum.Enum):
    """What the guard does with a claim result."""

    EXECUTE = "execute"
    """We own a fresh claim: run the effect."""
    RESOLVE = "resolve"
    """We took over an in-doubt record: resolve it before running anything."""
    REPLAY = "replay"
    """A recorded success: return its result."""
    REPLAY_FAILURE = "replay_failure"
    """A recorded permanent failure: raise it again."""
    CONFLICT = "conflict"
    """Same key, other arguments."""
    WAIT = "wait"
    """Someone else holds a live claim: wait, then claim again."""
    TAKE_OVER = "take_over"
    """A live claim whose holder is provably dead (same host, process gone): take it over at once,
    fenced as a lease expiry is, then resolve it."""


def decide(
    claim: ClaimResult, fingerprint: str, name: str | None = None, *, holder_dead: bool = False
) -> Action:
    """The next action for a claim result. Pure.

    ``name`` is the calling effect's name: a record written by another effect under the same key
    (one explicit key shared by two effects) is a conflict, never replayed as this effect's result.

    ``holder_dead``: the driver's probe found the holder of a live claim dead on this host
    (:func:`sagaguard.idempotency.holder.is_dead_on_this_host`); such a claim (IN_PROGRESS, or IN_DOUBT
    while a dead taker resolved it) is taken over at once instead of waited for.
    """
    if claim.outcome is ClaimOutcome.CLAIMED:
        return Action.EXECUTE
    record = claim.record
    if record.fingerprint != fingerprint or (name is not None and record.name != name):
        return Action.CONFLICT
    if claim.outcome is ClaimOutcome.TOOK_OVER:
        return Action.RESOLVE
    if record.state is State.SUCCEEDED:
        return Action.REPLAY
    if record.state is State.FAILED:
        return Action.REPLAY_FAILURE
    return Action.TAKE_OVER if holder_dead else Action.WAIT


@dataclass(frozen=True, slots=True)
class EffectSpec(Generic[T]):
    """Everything the guard knows about one effect: fixed at decoration time."""

    name: str
    codec: Codec[T]
    policy: Policy
    provider_idempotent: bool
    reconciler: Any | None
    classifier: Classifier | None
    permanent: tuple[type[BaseException], ...]
    retryable: tuple[type[BaseException], ...]
    retry: Retry
    lease: float
    retention: float
    wait: float
    """How long a duplicate waits, in total, for a live claim to finish before AlreadyInProgress."""
    provider_window: float | None = None
    """Seconds after the first attempt during which the provider still deduplicates on the provider
    key (Stripe: 24 hours); an in-doubt record older than this is not re-sent. None: forever."""

    def within_provider_window(self, record: Record) -> bool:
        """Whether a re-send of ``record`` under its provider key is still absorbed by the provider.

        The record's age is measured on the store's clock: ``updated_at`` (the take-over) minus
        ``created_at`` (the first claim, before the first send).
        """
        window = self.provider_window
        return window is None or record.updated_at - record.created_at < window

    def disposition(self, exc: BaseException) -> Disposition:
        """Classify an exception raised by this effect."""
        return classify(exc, self.classifier, self.permanent, self.retryable)

    def retries(self, exc: BaseException) -> bool:
        """Whether ``exc`` is retried inside the claim.

        Not-applied retryable errors always are; ambiguous ones only when the provider deduplicates
        on the provider key, so a re-send cannot apply twice.
        """
        disposition = self.disposition(exc)
        return disposition is Disposition.RETRYABLE or (
            disposition is Disposition.AMBIGUOUS and self.provider_idempotent
        )

    def rebuild_failure(self, text: str) -> BaseException:
        """The exception a recorded permanent failure is replayed as.

        Only types the effect declared (``permanent=``) and :class:`NotApplied` are rebuilt; a type
        name read from storage is never imported.
        """
        info = decode_error(text)
        for tp in (*self.permanent, NotApplied):
            if names_type(info.type_name, tp):
                try:
                    return cast(BaseException, tp(*info.args))
                except Exception:
                    break
        return ReplayedFailure(info.type_name, info.message)


# The I/O a flow asks its driver for.


@dataclass(frozen=True, slots=True)
class Claim:
    """Claim the key. Answer: :class:`ClaimResult`."""


@dataclass(frozen=True, slots=True)
class Complete:
    """Record success. Answer: the record."""

    token: int
    result: str


@dataclass(frozen=True, slots=True)
class Fail:
    """Record a failed attempt. Answer: the record or None."""

    token: int
    disposition: Disposition
    error: str


@dataclass(frozen=True, slots=True)
class Probe:
    """Is the holder of a live claim dead on this host? Answer: bool (False when the store cannot
    take a claim over, so the flow waits)."""

    holder: str


@dataclass(frozen=True, slots=True)
class TakeOver:
    """Take over the live claim held under ``token`` by a dead holder. Answer: the record the
    caller now owns, or None when the record changed meanwhile."""

    token: int


@dataclass(frozen=True, slots=True)
class Sleep:
    """Wait before claiming again. Answer: None."""

    seconds: float


@dataclass(frozen=True, slots=True)
class Execute:
    """Run the effect body (with in-claim retries and heartbeats). Answer: :class:`Ran`."""

    token: int


@dataclass(frozen=True, slots=True)
class Reconcile:
    """Ask the effect's reconciler. Answer: a resolution; an exception counts as Unknown."""

    request: ReconcileRequest


class Ran(NamedTuple):
    """The outcome of :class:`Execute`: a value, or the exception the body raised."""

    value: Any = None
    error: BaseException | None = None


Op = Claim | Complete | Fail | Sleep | Execute | Reconcile | Probe | TakeOver

_CANCELLED_NOTE = json.dumps(
    {"type": "sagaguard.cancelled", "message": "the call was cancelled while claiming", "args": []}
)


def abandon(claim: ClaimResult) -> Fail | None:
    """The write that gives back a claim its caller will not use (cancelled while claiming). Pure.

    A fresh claim is deleted, since nothing ran; a taken-over record stays IN_DOUBT with its lease
    released, since the earlier attempt may have happened. Without this the claim looks like a
    crash once its lease runs out and an effect that never ran is reported in doubt. None when the
    claim gave the caller nothing to own.
    """
    record = claim.record
    if claim.outcome is ClaimOutcome.CLAIMED:
        return Fail(record.token, Disposition.RETRYABLE, _CANCELLED_NOTE)
    if claim.outcome is ClaimOutcome.TOOK_OVER:
        return Fail(record.token, Disposition.AMBIGUOUS, record.error or _CRASH_NOTE)
    return None


_WAIT_FIRST = 0.01
_WAIT_MAX = 0.5


class Flow(Generic[T]):
    """One guarded call, as a generator of I/O requests.

    ``outcome`` says what the call did once the generator has finished (for telemetry).
    """

    __slots__ = ("arguments", "fingerprint", "identity", "outcome", "spec")

    def __init__(
        self,
        spec: EffectSpec[T],
        identity: EffectIdentity,
        fingerprint: str,
        arguments: Mapping[str, Any],
    ) -> None:
        self.spec = spec
        self.identity = identity
        self.fingerprint = fingerprint
        self.arguments = arguments
        self.outcome = Outcome.EXECUTED

    def run(self) -> Generator[Op, Any, T]:
        """Claim, then execute, replay, wait, take over or resolve; returns the result or raises."""
        waited = 0.0
        delay = _WAIT_FIRST
        while True:
            claim: ClaimResult = yield Claim()
            action = decide(claim, self.fingerprint, self.identity.name)
            record = claim.record
            if action is Action.WAIT and record.holder is not None:
                # A live claim: one held by a process that died on this host is not waited for.
                dead = yield Probe(record.holder)
                action = decide(claim, self.fingerprint, self.identity.name, holder_dead=dead)
            if action is Action.TAKE_OVER:
                taken = yield TakeOver(record.token)
                if taken is not None:
                    return (yield from self._resolve(taken))
                continue  # taken over by another claimant, finished, or gone: claim again
            if action is Action.EXECUTE:
                return (yield from self._execute(record))
            if action is Action.RESOLVE:
                return (yield from self._resolve(record))
            if action is Action.REPLAY:
                return self._replay(record)
            if action is Action.REPLAY_FAILURE:
                self.outcome = Outcome.REPLAYED
                raise self.spec.rebuild_failure(record.error or "{}")
            if action is Action.CONFLICT:
                self.outcome = Outcome.CONFLICT
                raise KeyConflict(record.key, record.fingerprint, self.fingerprint)
            # WAIT: a live holder. Claiming again later replays its result once it finishes, or
            # takes the record over if the holder's lease runs out meanwhile.
            if waited >= self.spec.wait:
                self.outcome = Outcome.BUSY
                raise AlreadyInProgress(record)
            pause = min(delay, self.spec.wait - waited)
            yield Sleep(pause)
            waited += pause
            delay = min(delay * 2, _WAIT_MAX)

    def _replay(self, record: Record) -> T:
        """The result of a SUCCEEDED record (:attr:`Action.REPLAY`).

        Only decoded: the text was checked to read back as this type when it was recorded.

        Raises:
            CodecError: the record no longer reads back as the declared type.
        """
        self.outcome = Outcome.REPLAYED
        return self.spec.codec.decode(record.result or "null")

    def _execute(self, record: Record) -> Generator[Op, Any, T]:
        """Run the body under ``record``'s token and record what it did; returns the value or raises."""
        ran: Ran = yield Execute(record.token)
        token = record.token
        if ran.error is None:
            try:
                text = self.spec.codec.encode(ran.value)
            except CodecError as codec_error:
                # The effect happened but its result cannot be stored: leave the record in doubt
                # (a reconciler or an operator settles it) rather than lose the fact that it ran.
                yield from self._record_after(
                    record, Fail(token, Disposition.AMBIGUOUS, encode_error(codec_error)), ran
                )
                self.outcome = Outcome.IN_DOUBT
                raise
            yield from self._record_after(record, Complete(token, text), ran)
            return ran.value  # type: ignore[no-any-return]
        exc = ran.error
        disposition = self.spec.disposition(exc)
        yield from self._record_after(record, Fail(token, disposition, encode_error(exc)), ran)
        if disposition is Disposition.AMBIGUOUS:
            self.outcome = Outcome.IN_DOUBT
            if not isinstance(exc, Exception):
                # Cancellation and interrupts stay what they are once the doubt is recorded.
                raise exc
            raise OutcomeUnknown(record.evolve(state=State.IN_DOUBT), f"{type(exc).__name__}: {exc}") from exc
        self.outcome = Outcome.FAILED
        raise exc

    def _record_after(
        self, record: Record, write: Complete | Fail, ran: Ran | None
    ) -> Generator[Op, Any, Any]:
        """Ask for ``write``, a record of what happened after the body ran (or after a take-over);
        returns its answer.

        Raises:
            OutcomeNotRecorded: the store failed (:class:`StoreError`): the effect ran, or may have,
                and what it did is not recorded. Never the store's error itself, which from a
                guarded call means "not run". An interrupt or cancellation the body raised goes on
                as itself (the store's error as its context).
        """
        try:
            return (yield write)
        except StoreError as exc:
            raise self._not_recorded(record, exc, ran) from exc

    def _not_recorded(self, record: Record, exc: StoreError, ran: Ran | None) -> BaseException:
        """The error for a store that failed while recording after the body ran (see
        :meth:`_record_after`)."""
        self.outcome = Outcome.IN_DOUBT
        reason = f"the effect ran, but the store failed while recording its outcome: {exc}"
        if ran is None:
            return OutcomeNotRecorded(record, reason)
        if ran.error is None:
            return OutcomeNotRecorded(record, reason, has_result=True, result=ran.value)
        if not isinstance(ran.error, Exception):
            return ran.error
        return OutcomeNotRecorded(record, reason, error=ran.error)

    def _resolve(self, record: Record) -> Generator[Op, Any, T]:
        spec = self.spec
        reason = "the previous attempt's outcome is unknown"
        if spec.reconciler is not None:
            request = ReconcileRequest(self.identity, self.identity.provider_key, self.arguments, record)
            resolution: Resolution[Any] = yield Reconcile(request)
            if isinstance(resolution, Applied):
                found = Ran(resolution.result)  # the world says it happened: this is its result
                try:
                    text = spec.codec.encode(resolution.result)
                except CodecError:
                    # Still in doubt: release the lease so the next call resolves again at once.
                    release = Fail(record.token, Disposition.AMBIGUOUS, record.error or _CRASH_NOTE)
                    yield from self._record_after(record, release, None)
                    self.outcome = Outcome.IN_DOUBT
                    raise
                yield from self._record_after(record, Complete(record.token, text), found)
                self.outcome = Outcome.RECONCILED
                return resolution.result  # type: ignore[no-any-return]
            if isinstance(resolution, NotAppliedResolution):
                return (yield from self._execute(record))
            reason = "the reconciler could not tell whether it happened"
        resend = spec.provider_idempotent and spec.within_provider_window(record)
        if resend or spec.policy is Policy.AT_LEAST_ONCE:
            # Re-send: the provider deduplicates on the same provider key (still within its window),
            # or the effect said it is harmless to repeat.
            return (yield from self._execute(record))
        if spec.provider_idempotent:
            reason += "; the provider's deduplication window has passed, so it is not re-sent"
        # Release the lease and leave the record IN_DOUBT, for an operator or a later reconciler.
        yield from self._record_after(
            record, Fail(record.token, Disposition.AMBIGUOUS, record.error or _CRASH_NOTE), None
        )
        self.outcome = Outcome.IN_DOUBT
        raise OutcomeUnknown(record, reason)
