"""The guard with async effects, against every backend.

The same promises as test_guard.py, driven by the async loop: each test runs its coroutine with
``asyncio.run`` (no pytest plugin). The guard's sync ``sleep`` is forbidden here, so a wait or retry
that blocked the event loop would fail the test; the injected ``async_sleep`` records each pause and
advances the fake clock. The ``guard`` fixture is the guard as it comes (``offload=None``: the store
decides; on SQLite the two writes of a new call are tried on the event loop first); tests marked
with the ``guard`` parametrisation also run with every store call in a thread (``offload=True``)
and inline (``offload=False``).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import threading
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from typing import Any, TypeVar

import pytest
import tenacity
from _guardutil import (
    LEASE,
    RETENTION,
    Calls,
    Declined,
    Plain,
    RateLimited,
    Receipt,
    Sleeper,
    all_records,
    explicit,
    forbidden_sleep,
    fp,
    identity,
    span_exporter,
)
from conftest import FakeClock, StoreFactory, closed_port

from sagaguard.idempotency import (
    NOT_APPLIED,
    AlreadyInProgress,
    Applied,
    ClaimOutcome,
    CodecError,
    Guard,
    KeyConflict,
    LostOwnership,
    NoScope,
    NotApplied,
    OutcomeUnknown,
    ReconcileRequest,
    Retry,
    State,
    StoreUnavailable,
    Unknown,
    current_effect,
    scope,
)
from sagaguard.idempotency.store import IdempotencyStore

T = TypeVar("T")
WAIT = 2.0
ONE_TRY = Retry(stop=tenacity.stop_after_attempt(1), wait=tenacity.wait_none())
BOTH_DRIVERS = pytest.mark.parametrize(
    "guard", [None, True, False], ids=["default", "offload", "inline"], indirect=True
)


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


async def in_scope(scope_id: str, call: Callable[[], Awaitable[T]]) -> T:
    with scope(scope_id):
        return await call()


@pytest.fixture
def sleeps(clock: FakeClock) -> Sleeper:
    return Sleeper(clock)


@pytest.fixture
def guard(request: pytest.FixtureRequest, store: IdempotencyStore, sleeps: Sleeper) -> Iterator[Guard]:
    g = Guard(
        store,
        lease=LEASE,
        retention=RETENTION,
        wait=WAIT,
        sleep=forbidden_sleep,
        async_sleep=sleeps.asleep,
        offload=getattr(request, "param", None),
    )
    yield g
    g.close()


@pytest.fixture
def holder(store_factory: StoreFactory) -> IdempotencyStore:
    """Another worker's connection to the same data."""
    return store_factory.open()


def state_of(store: IdempotencyStore, key: str) -> State | None:
    rec = store.get(key)
    return None if rec is None else State(rec.state)


# ------------------------------------------------------------------------- run once, replay


@BOTH_DRIVERS
def test_async_first_call_executes_and_rerun_replays(guard: Guard, store: IdempotencyStore) -> None:
    calls = Calls()

    @guard.effect("pay.charge")
    async def charge(customer: str, amount: int) -> Receipt:
        n = calls.hit()
        await asyncio.sleep(0)
        return Receipt(f"ch_{n}", amount, customer)

    assert inspect.iscoroutinefunction(charge)
    first = run(in_scope("order-1", lambda: charge("cus_1", 500)))
    again = run(in_scope("order-1", lambda: charge("cus_1", 500)))
    assert calls.n == 1
    assert first == Receipt("ch_1", 500, "cus_1")
    assert type(again) is Receipt
    assert again == first
    rec = store.get(identity("order-1", "pay.charge").key)
    assert rec is not None
    assert rec.state == State.SUCCEEDED
    assert rec.fingerprint == fp(customer="cus_1", amount=500)


