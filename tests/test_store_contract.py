"""The store contract (idempotency/store.py, DESIGN.md section 4), run against every backend.

Every test takes the ``store`` (or ``store_factory``) fixture, so it runs four times: memory, SQLite,
Postgres and Redis (see conftest.py). Time is the injected ``clock``; nothing sleeps.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from _procs import race_claims_in_processes
from conftest import FakeClock, StoreFactory, closed_port

from idempotency.errors import LostOwnership, StoreError, StoreUnavailable
from idempotency.keys import EffectIdentity, fingerprint
from idempotency.records import ClaimOutcome, Disposition, Record, State
from idempotency.store import IdempotencyStore

LEASE = 30.0
RETENTION = 3600.0
YEAR = 365 * 24 * 3600.0
FP = fingerprint({"amount": 1000, "currency": "eur"})
OTHER_FP = fingerprint({"amount": 2000, "currency": "eur"})
RESULT = json.dumps({"id": "pi_123", "status": "succeeded"})
ERROR = json.dumps({"type": "stripe.CardError", "message": "card declined", "args": []})
CLAIMED, TOOK_OVER, EXISTING = ClaimOutcome.CLAIMED, ClaimOutcome.TOOK_OVER, ClaimOutcome.EXISTING


def ident(
    ordinal: int = 0, *, namespace: str = "tenant-a", scope: str = "run-1", name: str = "charge"
) -> EffectIdentity:
    return EffectIdentity.of(namespace, scope, name, ordinal)


def at(when: float) -> Any:
    """A time as the store returns it: backends may round through their own time types."""
    return pytest.approx(when, abs=1e-3)


def assert_same(actual: Record | None, expected: Record) -> None:
    """The record is unchanged (field by field, times to the millisecond)."""
    assert actual is not None, f"record {expected.key} vanished"
    assert dataclasses.asdict(actual) == pytest.approx(dataclasses.asdict(expected), abs=1e-3)


def assert_lost(call: Callable[[], object], key: str, token: int) -> None:
    with pytest.raises(LostOwnership) as info:
        call()
    assert info.value.key == key
    assert info.value.token == token


def fenced_writes(store: IdempotencyStore, key: str, token: int) -> dict[str, Callable[[], object]]:
    """Every write after the claim, by the holder of ``token``."""
    return {
        "complete": lambda: store.complete(key, token, RESULT, RETENTION),
        "fail-permanent": lambda: store.fail(key, token, Disposition.PERMANENT, ERROR, RETENTION),
        "fail-retryable": lambda: store.fail(key, token, Disposition.RETRYABLE, ERROR, RETENTION),
        "fail-ambiguous": lambda: store.fail(key, token, Disposition.AMBIGUOUS, ERROR, RETENTION),
        "heartbeat": lambda: store.heartbeat(key, token, LEASE),
    }


def assert_all_fenced(store: IdempotencyStore, key: str, token: int) -> None:
    """Every fenced write with ``token`` raises LostOwnership and changes nothing."""
    before = store.get(key)
    for what, call in fenced_writes(store, key, token).items():
        with pytest.raises(LostOwnership) as info:
            call()
        assert (info.value.key, info.value.token) == (key, token), what
        after = store.get(key)
        if before is None:
            assert after is None, f"{what} with a stale token created a record"
        else:
            assert_same(after, before)


# ------------------------------------------------------------------------------------ basics


def test_store_satisfies_protocol(store: IdempotencyStore) -> None:
    assert isinstance(store, IdempotencyStore)


def test_now_is_the_injected_clock(store: IdempotencyStore, clock: FakeClock) -> None:
    assert store.now() == at(clock.now)
    clock.advance(12.5)
    assert store.now() == at(FakeClock.START + 12.5)


def test_get_absent_is_none(store: IdempotencyStore) -> None:
    assert store.get(ident().key) is None


# ------------------------------------------------------------------------------------- claim


def test_claim_absent_creates_in_progress(store: IdempotencyStore, clock: FakeClock) -> None:
    identity = ident(3, namespace="tenant-ü", scope="thread-7/ns:node|task", name="stripe.charge")
    got = store.claim(identity, FP, LEASE)

    assert got.outcome is CLAIMED
    rec = got.record
    assert (rec.key, rec.namespace, rec.scope, rec.name, rec.ordinal) == (
        identity.key,
        "tenant-ü",
        "thread-7/ns:node|task",
        "stripe.charge",
        3,
    )
    assert rec.fingerprint == FP
    assert rec.state is State.IN_PROGRESS
    assert rec.token == 1
    assert rec.attempts == 1
    assert rec.lease_until == at(clock.now + LEASE)
    assert rec.created_at == at(clock.now)
    assert rec.updated_at == at(clock.now)
    assert rec.expires_at is None
    assert rec.result is None
    assert rec.error is None
    assert_same(store.get(identity.key), rec)


def test_claim_while_lease_live_is_existing_and_unchanged(
    store: IdempotencyStore, clock: FakeClock
) -> None:
    identity = ident()
    first = store.claim(identity, FP, LEASE).record
    clock.advance(LEASE - 1)

    again = store.claim(identity, FP, LEASE)
    assert again.outcome is EXISTING
    assert_same(again.record, first)

    other = store.claim(identity, OTHER_FP, LEASE)
    assert other.outcome is EXISTING
    assert_same(other.record, first)
    assert_same(store.get(identity.key), first)


def test_lease_runs_out_exactly_at_its_deadline(store: IdempotencyStore, clock: FakeClock) -> None:
    # Record.lease_live: the holder owns the record while now < lease_until.
    identity = ident()
    first = store.claim(identity, FP, LEASE).record
    clock.set(first.lease_until - 0.5)
    assert store.claim(identity, FP, LEASE).outcome is EXISTING
    clock.set(first.lease_until)
    assert store.claim(identity, FP, LEASE).outcome is TOOK_OVER


def test_distinct_identities_are_distinct_records(store: IdempotencyStore) -> None:
    identities = [
        ident(0),
        ident(1),
        ident(0, namespace="tenant-b"),
        ident(0, scope="run-2"),
        ident(0, name="refund"),
    ]
    for identity in identities:
        got = store.claim(identity, FP, LEASE)
        assert got.outcome is CLAIMED
        assert got.record.token == 1
    for identity in identities:
        rec = store.get(identity.key)
        assert rec is not None
        assert (rec.namespace, rec.scope, rec.name, rec.ordinal) == (
            identity.namespace,
            identity.scope,
            identity.name,
            identity.ordinal,
        )


# ---------------------------------------------------------------------------------- complete


def test_complete_records_success(store: IdempotencyStore, clock: FakeClock) -> None:
    identity = ident()
    claimed = store.claim(identity, FP, LEASE).record
    clock.advance(5)

    done = store.complete(identity.key, 1, RESULT, RETENTION)
    assert done.state is State.SUCCEEDED
    assert done.result == RESULT
    assert done.error is None
    assert done.token == 1
    assert done.attempts == 1
    assert done.fingerprint == FP
    assert done.expires_at == at(clock.now + RETENTION)
    assert done.updated_at == at(clock.now)
    assert done.created_at == at(claimed.created_at)
    assert_same(store.get(identity.key), done)

    clock.advance(LEASE * 10)  # the lease is irrelevant once finished
    replay = store.claim(identity, FP, LEASE)
    assert replay.outcome is EXISTING
    assert replay.record.result == RESULT
    assert_same(replay.record, done)
    conflict = store.claim(identity, OTHER_FP, LEASE)
    assert conflict.outcome is EXISTING
    assert_same(conflict.record, done)


def test_complete_after_complete_is_lost_ownership(store: IdempotencyStore) -> None:
    identity = ident()
    store.claim(identity, FP, LEASE)
    done = store.complete(identity.key, 1, RESULT, RETENTION)
    assert_lost(lambda: store.complete(identity.key, 1, '"other"', RETENTION), identity.key, 1)
    assert_same(store.get(identity.key), done)
    assert_all_fenced(store, identity.key, 1)


def test_fenced_writes_on_absent_key_are_lost_ownership(store: IdempotencyStore) -> None:
    assert_all_fenced(store, ident().key, 1)


def test_result_and_error_text_round_trip(store: IdempotencyStore) -> None:
    result = json.dumps(
        {"text": '日本語 ✓ 🚀 "quoted" \\ \n\t \u0000 end', "blob": "x" * 100_000, "n": [1.5, None]},
        ensure_ascii=False,
    )
    error = json.dumps({"type": "E", "message": "ünïcödé 🚫 ' \" %s {}", "args": [1]})
    ok, bad = ident(0), ident(1)
    store.claim(ok, FP, LEASE)
    store.claim(bad, FP, LEASE)
    assert store.complete(ok.key, 1, result, RETENTION).result == result
    failed = store.fail(bad.key, 1, Disposition.PERMANENT, error, RETENTION)
    assert failed is not None
    assert failed.error == error
    ok_rec, bad_rec = store.get(ok.key), store.get(bad.key)
    assert ok_rec is not None
    assert bad_rec is not None
    assert ok_rec.result == result
    assert bad_rec.error == error


# -------------------------------------------------------------------------------------- fail


def test_fail_permanent_records_failure(store: IdempotencyStore, clock: FakeClock) -> None:
    identity = ident()
    store.claim(identity, FP, LEASE)
    clock.advance(2)

    failed = store.fail(identity.key, 1, Disposition.PERMANENT, ERROR, RETENTION)
    assert failed is not None
    assert failed.state is State.FAILED
    assert failed.error == ERROR
    assert failed.result is None
    assert failed.token == 1
    assert failed.expires_at == at(clock.now + RETENTION)
    assert failed.updated_at == at(clock.now)
    assert_same(store.get(identity.key), failed)

    clock.advance(LEASE * 10)
    replay = store.claim(identity, FP, LEASE)
    assert replay.outcome is EXISTING
    assert_same(replay.record, failed)
    assert_all_fenced(store, identity.key, 1)


def test_fail_retryable_removes_the_record(store: IdempotencyStore, clock: FakeClock) -> None:
    identity = ident()
    store.claim(identity, FP, LEASE)

    assert store.fail(identity.key, 1, Disposition.RETRYABLE, ERROR, RETENTION) is None
    assert store.get(identity.key) is None
    assert store.list() == []

    clock.advance(1)
    again = store.claim(identity, FP, LEASE)
    assert again.outcome is CLAIMED
    assert again.record.state is State.IN_PROGRESS
    assert again.record.attempts == 1
    assert again.record.error is None
    assert again.record.lease_until == at(clock.now + LEASE)


def test_fail_ambiguous_leaves_record_in_doubt(store: IdempotencyStore, clock: FakeClock) -> None:
    identity = ident()
    claimed = store.claim(identity, FP, LEASE).record
    clock.advance(3)

    doubt = store.fail(identity.key, 1, Disposition.AMBIGUOUS, ERROR, RETENTION)
    assert doubt is not None
    assert doubt.state is State.IN_DOUBT
    assert doubt.error == ERROR
    assert doubt.token == 1
    assert doubt.lease_until == 0
    assert doubt.expires_at is None
    assert doubt.updated_at == at(clock.now)
    assert doubt.created_at == at(claimed.created_at)
    assert_same(store.get(identity.key), doubt)

    # Lease released: another fingerprint still conflicts, the same one takes over at once.
    assert_same(store.claim(identity, OTHER_FP, LEASE).record, doubt)
    took = store.claim(identity, FP, LEASE)
    assert took.outcome is TOOK_OVER
    assert took.record.state is State.IN_DOUBT
    assert took.record.token == 2
    assert took.record.attempts == 2
    assert took.record.lease_until == at(clock.now + LEASE)
    assert_same(store.get(identity.key), took.record)
    assert_all_fenced(store, identity.key, 1)


# ------------------------------------------------------------------------ lease and take-over


def test_expired_lease_is_taken_over_in_doubt(store: IdempotencyStore, clock: FakeClock) -> None:
    identity = ident()
    first = store.claim(identity, FP, LEASE).record
    clock.advance(LEASE + 1)

    took = store.claim(identity, FP, LEASE)
    assert took.outcome is TOOK_OVER
    rec = took.record
    assert rec.state is State.IN_DOUBT
    assert rec.token == 2
    assert rec.attempts == 2
    assert rec.lease_until == at(clock.now + LEASE)
    assert rec.fingerprint == FP
    assert rec.created_at == at(first.created_at)
    assert rec.updated_at == at(clock.now)
    assert (rec.namespace, rec.scope, rec.name, rec.ordinal) == (
        first.namespace,
        first.scope,
        first.name,
        first.ordinal,
    )
    assert_same(store.get(identity.key), rec)

    # The new holder's lease is live: nobody else takes it; once it lapses, the next one does.
    assert_same(store.claim(identity, FP, LEASE).record, rec)
    clock.advance(LEASE + 1)
    third = store.claim(identity, FP, LEASE)
    assert third.outcome is TOOK_OVER
    assert (third.record.state, third.record.token, third.record.attempts) == (State.IN_DOUBT, 3, 3)


def test_expired_lease_with_other_fingerprint_is_existing(
    store: IdempotencyStore, clock: FakeClock
) -> None:
    identity = ident()
    first = store.claim(identity, FP, LEASE).record
    clock.advance(LEASE * 100)
    got = store.claim(identity, OTHER_FP, LEASE)
    assert got.outcome is EXISTING
    assert_same(got.record, first)
    assert_same(store.get(identity.key), first)


def test_taken_over_record_resolves_to_success(store: IdempotencyStore, clock: FakeClock) -> None:
    identity = ident()
    store.claim(identity, FP, LEASE)
    clock.advance(LEASE + 1)
    store.claim(identity, FP, LEASE)

    done = store.complete(identity.key, 2, RESULT, RETENTION)
    assert done.state is State.SUCCEEDED
    assert done.result == RESULT
    assert done.token == 2
    assert done.attempts == 2
    assert done.expires_at == at(clock.now + RETENTION)


def test_taken_over_record_can_fail_retryable(store: IdempotencyStore, clock: FakeClock) -> None:
    identity = ident()
    store.claim(identity, FP, LEASE)
    clock.advance(LEASE + 1)
    store.claim(identity, FP, LEASE)
    assert store.fail(identity.key, 2, Disposition.RETRYABLE, ERROR, RETENTION) is None
    assert store.get(identity.key) is None
    assert store.claim(identity, FP, LEASE).outcome is CLAIMED


def test_heartbeat_extends_the_lease(store: IdempotencyStore, clock: FakeClock) -> None:
    identity = ident()
    t0 = clock.now
    store.claim(identity, FP, LEASE)
    clock.advance(20)

    deadline = store.heartbeat(identity.key, 1, LEASE)
    assert deadline == at(t0 + 20 + LEASE)
    rec = store.get(identity.key)
    assert rec is not None
    assert rec.lease_until == at(deadline)
    assert (rec.state, rec.token, rec.attempts) == (State.IN_PROGRESS, 1, 1)

    clock.set(t0 + LEASE + 10)  # past the first deadline, before the extended one
    assert store.claim(identity, FP, LEASE).outcome is EXISTING
    clock.set(deadline + 0.5)
    took = store.claim(identity, FP, LEASE)
    assert took.outcome is TOOK_OVER
    assert took.record.token == 2


def test_heartbeat_by_the_taking_over_holder(store: IdempotencyStore, clock: FakeClock) -> None:
    identity = ident()
    store.claim(identity, FP, LEASE)
    clock.advance(LEASE + 1)
    store.claim(identity, FP, LEASE)
    clock.advance(10)
    deadline = store.heartbeat(identity.key, 2, LEASE * 2)
    assert deadline == at(clock.now + LEASE * 2)
    rec = store.get(identity.key)
    assert rec is not None
    assert (rec.state, rec.token, rec.lease_until) == (State.IN_DOUBT, 2, at(deadline))


# ------------------------------------------------------------------------------ zombie fencing


def test_zombie_worker_is_fenced_after_take_over(
    store_factory: StoreFactory, clock: FakeClock
) -> None:
    worker_a, worker_b = store_factory.open(), store_factory.open()
    identity = ident()
    assert worker_a.claim(identity, FP, LEASE).record.token == 1
    clock.advance(LEASE + 1)
    took = worker_b.claim(identity, FP, LEASE)
    assert took.outcome is TOOK_OVER
    assert took.record.token == 2

    # A wakes up: every write it tries is refused and leaves B's record alone.
    assert_all_fenced(worker_a, identity.key, 1)
    assert_same(worker_b.get(identity.key), took.record)

    done = worker_b.complete(identity.key, 2, RESULT, RETENTION)
    assert (done.state, done.result, done.token) == (State.SUCCEEDED, RESULT, 2)
    assert_same(worker_a.get(identity.key), done)
    assert_all_fenced(worker_a, identity.key, 1)
    assert_all_fenced(worker_b, identity.key, 2)


def test_zombie_of_an_earlier_generation_stays_fenced(
    store_factory: StoreFactory, clock: FakeClock
) -> None:
    worker_a, worker_b = store_factory.open(), store_factory.open()
    identity = ident()
    worker_a.claim(identity, FP, LEASE)
    worker_a.complete(identity.key, 1, RESULT, 100)
    clock.advance(101)

    fresh = worker_b.claim(identity, FP, LEASE)
    assert fresh.outcome is CLAIMED
    assert fresh.record.token == 2
    assert_all_fenced(worker_a, identity.key, 1)
    assert_same(worker_b.get(identity.key), fresh.record)


def test_second_instance_sees_the_same_records(store_factory: StoreFactory) -> None:
    writer, reader = store_factory.open(), store_factory.open()
    identity = ident()
    claimed = writer.claim(identity, FP, LEASE).record
    assert_same(reader.get(identity.key), claimed)
    assert reader.claim(identity, FP, LEASE).outcome is EXISTING
    done = writer.complete(identity.key, 1, RESULT, RETENTION)
    assert_same(reader.get(identity.key), done)
    assert [r.key for r in reader.list()] == [identity.key]


# ---------------------------------------------------------------------------------- retention


@pytest.mark.parametrize("finish", ["complete", "fail-permanent"])
def test_finished_record_past_retention_is_claimed_afresh(
    store: IdempotencyStore, clock: FakeClock, finish: str
) -> None:
    identity = ident()
    store.claim(identity, FP, LEASE)
    retention = 100.0
    if finish == "complete":
        store.complete(identity.key, 1, RESULT, retention)
    else:
        store.fail(identity.key, 1, Disposition.PERMANENT, ERROR, retention)
    done = store.get(identity.key)
    assert done is not None
    assert done.state is (State.SUCCEEDED if finish == "complete" else State.FAILED)

    clock.advance(retention - 1)
    assert_same(store.claim(identity, FP, LEASE).record, done)

    clock.advance(2)  # now past expires_at; a new call with other arguments is a new effect
    fresh = store.claim(identity, OTHER_FP, LEASE)
    assert fresh.outcome is CLAIMED
    rec = fresh.record
    assert rec.state is State.IN_PROGRESS
    assert rec.token == 2  # one above the old generation's, so its zombies stay fenced
    assert rec.attempts == 1
    assert rec.fingerprint == OTHER_FP
    assert rec.result is None
    assert rec.error is None
    assert rec.expires_at is None
    assert rec.lease_until == at(clock.now + LEASE)
    assert rec.created_at == at(clock.now)
    assert_same(store.get(identity.key), rec)
    assert_all_fenced(store, identity.key, 1)


def test_tokens_keep_growing_across_generations(store: IdempotencyStore, clock: FakeClock) -> None:
    identity = ident()
    store.claim(identity, FP, LEASE)
    clock.advance(LEASE + 1)
    assert store.claim(identity, FP, LEASE).record.token == 2
    store.complete(identity.key, 2, RESULT, 10)
    clock.advance(11)
    fresh = store.claim(identity, FP, LEASE)
    assert (fresh.outcome, fresh.record.token) == (CLAIMED, 3)
    store.fail(identity.key, 3, Disposition.PERMANENT, ERROR, 10)
    clock.advance(11)
    assert store.claim(identity, FP, LEASE).record.token == 4


# -------------------------------------------------------------------------------------- purge


def test_purge_deletes_only_expired_finished_records_in_pages(
    store: IdempotencyStore, clock: FakeClock
) -> None:
    t0 = clock.now
    expired: list[str] = []
    kept: dict[str, State] = {}

    for i in range(3):
        identity = ident(i, name="succeeded")
        store.claim(identity, FP, LEASE)
        store.complete(identity.key, 1, RESULT, 10)
        expired.append(identity.key)
    for i in range(2):
        identity = ident(i, name="failed")
        store.claim(identity, FP, LEASE)
        store.fail(identity.key, 1, Disposition.PERMANENT, ERROR, 10)
        expired.append(identity.key)

    long_lived = ident(name="long-retention")
    store.claim(long_lived, FP, LEASE)
    store.complete(long_lived.key, 1, RESULT, 100 * YEAR)
    kept[long_lived.key] = State.SUCCEEDED

    running = ident(name="running")  # IN_PROGRESS, lease long gone by purge time
    store.claim(running, FP, LEASE)
    kept[running.key] = State.IN_PROGRESS

    ambiguous = ident(name="ambiguous")  # IN_DOUBT with lease_until = 0
    store.claim(ambiguous, FP, LEASE)
    store.fail(ambiguous.key, 1, Disposition.AMBIGUOUS, ERROR, 10)
    kept[ambiguous.key] = State.IN_DOUBT

    crashed = ident(name="crashed")  # IN_DOUBT after a take-over
    store.claim(crashed, FP, 1.0)
    clock.advance(5)
    assert store.claim(crashed, FP, LEASE).outcome is TOOK_OVER
    kept[crashed.key] = State.IN_DOUBT

    clock.set(t0 + 10 * YEAR)
    counts = [store.purge(limit=2) for _ in range(4)]
    assert counts == [2, 2, 1, 0]

    for key in expired:
        assert store.get(key) is None, "an expired finished record survived the purge"
    for key, state in kept.items():
        rec = store.get(key)
        assert rec is not None, f"purge deleted a {state} record"
        assert rec.state is state
    assert {r.key for r in store.list(limit=1000)} == set(kept)
    assert store.purge() == 0


def test_purge_keeps_records_before_expiry(store: IdempotencyStore, clock: FakeClock) -> None:
    identities = [ident(i) for i in range(3)]
    for identity in identities:
        store.claim(identity, FP, LEASE)
        store.complete(identity.key, 1, RESULT, 100)
    clock.advance(50)
    assert store.purge() == 0
    assert all(store.get(i.key) is not None for i in identities)
    clock.advance(51)
    assert store.purge() == 3
    assert all(store.get(i.key) is None for i in identities)


# --------------------------------------------------------------------------------------- list


def _populate(store: IdempotencyStore, clock: FakeClock) -> dict[str, tuple[str, State]]:
    """Records in two namespaces and every state; returns key -> (namespace, state)."""
    made: dict[str, tuple[str, State]] = {}
    states = [State.IN_PROGRESS, State.SUCCEEDED, State.FAILED, State.IN_DOUBT]
    for i in range(16):
        namespace = "tenant-a" if i % 3 else "tenant-b"
        state = states[i % 4]
        identity = ident(i, namespace=namespace, name=f"effect-{i % 5}")
        store.claim(identity, FP, LEASE)
        if state is State.SUCCEEDED:
            store.complete(identity.key, 1, RESULT, RETENTION)
        elif state is State.FAILED:
            store.fail(identity.key, 1, Disposition.PERMANENT, ERROR, RETENTION)
        elif state is State.IN_DOUBT:
            store.fail(identity.key, 1, Disposition.AMBIGUOUS, ERROR, RETENTION)
        made[identity.key] = (namespace, state)
    clock.advance(1)
    return made


def test_list_filters_by_state_and_namespace(store: IdempotencyStore, clock: FakeClock) -> None:
    made = _populate(store, clock)

    def keys(**filters: Any) -> list[str]:
        found = store.list(limit=1000, **filters)
        assert [r.key for r in found] == sorted(r.key for r in found), "not ordered by key"
        return [r.key for r in found]

    assert keys() == sorted(made)
    for state in State:
        assert keys(states={state}) == sorted(k for k, (_, s) in made.items() if s is state)
    live = {State.IN_PROGRESS, State.IN_DOUBT}
    assert keys(states=live) == sorted(k for k, (_, s) in made.items() if s in live)
    assert keys(states=[State.IN_DOUBT, State.FAILED]) == sorted(
        k for k, (_, s) in made.items() if s in (State.IN_DOUBT, State.FAILED)
    )
    for namespace in ("tenant-a", "tenant-b"):
        assert keys(namespace=namespace) == sorted(k for k, (n, _) in made.items() if n == namespace)
    assert keys(namespace="tenant-b", states={State.SUCCEEDED}) == sorted(
        k for k, (n, s) in made.items() if n == "tenant-b" and s is State.SUCCEEDED
    )
    assert keys(namespace="nobody") == []
    assert keys(states=set()) == []


def test_list_returns_full_records(store: IdempotencyStore) -> None:
    identity = ident(7, scope="scope-ü", name="email.send")
    store.claim(identity, FP, LEASE)
    done = store.complete(identity.key, 1, RESULT, RETENTION)
    (listed,) = store.list()
    assert_same(listed, done)


def test_list_pages_visit_every_record_once(store: IdempotencyStore, clock: FakeClock) -> None:
    made = _populate(store, clock)
    assert len(store.list(limit=5)) == 5

    seen: list[str] = []
    after: str | None = None
    pages = 0
    while True:
        page = store.list(limit=5, after=after)
        assert len(page) <= 5
        if not page:
            break
        assert after is None or page[0].key > after
        seen += [r.key for r in page]
        after = page[-1].key
        pages += 1
        assert pages <= len(made), "paging does not terminate"
    assert seen == sorted(made)
    assert pages == 4  # 16 records, 5 a page

    in_progress = sorted(k for k, (_, s) in made.items() if s is State.IN_PROGRESS)
    first = store.list(states={State.IN_PROGRESS}, limit=2)
    rest = store.list(states={State.IN_PROGRESS}, limit=100, after=first[-1].key)
    assert [r.key for r in first + rest] == in_progress
    assert store.list(after=max(made)) == []


# -------------------------------------------------------------------------------- concurrency


def _race_threads(store: IdempotencyStore, identity: EffectIdentity, n: int) -> list[Any]:
    barrier = threading.Barrier(n, timeout=60)
    results: list[Any] = [None] * n

    def worker(i: int) -> None:
        try:
            barrier.wait()
            results[i] = store.claim(identity, FP, LEASE)
        except BaseException as exc:
            results[i] = exc

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a claim thread hangs"
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, f"{len(errors)} claims raised, first: {errors[0]!r}"
    return results


def test_64_threads_race_one_claim(store: IdempotencyStore, clock: FakeClock) -> None:
    identity = ident()
    first = _race_threads(store, identity, 64)
    assert Counter(r.outcome for r in first) == {CLAIMED: 1, EXISTING: 63}
    assert {r.record.token for r in first} == {1}
    rec = store.get(identity.key)
    assert rec is not None
    assert (rec.token, rec.attempts) == (1, 1)

    clock.advance(LEASE + 1)  # the winner crashed: exactly one thread may take over
    second = _race_threads(store, identity, 64)
    assert Counter(r.outcome for r in second) == {TOOK_OVER: 1, EXISTING: 63}
    assert {r.record.token for r in second} == {2}
    rec = store.get(identity.key)
    assert rec is not None
    assert (rec.state, rec.token, rec.attempts) == (State.IN_DOUBT, 2, 2)


def test_threads_race_many_keys(store: IdempotencyStore) -> None:
    identities = [ident(i) for i in range(8)]
    n = 16
    barrier = threading.Barrier(n, timeout=60)
    outcomes: list[tuple[str, ClaimOutcome]] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def worker(seed: int) -> None:
        order = identities[:]
        random.Random(seed).shuffle(order)
        try:
            barrier.wait()
            for identity in order:
                got = store.claim(identity, FP, LEASE)
                with lock:
                    outcomes.append((identity.key, got.outcome))
        except BaseException as exc:
            with lock:
                errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, f"first error: {errors[0]!r}"
    claimed = Counter(key for key, outcome in outcomes if outcome is CLAIMED)
    assert claimed == {i.key: 1 for i in identities}
    assert len(outcomes) == n * len(identities)


def test_8_processes_race_one_claim(shared_store_factory: StoreFactory, clock: FakeClock) -> None:
    store = shared_store_factory.open()
    identity = ident()
    store.get(identity.key)  # the parent's instance creates the schema before the children race
    t0 = clock.now
    first, second = race_claims_in_processes(
        shared_store_factory.spec(),
        identity,
        fingerprint=FP,
        lease=LEASE,
        round_times=[t0, t0 + LEASE + 1],
        processes=8,
    )

    assert Counter(r["outcome"] for r in first) == {"claimed": 1, "existing": 7}, first
    assert {r["token"] for r in first} == {1}
    # The claimer "crashed" (never completed); after its lease, exactly one process takes over.
    assert Counter(r["outcome"] for r in second) == {"took_over": 1, "existing": 7}, second
    assert {r["token"] for r in second} == {2}
    rec = store.get(identity.key)
    assert rec is not None
    assert (rec.state, rec.token, rec.attempts) == (State.IN_DOUBT, 2, 2)


# ---------------------------------------------------------------------------- unreachable store


def _claim_on(open_store: Callable[[], IdempotencyStore]) -> None:
    """Open a store and claim; whichever step raises, the error propagates."""
    store = open_store()
    try:
        store.claim(ident(), FP, LEASE)
    finally:
        with contextlib.suppress(StoreError):
            store.close()


def _assert_unavailable(open_store: Callable[[], IdempotencyStore]) -> None:
    started = time.monotonic()
    with pytest.raises(StoreUnavailable) as info:
        _claim_on(open_store)
    elapsed = time.monotonic() - started
    assert info.value.__cause__ is not None, "the driver's error should be chained as __cause__"
    assert info.value.transient
    assert elapsed < 15, f"an unreachable store took {elapsed:.1f}s to fail"


def test_postgres_unreachable_is_store_unavailable(clock: FakeClock) -> None:
    from idempotency.stores.sql import SqlStore

    url = f"postgresql://postgres@127.0.0.1:{closed_port()}/test"
    _assert_unavailable(lambda: SqlStore(url, clock=clock, table_name="sg_unreachable"))


def test_redis_unreachable_is_store_unavailable(clock: FakeClock) -> None:
    from idempotency.stores.redis import RedisStore

    url = f"redis://127.0.0.1:{closed_port()}/0"
    _assert_unavailable(lambda: RedisStore(url, clock=clock, prefix="sg-unreachable"))


def test_sqlite_unopenable_path_is_store_error(clock: FakeClock, tmp_path: Path) -> None:
    from idempotency.stores.sql import SqlStore

    url = f"sqlite:///{tmp_path}/no-such-dir/s.db"
    with pytest.raises(StoreError) as info:
        _claim_on(lambda: SqlStore(url, clock=clock, table_name="sg_unopenable"))
    assert info.value.__cause__ is not None


# ------------------------------------------------------------------------------- server clock


def test_server_clock_round_trip(server_clock_store: IdempotencyStore) -> None:
    store = server_clock_store
    # A sanity check of units (seconds since the epoch), not a timing threshold.
    assert abs(store.now() - time.time()) < 60

    identity = ident()
    claimed = store.claim(identity, FP, LEASE)
    assert claimed.outcome is CLAIMED
    rec = claimed.record
    assert abs(rec.created_at - time.time()) < 60
    assert rec.lease_until - rec.created_at == pytest.approx(LEASE, abs=5)
    assert store.claim(identity, FP, LEASE).outcome is EXISTING

    done = store.complete(identity.key, rec.token, RESULT, RETENTION)
    assert done.state is State.SUCCEEDED
    assert done.updated_at >= rec.created_at - 1
    assert done.expires_at is not None
    assert done.expires_at - done.updated_at == pytest.approx(RETENTION, abs=5)
    assert abs(done.updated_at - time.time()) < 60
    replay = store.claim(identity, FP, LEASE)
    assert replay.outcome is EXISTING
    assert replay.record.result == RESULT


def test_server_clock_in_doubt_take_over_and_heartbeat(server_clock_store: IdempotencyStore) -> None:
    store = server_clock_store
    identity = ident()
    store.claim(identity, FP, LEASE)
    doubt = store.fail(identity.key, 1, Disposition.AMBIGUOUS, ERROR, RETENTION)
    assert doubt is not None
    assert doubt.lease_until == 0
    took = store.claim(identity, FP, LEASE)  # the released lease needs no waiting
    assert (took.outcome, took.record.token) == (TOOK_OVER, 2)
    deadline = store.heartbeat(identity.key, 2, LEASE)
    assert deadline - store.now() == pytest.approx(LEASE, abs=5)
    assert store.purge() == 0
    assert [r.key for r in store.list(states={State.IN_DOUBT})] == [identity.key]


def test_server_clock_takes_over_a_lease_written_in_the_past(
    shared_store_factory: StoreFactory,
) -> None:
    # The fake clock stands in 2023; on the server's clock that lease ran out long ago.
    past, present = shared_store_factory.open(), shared_store_factory.open(clock=None)
    identity = ident()
    assert past.claim(identity, FP, LEASE).outcome is CLAIMED
    took = present.claim(identity, FP, LEASE)
    assert took.outcome is TOOK_OVER
    assert took.record.token == 2
    assert abs(took.record.lease_until - LEASE - time.time()) < 60
    assert_all_fenced(past, identity.key, 1)
