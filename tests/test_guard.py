"""The guard (idempotency/guard.py) with sync effects, against every backend.

Every test that takes ``store`` (or ``store_factory``) runs on memory, SQLite, Postgres and Redis
(see conftest.py). Time is the injected ``clock``; waits and retries go through an injected sleep that
records the pause and advances the clock, so nothing really sleeps except the real-race tests at the
end. Every effect body counts its calls, so "ran once", "replayed" and "never ran" are assertions.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from decimal import Decimal
from typing import Any

import pytest
import tenacity
from _guardutil import (
    LEASE,
    NAMESPACE,
    RETENTION,
    Calls,
    Declined,
    Invoice,
    Line,
    Plain,
    RateLimited,
    Receipt,
    Sleeper,
    TcpProxy,
    all_records,
    explicit,
    forbidden_async_sleep,
    fp,
    identity,
    race_effect_in_processes,
    span_exporter,
)
from conftest import FakeClock, StoreFactory, closed_port, require_postgres, require_redis

from sagaguard.idempotency import (
    NOT_APPLIED,
    AlreadyInProgress,
    Applied,
    ClaimOutcome,
    CodecError,
    ConfigurationError,
    Guard,
    KeyConflict,
    LostOwnership,
    NoScope,
    NotApplied,
    OutcomeUnknown,
    ReconcileRequest,
    ReplayedFailure,
    Retry,
    State,
    StoreUnavailable,
    Unknown,
    current_effect,
    scope,
)
from sagaguard.idempotency.heartbeat import Heartbeater
from sagaguard.idempotency.keys import provider_key
from sagaguard.idempotency.store import IdempotencyStore
from sagaguard.idempotency.telemetry import TOOL_CALL_ID, error_type

WAIT = 2.0
ONE_TRY = Retry(stop=tenacity.stop_after_attempt(1), wait=tenacity.wait_none())


@pytest.fixture
def sleeps(clock: FakeClock) -> Sleeper:
    return Sleeper(clock)


@pytest.fixture
def guard(store: IdempotencyStore, sleeps: Sleeper) -> Iterator[Guard]:
    g = Guard(
        store,
        lease=LEASE,
        retention=RETENTION,
        wait=WAIT,
        sleep=sleeps,
        async_sleep=forbidden_async_sleep,
    )
    yield g
    g.close()


def state_of(store: IdempotencyStore, key: str) -> State | None:
    rec = store.get(key)
    return None if rec is None else State(rec.state)


# ------------------------------------------------------------------------- run once, replay


def test_first_call_executes_and_rerun_replays_a_dataclass(guard: Guard, store: IdempotencyStore) -> None:
    calls = Calls()

    @guard.effect("pay.charge")
    def charge(customer: str, amount: int) -> Receipt:
        n = calls.hit()
        return Receipt(f"ch_{n}", amount, customer)

    with scope("order-1"):
        first = charge("cus_1", 500)
    with scope("order-1"):  # the framework re-runs the unit from its start
        again = charge("cus_1", 500)

    assert calls.n == 1
    assert first == Receipt("ch_1", 500, "cus_1")
    assert type(again) is Receipt
    assert again == first
    rec = store.get(identity("order-1", "pay.charge").key)
    assert rec is not None
    assert rec.state == State.SUCCEEDED
    assert (rec.namespace, rec.scope, rec.name, rec.ordinal) == (NAMESPACE, "order-1", "pay.charge", 0)
    assert rec.fingerprint == fp(customer="cus_1", amount=500)
    assert rec.result is not None
    assert json.loads(rec.result) == {"id": "ch_1", "amount": 500, "customer": "cus_1"}


def test_pydantic_result_replays_as_its_type(guard: Guard) -> None:
    calls = Calls()

    @guard.effect("billing.invoice")
    def invoice(number: str) -> Invoice:
        calls.hit()
        return Invoice(number=number, total=Decimal("12.50"), lines=[Line(sku="a", quantity=2)])

    with scope("order-1"):
        first = invoice("INV-1")
    with scope("order-1"):
        again = invoice("INV-1")
    assert calls.n == 1
    assert type(again) is Invoice
    assert type(again.lines[0]) is Line
    assert again == first
    assert again.total == Decimal("12.50")


def test_run_replays_with_explicit_result_type(guard: Guard) -> None:
    calls = Calls()

    def send() -> list[Receipt]:
        calls.hit()
        return [Receipt("ch_1", 1, "a"), Receipt("ch_2", 2, "b")]

    for _ in range(2):
        with scope("batch-1"):
            got = guard.run("pay.batch", send, arguments={"n": 2}, result_type=list[Receipt])
        assert got == [Receipt("ch_1", 1, "a"), Receipt("ch_2", 2, "b")]
        assert all(type(r) is Receipt for r in got)
    assert calls.n == 1


def test_default_name_is_the_qualified_function_name(guard: Guard, store: IdempotencyStore) -> None:
    @guard.effect()
    def notify(user: str) -> None:
        return None

    with scope("s"):
        assert notify("u1") is None
    name = f"{notify.__module__}.{notify.__qualname__}"
    assert state_of(store, identity("s", name).key) == State.SUCCEEDED


def test_wrapped_function_keeps_its_metadata(guard: Guard) -> None:
    @guard.effect("pay.charge")
    def charge(customer: str, amount: int) -> int:
        """Charge a customer."""
        return amount

    assert charge.__name__ == "charge"
    assert charge.__doc__ == "Charge a customer."


def test_ordinals_distinguish_calls_of_one_name_in_a_scope(guard: Guard, store: IdempotencyStore) -> None:
    calls = Calls()

    @guard.effect("mail.send")
    def send(to: str) -> int:
        return calls.hit()

    def unit() -> list[int]:
        with scope("job-7"):
            return [send("a@example.com"), send("a@example.com"), send("a@example.com")]

    assert unit() == [1, 2, 3]
    assert unit() == [1, 2, 3]  # each call replays its own record, in order
    assert calls.n == 3
    keys = [identity("job-7", "mail.send", i).key for i in range(3)]
    assert len(set(keys)) == 3
    assert [state_of(store, k) for k in keys] == [State.SUCCEEDED] * 3


def test_ordinals_count_per_name(guard: Guard) -> None:
    calls = Calls()

    @guard.effect("a")
    def a() -> int:
        return calls.hit()

    @guard.effect("b")
    def b() -> int:
        return calls.hit()

    with scope("s"):
        first = [a(), b(), a()]
    with scope("s"):
        second = [a(), b(), a()]
    assert first == second == [1, 2, 3]
    assert calls.n == 3


def test_different_scopes_are_different_effects(guard: Guard) -> None:
    calls = Calls()

    @guard.effect("mail.send")
    def send(to: str) -> int:
        return calls.hit()

    with scope("order-1"):
        assert send("x") == 1
    with scope("order-2"):
        assert send("x") == 2
    with scope("order-1"):
        assert send("x") == 1
    assert calls.n == 2


def test_decorator_key_wins_over_scope(guard: Guard, store: IdempotencyStore) -> None:
    calls = Calls()

    @guard.effect("pay.refund", key=lambda order_id, amount: f"refund:{order_id}")
    def refund(order_id: str, amount: int) -> int:
        return calls.hit()

    with scope("attempt-1"):
        assert refund("o1", 5) == 1
    with scope("attempt-2"):  # another scope, same key: the same effect
        assert refund("o1", 5) == 1
    assert refund("o1", 5) == 1  # no scope needed with a key
    assert refund("o2", 5) == 2
    assert calls.n == 2
    assert state_of(store, explicit("refund:o1", "pay.refund").key) == State.SUCCEEDED
    assert store.get(identity("attempt-1", "pay.refund").key) is None


def test_run_key_wins_over_scope(guard: Guard, store: IdempotencyStore) -> None:
    calls = Calls()

    def run() -> int:
        return guard.run("pay.refund", calls.hit, key="refund-42", arguments={"amount": 5}, result_type=int)

    assert run() == 1
    with scope("some-scope"):
        assert run() == 1
    assert calls.n == 1
    assert state_of(store, explicit("refund-42", "pay.refund").key) == State.SUCCEEDED


def test_explicit_key_used_by_two_effect_names_never_replays_the_other(guard: Guard) -> None:
    """One order id as the key of two effects: the second must not get the first one's result."""
    charged, mailed = Calls(), Calls()

    @guard.effect("pay.charge", key=lambda order_id: order_id)
    def charge(order_id: str) -> str:
        charged.hit()
        return "charged"

    @guard.effect("mail.receipt", key=lambda order_id: order_id)
    def mail(order_id: str) -> str:
        mailed.hit()
        return "mailed"

    assert charge("order-42") == "charged"
    try:
        result: str | None = mail("order-42")
    except KeyConflict:
        result = None  # refused loudly: acceptable
    assert result != "charged"
    assert charged.n == 1