def test_async_ordinals_and_scopes(guard: Guard) -> None:
    calls = Calls()

    @guard.effect("mail.send")
    async def send(to: str) -> int:
        return calls.hit()

    async def unit(scope_id: str) -> list[int]:
        with scope(scope_id):
            return [await send("a"), await send("a")]

    assert run(unit("job-1")) == [1, 2]
    assert run(unit("job-1")) == [1, 2]
    assert run(unit("job-2")) == [3, 4]
    assert calls.n == 4


@BOTH_DRIVERS
def test_async_arun_with_explicit_key(guard: Guard, store: IdempotencyStore) -> None:
    calls = Calls()

    async def refund() -> int:
        return calls.hit()

    def once() -> Awaitable[int]:
        return guard.arun("pay.refund", refund, key="r-42", arguments={"amount": 5}, result_type=int)

    async def main() -> list[int]:
        first = await once()
        with scope("anything"):
            second = await once()
        return [first, second]

    assert run(main()) == [1, 1]
    assert calls.n == 1
    assert state_of(store, explicit("r-42", "pay.refund").key) == State.SUCCEEDED


def test_async_decorator_key(guard: Guard) -> None:
    calls = Calls()

    @guard.effect("pay.refund", key=lambda order_id: f"refund:{order_id}")
    async def refund(order_id: str) -> int:
        return calls.hit()

    assert run(refund("o1")) == 1
    assert run(in_scope("other", lambda: refund("o1"))) == 1
    assert calls.n == 1


def test_async_key_conflict(guard: Guard) -> None:
    calls = Calls()

    @guard.effect("pay.charge")
    async def charge(amount: int) -> int:
        return calls.hit()

    run(in_scope("s", lambda: charge(5)))
    with pytest.raises(KeyConflict):
        run(in_scope("s", lambda: charge(6)))
    assert calls.n == 1


def test_async_bad_input_runs_nothing(guard: Guard, store: IdempotencyStore) -> None:
    calls = Calls()

    @guard.effect("pay.charge")
    async def charge(customer: Any, amount: int) -> int:
        return calls.hit()

    with pytest.raises(NoScope):
        run(charge("cus_1", 5))
    with pytest.raises(CodecError):
        run(in_scope("s", lambda: charge(Plain(), 5)))
    with pytest.raises(NoScope):
        run(guard.arun("pay.charge", charge, result_type=int))  # type: ignore[arg-type]
    with pytest.raises(CodecError):

        @guard.effect("make.plain")
        async def make() -> Plain:
            calls.hit()
            return Plain()

    assert calls.n == 0
    assert all_records(store) == []


# ------------------------------------------------------------------------------------ failures


@BOTH_DRIVERS
def test_async_permanent_error_is_replayed(guard: Guard, store: IdempotencyStore) -> None:
    calls = Calls()

    @guard.effect("pay.charge", permanent=(Declined,))
    async def charge(amount: int) -> int:
        calls.hit()
        raise Declined("card declined", amount)

    with pytest.raises(Declined):
        run(in_scope("s", lambda: charge(5)))
    with pytest.raises(Declined) as info:
        run(in_scope("s", lambda: charge(5)))
    assert info.value.args == ("card declined", 5)
    assert calls.n == 1
    assert state_of(store, identity("s", "pay.charge").key) == State.FAILED


def test_async_not_applied_is_replayed(guard: Guard) -> None:
    calls = Calls()

    @guard.effect("pay.charge")
    async def charge(amount: int) -> int:
        calls.hit()
        raise NotApplied("invalid amount")

    for _ in range(2):
        with pytest.raises(NotApplied) as info:
            run(in_scope("s", lambda: charge(5)))
        assert info.value.args == ("invalid amount",)
    assert calls.n == 1


