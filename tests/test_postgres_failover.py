"""A Postgres primary SIGKILLed in the middle of guarded calls, sagas and outbox enqueues: its
synchronous standby is promoted, and nothing the primary acknowledged is lost.

A local primary with ``synchronous_standby_names`` and its streaming standby (``_pgpair``); every
client connects through the libpq multi-host URL ``host1:p1,host2:p2/...?target_session_attrs=
read-write``, so after the promotion a new connection finds the standby, now writable. Three
threads charge their own orders at a counter service (another process) through a Guard with a
reconciler that asks the service; one thread runs sagas of two guarded steps on a SqlJournal on the
same URL; one enqueues outbox messages. Once a few dozen charges went through, the primary is
SIGKILLed and the standby promoted. Calls in flight fail closed with sagaguard's typed errors and
are retried; at the end:

- the service counts exactly one charge per order and per saga step (0 duplicates);
- every call that returned has its record, succeeded, on the new primary; every saga outcome a
  runner returned is the journal's state there;
- every outbox message whose transaction committed before the kill is delivered exactly once by a
  relay on the new primary.

Runs with ``-m slow`` (it starts and kills its own servers, about 6 s to start them).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator

import pytest
import tenacity
from _pgpair import LocalPgPair, PairStartError, pair_problem
from conftest import require_service
from sqlalchemy import text
from sqlalchemy.exc import SQLAlchemyError
from sqlmodel import Session

from sagaguard.idempotency import Guard, Retry, current_effect, scope
from sagaguard.idempotency.errors import IdempotencyError
from sagaguard.idempotency.outbox import Message, Outbox, create_tables
from sagaguard.idempotency.stores.sql import SqlStore, make_engine
from sagaguard.idempotency.testing import Charge, CounterClient, CounterService
from sagaguard.saga import Saga, SagaRunner, SagaState, StepContext
from sagaguard.saga.errors import SagaError
from sagaguard.saga.journals.sql import SqlJournal

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif("'slow' not in config.getoption('markexpr')", reason="runs with -m slow"),
    pytest.mark.timeout(300),
]

WORKERS = 3
ORDERS = 40
"""Orders per worker thread."""
SAGAS = 20
DEADLINE = 90.0
RIDE_OUT = Retry(stop=tenacity.stop_after_delay(60), wait=tenacity.wait_fixed(0.2))
"""A step's retries outlast a failover (the default, three quick tries, would fail the saga)."""
"""Seconds a worker keeps retrying before it gives up (a bound the test reports, not a measure)."""


@pytest.fixture(scope="module")
def pair() -> Iterator[LocalPgPair]:
    require_service("a local Postgres primary and standby", pair_problem())
    local = LocalPgPair(synchronous=True)
    try:
        local.start()
    except PairStartError as exc:
        require_service("a local Postgres primary and standby", str(exc))
    print(f"\nprimary and synchronous standby started in {local.started_in:.1f} s")
    yield local
    local.stop()


TYPED: tuple[type[Exception], ...] = (IdempotencyError, SagaError)
"""sagaguard's errors: what a guarded call or a saga run may raise when the database goes away."""


def _until(condition: Callable[[], bool], what: str, timeout: float = DEADLINE) -> None:
    """Wait for ``condition`` (polled), failing the test with ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.05)


class Tally:
    """What the client threads saw, under one lock."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.in_flight = 0
        self.errors: Counter[str] = Counter()
        self.untyped: list[BaseException] = []
        self.fault_at: float | None = None
        self.promoted_at: float | None = None
        self.first_success_after_fault: float | None = None

    def attempt(self, call: Callable[[], object], typed: tuple[type[Exception], ...] = TYPED) -> bool:
        """Run one call; True when it returned. ``typed`` errors are counted, others kept."""
        with self.lock:
            self.in_flight += 1
            # Started after the promotion: on the new primary. (A call started between the kill and
            # the promotion may still commit on the old primary: its backend outlives the killed
            # postmaster for a moment, and its commit still waits for the standby.)
            after_fault = self.promoted_at is not None
        try:
            call()
        except typed as exc:
            with self.lock:
                self.errors[type(exc).__name__] += 1
            time.sleep(0.1)  # a worker's back-off, not a measurement
            return False
        except Exception as exc:
            with self.lock:
                self.untyped.append(exc)
            raise
        finally:
            with self.lock:
                self.in_flight -= 1
        with self.lock:
            if after_fault and self.first_success_after_fault is None:
                self.first_success_after_fault = time.monotonic()
        return True


