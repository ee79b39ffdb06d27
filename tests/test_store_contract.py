"""The store contract (idempotency/store.py, docs/backends.md), run against every backend.

Every test takes the ``store`` (or ``store_factory``) fixture, so it runs four times: memory, SQLite,
Postgres and Redis (see conftest.py); with ``-m cluster`` a fifth, on a local Redis Cluster. Time is
the injected ``clock``; nothing sleeps.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import random
import secrets
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from _procs import race_claims_in_processes
from conftest import (
    BACKENDS,
    CLUSTER,
    SHARED_BACKENDS,
    FakeClock,
    StoreFactory,
    closed_port,
    require_redis,
    store_factory_for,
)

from sagaguard.idempotency import holder
from sagaguard.idempotency.errors import LostOwnership, StoreError, StoreUnavailable
from sagaguard.idempotency.keys import EffectIdentity, check_ledger_id, fingerprint
from sagaguard.idempotency.records import ClaimOutcome, Disposition, Record, State
from sagaguard.idempotency.store import FIRST_TOKEN_BITS, IdempotencyStore

LEASE = 30.0
RETENTION = 3600.0
YEAR = 365 * 24 * 3600.0
FP = fingerprint({"amount": 1000, "currency": "eur"})
OTHER_FP = fingerprint({"amount": 2000, "currency": "eur"})
RESULT = json.dumps({"id": "pi_123", "status": "succeeded"})
ERROR = json.dumps({"type": "stripe.CardError", "message": "card declined", "args": []})
CLAIMED, TOOK_OVER, EXISTING = ClaimOutcome.CLAIMED, ClaimOutcome.TOOK_OVER, ClaimOutcome.EXISTING


@pytest.fixture(params=[*BACKENDS, CLUSTER])
def store_factory(request: pytest.FixtureRequest, clock: FakeClock, tmp_path: Path) -> Iterator[StoreFactory]:
    """conftest's ``store_factory``, and the Redis store on a local Redis Cluster (``-m cluster``)."""
    yield from store_factory_for(request, clock, tmp_path)


@pytest.fixture(params=[*SHARED_BACKENDS, CLUSTER])
def shared_store_factory(
    request: pytest.FixtureRequest, clock: FakeClock, tmp_path: Path
) -> Iterator[StoreFactory]:
    """conftest's ``shared_store_factory``, and the Redis Cluster (``-m cluster``)."""
    yield from store_factory_for(request, clock, tmp_path)


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


def assert_first_token(token: int) -> None:
    """A fresh claim's token: random in [1, 2**48] (store.first_token), an exact int."""
    assert isinstance(token, int)
    assert 1 <= token <= 2**FIRST_TOKEN_BITS, token


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
    assert_first_token(rec.token)
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
        assert_first_token(got.record.token)
        assert got.record.attempts == 1
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

    done = store.complete(identity.key, claimed.token, RESULT, RETENTION)
    assert done.state is State.SUCCEEDED
    assert done.result == RESULT
    assert done.error is None
    assert done.token == claimed.token
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
    t = store.claim(identity, FP, LEASE).record.token
    done = store.complete(identity.key, t, RESULT, RETENTION)
    assert_lost(lambda: store.complete(identity.key, t, '"other"', RETENTION), identity.key, t)
    assert_same(store.get(identity.key), done)
    assert_all_fenced(store, identity.key, t)


def test_fenced_writes_on_absent_key_are_lost_ownership(store: IdempotencyStore) -> None:
    assert_all_fenced(store, ident().key, 1)


def test_result_and_error_text_round_trip(store: IdempotencyStore) -> None:
    result = json.dumps(
        {"text": '日本語 ✓ 🚀 "quoted" \\ \n\t \u0000 end', "blob": "x" * 100_000, "n": [1.5, None]},
        ensure_ascii=False,
    )
    error = json.dumps({"type": "E", "message": "ünïcödé 🚫 ' \" %s {}", "args": [1]})
    ok, bad = ident(0), ident(1)
    ok_token = store.claim(ok, FP, LEASE).record.token
    bad_token = store.claim(bad, FP, LEASE).record.token
    assert store.complete(ok.key, ok_token, result, RETENTION).result == result
    failed = store.fail(bad.key, bad_token, Disposition.PERMANENT, error, RETENTION)
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
    t = store.claim(identity, FP, LEASE).record.token
    clock.advance(2)

    failed = store.fail(identity.key, t, Disposition.PERMANENT, ERROR, RETENTION)
    assert failed is not None
    assert failed.state is State.FAILED
    assert failed.error == ERROR
    assert failed.result is None
    assert failed.token == t
    assert failed.expires_at == at(clock.now + RETENTION)
    assert failed.updated_at == at(clock.now)
    assert_same(store.get(identity.key), failed)

    clock.advance(LEASE * 10)
    replay = store.claim(identity, FP, LEASE)
    assert replay.outcome is EXISTING
    assert_same(replay.record, failed)
    assert_all_fenced(store, identity.key, t)