def test_namespaces_do_not_replay_each_other(store: IdempotencyStore, sleeps: Sleeper) -> None:
    calls = Calls()
    guards = [Guard(store, namespace=ns, lease=LEASE, sleep=sleeps) for ns in ("tenant-a", "tenant-b")]
    try:
        effects = []
        for g in guards:

            @g.effect("pay.charge")
            def charge(amount: int) -> int:
                return calls.hit()

            effects.append(charge)
        for _ in range(2):
            with scope("order-1"):
                assert [e(5) for e in effects] == [1, 2]
        assert [g.run("x", calls.hit, key="k", result_type=int) for g in guards] == [3, 4]
        assert [g.run("x", calls.hit, key="k", result_type=int) for g in guards] == [3, 4]
        assert calls.n == 4
        a = identity("order-1", "pay.charge", namespace="tenant-a")
        b = identity("order-1", "pay.charge", namespace="tenant-b")
        assert a.key != b.key
        assert {r.namespace for r in all_records(store)} == {"tenant-a", "tenant-b"}
    finally:
        for g in guards:
            g.close()


def test_finished_record_past_retention_runs_again(
    guard: Guard, store: IdempotencyStore, clock: FakeClock
) -> None:
    calls = Calls()

    @guard.effect("mail.digest", retention=100.0)
    def digest() -> int:
        return calls.hit()

    with scope("s"):
        assert digest() == 1
    clock.advance(99)
    with scope("s"):
        assert digest() == 1
    clock.advance(2)
    with scope("s"):
        assert digest() == 2
    assert calls.n == 2


# ------------------------------------------------------------------------------ fingerprints


def test_same_identity_other_arguments_is_key_conflict(guard: Guard, store: IdempotencyStore) -> None:
    calls = Calls()

    @guard.effect("pay.charge")
    def charge(customer: str, amount: int) -> int:
        calls.hit()
        return amount

    with scope("order-1"):
        charge("cus_1", 500)
    key = identity("order-1", "pay.charge").key
    before = store.get(key)
    with scope("order-1"), pytest.raises(KeyConflict) as info:
        charge("cus_1", 999)
    assert calls.n == 1
    assert info.value.key == key
    assert info.value.recorded_fingerprint == fp(customer="cus_1", amount=500)
    assert info.value.fingerprint == fp(customer="cus_1", amount=999)
    assert store.get(key) == before
    with scope("order-1"):  # the right arguments still replay
        assert charge("cus_1", 500) == 500
    assert calls.n == 1


def test_run_key_conflict(guard: Guard) -> None:
    calls = Calls()
    guard.run("pay.refund", calls.hit, key="r-1", arguments={"amount": 5}, result_type=int)
    with pytest.raises(KeyConflict):
        guard.run("pay.refund", calls.hit, key="r-1", arguments={"amount": 6}, result_type=int)
    assert calls.n == 1


def test_keyword_and_positional_calls_have_one_fingerprint(guard: Guard) -> None:
    calls = Calls()

    @guard.effect("pay.charge")
    def charge(customer: str, amount: int, currency: str = "eur") -> int:
        return calls.hit()

    with scope("s"):
        charge("cus_1", 5)
    with scope("s"):
        assert charge(amount=5, customer="cus_1", currency="eur") == 1
    assert calls.n == 1


def _lower_customer(arguments: Any) -> dict[str, Any]:
    return {"customer": arguments["customer"].lower()}


@pytest.mark.parametrize(
    ("option", "second", "conflict"),
    [
        (None, ("cus_1", 999), True),
        (True, ("cus_1", 999), True),
        (["customer"], ("cus_1", 999), False),  # only the customer must match
        (["customer"], ("cus_2", 500), True),
        (("customer", "amount"), ("cus_1", 999), True),
        (False, ("cus_2", 999), False),  # nothing must match
        (_lower_customer, ("CUS_1", 999), False),
        (_lower_customer, ("cus_2", 500), True),
    ],
    ids=[
        "all",
        "true",
        "subset-same",
        "subset-other",
        "subset-all",
        "false",
        "callable-same",
        "callable-other",
    ],
)
def test_fingerprint_option(guard: Guard, option: Any, second: tuple[str, int], conflict: bool) -> None:
    calls = Calls()

    @guard.effect("pay.charge", fingerprint=option)
    def charge(customer: str, amount: int) -> str:
        calls.hit()
        return f"{customer}:{amount}"

    with scope("s"):
        assert charge("cus_1", 500) == "cus_1:500"
    with scope("s"):
        if conflict:
            with pytest.raises(KeyConflict):
                charge(*second)
        else:
            assert charge(*second) == "cus_1:500"  # the recorded result, not a new one
    assert calls.n == 1


