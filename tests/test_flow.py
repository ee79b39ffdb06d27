"""The guard's pure decisions (idempotency/flow.py), table-tested without a store.

``decide()`` is checked over every ClaimOutcome x State x fingerprint match against a table written
out by hand from docs/concepts.md; ``EffectSpec`` over every classification path; and the ``Flow``
generator is driven by hand, answering its I/O requests, so the wait schedule and the order of writes
are visible without any backend.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest
import tenacity

from sagaguard.idempotency.codec import Codec, encode_error
from sagaguard.idempotency.effect import NOT_APPLIED, Applied, Policy, ReconcileRequest, Retry, Unknown
from sagaguard.idempotency.errors import (
    AlreadyInProgress,
    CodecError,
    KeyConflict,
    NotApplied,
    OutcomeNotRecorded,
    OutcomeUnknown,
    ReplayedFailure,
    StoreError,
    StoreUnavailable,
)
from sagaguard.idempotency.flow import (
    Action,
    Claim,
    Complete,
    EffectSpec,
    Execute,
    Fail,
    Flow,
    Probe,
    Ran,
    Reconcile,
    Sleep,
    TakeOver,
    abandon,
    decide,
)
from sagaguard.idempotency.keys import EffectIdentity, fingerprint
from sagaguard.idempotency.records import ClaimOutcome, ClaimResult, Disposition, Record, State
from sagaguard.idempotency.telemetry import Outcome

FP = fingerprint({"amount": 1000})
OTHER_FP = fingerprint({"amount": 2000})
IDENTITY = EffectIdentity.of("tenant", "order-1", "pay.charge", 0)


def record(state: State = State.IN_PROGRESS, fp: str = FP, **changes: Any) -> Record:
    base = Record(
        key=IDENTITY.key,
        namespace=IDENTITY.namespace,
        scope=IDENTITY.scope,
        name=IDENTITY.name,
        ordinal=0,
        fingerprint=fp,
        state=state,
        token=1,
        lease_until=130.0,
        attempts=1,
        created_at=100.0,
        updated_at=100.0,
    )
    return base.evolve(**changes) if changes else base


# ------------------------------------------------------------------------------------- decide()

# Written out in full rather than computed, so the table is the specification.
# (outcome, state, fingerprint matches) -> action
DECISIONS: dict[tuple[ClaimOutcome, State, bool], Action] = {
    # A fresh claim is ours whatever came before (the store wrote the record with our fingerprint).
    (ClaimOutcome.CLAIMED, State.IN_PROGRESS, True): Action.EXECUTE,
    (ClaimOutcome.CLAIMED, State.IN_PROGRESS, False): Action.EXECUTE,
    (ClaimOutcome.CLAIMED, State.SUCCEEDED, True): Action.EXECUTE,
    (ClaimOutcome.CLAIMED, State.SUCCEEDED, False): Action.EXECUTE,
    (ClaimOutcome.CLAIMED, State.FAILED, True): Action.EXECUTE,
    (ClaimOutcome.CLAIMED, State.FAILED, False): Action.EXECUTE,
    (ClaimOutcome.CLAIMED, State.IN_DOUBT, True): Action.EXECUTE,
    (ClaimOutcome.CLAIMED, State.IN_DOUBT, False): Action.EXECUTE,
    # Took over a lapsed lease: resolve first, never run blindly; other arguments are a conflict.
    (ClaimOutcome.TOOK_OVER, State.IN_PROGRESS, True): Action.RESOLVE,
    (ClaimOutcome.TOOK_OVER, State.IN_PROGRESS, False): Action.CONFLICT,
    (ClaimOutcome.TOOK_OVER, State.SUCCEEDED, True): Action.RESOLVE,
    (ClaimOutcome.TOOK_OVER, State.SUCCEEDED, False): Action.CONFLICT,
    (ClaimOutcome.TOOK_OVER, State.FAILED, True): Action.RESOLVE,
    (ClaimOutcome.TOOK_OVER, State.FAILED, False): Action.CONFLICT,
    (ClaimOutcome.TOOK_OVER, State.IN_DOUBT, True): Action.RESOLVE,
    (ClaimOutcome.TOOK_OVER, State.IN_DOUBT, False): Action.CONFLICT,
    # Someone else's record.
    (ClaimOutcome.EXISTING, State.IN_PROGRESS, True): Action.WAIT,
    (ClaimOutcome.EXISTING, State.IN_PROGRESS, False): Action.CONFLICT,
    (ClaimOutcome.EXISTING, State.SUCCEEDED, True): Action.REPLAY,
    (ClaimOutcome.EXISTING, State.SUCCEEDED, False): Action.CONFLICT,
    (ClaimOutcome.EXISTING, State.FAILED, True): Action.REPLAY_FAILURE,
    (ClaimOutcome.EXISTING, State.FAILED, False): Action.CONFLICT,
    (ClaimOutcome.EXISTING, State.IN_DOUBT, True): Action.WAIT,  # another worker is resolving it
    (ClaimOutcome.EXISTING, State.IN_DOUBT, False): Action.CONFLICT,
}


def test_decision_table_covers_every_combination() -> None:
    assert set(DECISIONS) == set(itertools.product(ClaimOutcome, State, (True, False)))


@pytest.mark.parametrize(
    ("outcome", "state", "matches"),
    sorted(DECISIONS, key=str),
    ids=lambda v: str(v) if not isinstance(v, bool) else ("same-fp" if v else "other-fp"),
)
def test_decide(outcome: ClaimOutcome, state: State, matches: bool) -> None:
    claim = ClaimResult(outcome, record(state, FP if matches else OTHER_FP))
    assert decide(claim, FP) is DECISIONS[(outcome, state, matches)]


def test_decide_is_pure() -> None:
    claim = ClaimResult(ClaimOutcome.EXISTING, record(State.SUCCEEDED))
    assert [decide(claim, FP) for _ in range(3)] == [Action.REPLAY] * 3
    assert claim.record == record(State.SUCCEEDED)


# ------------------------------------------------------------------------------------ EffectSpec


class Declined(Exception):
    """A permanent provider error with two arguments."""


class RateLimited(Exception):
    """A retryable provider error."""


class SubDeclined(Declined):
    pass


class NeedsKeyword(Exception):
    def __init__(self, *, code: int) -> None:
        super().__init__(f"code {code}")
        self.code = code


def spec(**changes: Any) -> EffectSpec[Any]:
    values: dict[str, Any] = {
        "name": "pay.charge",
        "codec": Codec(int),
        "policy": Policy.AT_MOST_ONCE,
        "provider_idempotent": False,
        "reconciler": None,
        "classifier": None,
        "permanent": (Declined,),
        "retryable": (RateLimited,),
        "retry": Retry(stop=tenacity.stop_after_attempt(1), wait=tenacity.wait_none()),
        "lease": 30.0,
        "retention": 3600.0,
        "wait": 1.0,
    }
    values.update(changes)
    return EffectSpec(**values)


P, R, A = Disposition.PERMANENT, Disposition.RETRYABLE, Disposition.AMBIGUOUS


def _to_permanent(exc: BaseException) -> Disposition | None:
    return P if isinstance(exc, KeyError) else None


def _everything_retryable(exc: BaseException) -> Disposition | None:
    return R


@pytest.mark.parametrize(
    ("exc", "classifier", "expected"),
    [
        (Declined("no"), None, P),
        (SubDeclined("no"), None, P),  # subclasses of a listed type count
        (RateLimited(), None, R),
        (NotApplied("refused"), None, P),  # NotApplied defaults to permanent
        (NotApplied("later", retryable=True), None, R),
        (TimeoutError("read timed out"), None, A),  # the classic ambiguous error
        (ConnectionResetError(), None, A),
        (RuntimeError("boom"), None, A),  # unknown exceptions may have reached the world
        (KeyError("k"), None, A),
        (KeyError("k"), _to_permanent, P),  # the classifier answers first
        (RuntimeError("boom"), _to_permanent, A),  # classifier returns None: fall through
        (Declined("no"), _everything_retryable, R),  # the classifier beats the type lists
        (TimeoutError(), _everything_retryable, R),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, BaseException) else getattr(v, "__name__", str(v)),
)
def test_disposition(exc: BaseException, classifier: Any, expected: Disposition) -> None:
    assert spec(classifier=classifier).disposition(exc) is expected


def test_permanent_list_wins_over_retryable_list() -> None:
    both = spec(permanent=(Declined,), retryable=(Declined,))
    assert both.disposition(Declined()) is P


def test_permanent_list_wins_over_not_applied_flag() -> None:
    class Refused(NotApplied):
        pass

    assert spec(retryable=(Refused,)).disposition(Refused("x")) is R
    assert spec(permanent=(Refused,)).disposition(Refused("x", retryable=True)) is P


@pytest.mark.parametrize(
    ("exc", "provider_idempotent", "retried"),
    [
        (RateLimited(), False, True),
        (RateLimited(), True, True),
        (NotApplied("later", retryable=True), False, True),
        (Declined(), False, False),
        (Declined(), True, False),  # permanent is never retried
        (NotApplied("never"), True, False),
        (TimeoutError(), False, False),  # ambiguous: a re-send could apply twice
        (TimeoutError(), True, True),  # ...unless the provider deduplicates on the provider key
        (RuntimeError(), True, True),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, BaseException) else str(v),
)
def test_retries(exc: BaseException, provider_idempotent: bool, retried: bool) -> None:
    assert spec(provider_idempotent=provider_idempotent).retries(exc) is retried


def test_rebuild_failure_rebuilds_declared_permanent_type_with_its_args() -> None:
    rebuilt = spec().rebuild_failure(encode_error(Declined("card declined", 42)))
    assert type(rebuilt) is Declined
    assert rebuilt.args == ("card declined", 42)


def test_rebuild_failure_rebuilds_not_applied() -> None:
    rebuilt = spec(permanent=()).rebuild_failure(encode_error(NotApplied("invalid amount")))
    assert type(rebuilt) is NotApplied
    assert rebuilt.args == ("invalid amount",)


def test_rebuild_failure_of_unregistered_type_is_replayed_failure() -> None:
    rebuilt = spec(permanent=()).rebuild_failure(encode_error(Declined("card declined", 42)))
    assert isinstance(rebuilt, ReplayedFailure)
    assert rebuilt.type_name == f"{Declined.__module__}.Declined"
    assert rebuilt.message == "('card declined', 42)"


def test_rebuild_failure_matches_the_exact_type_not_a_base() -> None:
    # SubDeclined was recorded; only Declined is declared: no guessing, no import.
    rebuilt = spec().rebuild_failure(encode_error(SubDeclined("x")))
    assert isinstance(rebuilt, ReplayedFailure)
    assert rebuilt.type_name.endswith("SubDeclined")


def test_rebuild_failure_never_imports_a_type_named_in_storage() -> None:
    forged = json.dumps({"type": "os.system", "message": "rm -rf /", "args": ["rm -rf /"]})
    rebuilt = spec().rebuild_failure(forged)
    assert isinstance(rebuilt, ReplayedFailure)
    assert rebuilt.type_name == "os.system"


def test_rebuild_failure_with_unbuildable_args_is_replayed_failure() -> None:
    rebuilt = spec(permanent=(NeedsKeyword,)).rebuild_failure(encode_error(NeedsKeyword(code=7)))
    assert isinstance(rebuilt, ReplayedFailure)
    assert rebuilt.message == "code 7"


def test_rebuild_failure_of_unreadable_text_is_codec_error() -> None:
    with pytest.raises(CodecError):
        spec().rebuild_failure("not json")


# ---------------------------------------------------------------------- Flow, driven by hand


class Driver:
    """Answers a flow's requests from a script of answers and records every request."""

    def __init__(self, flow: Flow[Any]) -> None:
        self.flow = flow
        self.gen = flow.run()
        self.ops: list[Any] = []

    def start(self) -> Any:
        op = next(self.gen)
        self.ops.append(op)
        return op

    def send(self, answer: Any) -> Any:
        op = self.gen.send(answer)
        self.ops.append(op)
        return op

    def finish(self, answer: Any) -> Any:
        """Send the last answer; returns the flow's return value."""
        with pytest.raises(StopIteration) as stop:
            self.gen.send(answer)
        return stop.value.value