@BOTH_DRIVERS
def test_async_retryable_error_retries_with_async_sleep(
    guard: Guard, store: IdempotencyStore, sleeps: Sleeper
) -> None:
    seen: list[tuple[int, str]] = []
    key = identity("s", "pay.charge").key

    @guard.effect(
        "pay.charge",
        retryable=(RateLimited,),
        retry=Retry(stop=tenacity.stop_after_attempt(5), wait=tenacity.wait_incrementing(0.1, 0.2)),
    )
    async def charge(amount: int) -> str:
        seen.append((current_effect().attempt, current_effect().provider_key))
        if len(seen) < 3:
            raise RateLimited("slow down")
        return "ok"

    assert run(in_scope("s", lambda: charge(5))) == "ok"
    assert [a for a, _ in seen] == [1, 2, 3]
    assert {p for _, p in seen} == {guard.provider_key(identity("s", "pay.charge"))}
    assert sleeps.pauses == pytest.approx([0.1, 0.3])
    assert state_of(store, key) == State.SUCCEEDED


def test_async_retries_exhausted_remove_the_record(
    guard: Guard, store: IdempotencyStore, sleeps: Sleeper
) -> None:
    calls = Calls()

    @guard.effect("pay.charge", retryable=(RateLimited,), retry=Retry(wait=tenacity.wait_fixed(0.5)))
    async def charge(amount: int) -> str:
        calls.hit()
        raise RateLimited("slow down")

    with pytest.raises(RateLimited):
        run(in_scope("s", lambda: charge(5)))
    assert calls.n == 3
    assert sleeps.pauses == [0.5, 0.5]
    assert store.get(identity("s", "pay.charge").key) is None


@BOTH_DRIVERS
def test_async_ambiguous_error_leaves_in_doubt(guard: Guard, store: IdempotencyStore) -> None:
    calls = Calls()
    err = TimeoutError("read timed out")

    @guard.effect("pay.charge")
    async def charge(amount: int) -> int:
        calls.hit()
        raise err

    with pytest.raises(OutcomeUnknown) as info:
        run(in_scope("s", lambda: charge(5)))
    assert info.value.__cause__ is err
    assert state_of(store, identity("s", "pay.charge").key) == State.IN_DOUBT
    with pytest.raises(OutcomeUnknown):
        run(in_scope("s", lambda: charge(5)))
    assert calls.n == 1


# ------------------------------------------------------------------------------ resolving doubt

FOUND = Receipt("ch_found", 500, "cus_1")


def _answer(answer: Any, asked: list[ReconcileRequest], request: ReconcileRequest) -> Any:
    asked.append(request)
    if isinstance(answer, Exception):
        raise answer
    return answer


def async_reconciler(answer: Any, asked: list[ReconcileRequest]) -> Any:
    async def reconciler(request: ReconcileRequest) -> Any:
        await asyncio.sleep(0)
        return _answer(answer, asked, request)

    return reconciler


def sync_reconciler(answer: Any, asked: list[ReconcileRequest]) -> Any:
    return lambda request: _answer(answer, asked, request)


# mode -> (reconciler maker, answer, other options, what the resolving call does)
RESOLUTIONS: dict[str, tuple[Any, Any, dict[str, Any], str]] = {
    "async-applied": (async_reconciler, Applied(FOUND), {}, "found"),
    "async-not-applied": (async_reconciler, NOT_APPLIED, {}, "runs"),
    "async-unknown": (async_reconciler, Unknown(), {}, "unknown"),
    "async-raises": (async_reconciler, ConnectionError("provider API down"), {}, "unknown"),
    "async-unknown-then-provider-key": (async_reconciler, Unknown(), {"provider_idempotent": True}, "runs"),
    "sync-applied": (sync_reconciler, Applied(FOUND), {}, "found"),
    "sync-raises": (sync_reconciler, ValueError("bad reply"), {}, "unknown"),
    "no-reconciler": (None, None, {}, "unknown"),
    "provider-key": (None, None, {"provider_idempotent": True}, "runs"),
    "at-least-once": (None, None, {"policy": "at_least_once"}, "runs"),
}