# ---------------------------------------------------------- bad input: nothing runs, nothing recorded


def test_no_scope_and_no_key_is_no_scope(guard: Guard, store: IdempotencyStore) -> None:
    calls = Calls()

    @guard.effect("pay.charge")
    def charge(amount: int) -> int:
        return calls.hit()

    with pytest.raises(NoScope):
        charge(5)
    with pytest.raises(NoScope):
        guard.run("pay.charge", calls.hit, arguments={"amount": 5}, result_type=int)
    assert calls.n == 0
    assert all_records(store) == []


def test_unstorable_return_type_is_codec_error_at_decoration(guard: Guard, store: IdempotencyStore) -> None:
    calls = Calls()
    with pytest.raises(CodecError):

        @guard.effect("make.plain")
        def make() -> Plain:
            calls.hit()
            return Plain()

    with pytest.raises(CodecError):

        @guard.effect("make.plain", result_type=Plain)
        def make_untyped():  # type: ignore[no-untyped-def]
            calls.hit()

    with scope("s"), pytest.raises(CodecError):
        guard.run("make.plain", lambda: Plain(calls.hit()), result_type=Plain)
    assert calls.n == 0
    assert all_records(store) == []


@pytest.mark.parametrize(
    "options",
    [
        {"policy": "sometimes"},
        {"permanent": (int,)},
        {"permanent": ("Declined",)},
        {"permanent": (Declined("instance"),)},
        {"permanent": Declined},  # a type, not a tuple of types
        {"retryable": (str,)},
        {"fingerprint": ["customer", "nope"]},
        {"reconciler": "find_charge"},
        {"classify": 3},
        {"retry": 3},
        {"lease": -1.0},
        {"lease": 0},
        {"retention": -5},
        {"wait": -1},
        {"provider_window": 0},
        {"provider_window": "1 day"},
    ],
    ids=lambda o: "-".join(f"{k}={v!r}" for k, v in o.items())[:40],
)
def test_bad_options_are_configuration_errors(
    guard: Guard, store: IdempotencyStore, options: dict[str, Any]
) -> None:
    calls = Calls()
    with pytest.raises(ConfigurationError):

        @guard.effect("pay.charge", **options)
        def charge(customer: str, amount: int) -> int:
            return calls.hit()

    with scope("s"), pytest.raises(ConfigurationError):  # run() refuses them too (and fingerprint=)
        guard.run("pay.charge", calls.hit, arguments={"amount": 1}, result_type=int, **options)
    assert calls.n == 0
    assert all_records(store) == []


def test_run_rejects_unknown_options(guard: Guard, store: IdempotencyStore) -> None:
    calls = Calls()
    with scope("s"), pytest.raises(ConfigurationError):
        guard.run("pay.charge", calls.hit, result_type=int, polcy="at_least_once")  # a typo
    assert calls.n == 0
    assert all_records(store) == []


def test_async_reconciler_on_a_sync_effect_is_configuration_error(
    guard: Guard, store: IdempotencyStore
) -> None:
    """A sync call cannot await it: it would never run and the effect would stay in doubt."""
    calls = Calls()

    async def find_charge(request: ReconcileRequest) -> Applied[int]:
        return Applied(1)

    with pytest.raises(ConfigurationError):

        @guard.effect("pay.charge", reconciler=find_charge)
        def charge(amount: int) -> int:
            return calls.hit()

    with scope("s"), pytest.raises(ConfigurationError):
        guard.run("pay.charge", calls.hit, reconciler=find_charge, result_type=int)
    assert calls.n == 0
    assert all_records(store) == []


def test_bad_guard_settings() -> None:
    from sagaguard.idempotency import MemoryStore

    for kwargs in ({"lease": 0}, {"retention": -1}, {"wait": -0.5}):
        with pytest.raises(ConfigurationError):
            Guard(MemoryStore(), **kwargs)


def test_unfingerprintable_argument_is_codec_error(guard: Guard, store: IdempotencyStore) -> None:
    calls = Calls()

    @guard.effect("pay.charge")
    def charge(customer: Any, amount: int) -> int:
        return calls.hit()

    with scope("s"), pytest.raises(CodecError):
        charge(Plain(), 5)
    with scope("s"), pytest.raises(CodecError):
        guard.run("pay.charge", calls.hit, arguments={"customer": Plain()}, result_type=int)
    assert calls.n == 0
    assert all_records(store) == []


def test_wrong_call_arguments_run_nothing(guard: Guard, store: IdempotencyStore) -> None:
    calls = Calls()

    @guard.effect("pay.charge")
    def charge(customer: str, amount: int) -> int:
        return calls.hit()

    with scope("s"), pytest.raises((TypeError, ConfigurationError)):
        charge("cus_1", 5, 6)  # type: ignore[call-arg]
    assert calls.n == 0
    assert all_records(store) == []


def test_current_effect_outside_an_effect() -> None:
    with pytest.raises(ConfigurationError):
        current_effect()


# --------------------------------------------------------------------------- permanent failures


@pytest.mark.parametrize(
    "make_error",
    [lambda: Declined("card declined", 42), lambda: NotApplied("invalid amount")],
    ids=["permanent-list", "NotApplied"],
)
def test_permanent_error_is_recorded_and_replayed_as_itself(
    guard: Guard, store: IdempotencyStore, make_error: Callable[[], Exception]
) -> None:
    calls = Calls()

    @guard.effect("pay.charge", permanent=(Declined,))
    def charge(amount: int) -> int:
        calls.hit()
        raise make_error()

    with scope("s"), pytest.raises(Exception) as first:
        charge(5)
    rec = store.get(identity("s", "pay.charge").key)
    assert rec is not None
    assert rec.state == State.FAILED
    assert rec.error is not None
    assert json.loads(rec.error)["type"].endswith(type(first.value).__qualname__)
    with scope("s"), pytest.raises(Exception) as again:
        charge(5)
    assert calls.n == 1
    assert type(again.value) is type(first.value)
    assert again.value is not first.value
    assert again.value.args == first.value.args


def test_unregistered_recorded_failure_replays_as_replayed_failure(guard: Guard) -> None:
    calls = Calls()

    class Refused(NotApplied):  # permanent by NotApplied's flag, but never declared
        pass

    @guard.effect("pay.charge")
    def charge(amount: int) -> int:
        calls.hit()
        raise Refused("invalid account")

    with scope("s"), pytest.raises(Refused):
        charge(5)
    with scope("s"), pytest.raises(ReplayedFailure) as info:
        charge(5)
    assert calls.n == 1
    assert info.value.type_name == f"{Refused.__module__}.{Refused.__qualname__}"
    assert info.value.message == "invalid account"