def flow(**changes: Any) -> Flow[Any]:
    return Flow(spec(**changes), IDENTITY, FP, {"amount": 1000})


def test_flow_claimed_then_executed_then_completed() -> None:
    d = Driver(flow())
    assert d.start() == Claim()
    assert d.send(ClaimResult(ClaimOutcome.CLAIMED, record())) == Execute(1)
    assert d.send(Ran(7)) == Complete(1, "7")
    assert d.finish(record(State.SUCCEEDED, result="7")) == 7
    assert d.flow.outcome is Outcome.EXECUTED


def test_flow_replays_success_without_executing() -> None:
    d = Driver(flow())
    d.start()
    assert d.finish(ClaimResult(ClaimOutcome.EXISTING, record(State.SUCCEEDED, result="5"))) == 5
    assert d.flow.outcome is Outcome.REPLAYED
    assert not any(isinstance(op, Execute) for op in d.ops)


def test_flow_conflict() -> None:
    d = Driver(flow())
    d.start()
    with pytest.raises(KeyConflict) as info:
        d.send(ClaimResult(ClaimOutcome.EXISTING, record(State.SUCCEEDED, fp=OTHER_FP, result="5")))
    assert (info.value.recorded_fingerprint, info.value.fingerprint) == (OTHER_FP, FP)
    assert d.flow.outcome is Outcome.CONFLICT