@pytest.mark.parametrize("entry", ["ambiguous-error", "crash"])
@pytest.mark.parametrize("mode", list(RESOLUTIONS))
def test_async_in_doubt_resolution(
    guard: Guard, holder: IdempotencyStore, clock: FakeClock, entry: str, mode: str
) -> None:
    store = guard.store
    make, answer, options, expect = RESOLUTIONS[mode]
    asked: list[ReconcileRequest] = []
    if make is not None:
        options = {**options, "reconciler": make(answer, asked)}
    calls = Calls()
    ident = identity("order-1", "pay.charge")

    @guard.effect("pay.charge", retry=ONE_TRY, **options)
    async def charge(customer: str, amount: int) -> Receipt:
        n = calls.hit(current_effect().provider_key)
        if entry == "ambiguous-error" and n == 1:
            raise TimeoutError("read timed out")
        return Receipt(f"ch_{n}", amount, customer)

    if entry == "ambiguous-error":
        with pytest.raises(OutcomeUnknown):
            run(in_scope("order-1", lambda: charge("cus_1", 500)))
    else:
        assert holder.claim(ident, fp(customer="cus_1", amount=500), LEASE).outcome == ClaimOutcome.CLAIMED
        clock.advance(LEASE + 1)  # the holder died
    before = calls.n
    entered = store.get(ident.key)
    assert entered is not None
    first = entered.token  # the token of the claim that left the doubt

    if expect == "unknown":
        with pytest.raises(OutcomeUnknown):
            run(in_scope("order-1", lambda: charge("cus_1", 500)))
        assert calls.n == before
        rec = store.get(ident.key)
        assert rec is not None
        assert (rec.state, rec.token) == (State.IN_DOUBT, first + 1)
        assert rec.lease_until <= clock.now
    else:
        got = run(in_scope("order-1", lambda: charge("cus_1", 500)))
        if expect == "found":
            assert got == FOUND
            assert calls.n == before
        else:
            assert got == Receipt(f"ch_{before + 1}", 500, "cus_1")
            assert calls.n == before + 1
        rec = store.get(ident.key)
        assert rec is not None
        assert (rec.state, rec.token) == (State.SUCCEEDED, first + 1)
        assert run(in_scope("order-1", lambda: charge("cus_1", 500))) == got
    assert set(calls.seen) <= {guard.provider_key(ident)}
    if make is not None:
        assert len(asked) == 1
        assert asked[0].provider_key == guard.provider_key(ident)
        assert dict(asked[0].arguments) == {"customer": "cus_1", "amount": 500}
        assert asked[0].record.token == first + 1


# ----------------------------------------------------------------------------- live duplicates


@BOTH_DRIVERS
def test_async_live_duplicate_waits_then_raises(
    guard: Guard, store: IdempotencyStore, holder: IdempotencyStore, sleeps: Sleeper
) -> None:
    calls = Calls()
    ident = identity("s", "pay.charge")

    @guard.effect("pay.charge", wait=1.0)
    async def charge(amount: int) -> int:
        return calls.hit()

    held = holder.claim(ident, fp(amount=5), LEASE)
    with pytest.raises(AlreadyInProgress) as info:
        run(in_scope("s", lambda: charge(5)))
    assert info.value.record.token == held.record.token
    assert calls.n == 0
    assert sleeps.total == pytest.approx(1.0)
    assert max(sleeps.pauses) <= 0.5
    assert state_of(store, ident.key) == State.IN_PROGRESS


def test_async_live_duplicate_replays_when_the_holder_completes(
    guard: Guard, holder: IdempotencyStore, sleeps: Sleeper
) -> None:
    calls = Calls()
    ident = identity("s", "pay.charge")

    @guard.effect("pay.charge")
    async def charge(amount: int) -> int:
        return calls.hit()

    held = holder.claim(ident, fp(amount=5), LEASE)
    sleeps.hook = lambda n: holder.complete(ident.key, held.record.token, "41", RETENTION) if n == 2 else None
    assert run(in_scope("s", lambda: charge(5))) == 41
    assert calls.n == 0
    assert len(sleeps.pauses) == 2