def test_fail_retryable_removes_the_record(store: IdempotencyStore, clock: FakeClock) -> None:
    identity = ident()
    t = store.claim(identity, FP, LEASE).record.token

    assert store.fail(identity.key, t, Disposition.RETRYABLE, ERROR, RETENTION) is None
    assert store.get(identity.key) is None
    assert store.list() == []

    clock.advance(1)
    again = store.claim(identity, FP, LEASE)
    assert again.outcome is CLAIMED
    assert again.record.state is State.IN_PROGRESS
    assert_first_token(again.record.token)
    assert again.record.token != t  # the deleted record's holder stays fenced
    assert again.record.attempts == 1
    assert again.record.error is None
    assert again.record.lease_until == at(clock.now + LEASE)


def test_fail_ambiguous_leaves_record_in_doubt(store: IdempotencyStore, clock: FakeClock) -> None:
    identity = ident()
    claimed = store.claim(identity, FP, LEASE).record
    t = claimed.token
    clock.advance(3)

    doubt = store.fail(identity.key, t, Disposition.AMBIGUOUS, ERROR, RETENTION)
    assert doubt is not None
    assert doubt.state is State.IN_DOUBT
    assert doubt.error == ERROR
    assert doubt.token == t
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
    assert took.record.token == t + 1
    assert took.record.attempts == 2
    assert took.record.lease_until == at(clock.now + LEASE)
    assert_same(store.get(identity.key), took.record)
    assert_all_fenced(store, identity.key, t)


# ------------------------------------------------------------------------ lease and take-over


def test_expired_lease_is_taken_over_in_doubt(store: IdempotencyStore, clock: FakeClock) -> None:
    identity = ident()
    first = store.claim(identity, FP, LEASE).record
    clock.advance(LEASE + 1)

    took = store.claim(identity, FP, LEASE)
    assert took.outcome is TOOK_OVER
    rec = took.record
    assert rec.state is State.IN_DOUBT
    assert rec.token == first.token + 1
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
    assert (third.record.state, third.record.token, third.record.attempts) == (
        State.IN_DOUBT,
        first.token + 2,
        3,
    )


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
    t = store.claim(identity, FP, LEASE).record.token
    clock.advance(LEASE + 1)
    assert store.claim(identity, FP, LEASE).record.token == t + 1

    done = store.complete(identity.key, t + 1, RESULT, RETENTION)
    assert done.state is State.SUCCEEDED
    assert done.result == RESULT
    assert done.token == t + 1
    assert done.attempts == 2
    assert done.expires_at == at(clock.now + RETENTION)


def test_taken_over_record_can_fail_retryable(store: IdempotencyStore, clock: FakeClock) -> None:
    identity = ident()
    t = store.claim(identity, FP, LEASE).record.token
    clock.advance(LEASE + 1)
    assert store.claim(identity, FP, LEASE).record.token == t + 1
    assert store.fail(identity.key, t + 1, Disposition.RETRYABLE, ERROR, RETENTION) is None
    assert store.get(identity.key) is None
    assert store.claim(identity, FP, LEASE).outcome is CLAIMED


def test_heartbeat_extends_the_lease(store: IdempotencyStore, clock: FakeClock) -> None:
    identity = ident()
    t0 = clock.now
    t = store.claim(identity, FP, LEASE).record.token
    clock.advance(20)

    deadline = store.heartbeat(identity.key, t, LEASE)
    assert deadline == at(t0 + 20 + LEASE)
    rec = store.get(identity.key)
    assert rec is not None
    assert rec.lease_until == at(deadline)
    assert (rec.state, rec.token, rec.attempts) == (State.IN_PROGRESS, t, 1)

    clock.set(t0 + LEASE + 10)  # past the first deadline, before the extended one
    assert store.claim(identity, FP, LEASE).outcome is EXISTING
    clock.set(deadline + 0.5)
    took = store.claim(identity, FP, LEASE)
    assert took.outcome is TOOK_OVER
    assert took.record.token == t + 1