def test_a_primary_killed_mid_run_loses_no_acknowledged_claim_phase_or_message(pair: LocalPgPair) -> None:
    prefix = f"sgpgfo-{uuid.uuid4().hex[:6]}"
    tally = Tally()
    done_orders: list[str] = []
    outcomes: dict[str, SagaState] = {}
    committed: list[str] = []  # outbox messages whose transaction committed
    stop_enqueue = threading.Event()

    engine = make_engine(pair.url)
    outbox = Outbox()
    create_tables(engine)

    with CounterService() as service:
        client = CounterClient(service.url)
        store = SqlStore(pair.url)
        journal = SqlJournal(pair.url)
        guard = Guard(store, namespace="pgfailover", lease=1.0, wait=30.0)
        runner = SagaRunner(journal, guard, lease=1.0)

        @guard.effect("charge", reconciler=client.reconciler())
        def charge(order: str) -> Charge:
            return client.charge(order, 100, provider_key=current_effect().provider_key)

        pay_order: Saga[str] = Saga("pay_order", version=1, input=str)

        @pay_order.step(compensate=None, retry=RIDE_OUT)
        def pay(ctx: StepContext, order: str) -> str:
            return charge(f"{order}:pay").charge_id

        @pay_order.step(compensate=None, retry=RIDE_OUT)
        def ship(ctx: StepContext, order: str) -> str:
            return charge(f"{order}:ship").charge_id

        @outbox.handler("receipt")
        def send_receipt(message: Message) -> None:
            client.charge(f"msg:{message.payload['n']}", 1, provider_key=message.provider_key)

        def worker(n: int) -> None:
            deadline = time.monotonic() + DEADLINE
            for i in range(ORDERS):
                order = f"{prefix}-w{n}-o{i}"

                def call(order: str = order) -> None:
                    with scope(order):
                        charge(order)

                while time.monotonic() < deadline:
                    if tally.attempt(call):
                        with tally.lock:
                            done_orders.append(order)
                        break

        def saga_worker() -> None:
            deadline = time.monotonic() + DEADLINE
            for i in range(SAGAS):
                saga_id = f"{prefix}-s{i}"
                result: list[SagaState] = []

                def call(saga_id: str = saga_id, result: list[SagaState] = result) -> None:
                    result.append(runner.run(pay_order, saga_id, saga_id).state)

                while time.monotonic() < deadline:
                    if tally.attempt(call):
                        outcomes[saga_id] = result[-1]
                        break

        def enqueuer() -> None:
            n = 0
            while not stop_enqueue.is_set():
                n += 1

                def call(n: int = n) -> None:
                    with Session(engine) as session:
                        outbox.enqueue(session, "receipt", {"n": n})
                        session.commit()

                # The application's own Session.commit() raises SQLAlchemy's errors, not ours.
                if tally.attempt(call, (*TYPED, SQLAlchemyError)):
                    with tally.lock:
                        committed.append(str(n))
                time.sleep(0.01)

        threads = [threading.Thread(target=worker, args=(n,)) for n in range(WORKERS)]
        threads += [threading.Thread(target=saga_worker), threading.Thread(target=enqueuer)]
        for thread in threads:
            thread.start()
        _until(lambda: len(done_orders) >= 30, "30 charges before the fault")
        with tally.lock:
            at_fault = tally.in_flight
            tally.fault_at = faulted = time.monotonic()
            before = len(committed)
        pair.kill_primary()
        pair.promote()
        with tally.lock:
            tally.promoted_at = promoted = time.monotonic()
        try:
            _until(lambda: len(committed) >= before + 20, "20 enqueues on the new primary")
        finally:
            stop_enqueue.set()
        for thread in threads:
            thread.join(timeout=DEADLINE + 30)
        finished = time.monotonic()

        # The relay on the new primary delivers every message that committed, once.
        relay = outbox.relay(pair.url)
        relay.run(until_idle=True)
        relay.close()
        counts = client.counts()

        with engine.connect() as conn:
            states = dict(conn.execute(text("SELECT scope, state FROM sagaguard_effects")).all())
            port = conn.execute(text("SELECT inet_server_port()")).scalar()
        recorded = {saga_id: journal.load(saga_id) for saga_id in outcomes}
        guard.close()
        store.close()
        journal.close()
        engine.dispose()

    recovered = (tally.first_success_after_fault or finished) - faulted
    duplicates = {k: c for k, c in counts.items() if c > 1}
    print(  # the figures the docs quote; nothing below asserts a duration
        f"\ncalls in flight at the fault: {at_fault}; errors seen: {dict(tally.errors)}; "
        f"duplicates: {len(duplicates)}; standby promoted {promoted - faulted:.2f} s after the kill; "
        f"first success on the new primary {recovered:.2f} s after the kill; "
        f"all done {finished - faulted:.1f} s after it; outbox messages committed: {len(committed)}; "
        f"sagas: {Counter(o.value for o in outcomes.values())}"
    )
    assert tally.untyped == [], tally.untyped  # every failure was a typed error
    assert not any(t.is_alive() for t in threads)
    assert port == pair.ports[1]  # the clients ended on the promoted standby
    assert tally.errors, "no call failed: the fault did not hit a call in flight"
    assert duplicates == {}  # 0 duplicates: effects, saga steps and deliveries
    orders = {f"{prefix}-w{n}-o{i}" for n in range(WORKERS) for i in range(ORDERS)}
    assert set(done_orders) == orders  # every order went through in the end...
    assert {o: counts.get(o) for o in orders if counts.get(o) != 1} == {}  # ...charged once
    # Every acknowledged claim is on the new primary, recorded as succeeded.
    assert {o: states.get(o) for o in done_orders if states.get(o) != "succeeded"} == {}
    # Every saga completed, its two steps charged once each, and every outcome a runner
    # returned is what the new primary's journal says.
    assert len(outcomes) == SAGAS
    assert {s: st for s, st in outcomes.items() if st is not SagaState.COMPLETED} == {}
    journal_states = {s: r.saga.state if r else None for s, r in recorded.items()}
    assert {s: st for s, st in journal_states.items() if st is not outcomes[s]} == {}
    for saga_id in outcomes:
        assert counts.get(f"{saga_id}:pay") == 1 and counts.get(f"{saga_id}:ship") == 1
    # Every committed outbox message delivered exactly once.
    assert {n: counts.get(f"msg:{n}") for n in committed if counts.get(f"msg:{n}") != 1} == {}