def test_flow_wait_schedule_is_bounded_by_wait() -> None:
    d = Driver(flow(wait=1.0))
    d.start()
    busy = ClaimResult(ClaimOutcome.EXISTING, record(State.IN_PROGRESS))
    pauses: list[float] = []
    with pytest.raises(AlreadyInProgress):
        while True:
            op = d.send(busy)
            assert isinstance(op, Sleep)
            pauses.append(op.seconds)
            assert d.send(None) == Claim()
    assert pauses[:4] == pytest.approx([0.01, 0.02, 0.04, 0.08])
    assert max(pauses) <= 0.5
    assert sum(pauses) == pytest.approx(1.0)
    assert d.flow.outcome is Outcome.BUSY


def test_flow_zero_wait_raises_at_once() -> None:
    d = Driver(flow(wait=0.0))
    d.start()
    with pytest.raises(AlreadyInProgress):
        d.send(ClaimResult(ClaimOutcome.EXISTING, record(State.IN_PROGRESS)))


def test_flow_ambiguous_error_records_in_doubt_then_raises_outcome_unknown() -> None:
    d = Driver(flow())
    d.start()
    d.send(ClaimResult(ClaimOutcome.CLAIMED, record()))
    err = TimeoutError("read timed out")
    fail = d.send(Ran(error=err))
    assert isinstance(fail, Fail) and fail.disposition is Disposition.AMBIGUOUS and fail.token == 1
    with pytest.raises(OutcomeUnknown) as info:
        d.send(record(State.IN_DOUBT))
    assert info.value.__cause__ is err
    assert info.value.record.state is State.IN_DOUBT
    assert d.flow.outcome is Outcome.IN_DOUBT