def test_heartbeat_by_the_taking_over_holder(store: IdempotencyStore, clock: FakeClock) -> None:
    identity = ident()
    t = store.claim(identity, FP, LEASE).record.token
    clock.advance(LEASE + 1)
    assert store.claim(identity, FP, LEASE).record.token == t + 1
    clock.advance(10)
    deadline = store.heartbeat(identity.key, t + 1, LEASE * 2)
    assert deadline == at(clock.now + LEASE * 2)
    rec = store.get(identity.key)
    assert rec is not None
    assert (rec.state, rec.token, rec.lease_until) == (State.IN_DOUBT, t + 1, at(deadline))


# ------------------------------------------------------------------------------ zombie fencing


def test_zombie_worker_is_fenced_after_take_over(
    store_factory: StoreFactory, clock: FakeClock
) -> None:
    worker_a, worker_b = store_factory.open(), store_factory.open()
    identity = ident()
    t = worker_a.claim(identity, FP, LEASE).record.token
    assert_first_token(t)
    clock.advance(LEASE + 1)
    took = worker_b.claim(identity, FP, LEASE)
    assert took.outcome is TOOK_OVER
    assert took.record.token == t + 1

    # A wakes up: every write it tries is refused and leaves B's record alone.
    assert_all_fenced(worker_a, identity.key, t)
    assert_same(worker_b.get(identity.key), took.record)

    done = worker_b.complete(identity.key, t + 1, RESULT, RETENTION)
    assert (done.state, done.result, done.token) == (State.SUCCEEDED, RESULT, t + 1)
    assert_same(worker_a.get(identity.key), done)
    assert_all_fenced(worker_a, identity.key, t)
    assert_all_fenced(worker_b, identity.key, t + 1)


def test_zombie_of_an_earlier_generation_stays_fenced(
    store_factory: StoreFactory, clock: FakeClock
) -> None:
    worker_a, worker_b = store_factory.open(), store_factory.open()
    identity = ident()
    t = worker_a.claim(identity, FP, LEASE).record.token
    worker_a.complete(identity.key, t, RESULT, 100)
    clock.advance(101)

    fresh = worker_b.claim(identity, FP, LEASE)
    assert fresh.outcome is CLAIMED
    assert fresh.record.token == t + 1
    assert_all_fenced(worker_a, identity.key, t)
    assert_same(worker_b.get(identity.key), fresh.record)


def test_zombie_of_a_deleted_generation_stays_fenced(
    store_factory: StoreFactory, clock: FakeClock
) -> None:
    # A RETRYABLE failure deletes the record and leaves no trace of its tokens: the next claim must
    # still not hand out a token that a worker of the deleted generation may hold.
    worker_a, worker_b, worker_c = store_factory.open(), store_factory.open(), store_factory.open()
    identity = ident()
    claimed = worker_a.claim(identity, FP, LEASE)
    assert claimed.outcome is CLAIMED
    token_a = claimed.record.token
    clock.advance(LEASE + 1)  # A stalls (a GC pause, a partition) past its lease
    took = worker_b.claim(identity, FP, LEASE)
    assert (took.outcome, took.record.token) == (TOOK_OVER, token_a + 1)
    token_b = took.record.token
    assert worker_b.fail(identity.key, token_b, Disposition.RETRYABLE, ERROR, RETENTION) is None
    assert worker_b.get(identity.key) is None

    fresh = worker_c.claim(identity, FP, LEASE)
    assert fresh.outcome is CLAIMED
    # A wakes up: complete, every fail and heartbeat are refused and leave C's record alone.
    assert_all_fenced(worker_a, identity.key, token_a)
    assert_all_fenced(worker_b, identity.key, token_b)
    assert_same(worker_c.get(identity.key), fresh.record)
    assert fresh.record.token not in (token_a, token_b)
    done = worker_c.complete(identity.key, fresh.record.token, RESULT, RETENTION)
    assert (done.state, done.token) == (State.SUCCEEDED, fresh.record.token)
    assert_all_fenced(worker_a, identity.key, token_a)


def test_zombie_of_a_purged_generation_stays_fenced(
    store_factory: StoreFactory, clock: FakeClock
) -> None:
    worker_a, worker_b, worker_c = store_factory.open(), store_factory.open(), store_factory.open()
    identity = ident()
    token_a = worker_a.claim(identity, FP, LEASE).record.token
    clock.advance(LEASE + 1)
    token_b = worker_b.claim(identity, FP, LEASE).record.token
    assert token_b == token_a + 1
    worker_b.complete(identity.key, token_b, RESULT, 100)
    clock.advance(101)  # retention passes and the record is purged: no trace of its tokens
    assert worker_c.purge() == 1
    assert worker_c.get(identity.key) is None

    fresh = worker_c.claim(identity, OTHER_FP, LEASE)
    assert fresh.outcome is CLAIMED
    assert_all_fenced(worker_a, identity.key, token_a)
    assert_all_fenced(worker_b, identity.key, token_b)
    assert_same(worker_c.get(identity.key), fresh.record)
    assert fresh.record.token not in (token_a, token_b)