def test_async_cancelled_while_waiting_leaves_the_holder_alone(
    store: IdempotencyStore, holder: IdempotencyStore
) -> None:
    calls = Calls()
    ident = identity("s", "pay.charge")
    held = holder.claim(ident, fp(amount=5), LEASE).record

    async def main() -> None:
        waiting = asyncio.Event()

        async def never(seconds: float) -> None:
            waiting.set()
            await asyncio.Event().wait()

        guard = Guard(store, lease=LEASE, sleep=forbidden_sleep, async_sleep=never)

        @guard.effect("pay.charge")
        async def charge(amount: int) -> int:
            return calls.hit()

        try:
            with scope("s"):
                task = asyncio.create_task(charge(5))
            await waiting.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        finally:
            guard.close()

    run(main())
    assert calls.n == 0
    assert store.get(ident.key) == held


# -------------------------------------------------------------------------------- cancellation


class BlockingClaims:
    """A store whose ``claim`` blocks until released: lets a test cancel a call mid-claim."""

    def __init__(self, inner: IdempotencyStore) -> None:
        self._inner = inner
        self.entered = threading.Event()
        self.proceed = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def claim(self, *args: Any) -> Any:
        self.entered.set()
        self.proceed.wait(10)
        return self._inner.claim(*args)


def cancel_mid_claim(store: IdempotencyStore, effect: Callable[[Guard], Any], scope_id: str) -> None:
    """Call ``effect`` (built on an offloading guard over ``store``) and cancel it mid-claim."""
    blocking = BlockingClaims(store)
    guard = Guard(blocking, lease=LEASE, sleep=forbidden_sleep, offload=True)  # type: ignore[arg-type]
    call = effect(guard)

    async def main() -> None:
        with scope(scope_id):
            task = asyncio.create_task(call())
        await asyncio.to_thread(blocking.entered.wait, 10)
        task.cancel()  # lands while the claim runs in its worker thread
        blocking.proceed.set()
        with pytest.raises(asyncio.CancelledError):
            await task

    try:
        run(main())
    finally:
        guard.close()


def test_async_cancelled_mid_claim_gives_the_claim_back(guard: Guard, store: IdempotencyStore) -> None:
    calls = Calls()

    def effect(g: Guard) -> Any:
        @g.effect("pay.charge")
        async def charge() -> int:
            return calls.hit()

        return charge

    cancel_mid_claim(store, effect, "s")
    assert calls.n == 0
    assert store.get(identity("s", "pay.charge").key) is None  # not an orphan claim

    @guard.effect("pay.charge")
    async def charge() -> int:
        return calls.hit()

    assert run(in_scope("s", charge)) == 1  # never ran, so it simply runs now


def test_async_cancelled_mid_take_over_leaves_it_in_doubt_and_released(
    guard: Guard, store: IdempotencyStore, holder: IdempotencyStore, clock: FakeClock
) -> None:
    calls = Calls()
    ident = identity("s", "pay.charge")
    t = holder.claim(ident, fp(), LEASE).record.token
    clock.advance(LEASE + 1)  # the holder died

    def effect(g: Guard) -> Any:
        @g.effect("pay.charge")
        async def charge() -> int:
            return calls.hit()

        return charge

    cancel_mid_claim(store, effect, "s")
    rec = store.get(ident.key)
    assert rec is not None
    assert (rec.state, rec.token) == (State.IN_DOUBT, t + 1)  # the dead holder's attempt may have happened
    assert rec.lease_until <= clock.now  # released: the next call resolves at once

    @guard.effect("pay.charge", policy="at_least_once")
    async def charge() -> int:
        return calls.hit()

    assert run(in_scope("s", charge)) == 1
    assert store.get(ident.key).token == t + 2  # type: ignore[union-attr]