def test_flow_resolve_order_reconciler_first() -> None:
    d = Driver(flow(reconciler=lambda r: None, policy=Policy.AT_LEAST_ONCE, provider_idempotent=True))
    d.start()
    taken = record(State.IN_DOUBT, token=2)
    op = d.send(ClaimResult(ClaimOutcome.TOOK_OVER, taken))
    assert isinstance(op, Reconcile)
    assert isinstance(op.request, ReconcileRequest)
    assert op.request.provider_key == IDENTITY.provider_key
    assert op.request.record == taken
    assert d.send(Applied(9)) == Complete(2, "9")
    assert d.finish(None) == 9
    assert d.flow.outcome is Outcome.RECONCILED


@pytest.mark.parametrize(
    ("changes", "answer", "next_op"),
    [
        ({"reconciler": lambda r: None}, NOT_APPLIED, Execute(2)),
        ({"reconciler": lambda r: None, "provider_idempotent": True}, Unknown(), Execute(2)),
        ({"reconciler": lambda r: None, "policy": Policy.AT_LEAST_ONCE}, Unknown(), Execute(2)),
        ({"provider_idempotent": True}, None, Execute(2)),
        ({"policy": Policy.AT_LEAST_ONCE}, None, Execute(2)),
    ],
    ids=["not-applied", "unknown+provider-key", "unknown+at-least-once", "provider-key", "at-least-once"],
)
def test_flow_resolve_runs_again_under_the_new_token(
    changes: dict[str, Any], answer: Any, next_op: Any
) -> None:
    d = Driver(flow(**changes))
    d.start()
    op = d.send(ClaimResult(ClaimOutcome.TOOK_OVER, record(State.IN_DOUBT, token=2)))
    if answer is not None:
        assert isinstance(op, Reconcile)
        op = d.send(answer)
    assert op == next_op