def test_tokens_are_never_reused_across_deletions(store: IdempotencyStore, clock: FakeClock) -> None:
    # Generations of one key, each ended by a deletion (retryable failure or purge), some with a
    # take-over: every token any of them held stays fenced against the live holder.
    identity = ident()
    held: list[int] = []
    for generation in range(12):
        got = store.claim(identity, FP, LEASE)
        assert got.outcome is CLAIMED
        token = got.record.token
        held.append(token)
        if generation % 3 == 1:  # a crash and a take-over within this generation
            clock.advance(LEASE + 1)
            took = store.claim(identity, FP, LEASE)
            assert (took.outcome, took.record.token) == (TOOK_OVER, token + 1)
            token = took.record.token
            held.append(token)
        if generation % 2:
            store.complete(identity.key, token, RESULT, 10)
            clock.advance(11)
            assert store.purge() == 1
        else:
            assert store.fail(identity.key, token, Disposition.RETRYABLE, ERROR, RETENTION) is None
        assert store.get(identity.key) is None
    assert len(set(held)) == len(held), f"a token was reused: {held}"

    live = store.claim(identity, FP, LEASE).record
    assert live.token not in held
    for token in held:
        assert_all_fenced(store, identity.key, token)
    assert_same(store.get(identity.key), live)


def test_fresh_claims_start_at_a_random_token_exact_in_a_double(
    store: IdempotencyStore, clock: FakeClock
) -> None:
    # Random, not 1: so a deleted generation's tokens are not handed out again. Below 2**53, so
    # Lua (doubles) and JSON carry it exactly, also after a take-over adds one.
    identities = [ident(i) for i in range(8)]
    tokens = [store.claim(identity, FP, LEASE).record.token for identity in identities]
    assert all(isinstance(t, int) and 1 <= t <= 2**48 for t in tokens), tokens
    assert len(set(tokens)) == len(tokens), tokens
    clock.advance(LEASE + 1)
    for identity, token in zip(identities, tokens, strict=True):
        took = store.claim(identity, FP, LEASE)
        assert (took.outcome, took.record.token) == (TOOK_OVER, token + 1)
        rec = store.get(identity.key)
        assert rec is not None
        assert rec.token == token + 1
        done = store.complete(identity.key, token + 1, RESULT, RETENTION)
        assert done.token == token + 1