def test_failure_recorded_by_an_older_definition_replays_as_replayed_failure(guard: Guard) -> None:
    calls = Calls()

    @guard.effect("pay.charge", permanent=(Declined,))
    def v1(amount: int) -> int:
        calls.hit()
        raise Declined("card declined")

    @guard.effect("pay.charge")  # redeployed without the permanent list
    def v2(amount: int) -> int:
        return calls.hit()

    with scope("s"), pytest.raises(Declined):
        v1(5)
    with scope("s"), pytest.raises(ReplayedFailure) as info:
        v2(5)
    assert calls.n == 1
    assert info.value.type_name.endswith("Declined")


def test_classifier_decides_first(guard: Guard, store: IdempotencyStore) -> None:
    calls = Calls()

    def classify(exc: BaseException) -> Any:
        from sagaguard.idempotency import Disposition

        return Disposition.PERMANENT if isinstance(exc, LookupError) else None

    @guard.effect("pay.charge", classify=classify)
    def charge(amount: int) -> int:
        calls.hit()
        raise KeyError("no such customer")

    with scope("s"), pytest.raises(KeyError):
        charge(5)
    assert state_of(store, identity("s", "pay.charge").key) == State.FAILED


# -------------------------------------------------------------------------- retryable failures


def test_retryable_error_is_retried_in_the_claim(
    guard: Guard, store: IdempotencyStore, sleeps: Sleeper
) -> None:
    seen: list[tuple[int, str, int, str]] = []
    key = identity("s", "pay.charge").key

    @guard.effect(
        "pay.charge",
        retryable=(RateLimited,),
        retry=Retry(stop=tenacity.stop_after_attempt(5), wait=tenacity.wait_incrementing(0.1, 0.2)),
    )
    def charge(amount: int) -> str:
        ctx = current_effect()
        seen.append((ctx.attempt, ctx.provider_key, ctx.token, ctx.key))
        if len(seen) < 3:
            raise RateLimited("slow down")
        return "ok"

    with scope("s"):
        assert charge(5) == "ok"
    assert [s[0] for s in seen] == [1, 2, 3]
    assert {s[1] for s in seen} == {provider_key(key, store.ledger_id())}
    (token,) = {s[2] for s in seen}  # every try ran under the one claim's token
    assert {s[3] for s in seen} == {key}
    assert sleeps.pauses == pytest.approx([0.1, 0.3])
    rec = store.get(key)
    assert rec is not None
    assert rec.state == State.SUCCEEDED
    assert rec.token == token
    assert rec.attempts == 1  # one claim, three tries inside it


def test_retries_exhausted_remove_the_record_so_the_next_call_runs(
    guard: Guard, store: IdempotencyStore, sleeps: Sleeper
) -> None:
    calls = Calls()
    key = identity("s", "pay.charge").key

    @guard.effect(
        "pay.charge",
        retryable=(RateLimited,),
        retry=Retry(stop=tenacity.stop_after_attempt(4), wait=tenacity.wait_incrementing(0.1, 0.2)),
    )
    def charge(amount: int) -> str:
        calls.hit(current_effect().attempt)
        raise RateLimited("slow down", amount)

    with scope("s"), pytest.raises(RateLimited) as info:
        charge(5)
    assert info.value.args == ("slow down", 5)
    assert calls.seen == [1, 2, 3, 4]
    assert sleeps.pauses == pytest.approx([0.1, 0.3, 0.5])
    assert store.get(key) is None
    with scope("s"), pytest.raises(RateLimited):
        charge(5)
    assert calls.n == 8


def test_not_applied_retryable_uses_default_retry(guard: Guard, sleeps: Sleeper) -> None:
    calls = Calls()

    @guard.effect("pay.charge")
    def charge(amount: int) -> int:
        if calls.hit() < 3:
            raise NotApplied("paused", retryable=True)
        return calls.n

    with scope("s"):
        assert charge(5) == 3
    assert len(sleeps.pauses) == 2
    assert all(0 <= p <= 5.0 for p in sleeps.pauses)


def test_provider_idempotent_effect_retries_ambiguous_errors_under_one_provider_key(
    guard: Guard, sleeps: Sleeper
) -> None:
    calls = Calls()

    @guard.effect("pay.charge", provider_idempotent=True, retry=Retry(wait=tenacity.wait_fixed(0.25)))
    def charge(amount: int) -> int:
        calls.hit((current_effect().attempt, current_effect().provider_key))
        if calls.n < 3:
            raise TimeoutError("read timed out")
        return amount

    with scope("s"):
        assert charge(5) == 5
    assert [a for a, _ in calls.seen] == [1, 2, 3]
    assert {p for _, p in calls.seen} == {guard.provider_key(identity("s", "pay.charge"))}
    assert sleeps.pauses == pytest.approx([0.25, 0.25])


def test_ambiguous_error_is_not_retried_without_a_provider_key(guard: Guard, sleeps: Sleeper) -> None:
    calls = Calls()

    @guard.effect("pay.charge", retry=Retry(stop=tenacity.stop_after_attempt(5)))
    def charge(amount: int) -> int:
        calls.hit()
        raise TimeoutError("read timed out")

    with scope("s"), pytest.raises(OutcomeUnknown):
        charge(5)
    assert calls.n == 1
    assert sleeps.pauses == []


# ------------------------------------------------------------------------ ambiguous and in doubt


@pytest.mark.parametrize(
    "error",
    [TimeoutError("read timed out"), ConnectionResetError("reset by peer"), RuntimeError("boom")],
    ids=lambda e: type(e).__name__,
)
def test_ambiguous_error_raises_outcome_unknown_and_leaves_in_doubt(
    guard: Guard, store: IdempotencyStore, clock: FakeClock, error: Exception
) -> None:
    calls = Calls()
    key = identity("s", "pay.charge").key

    @guard.effect("pay.charge")
    def charge(amount: int) -> int:
        calls.hit()
        raise error

    with scope("s"), pytest.raises(OutcomeUnknown) as info:
        charge(5)
    assert info.value.__cause__ is error
    assert info.value.key == key
    assert info.value.record.state == State.IN_DOUBT
    rec = store.get(key)
    assert rec is not None
    assert rec.state == State.IN_DOUBT
    assert rec.lease_until <= clock.now  # released: the next attempt resolves at once
    assert rec.error is not None
    assert json.loads(rec.error)["type"] == f"builtins.{type(error).__name__}"
    # The next call does not run it blindly.
    with scope("s"), pytest.raises(OutcomeUnknown):
        charge(5)
    assert calls.n == 1
    assert state_of(store, key) == State.IN_DOUBT