@pytest.mark.parametrize(
    ("age", "resent"), [(0.0, True), (86_399.0, True), (86_400.0, False), (3 * 86_400.0, False)]
)
def test_flow_resolve_resends_under_the_provider_key_only_within_its_window(age: float, resent: bool) -> None:
    d = Driver(flow(provider_idempotent=True, provider_window=86_400.0))
    d.start()
    taken = record(State.IN_DOUBT, token=2)
    taken = taken.evolve(updated_at=taken.created_at + age)
    op = d.send(ClaimResult(ClaimOutcome.TOOK_OVER, taken))
    if resent:
        assert op == Execute(2)
        return
    assert isinstance(op, Fail) and op.disposition is Disposition.AMBIGUOUS
    with pytest.raises(OutcomeUnknown, match="window"):
        d.send(taken.evolve(lease_until=0.0))


def test_flow_past_the_provider_window_at_least_once_still_runs_again() -> None:
    d = Driver(flow(provider_idempotent=True, provider_window=60.0, policy=Policy.AT_LEAST_ONCE))
    d.start()
    taken = record(State.IN_DOUBT, token=2)
    op = d.send(ClaimResult(ClaimOutcome.TOOK_OVER, taken.evolve(updated_at=taken.created_at + 3600)))
    assert op == Execute(2)


@pytest.mark.parametrize("reconciler", [None, lambda r: None], ids=["no-reconciler", "unknown"])
def test_flow_resolve_unknown_at_most_once_releases_and_raises(reconciler: Any) -> None:
    d = Driver(flow(reconciler=reconciler))
    d.start()
    op = d.send(ClaimResult(ClaimOutcome.TOOK_OVER, record(State.IN_DOUBT, token=2)))
    if reconciler is not None:
        op = d.send(Unknown())
    assert isinstance(op, Fail)
    assert (op.token, op.disposition) == (2, Disposition.AMBIGUOUS)
    assert json.loads(op.error)["type"] == "sagaguard.crash"  # no error was recorded: a crash
    with pytest.raises(OutcomeUnknown):
        d.send(record(State.IN_DOUBT, token=2, lease_until=0.0))
    assert d.flow.outcome is Outcome.IN_DOUBT


def test_flow_resolve_keeps_the_recorded_error() -> None:
    recorded = encode_error(TimeoutError("read timed out"))
    d = Driver(flow())
    d.start()
    op = d.send(ClaimResult(ClaimOutcome.TOOK_OVER, record(State.IN_DOUBT, token=2, error=recorded)))
    assert isinstance(op, Fail) and op.error == recorded


def test_flow_permanent_error_records_failed_and_raises_it() -> None:
    d = Driver(flow())
    d.start()
    d.send(ClaimResult(ClaimOutcome.CLAIMED, record()))
    err = Declined("card declined")
    fail = d.send(Ran(error=err))
    assert isinstance(fail, Fail) and fail.disposition is Disposition.PERMANENT
    with pytest.raises(Declined) as info:
        d.send(record(State.FAILED))
    assert info.value is err
    assert d.flow.outcome is Outcome.FAILED


def test_flow_unencodable_result_is_left_in_doubt() -> None:
    d = Driver(flow(codec=Codec(Any)))
    d.start()
    d.send(ClaimResult(ClaimOutcome.CLAIMED, record()))
    fail = d.send(Ran(object()))  # the effect happened; its result cannot be stored
    assert isinstance(fail, Fail) and fail.disposition is Disposition.AMBIGUOUS
    assert json.loads(fail.error)["type"] == "sagaguard.idempotency.errors.CodecError"
    with pytest.raises(CodecError):
        d.send(record(State.IN_DOUBT))
    assert d.flow.outcome is Outcome.IN_DOUBT