def test_fresh_claim_stores_the_drawn_token_exactly(
    store: IdempotencyStore, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The top of the range, 2**48, has 15 digits: more than cjson (or Lua's tostring) prints, so a
    # backend that let a token through as a Lua number in JSON would round it.
    monkeypatch.setattr(secrets, "randbits", lambda bits: 2**bits - 1)
    top = 2**FIRST_TOKEN_BITS
    identity = ident()
    got = store.claim(identity, FP, LEASE)
    assert (got.outcome, got.record.token) == (CLAIMED, top)
    assert_same(store.get(identity.key), got.record)
    assert_all_fenced(store, identity.key, top - 1)  # the fence tells neighbours apart
    assert_all_fenced(store, identity.key, top + 1)

    clock.advance(LEASE + 1)
    took = store.claim(identity, FP, LEASE)
    assert (took.outcome, took.record.token) == (TOOK_OVER, top + 1)
    assert_same(store.get(identity.key), took.record)
    assert_all_fenced(store, identity.key, top)
    assert store.heartbeat(identity.key, top + 1, LEASE) == at(clock.now + LEASE)
    done = store.complete(identity.key, top + 1, RESULT, 10)
    assert (done.state, done.token) == (State.SUCCEEDED, top + 1)

    clock.advance(11)  # replacing the expired record counts on from it, whatever randbits says
    again = store.claim(identity, FP, LEASE)
    assert (again.outcome, again.record.token) == (CLAIMED, top + 2)


def test_redis_ttl_eviction_does_not_restart_tokens(clock: FakeClock) -> None:
    # Redis evicts a finished record by its TTL on its own, like purge: the key is simply gone.
    import redis

    from sagaguard.idempotency.stores.redis import RedisStore

    url = require_redis()
    prefix = f"sgtest-ttl-{uuid.uuid4().hex[:12]}"
    store = RedisStore(url, clock=clock, prefix=prefix)
    client = redis.Redis.from_url(url)
    try:
        identity = ident()
        old = store.claim(identity, FP, LEASE).record.token
        store.complete(identity.key, old, RESULT, 0.0)
        name = f"{prefix}:{{{identity.key}}}"
        assert client.pttl(name) > 0  # a finished record carries a TTL...
        client.pexpire(name, 1)  # ...which we shorten rather than wait out
        deadline = time.monotonic() + 10
        while client.exists(name) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not client.exists(name), "redis did not evict the record"

        fresh = store.claim(identity, FP, LEASE)
        assert fresh.outcome is CLAIMED
        assert_all_fenced(store, identity.key, old)
        assert_same(store.get(identity.key), fresh.record)
        assert fresh.record.token != old
    finally:
        store.close()
        for key in client.scan_iter(match=f"*{prefix}*"):
            client.delete(key)
        client.close()


def test_second_instance_sees_the_same_records(store_factory: StoreFactory) -> None:
    writer, reader = store_factory.open(), store_factory.open()
    identity = ident()
    claimed = writer.claim(identity, FP, LEASE).record
    assert_same(reader.get(identity.key), claimed)
    assert reader.claim(identity, FP, LEASE).outcome is EXISTING
    done = writer.complete(identity.key, claimed.token, RESULT, RETENTION)
    assert_same(reader.get(identity.key), done)
    assert [r.key for r in reader.list()] == [identity.key]


# ---------------------------------------------------------------------------------- retention


@pytest.mark.parametrize("finish", ["complete", "fail-permanent"])
def test_finished_record_past_retention_is_claimed_afresh(
    store: IdempotencyStore, clock: FakeClock, finish: str
) -> None:
    identity = ident()
    t = store.claim(identity, FP, LEASE).record.token
    retention = 100.0
    if finish == "complete":
        store.complete(identity.key, t, RESULT, retention)
    else:
        store.fail(identity.key, t, Disposition.PERMANENT, ERROR, retention)
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
    assert rec.token == t + 1  # one above the old generation's, so its zombies stay fenced
    assert rec.attempts == 1
    assert rec.fingerprint == OTHER_FP
    assert rec.result is None
    assert rec.error is None
    assert rec.expires_at is None
    assert rec.lease_until == at(clock.now + LEASE)
    assert rec.created_at == at(clock.now)
    assert_same(store.get(identity.key), rec)
    assert_all_fenced(store, identity.key, t)


def test_tokens_keep_growing_across_generations(store: IdempotencyStore, clock: FakeClock) -> None:
    identity = ident()
    t = store.claim(identity, FP, LEASE).record.token
    clock.advance(LEASE + 1)
    assert store.claim(identity, FP, LEASE).record.token == t + 1
    store.complete(identity.key, t + 1, RESULT, 10)
    clock.advance(11)
    fresh = store.claim(identity, FP, LEASE)
    assert (fresh.outcome, fresh.record.token) == (CLAIMED, t + 2)
    store.fail(identity.key, t + 2, Disposition.PERMANENT, ERROR, 10)
    clock.advance(11)
    assert store.claim(identity, FP, LEASE).record.token == t + 3


# -------------------------------------------------------------------------------------- purge


def test_purge_deletes_only_expired_finished_records_in_pages(
    store: IdempotencyStore, clock: FakeClock
) -> None:
    t0 = clock.now
    expired: list[str] = []
    kept: dict[str, State] = {}

    for i in range(3):
        identity = ident(i, name="succeeded")
        t = store.claim(identity, FP, LEASE).record.token
        store.complete(identity.key, t, RESULT, 10)
        expired.append(identity.key)
    for i in range(2):
        identity = ident(i, name="failed")
        t = store.claim(identity, FP, LEASE).record.token
        store.fail(identity.key, t, Disposition.PERMANENT, ERROR, 10)
        expired.append(identity.key)

    long_lived = ident(name="long-retention")
    t = store.claim(long_lived, FP, LEASE).record.token
    store.complete(long_lived.key, t, RESULT, 100 * YEAR)
    kept[long_lived.key] = State.SUCCEEDED

    running = ident(name="running")  # IN_PROGRESS, lease long gone by purge time
    store.claim(running, FP, LEASE)
    kept[running.key] = State.IN_PROGRESS

    ambiguous = ident(name="ambiguous")  # IN_DOUBT with lease_until = 0
    t = store.claim(ambiguous, FP, LEASE).record.token
    store.fail(ambiguous.key, t, Disposition.AMBIGUOUS, ERROR, 10)
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
        t = store.claim(identity, FP, LEASE).record.token
        store.complete(identity.key, t, RESULT, 100)
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
        t = store.claim(identity, FP, LEASE).record.token
        if state is State.SUCCEEDED:
            store.complete(identity.key, t, RESULT, RETENTION)
        elif state is State.FAILED:
            store.fail(identity.key, t, Disposition.PERMANENT, ERROR, RETENTION)
        elif state is State.IN_DOUBT:
            store.fail(identity.key, t, Disposition.AMBIGUOUS, ERROR, RETENTION)
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
    t = store.claim(identity, FP, LEASE).record.token
    done = store.complete(identity.key, t, RESULT, RETENTION)
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
    (t,) = {r.record.token for r in first}  # every thread saw the winner's record
    assert_first_token(t)
    rec = store.get(identity.key)
    assert rec is not None
    assert (rec.token, rec.attempts) == (t, 1)

    clock.advance(LEASE + 1)  # the winner crashed: exactly one thread may take over
    second = _race_threads(store, identity, 64)
    assert Counter(r.outcome for r in second) == {TOOK_OVER: 1, EXISTING: 63}
    assert {r.record.token for r in second} == {t + 1}
    rec = store.get(identity.key)
    assert rec is not None
    assert (rec.state, rec.token, rec.attempts) == (State.IN_DOUBT, t + 1, 2)


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
    (t,) = {r["token"] for r in first}  # every process saw the winner's record
    assert_first_token(t)
    # The claimer "crashed" (never completed); after its lease, exactly one process takes over.
    assert Counter(r["outcome"] for r in second) == {"took_over": 1, "existing": 7}, second
    assert {r["token"] for r in second} == {t + 1}
    rec = store.get(identity.key)
    assert rec is not None
    assert (rec.state, rec.token, rec.attempts) == (State.IN_DOUBT, t + 1, 2)


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
    from sagaguard.idempotency.stores.sql import SqlStore

    url = f"postgresql://postgres@127.0.0.1:{closed_port()}/test"
    _assert_unavailable(lambda: SqlStore(url, clock=clock, table_name="sg_unreachable"))


def test_redis_unreachable_is_store_unavailable(clock: FakeClock) -> None:
    from sagaguard.idempotency.stores.redis import RedisStore

    url = f"redis://127.0.0.1:{closed_port()}/0"
    _assert_unavailable(lambda: RedisStore(url, clock=clock, prefix="sg-unreachable"))


def test_sqlite_unopenable_path_is_store_error(clock: FakeClock, tmp_path: Path) -> None:
    from sagaguard.idempotency.stores.sql import SqlStore

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
    t = store.claim(identity, FP, LEASE).record.token
    doubt = store.fail(identity.key, t, Disposition.AMBIGUOUS, ERROR, RETENTION)
    assert doubt is not None
    assert doubt.lease_until == 0
    took = store.claim(identity, FP, LEASE)  # the released lease needs no waiting
    assert (took.outcome, took.record.token) == (TOOK_OVER, t + 1)
    deadline = store.heartbeat(identity.key, t + 1, LEASE)
    assert deadline - store.now() == pytest.approx(LEASE, abs=5)
    assert store.purge() == 0
    assert [r.key for r in store.list(states={State.IN_DOUBT})] == [identity.key]


def test_server_clock_takes_over_a_lease_written_in_the_past(
    shared_store_factory: StoreFactory,
) -> None:
    # The fake clock stands in 2023; on the server's clock that lease ran out long ago.
    past, present = shared_store_factory.open(), shared_store_factory.open(clock=None)
    identity = ident()
    claimed = past.claim(identity, FP, LEASE)
    assert claimed.outcome is CLAIMED
    took = present.claim(identity, FP, LEASE)
    assert took.outcome is TOOK_OVER
    assert took.record.token == claimed.record.token + 1
    assert abs(took.record.lease_until - LEASE - time.time()) < 60
    assert_all_fenced(past, identity.key, claimed.record.token)


# ------------------------------------------------------------------------- holder and take-over

DEAD = "some-other-host/4026531836|4242|123456"
"""A holder identity of another process, as a claim in that process would have stored it."""


def claim_as(
    store: IdempotencyStore, monkeypatch: pytest.MonkeyPatch, who: str, identity: EffectIdentity
) -> Record:
    """Claim ``identity`` as the process ``who`` would (its holder identity stored with the claim)."""
    with monkeypatch.context() as patched:
        patched.setattr(holder, "current", lambda: who)
        got = store.claim(identity, FP, LEASE)
    assert got.outcome is CLAIMED
    assert got.record.holder == who
    return got.record


def test_claim_records_this_process_as_holder(store: IdempotencyStore, clock: FakeClock) -> None:
    identity = ident()
    rec = store.claim(identity, FP, LEASE).record
    assert rec.holder == holder.current()
    got = store.get(identity.key)
    assert got is not None and got.holder == holder.current()
    assert store.claim(identity, FP, LEASE).record.holder == holder.current()  # EXISTING: as stored
    done = store.complete(identity.key, rec.token, RESULT, RETENTION)
    assert done.holder == holder.current()
    assert store.list()[0].holder == holder.current()


def test_lease_expiry_take_over_records_the_new_holder(
    store: IdempotencyStore, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    identity = ident()
    claim_as(store, monkeypatch, DEAD, identity)
    clock.advance(LEASE + 1)
    got = store.claim(identity, FP, LEASE)
    assert got.outcome is TOOK_OVER
    assert got.record.holder == holder.current()
    assert_same(store.get(identity.key), got.record)


def test_take_over_a_live_claim_is_fenced_like_a_lease_expiry(
    store: IdempotencyStore, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    identity = ident()
    old = claim_as(store, monkeypatch, DEAD, identity)
    clock.advance(1.0)  # well within the dead holder's lease

    rec = store.take_over(identity.key, old.token, LEASE)

    assert rec is not None
    assert rec.state is State.IN_DOUBT
    assert (rec.token, rec.attempts) == (old.token + 1, 2)
    assert rec.lease_until == at(clock.now + LEASE)
    assert rec.updated_at == at(clock.now)
    assert rec.created_at == at(old.created_at)
    assert rec.holder == holder.current()
    assert (rec.fingerprint, rec.scope, rec.name) == (old.fingerprint, old.scope, old.name)
    assert_same(store.get(identity.key), rec)
    assert_all_fenced(store, identity.key, old.token)  # the dead holder's token is stale now
    # A second take-over under the token seen before is refused and changes nothing.
    assert store.take_over(identity.key, old.token, LEASE) is None
    assert_same(store.get(identity.key), rec)
    # The new holder owns it as after a claim that answered TOOK_OVER.
    done = store.complete(identity.key, rec.token, RESULT, RETENTION)
    assert (done.state, done.token, done.result) == (State.SUCCEEDED, rec.token, RESULT)


def test_take_over_of_an_in_doubt_claim_counts_on(
    store: IdempotencyStore, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    identity = ident()
    claim_as(store, monkeypatch, DEAD, identity)
    clock.advance(LEASE + 1)
    with monkeypatch.context() as patched:  # another process took it over by lease, then died
        patched.setattr(holder, "current", lambda: DEAD)
        taken = store.claim(identity, FP, LEASE).record
    rec = store.take_over(identity.key, taken.token, LEASE)
    assert rec is not None
    assert (rec.state, rec.token, rec.attempts, rec.holder) == (
        State.IN_DOUBT,
        taken.token + 1,
        3,
        holder.current(),
    )


@pytest.mark.parametrize("finish", ["complete", "fail-permanent", "fail-retryable"])
def test_take_over_refuses_a_finished_or_gone_record(
    store: IdempotencyStore, monkeypatch: pytest.MonkeyPatch, finish: str
) -> None:
    identity = ident()
    old = claim_as(store, monkeypatch, DEAD, identity)
    fenced_writes(store, identity.key, old.token)[finish]()
    before = store.get(identity.key)
    assert store.take_over(identity.key, old.token, LEASE) is None
    if before is None:
        assert store.get(identity.key) is None
    else:
        assert_same(store.get(identity.key), before)


def test_take_over_refuses_another_token_and_an_absent_key(
    store: IdempotencyStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    identity = ident()
    old = claim_as(store, monkeypatch, DEAD, identity)
    assert store.take_over(identity.key, old.token + 1, LEASE) is None
    assert store.take_over(identity.key, old.token - 1, LEASE) is None
    assert_same(store.get(identity.key), old)
    assert store.take_over(ident(1).key, 1, LEASE) is None
    assert store.get(ident(1).key) is None


def test_threads_race_one_take_over(store: IdempotencyStore, monkeypatch: pytest.MonkeyPatch) -> None:
    identity = ident()
    old = claim_as(store, monkeypatch, DEAD, identity)
    n = 16
    barrier = threading.Barrier(n, timeout=60)
    results: list[Any] = [None] * n

    def worker(i: int) -> None:
        try:
            barrier.wait()
            results[i] = store.take_over(identity.key, old.token, LEASE)
        except BaseException as exc:
            results[i] = exc

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(isinstance(r, BaseException) for r in results), results
    won = [r for r in results if r is not None]
    assert len(won) == 1, f"{len(won)} take-overs won"
    rec = store.get(identity.key)
    assert rec is not None
    assert (rec.token, rec.attempts) == (old.token + 1, 2) == (won[0].token, won[0].attempts)


# ----------------------------------------------------- the record complete() returns is the one stored


@pytest.mark.parametrize("heartbeat", [False, True], ids=["plain", "after-heartbeat"])
def test_complete_returns_what_was_stored(store: IdempotencyStore, clock: FakeClock, heartbeat: bool) -> None:
    identity = ident(scope=str(uuid.uuid4()))
    claimed = store.claim(identity, FP, LEASE).record
    if heartbeat:
        clock.advance(3)
        store.heartbeat(identity.key, claimed.token, LEASE * 2)
    clock.advance(2)
    done = store.complete(identity.key, claimed.token, '{"ok":true}', RETENTION)
    assert store.get(identity.key) == done


def test_complete_after_a_take_over_returns_what_was_stored(
    shared_store_factory: StoreFactory, clock: FakeClock
) -> None:
    first, second = shared_store_factory.open(), shared_store_factory.open()
    identity = ident(scope=str(uuid.uuid4()))
    zombie = first.claim(identity, FP, LEASE).record
    clock.advance(LEASE + 1)
    took = second.claim(identity, FP, LEASE).record
    assert took.token == zombie.token + 1
    done = second.complete(identity.key, took.token, "1", RETENTION)
    assert second.get(identity.key) == done
    assert done.attempts == 2 and done.token == took.token
    with pytest.raises(LostOwnership):
        first.complete(identity.key, zombie.token, "2", RETENTION)
    assert second.get(identity.key) == done


def test_a_new_ledger_has_an_id_of_its_own_kept_for_its_life(store_factory: StoreFactory) -> None:
    """The ledger id (part of every provider key) is drawn when the ledger is created, read back
    by every later open, and is no record: listing and purging never see it."""
    store = store_factory.open()
    ledger = store.ledger_id()
    assert ledger != "" and check_ledger_id(ledger) == ledger
    assert store_factory.open().ledger_id() == ledger
    assert store.list() == [] and store.purge() == 0
    store.claim(ident(), FP, LEASE)
    assert [r.key for r in store.list()] == [ident().key]
    assert store_factory.open().ledger_id() == ledger  # records do not change it


def test_the_claim_records_the_result_type_and_every_later_write_keeps_it(
    store: IdempotencyStore, clock: FakeClock
) -> None:
    """The declared result type rides on the claim (no write of its own): a fresh claim stores it,
    completion, an ambiguous failure and a take-over keep it, a take-over by code that declares
    another type records that one, and a claim that declares none leaves a record without one."""
    payment = "sagaguard.connectors.stripe._objects.Payment"
    typed = dataclasses.replace(ident(), result_type=payment)
    first = store.claim(typed, FP, LEASE)
    assert first.outcome is CLAIMED and first.record.result_type == payment
    assert store.get(typed.key).result_type == payment  # type: ignore[union-attr]
    done = store.complete(typed.key, first.record.token, RESULT, RETENTION)
    assert done.result_type == payment and store.get(typed.key).result_type == payment  # type: ignore[union-attr]

    second = dataclasses.replace(ident(1), result_type=payment)
    claimed = store.claim(second, FP, LEASE).record
    parked = store.fail(second.key, claimed.token, Disposition.AMBIGUOUS, ERROR, RETENTION)
    assert parked is not None and parked.result_type == payment
    untyped_retry = store.claim(ident(1), FP, LEASE)  # code that declares no type takes it over
    assert untyped_retry.outcome is TOOK_OVER and untyped_retry.record.result_type == payment
    clock.advance(LEASE + 1)
    retyped = store.claim(dataclasses.replace(ident(1), result_type="builtins.dict"), FP, LEASE)
    assert retyped.outcome is TOOK_OVER and retyped.record.result_type == "builtins.dict"
    taken = store.take_over(second.key, retyped.record.token, LEASE)
    assert taken is not None and taken.result_type == "builtins.dict"

    plain = store.claim(ident(2), FP, LEASE)
    assert plain.record.result_type is None and store.get(ident(2).key).result_type is None  # type: ignore[union-attr]
    listed = {r.key: r.result_type for r in store.list(limit=10)}
    assert listed == {typed.key: payment, second.key: "builtins.dict", ident(2).key: None}