FOUND = Receipt("ch_found", 500, "cus_1")

# mode -> (effect options, what the resolving call does: "found", "runs" or "unknown")
RESOLUTIONS: dict[str, tuple[dict[str, Any], str]] = {
    "applied": ({"reconciler": Applied(FOUND)}, "found"),
    "not-applied": ({"reconciler": NOT_APPLIED}, "runs"),
    "unknown": ({"reconciler": Unknown()}, "unknown"),
    "reconciler-raises": ({"reconciler": ConnectionError("provider API down")}, "unknown"),
    "no-reconciler": ({}, "unknown"),
    "provider-key": ({"provider_idempotent": True}, "runs"),
    "at-least-once": ({"policy": "at_least_once"}, "runs"),
    "unknown-then-provider-key": ({"reconciler": Unknown(), "provider_idempotent": True}, "runs"),
    "unknown-then-at-least-once": ({"reconciler": Unknown(), "policy": "at_least_once"}, "runs"),
    "applied-beats-at-least-once": ({"reconciler": Applied(FOUND), "policy": "at_least_once"}, "found"),
    "not-applied-beats-provider-key": ({"reconciler": NOT_APPLIED, "provider_idempotent": True}, "runs"),
}


def make_reconciler(answer: Any, asked: list[ReconcileRequest]) -> Callable[[ReconcileRequest], Any]:
    def reconciler(request: ReconcileRequest) -> Any:
        asked.append(request)
        if isinstance(answer, Exception):
            raise answer
        return answer

    return reconciler


@pytest.mark.parametrize("entry", ["ambiguous-error", "crash"])
@pytest.mark.parametrize("mode", list(RESOLUTIONS))
def test_in_doubt_resolution(
    guard: Guard, store_factory: StoreFactory, clock: FakeClock, entry: str, mode: str
) -> None:
    store = guard.store
    options, expect = RESOLUTIONS[mode]
    options = dict(options)
    asked: list[ReconcileRequest] = []
    if "reconciler" in options:
        options["reconciler"] = make_reconciler(options["reconciler"], asked)
    calls = Calls()
    ident = identity("order-1", "pay.charge")

    @guard.effect("pay.charge", retry=ONE_TRY, **options)
    def charge(customer: str, amount: int) -> Receipt:
        n = calls.hit(current_effect().provider_key)
        if entry == "ambiguous-error" and n == 1:
            raise TimeoutError("read timed out")
        return Receipt(f"ch_{n}", amount, customer)

    if entry == "ambiguous-error":
        with scope("order-1"), pytest.raises(OutcomeUnknown):
            charge("cus_1", 500)
    else:
        # A worker claimed, then died before recording anything; its lease runs out.
        dead = store_factory.open().claim(ident, fp(customer="cus_1", amount=500), LEASE)
        assert dead.outcome == ClaimOutcome.CLAIMED
        clock.advance(LEASE + 1)
    before = calls.n
    entered = store.get(ident.key)
    assert entered is not None
    assert entered.state in (State.IN_DOUBT, State.IN_PROGRESS)
    first = entered.token  # the token of the claim that left the doubt
    if entry == "crash":
        assert first == dead.record.token

    if expect == "unknown":
        with scope("order-1"), pytest.raises(OutcomeUnknown):
            charge("cus_1", 500)
        assert calls.n == before
        rec = store.get(ident.key)
        assert rec is not None
        assert rec.state == State.IN_DOUBT
        assert rec.token == first + 1
        assert rec.lease_until <= clock.now  # released, so a later call resolves again
        assert rec.error is not None
        recorded = json.loads(rec.error)["type"]
        assert recorded == ("builtins.TimeoutError" if entry == "ambiguous-error" else "sagaguard.crash")
        with scope("order-1"), pytest.raises(OutcomeUnknown):
            charge("cus_1", 500)
        assert calls.n == before
        assert store.get(ident.key).token == first + 2  # type: ignore[union-attr]
        if "reconciler" in options:
            assert len(asked) == 2  # asked again on the later call
    else:
        with scope("order-1"):
            got = charge("cus_1", 500)
        if expect == "found":
            assert got == FOUND
            assert calls.n == before
        else:
            assert got == Receipt(f"ch_{before + 1}", 500, "cus_1")
            assert calls.n == before + 1
        rec = store.get(ident.key)
        assert rec is not None
        assert rec.state == State.SUCCEEDED
        assert rec.token == first + 1
        assert rec.result is not None
        assert Receipt(**json.loads(rec.result)) == got
        with scope("order-1"):  # settled: replayed from now on
            assert charge("cus_1", 500) == got
        assert calls.n == before + (expect == "runs")
    # Every run of the body, the lost one and the re-send, saw the same provider key.
    assert set(calls.seen) <= {guard.provider_key(ident)}
    if asked:
        request = asked[0]
        assert request.identity.key == ident.key
        assert request.provider_key == guard.provider_key(ident) == provider_key(ident.key, guard.ledger_id)
        assert dict(request.arguments) == {"customer": "cus_1", "amount": 500}
        assert request.record.state == State.IN_DOUBT
        assert request.record.token == first + 1


def test_reconciler_result_that_cannot_be_stored_does_not_complete(
    guard: Guard, store: IdempotencyStore, clock: FakeClock
) -> None:
    calls, asked = Calls(), Calls()
    key = identity("s", "pay.charge").key

    @guard.effect("pay.charge", reconciler=lambda request: Applied(Plain(asked.hit())))
    def charge(amount: int) -> Receipt:
        calls.hit()
        raise TimeoutError("read timed out")

    with scope("s"), pytest.raises(OutcomeUnknown):
        charge(5)
    for n in (1, 2):
        with scope("s"), pytest.raises(CodecError):
            charge(5)
        assert asked.n == n  # the lease was released: the next call resolves again at once
        rec = store.get(key)
        assert rec is not None
        assert rec.state == State.IN_DOUBT
        assert rec.lease_until <= clock.now
    assert calls.n == 1


# ----------------------------------------------------------------------------- live duplicates


@pytest.fixture
def holder(store_factory: StoreFactory) -> IdempotencyStore:
    """Another worker's connection to the same data."""
    return store_factory.open()