@pytest.mark.parametrize(
    ("outcome", "state", "expected"),
    [
        (ClaimOutcome.CLAIMED, State.IN_PROGRESS, Action.EXECUTE),
        (ClaimOutcome.TOOK_OVER, State.IN_DOUBT, Action.CONFLICT),
        (ClaimOutcome.EXISTING, State.SUCCEEDED, Action.CONFLICT),
        (ClaimOutcome.EXISTING, State.FAILED, Action.CONFLICT),
        (ClaimOutcome.EXISTING, State.IN_PROGRESS, Action.CONFLICT),
    ],
)
def test_decide_record_of_another_effect_is_a_conflict(
    outcome: ClaimOutcome, state: State, expected: Action
) -> None:
    """One explicit key shared by two effects: never replay one effect's result as the other's."""
    claim = ClaimResult(outcome, record(state))  # written by "pay.charge", same fingerprint
    assert decide(claim, FP, "mail.receipt") is expected
    assert decide(claim, FP, "pay.charge") is DECISIONS[(outcome, state, True)]


def test_abandon_gives_back_a_claim_the_cancelled_caller_will_not_use() -> None:
    fresh = abandon(ClaimResult(ClaimOutcome.CLAIMED, record(token=4)))
    assert fresh is not None
    assert (fresh.token, fresh.disposition) == (4, Disposition.RETRYABLE)  # nothing ran: delete
    recorded = encode_error(TimeoutError("read timed out"))
    taken = abandon(ClaimResult(ClaimOutcome.TOOK_OVER, record(State.IN_DOUBT, token=5, error=recorded)))
    assert taken == Fail(5, Disposition.AMBIGUOUS, recorded)  # may have happened: stays in doubt
    crashed = abandon(ClaimResult(ClaimOutcome.TOOK_OVER, record(State.IN_DOUBT, token=5)))
    assert crashed is not None
    assert json.loads(crashed.error)["type"] == "sagaguard.crash"
    for state in State:
        assert abandon(ClaimResult(ClaimOutcome.EXISTING, record(state))) is None


def test_flow_reconciled_result_that_cannot_be_stored_releases_the_lease() -> None:
    d = Driver(flow(codec=Codec(Any), reconciler=lambda r: None))
    d.start()
    d.send(ClaimResult(ClaimOutcome.TOOK_OVER, record(State.IN_DOUBT, token=2)))
    op = d.send(Applied(object()))
    assert isinstance(op, Fail)
    assert (op.token, op.disposition) == (2, Disposition.AMBIGUOUS)
    with pytest.raises(CodecError):
        d.send(record(State.IN_DOUBT, token=2, lease_until=0.0))
    assert d.flow.outcome is Outcome.IN_DOUBT


# --------------------------------------------------------------------------- a dead holder's claim

DEAD = "boot/4026531836|4242|99"


@pytest.mark.parametrize(("outcome", "state", "matches"), sorted(DECISIONS, key=str))
def test_decide_with_the_holder_dead_takes_over_only_what_it_would_wait_for(
    outcome: ClaimOutcome, state: State, matches: bool
) -> None:
    claim = ClaimResult(outcome, record(state, FP if matches else OTHER_FP, holder=DEAD))
    alive = DECISIONS[(outcome, state, matches)]
    assert decide(claim, FP, holder_dead=False) is alive
    assert decide(claim, FP, holder_dead=True) is (Action.TAKE_OVER if alive is Action.WAIT else alive)


@pytest.mark.parametrize("state", [State.IN_PROGRESS, State.IN_DOUBT])
def test_flow_takes_over_a_dead_holders_live_claim_at_once(state: State) -> None:
    d = Driver(flow(provider_idempotent=True))
    d.start()
    assert d.send(ClaimResult(ClaimOutcome.EXISTING, record(state, holder=DEAD))) == Probe(DEAD)
    assert d.send(True) == TakeOver(1)
    taken = record(State.IN_DOUBT, token=2, attempts=2, holder="me|1|1")
    assert d.send(taken) == Execute(2)  # resolved as any take-over: here, re-sent under its key
    assert d.send(Ran(7)) == Complete(2, "7")
    assert d.finish(record(State.SUCCEEDED, token=2, result="7")) == 7
    assert not any(isinstance(op, Sleep) for op in d.ops)