@BOTH_DRIVERS
def test_async_cancellation_during_the_effect_leaves_in_doubt(
    guard: Guard, store: IdempotencyStore, clock: FakeClock
) -> None:
    calls = Calls()
    key = identity("s", "pay.charge").key

    async def main() -> None:
        started = asyncio.Event()

        @guard.effect("pay.charge")
        async def charge(amount: int) -> int:
            calls.hit()
            started.set()
            await asyncio.Event().wait()  # the request is on the wire...
            return amount

        with scope("s"):
            task = asyncio.create_task(charge(5))
        await started.wait()
        task.cancel()  # ...when the caller gives up
        with pytest.raises(asyncio.CancelledError):
            await task
        assert task.cancelled()

    run(main())
    rec = store.get(key)
    assert rec is not None
    assert rec.state == State.IN_DOUBT  # it may have happened
    assert rec.lease_until <= clock.now
    assert rec.error is not None
    assert "CancelledError" in json.loads(rec.error)["type"]

    @guard.effect("pay.charge")
    async def charge_again(amount: int) -> int:
        return calls.hit()

    with pytest.raises(OutcomeUnknown):  # never re-run blindly
        run(in_scope("s", lambda: charge_again(5)))
    assert calls.n == 1


def test_async_cancellation_is_not_retried(guard: Guard, store: IdempotencyStore) -> None:
    calls = Calls()

    @guard.effect("pay.charge", provider_idempotent=True, retryable=(asyncio.CancelledError,))
    async def charge(amount: int) -> int:
        calls.hit()
        raise asyncio.CancelledError

    with pytest.raises(asyncio.CancelledError):
        run(in_scope("s", lambda: charge(5)))
    assert calls.n == 1


# ------------------------------------------------------------------------- context, heartbeat


@BOTH_DRIVERS
def test_async_current_effect_and_heartbeat(
    guard: Guard, store: IdempotencyStore, holder: IdempotencyStore, clock: FakeClock
) -> None:
    ident = identity("job", "long.task")
    seen: dict[str, Any] = {}

    @guard.effect("long.task")
    async def long_task() -> str:
        ctx = current_effect()
        seen["ctx"] = (ctx.key, ctx.provider_key, ctx.token, ctx.attempt)
        clock.advance(20)
        seen["deadline"] = ctx.heartbeat()
        seen["now"] = clock.now
        clock.advance(20)
        seen["duplicate"] = holder.claim(ident, fp(), LEASE).outcome
        return "done"

    assert run(in_scope("job", long_task)) == "done"
    rec = store.get(ident.key)
    assert rec is not None
    assert rec.attempts == 1  # the call's own claim, nothing taken over
    assert seen["ctx"] == (ident.key, guard.provider_key(ident), rec.token, 1)
    assert seen["deadline"] == pytest.approx(seen["now"] + LEASE, abs=1e-3)
    assert seen["duplicate"] == ClaimOutcome.EXISTING


def test_async_result_that_cannot_be_stored_is_in_doubt(guard: Guard, store: IdempotencyStore) -> None:
    calls = Calls()

    @guard.effect("make.thing")
    async def make() -> Any:
        calls.hit()
        return Plain(1)

    with pytest.raises(CodecError):
        run(in_scope("s", make))
    assert state_of(store, identity("s", "make.thing").key) == State.IN_DOUBT
    with pytest.raises(OutcomeUnknown):
        run(in_scope("s", make))
    assert calls.n == 1