def test_live_duplicate_waits_then_raises_already_in_progress(
    guard: Guard, store: IdempotencyStore, holder: IdempotencyStore, sleeps: Sleeper
) -> None:
    calls = Calls()
    ident = identity("order-1", "pay.charge")

    @guard.effect("pay.charge", wait=1.0)
    def charge(amount: int) -> int:
        return calls.hit()

    held = holder.claim(ident, fp(amount=5), LEASE)
    with scope("order-1"), pytest.raises(AlreadyInProgress) as info:
        charge(5)
    assert calls.n == 0
    assert info.value.key == ident.key
    assert info.value.record.token == held.record.token
    assert len(sleeps.pauses) >= 3
    assert sleeps.pauses[:3] == pytest.approx([0.01, 0.02, 0.04])  # backoff
    assert max(sleeps.pauses) <= 0.5
    assert sleeps.total == pytest.approx(1.0)  # bounded by wait=
    rec = store.get(ident.key)
    assert rec is not None
    assert (rec.state, rec.token) == (State.IN_PROGRESS, held.record.token)


def test_live_duplicate_replays_when_the_holder_completes_meanwhile(
    guard: Guard, store: IdempotencyStore, holder: IdempotencyStore, sleeps: Sleeper
) -> None:
    calls = Calls()
    ident = identity("order-1", "pay.charge")

    @guard.effect("pay.charge")
    def charge(customer: str, amount: int) -> Receipt:
        calls.hit()
        return Receipt("mine", amount, customer)

    held = holder.claim(ident, fp(customer="cus_1", amount=5), LEASE)
    theirs = Receipt("theirs", 5, "cus_1")

    def finish(n: int) -> None:
        if n == 3:
            holder.complete(ident.key, held.record.token, json.dumps(theirs.__dict__), RETENTION)

    sleeps.hook = finish
    with scope("order-1"):
        got = charge("cus_1", 5)
    assert got == theirs
    assert type(got) is Receipt
    assert calls.n == 0
    assert len(sleeps.pauses) == 3


def test_live_duplicate_replays_the_holders_permanent_failure(
    guard: Guard, holder: IdempotencyStore, sleeps: Sleeper
) -> None:
    calls = Calls()
    ident = identity("order-1", "pay.charge")

    @guard.effect("pay.charge", permanent=(Declined,))
    def charge(amount: int) -> int:
        return calls.hit()

    held = holder.claim(ident, fp(amount=5), LEASE)
    from sagaguard.idempotency.codec import encode_error
    from sagaguard.idempotency.records import Disposition

    sleeps.hook = lambda n: (
        holder.fail(
            ident.key, held.record.token, Disposition.PERMANENT, encode_error(Declined("no")), RETENTION
        )
        if n == 2
        else None
    )
    with scope("order-1"), pytest.raises(Declined) as info:
        charge(5)
    assert info.value.args == ("no",)
    assert calls.n == 0


def test_live_duplicate_takes_over_when_the_holder_dies_meanwhile(
    guard: Guard, store: IdempotencyStore, holder: IdempotencyStore, sleeps: Sleeper, clock: FakeClock
) -> None:
    calls = Calls()
    ident = identity("order-1", "pay.charge")

    @guard.effect("pay.charge", policy="at_least_once")
    def charge(amount: int) -> int:
        return calls.hit()

    held = holder.claim(ident, fp(amount=5), LEASE)
    sleeps.hook = lambda n: clock.advance(LEASE) if n == 2 else None
    with scope("order-1"):
        assert charge(5) == 1
    rec = store.get(ident.key)
    assert rec is not None
    assert (rec.state, rec.token) == (State.SUCCEEDED, held.record.token + 1)


# ------------------------------------------------------------------------------------- zombies


@pytest.mark.parametrize("zombie_ends", ["returns", "raises"])
def test_zombie_cannot_overwrite_the_worker_that_took_over(
    guard: Guard, store_factory: StoreFactory, clock: FakeClock, sleeps: Sleeper, zombie_ends: str
) -> None:
    store = guard.store
    guard_b = Guard(store_factory.open(), lease=LEASE, wait=WAIT, sleep=sleeps)
    a_calls, b_calls = Calls(), Calls()
    a_tokens: list[int] = []
    ident = identity("order-1", "pay.charge")

    @guard_b.effect("pay.charge", policy="at_least_once")
    def charge_b(amount: int) -> str:
        b_calls.hit()
        return "B"

    @guard.effect("pay.charge", policy="at_least_once")
    def charge_a(amount: int) -> str:
        a_calls.hit()
        a_tokens.append(current_effect().token)
        clock.advance(LEASE + 1)  # A stalls past its lease (GC pause, slow provider)...
        with scope("order-1"):
            b_calls.seen.append(charge_b(amount))  # ...and B takes over, runs and records
        if zombie_ends == "raises":
            raise TimeoutError("late reply")
        return "A"

    try:
        with scope("order-1"), pytest.raises(LostOwnership) as info:
            charge_a(5)
    finally:
        guard_b.close()
    (a_token,) = a_tokens
    assert info.value.token == a_token
    assert info.value.key == ident.key
    assert (a_calls.n, b_calls.n) == (1, 1)
    assert b_calls.seen == [None, "B"]
    rec = store.get(ident.key)
    assert rec is not None
    assert (rec.state, rec.token) == (State.SUCCEEDED, a_token + 1)
    assert rec.result is not None
    assert json.loads(rec.result) == "B"
    with scope("order-1"):
        assert charge_a(5) == "B"
    assert a_calls.n == 1


# ----------------------------------------------------------------------------------- heartbeats


def test_current_effect_heartbeat_extends_the_lease(
    guard: Guard, store: IdempotencyStore, holder: IdempotencyStore, clock: FakeClock
) -> None:
    ident = identity("job", "long.task")
    seen: dict[str, Any] = {}

    @guard.effect("long.task")
    def long_task() -> str:
        clock.advance(20)
        seen["deadline"] = current_effect().heartbeat()
        seen["now"] = clock.now
        seen["stored"] = store.get(ident.key).lease_until  # type: ignore[union-attr]
        clock.advance(20)  # past the first lease, inside the renewed one
        seen["duplicate"] = holder.claim(ident, fp(), LEASE).outcome
        return "done"

    with scope("job"):
        assert long_task() == "done"
    assert seen["deadline"] == pytest.approx(seen["now"] + LEASE, abs=1e-3)
    assert seen["stored"] == pytest.approx(seen["deadline"], abs=1e-3)
    assert seen["duplicate"] == ClaimOutcome.EXISTING  # not taken over: the lease was renewed
    assert state_of(store, ident.key) == State.SUCCEEDED