def test_flow_take_over_of_a_dead_holder_is_resolved_by_the_policy() -> None:
    d = Driver(flow())  # at most once, no reconciler: the record stays in doubt for an operator
    d.start()
    d.send(ClaimResult(ClaimOutcome.EXISTING, record(holder=DEAD)))
    d.send(True)
    fail = d.send(record(State.IN_DOUBT, token=2, attempts=2))
    assert isinstance(fail, Fail) and (fail.token, fail.disposition) == (2, Disposition.AMBIGUOUS)
    with pytest.raises(OutcomeUnknown):
        d.send(record(State.IN_DOUBT, token=2, lease_until=0.0))
    assert d.flow.outcome is Outcome.IN_DOUBT


def test_flow_waits_for_a_live_holder() -> None:
    d = Driver(flow())
    d.start()
    assert d.send(ClaimResult(ClaimOutcome.EXISTING, record(holder=DEAD))) == Probe(DEAD)
    assert isinstance(d.send(False), Sleep)


def test_flow_claims_again_at_once_when_another_claimant_took_over_first() -> None:
    d = Driver(flow())
    d.start()
    d.send(ClaimResult(ClaimOutcome.EXISTING, record(holder=DEAD)))
    assert d.send(True) == TakeOver(1)
    assert d.send(None) == Claim()  # no sleep: the record changed, look at it again
    assert d.finish(ClaimResult(ClaimOutcome.EXISTING, record(State.SUCCEEDED, result="5"))) == 5


def test_flow_without_a_holder_waits_without_probing() -> None:
    d = Driver(flow())
    d.start()
    assert isinstance(d.send(ClaimResult(ClaimOutcome.EXISTING, record())), Sleep)


def test_flow_with_zero_wait_still_takes_over_a_dead_holder() -> None:
    d = Driver(flow(wait=0.0, provider_idempotent=True))
    d.start()
    d.send(ClaimResult(ClaimOutcome.EXISTING, record(holder=DEAD)))
    assert d.send(True) == TakeOver(1)


# ------------------------------------------------------------------- a store lost after the body ran


def test_flow_store_failing_to_record_a_success_is_outcome_not_recorded() -> None:
    d = Driver(flow())
    d.start()
    d.send(ClaimResult(ClaimOutcome.CLAIMED, record()))
    assert d.send(Ran(7)) == Complete(1, "7")
    down = StoreUnavailable("gone")
    with pytest.raises(OutcomeNotRecorded) as info:
        d.gen.throw(down)
    assert info.value.__cause__ is down
    assert (info.value.has_result, info.value.result, info.value.error) == (True, 7, None)
    assert d.flow.outcome is Outcome.IN_DOUBT


def test_flow_store_failing_to_record_a_failure_is_outcome_not_recorded() -> None:
    d = Driver(flow())
    d.start()
    d.send(ClaimResult(ClaimOutcome.CLAIMED, record()))
    err = TimeoutError("no answer")
    assert isinstance(d.send(Ran(error=err)), Fail)
    with pytest.raises(OutcomeNotRecorded) as info:
        d.gen.throw(StoreError("disk full"))
    assert (info.value.has_result, info.value.error) == (False, err)


def test_flow_store_failing_to_record_a_reconciled_result_is_outcome_not_recorded() -> None:
    d = Driver(flow(reconciler=lambda request: Applied(9)))
    d.start()
    d.send(ClaimResult(ClaimOutcome.TOOK_OVER, record(State.IN_DOUBT, token=2)))
    assert d.send(Applied(9)) == Complete(2, "9")
    with pytest.raises(OutcomeNotRecorded) as info:
        d.gen.throw(StoreUnavailable("gone"))
    assert (info.value.has_result, info.value.result) == (True, 9)


def test_flow_store_failing_to_claim_stays_store_unavailable() -> None:
    d = Driver(flow())
    d.start()
    with pytest.raises(StoreUnavailable):
        d.gen.throw(StoreUnavailable("gone"))