def test_async_zombie_gets_lost_ownership(
    guard: Guard, store: IdempotencyStore, store_factory: StoreFactory, clock: FakeClock, sleeps: Sleeper
) -> None:
    guard_b = Guard(store_factory.open(), lease=LEASE, sleep=forbidden_sleep, async_sleep=sleeps.asleep)
    ident = identity("s", "pay.charge")
    a_tokens: list[int] = []

    @guard_b.effect("pay.charge", policy="at_least_once")
    async def charge_b(amount: int) -> str:
        return "B"

    @guard.effect("pay.charge", policy="at_least_once")
    async def charge_a(amount: int) -> str:
        a_tokens.append(current_effect().token)
        clock.advance(LEASE + 1)
        assert await in_scope("s", lambda: charge_b(amount)) == "B"
        return "A"

    try:
        with pytest.raises(LostOwnership) as info:
            run(in_scope("s", lambda: charge_a(5)))
    finally:
        guard_b.close()
    (a_token,) = a_tokens
    assert info.value.token == a_token
    rec = store.get(ident.key)
    assert rec is not None
    assert (rec.state, rec.token, rec.result) == (State.SUCCEEDED, a_token + 1, '"B"')


# --------------------------------------------------------------------------- real concurrency


@pytest.mark.parametrize("offload", [None, True, False], ids=["default", "offload", "inline"])
def test_async_tasks_race_one_effect_runs_once(store: IdempotencyStore, offload: bool) -> None:
    racer = Guard(store, lease=LEASE, wait=60.0, offload=offload)  # real asyncio.sleep
    calls = Calls()

    @racer.effect("race.effect")
    async def effect(amount: int) -> str:
        n = calls.hit()
        await asyncio.sleep(0.05)
        return f"run-{n}"

    async def one() -> str:
        with scope("same"):
            return await effect(100)

    async def main() -> list[str]:
        return await asyncio.gather(*(one() for _ in range(32)))

    try:
        results = run(main())
    finally:
        racer.close()
    assert calls.n == 1
    assert results == ["run-1"] * 32


@pytest.mark.parametrize("offload", [None, True, False], ids=["default", "offload", "inline"])
def test_async_unreachable_store_fails_closed(offload: bool) -> None:
    from sagaguard.idempotency.stores.sql import SqlStore

    pytest.importorskip("psycopg")
    store = SqlStore(f"postgresql://postgres@127.0.0.1:{closed_port()}/test", create=False)
    guard = Guard(store, sleep=forbidden_sleep, offload=offload)
    calls = Calls()

    @guard.effect("pay.charge")
    async def charge(amount: int) -> int:
        return calls.hit()

    try:
        with pytest.raises(StoreUnavailable):
            run(in_scope("s", lambda: charge(5)))
    finally:
        guard.close()
        store.close()
    assert calls.n == 0


# ------------------------------------------------------------------------------ OpenTelemetry


def test_async_spans(guard: Guard) -> None:
    exporter = span_exporter()
    if exporter is None:
        pytest.skip("a non-SDK global tracer provider is already set in this process")
    exporter.clear()

    @guard.effect("pay.charge")
    async def charge(amount: int) -> int:
        if amount < 0:
            raise TimeoutError
        return amount

    run(in_scope("s", lambda: charge(5)))
    run(in_scope("s", lambda: charge(5)))
    with pytest.raises(OutcomeUnknown):
        run(in_scope("t", lambda: charge(-1)))
    outcomes = [
        (s.name, s.attributes["sagaguard.effect.outcome"], s.attributes.get("error.type"))
        for s in exporter.get_finished_spans()
    ]
    assert outcomes == [
        ("sagaguard.effect pay.charge", "executed", None),
        ("sagaguard.effect pay.charge", "replayed", None),
        ("sagaguard.effect pay.charge", "in_doubt", "sagaguard.idempotency.errors.OutcomeUnknown"),
    ]


def test_offload_defaults_to_what_the_store_says(store: IdempotencyStore) -> None:
    """SQL stores wait on fsync, so async calls hand them to a thread; Redis and memory answer in
    one round trip, cheaper than two thread hops, so they are called directly."""
    guard = Guard(store)
    try:
        assert guard._offload is (type(store).__name__ == "SqlStore")
        assert Guard(store, offload=True)._offload is True
        assert Guard(store, offload=False)._offload is False
    finally:
        guard.close()