def test_heartbeater_renews_a_long_call(
    guard: Guard, store: IdempotencyStore, holder: IdempotencyStore, clock: FakeClock
) -> None:
    mono = [1000.0]
    beats = Heartbeater(store, monotonic=lambda: mono[0])
    beats.close()  # no background thread: the test drives beat_due itself
    guard.heartbeater.close()
    guard.heartbeater = beats
    ident = identity("job", "long.task")
    seen: dict[str, Any] = {}

    @guard.effect("long.task")
    def long_task() -> str:
        seen["early"] = beats.beat_due()  # not due before a third of the lease
        mono[0] += LEASE / 3 + 0.1
        clock.advance(25)
        seen["renewed"] = beats.beat_due()
        seen["now"] = clock.now
        seen["stored"] = store.get(ident.key).lease_until  # type: ignore[union-attr]
        seen["again"] = beats.beat_due()  # the next renewal is a third of a lease away
        clock.advance(10)  # the first lease is over; the renewed one is not
        seen["duplicate"] = holder.claim(ident, fp(), LEASE).outcome
        return "done"

    with scope("job"):
        assert long_task() == "done"
    assert (seen["early"], seen["renewed"], seen["again"]) == (0, 1, 0)
    assert seen["stored"] == pytest.approx(seen["now"] + LEASE, abs=1e-3)
    assert seen["duplicate"] == ClaimOutcome.EXISTING
    assert beats.beat_due() == 0  # the finished call is no longer watched
    assert state_of(store, ident.key) == State.SUCCEEDED


def test_heartbeater_stops_renewing_a_lost_claim(
    store: IdempotencyStore, holder: IdempotencyStore, clock: FakeClock
) -> None:
    ident = identity("job", "long.task")
    mine = store.claim(ident, fp(), LEASE).record
    clock.advance(LEASE + 1)
    theirs = holder.claim(ident, fp(), LEASE).record
    assert theirs.token == mine.token + 1
    mono = [0.0]
    beats = Heartbeater(store, monotonic=lambda: mono[0])
    beats.close()
    beats.register(ident.key, mine.token, LEASE)
    mono[0] += LEASE
    assert beats.beat_due() == 0  # refused (LostOwnership), remembered, not raised
    mono[0] += LEASE
    assert beats.beat_due() == 0
    rec = store.get(ident.key)
    assert rec is not None
    assert rec.token == theirs.token
    assert rec.lease_until == pytest.approx(theirs.lease_until, abs=1e-3)
    with pytest.raises(LostOwnership):
        beats.beat(ident.key, mine.token, LEASE)


# ------------------------------------------------------------------------- results at runtime


def test_result_that_cannot_be_stored_is_codec_error_and_in_doubt(
    guard: Guard, store: IdempotencyStore
) -> None:
    calls = Calls()
    key = identity("s", "make.thing").key

    @guard.effect("make.thing")
    def make() -> Any:
        calls.hit()
        return Plain(1)

    with scope("s"), pytest.raises(CodecError):
        make()
    assert state_of(store, key) == State.IN_DOUBT  # it happened: the fact is not lost
    with scope("s"), pytest.raises(OutcomeUnknown):
        make()
    assert calls.n == 1


@pytest.mark.filterwarnings("ignore:Pydantic serializer warnings:UserWarning")
def test_result_of_the_wrong_type_is_codec_error_and_in_doubt(guard: Guard, store: IdempotencyStore) -> None:
    calls = Calls()

    @guard.effect("make.count")
    def count() -> int:
        calls.hit()
        return "not a number"  # type: ignore[return-value]

    with scope("s"), pytest.raises(CodecError):
        count()
    assert state_of(store, identity("s", "make.count").key) == State.IN_DOUBT


# --------------------------------------------------------------------------- unreachable stores


@contextlib.contextmanager
def guarded_charge(store: IdempotencyStore, calls: Calls) -> Iterator[Callable[[int], int]]:
    guard = Guard(store, lease=LEASE)

    @guard.effect("pay.charge")
    def charge(amount: int) -> int:
        return calls.hit()

    try:
        yield charge
    finally:
        guard.close()


def test_unreachable_postgres_fails_closed() -> None:
    pytest.importorskip("psycopg")
    from sagaguard.idempotency.stores.sql import SqlStore

    url = f"postgresql://postgres@127.0.0.1:{closed_port()}/test"
    with pytest.raises(StoreUnavailable):
        SqlStore(url)  # creating the table needs the database
    calls = Calls()
    with guarded_charge(SqlStore(url, create=False), calls) as charge:
        with scope("s"), pytest.raises(StoreUnavailable):
            charge(5)
    assert calls.n == 0


def test_unreachable_redis_fails_closed() -> None:
    from sagaguard.idempotency.stores.redis import RedisStore

    with pytest.raises(StoreUnavailable):
        RedisStore(f"redis://127.0.0.1:{closed_port()}/0", prefix="sg-unreachable")


@pytest.mark.parametrize("backend", ["postgres", "redis"])
def test_store_going_away_fails_closed(backend: str) -> None:
    """The store answered when it was opened, then the server went away: nothing runs unclaimed."""
    from urllib.parse import urlsplit

    url = require_postgres() if backend == "postgres" else require_redis()
    parts = urlsplit(url)
    proxy = TcpProxy(parts.hostname or "127.0.0.1", parts.port or (5432 if backend == "postgres" else 6379))
    userinfo = parts.netloc.rpartition("@")[0]
    proxied = parts._replace(netloc=(f"{userinfo}@" if userinfo else "") + f"127.0.0.1:{proxy.port}").geturl()
    calls = Calls()
    if backend == "postgres":
        from sagaguard.idempotency.stores.sql import SqlStore

        store: IdempotencyStore = SqlStore(proxied, table_name=f"sg_gone_{uuid.uuid4().hex[:8]}")
    else:
        from sagaguard.idempotency.stores.redis import RedisStore

        store = RedisStore(proxied, prefix=f"sg-gone-{uuid.uuid4().hex[:8]}")
    try:
        with guarded_charge(store, calls) as charge:
            with scope("before"):
                assert charge(1) == 1  # the store works through the proxy
            proxy.cut()
            with scope("after"), pytest.raises(StoreUnavailable):
                charge(5)
        assert calls.n == 1
    finally:
        proxy.cut()
        store.close()
        if backend == "postgres":
            _drop_table(url, store)


def _drop_table(url: str, store: IdempotencyStore) -> None:
    import psycopg
    from psycopg import sql

    table = store._table.name  # type: ignore[attr-defined]
    with psycopg.connect(url, autocommit=True) as conn:
        for name in (table, f"{table}_version", f"{table}_ledger"):
            conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier(name)))


# ---------------------------------------------------------------------------- real concurrency


def test_threads_race_one_effect_runs_once(store: IdempotencyStore) -> None:
    threads_n = 64
    guard = Guard(store, lease=LEASE, wait=60.0)  # real sleep: these threads race for real
    calls = Calls()
    ran_under: list[int] = []

    @guard.effect("race.effect")
    def effect(amount: int) -> str:
        n = calls.hit()
        ran_under.append(current_effect().token)
        time.sleep(0.05)  # hold the claim so the others must wait
        return f"run-{n}"

    barrier = threading.Barrier(threads_n)
    results: list[str | None] = [None] * threads_n
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            with scope("same"):
                barrier.wait(timeout=30)
                results[i] = effect(100)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(threads_n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    guard.close()
    assert errors == []
    assert calls.n == 1
    assert results == ["run-1"] * threads_n
    rec = store.get(identity("same", "race.effect").key)
    assert rec is not None
    assert (rec.state, rec.token, rec.attempts) == (State.SUCCEEDED, ran_under[0], 1)


def test_processes_race_one_effect_runs_once(shared_store_factory: StoreFactory, tmp_path: Any) -> None:
    log = tmp_path / "executions.log"
    log.touch()
    results = race_effect_in_processes(
        shared_store_factory.spec(), scope_id="race", name="race.effect", log=log, processes=8
    )
    assert [r.get("error") for r in results] == [None] * 8
    executions = log.read_text().splitlines()
    assert len(executions) == 1, executions
    ident = identity("race", "race.effect")
    # The winner returned the provider key it was given; every other process replayed it, and it
    # is the key this process derives for the same identity.
    opened = shared_store_factory.open()
    assert {r["result"] for r in results} == {provider_key(ident.key, opened.ledger_id())}
    rec = opened.get(ident.key)
    assert rec is not None
    assert rec.state == State.SUCCEEDED


# ------------------------------------------------------------------------------ OpenTelemetry


@pytest.fixture
def spans() -> Any:
    exporter = span_exporter()
    if exporter is None:
        pytest.skip("a non-SDK global tracer provider is already set in this process")
    exporter.clear()
    return exporter


def test_spans_report_outcomes_without_secrets(guard: Guard, store: IdempotencyStore, spans: Any) -> None:
    secret_customer, secret_amount, secret_scope = "cus_SECRET_4f1c", 7919, "scope-SECRET-77"

    @guard.effect("pay.charge", permanent=(Declined,))
    def charge(customer: str, amount: int) -> int:
        if amount == 13:
            raise Declined(f"card of {customer} declined")
        return amount

    attempts = Calls()

    @guard.effect("pay.flaky", reconciler=lambda request: Applied(secret_amount) if attempts.n else Unknown())
    def flaky(customer: str) -> int:
        attempts.hit()
        raise TimeoutError(f"timeout charging {customer}")

    expected: list[tuple[str, str, str | None]] = []

    def step(name: str, outcome: str, error: str | None, call: Callable[[], Any]) -> None:
        with scope(secret_scope):
            if error is None:
                call()
            else:
                with pytest.raises(Exception) as info:
                    call()
                assert type(info.value).__qualname__ == error
                error = error_type(info.value)  # error.type: the fully-qualified name
        expected.append((name, outcome, error))

    step("pay.charge", "executed", None, lambda: charge(secret_customer, secret_amount))
    step("pay.charge", "replayed", None, lambda: charge(secret_customer, secret_amount))
    step("pay.charge", "conflict", "KeyConflict", lambda: charge(secret_customer, 1))
    step("pay.flaky", "in_doubt", "OutcomeUnknown", lambda: flaky(secret_customer))
    step("pay.flaky", "reconciled", None, lambda: flaky(secret_customer))
    expected.append(("pay.charge", "failed", error_type(Declined)))
    with scope("declines"), pytest.raises(Declined):
        charge(secret_customer, 13)

    finished = spans.get_finished_spans()
    assert len(finished) == len(expected)
    from opentelemetry.trace import SpanKind, StatusCode

    for span, (name, outcome, error) in zip(finished, expected, strict=True):
        attrs = dict(span.attributes)
        assert span.name == f"sagaguard.effect {name}"  # not an agent's tool call: no GenAI names
        assert span.kind is SpanKind.INTERNAL
        assert attrs["sagaguard.effect.name"] == name
        assert not [a for a in attrs if a.startswith("gen_ai.")]
        assert attrs["sagaguard.effect.outcome"] == outcome, span.name
        assert attrs.get("error.type") == error
        assert (span.status.status_code is StatusCode.ERROR) == (error is not None)

    secrets = {
        secret_customer,
        str(secret_amount),
        secret_scope,
        *(identity(secret_scope, n).key for n in ("pay.charge", "pay.flaky")),
        *(guard.provider_key(identity(secret_scope, n)) for n in ("pay.charge", "pay.flaky")),
        *(r.key for r in all_records(store)),
    }
    for span in finished:
        texts = [str(v) for v in span.attributes.values()]
        texts += [str(span.status.description or "")]
        texts += [str(v) for event in span.events for v in (event.attributes or {}).values()]
        for secret in secrets:
            assert not any(secret in t for t in texts), (span.name, secret)


def test_span_carries_the_tool_call_id(guard: Guard, spans: Any) -> None:
    """A tool call is an ``execute_tool`` span; an effect its body runs is not, and carries no id."""

    @guard.effect("stripe.refund")
    def refund(q: str) -> str:
        return q

    @guard.effect("tool.search", tool=True)
    def search(q: str) -> str:
        return refund(q)

    token = TOOL_CALL_ID.set("call_abc123")
    try:
        with scope("s"):
            search("x")
            guard.run("tool.lookup", lambda: 1, tool=True)
    finally:
        TOOL_CALL_ID.reset(token)
    inner, outer, run = spans.get_finished_spans()
    assert (outer.name, run.name) == ("execute_tool tool.search", "execute_tool tool.lookup")
    for span in (outer, run):
        assert span.attributes["gen_ai.operation.name"] == "execute_tool"
        assert span.attributes["gen_ai.tool.name"] == span.attributes["sagaguard.effect.name"]
        assert span.attributes["gen_ai.tool.call.id"] == "call_abc123"
        assert span.attributes["sagaguard.effect.outcome"] == "executed"
    assert inner.name == "sagaguard.effect stripe.refund"
    assert dict(inner.attributes) == {
        "sagaguard.effect.name": "stripe.refund",
        "sagaguard.effect.outcome": "executed",
    }
    with pytest.raises(ConfigurationError):
        guard.run("tool.lookup", lambda: 1, tool="yes")


def test_busy_span(guard: Guard, holder: IdempotencyStore, spans: Any) -> None:
    @guard.effect("pay.charge", wait=0.1)
    def charge(amount: int) -> int:
        return amount

    holder.claim(identity("s", "pay.charge"), fp(amount=1), LEASE)
    with scope("s"), pytest.raises(AlreadyInProgress):
        charge(1)
    (span,) = spans.get_finished_spans()
    assert span.attributes["error.type"] == "sagaguard.idempotency.errors.AlreadyInProgress"
    assert span.attributes["sagaguard.effect.outcome"] == "busy"
