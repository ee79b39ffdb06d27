"""The guard's fast paths say and do exactly what the general paths do.

Each shortcut taken on every call (the key deriver fixed per effect, the codec writing plain
results directly, the operation built once for :meth:`Guard.run`, skipping no-op spans) is checked
here against the path it short-cuts, or against the behaviour it must keep; and the Redis store's
claim and complete against what it stores.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sagaguard.idempotency import CodecError, ConfigurationError, Guard, LostOwnership, MemoryStore, scope
from sagaguard.idempotency.codec import Codec
from sagaguard.idempotency.keys import derive_key, fingerprint, key_deriver

# ------------------------------------------------------------------------------ fingerprints

def test_fingerprint_of_an_int_subclass_and_a_nan_are_unchanged() -> None:
    class Level(int):
        pass

    # Both go the general way: an int subclass is converted, a NaN is refused.
    assert fingerprint({"a": Level(3)}) == fingerprint({"a": 3})
    with pytest.raises(CodecError):
        fingerprint({"a": float("nan")})
    with pytest.raises(CodecError):
        fingerprint({"a": "\ud800"})


# ------------------------------------------------------------------------------------- keys


@given(st.text(max_size=30), st.text(max_size=30), st.text(min_size=1, max_size=30), st.integers(0, 2**40))
def test_key_deriver_derives_the_same_keys(namespace: str, unit: str, name: str, ordinal: int) -> None:
    try:
        expected: Any = derive_key(namespace, unit, name, ordinal)
    except (ConfigurationError, CodecError) as exc:
        expected = type(exc)
    try:
        got: Any = key_deriver(namespace, name)(unit, ordinal)
    except (ConfigurationError, CodecError) as exc:
        got = type(exc)
    assert got == expected


def test_key_deriver_refuses_what_derive_key_refuses() -> None:
    with pytest.raises(ConfigurationError):
        key_deriver("ns", "")
    derive = key_deriver("ns", "n")
    with pytest.raises(ConfigurationError):
        derive("s", -1)
    with pytest.raises(ConfigurationError):
        derive("s", True)
    with pytest.raises(ConfigurationError):
        derive("x" * 5000, 0)
    with pytest.raises(CodecError):
        derive("\ud800", 0)


# ------------------------------------------------------------------------------------ codec


@pytest.mark.parametrize(
    ("tp", "value"),
    [(int, 5), (int, -(2**80)), (str, 'a"\\\n\u2028\x00é'), (bool, True), (None, None), (Any, "x"), (Any, 7)],
)
def test_plain_results_read_back_as_written(tp: Any, value: Any) -> None:
    codec: Codec[Any] = Codec(tp)
    text = codec.encode(value)
    assert codec.decode(text) == value
    assert type(codec.decode(text)) is type(value)


def test_plain_results_that_cannot_be_stored_are_still_refused() -> None:
    with pytest.raises(CodecError):
        Codec(str).encode("\ud800")
    with pytest.raises(CodecError):
        Codec(int).encode("5")


# ---------------------------------------------------------------------------- the explicit API


def test_operation_checks_its_options_once_and_runs_like_run() -> None:
    guard = Guard(MemoryStore())
    with pytest.raises(ConfigurationError):
        guard.operation("x", polcy="at_least_once")
    calls: list[int] = []
    charge = guard.operation("pay.charge", result_type=int)
    assert charge.name == "pay.charge"
    with scope("s"):
        assert charge.run(lambda: calls.append(1) or len(calls), arguments={"n": 1}) == 1
    with scope("s"):  # a re-run of the scope replays, through run() as through the operation
        assert guard.run("pay.charge", lambda: 99, arguments={"n": 1}, result_type=int) == 1
        assert charge.run(lambda: 99, arguments={"n": 1}) == 99  # ordinal 1: a new effect
    assert calls == [1]


def test_run_reuses_one_operation_per_name_and_options() -> None:
    guard = Guard(MemoryStore())
    first = guard._operation("a", int, {"policy": "at_least_once"})
    assert guard._operation("a", int, {"policy": "at_least_once"}) is first
    assert guard._operation("a", int, {"policy": "at_most_once"}) is not first
    assert guard._operation("a", int, {"permanent": [ValueError]}) is not guard._operation(
        "a", int, {"permanent": [ValueError]}
    )  # unhashable options: built each time, never confused


def test_operation_with_an_async_reconciler_refuses_a_sync_run() -> None:
    async def reconcile(request: Any) -> Any:
        return None

    op = Guard(MemoryStore()).operation("x", reconciler=reconcile)
    with scope("s"), pytest.raises(ConfigurationError):
        op.run(lambda: 1)


# ----------------------------------------------------------------------- spans without an SDK


_NO_SDK_CHILD = """
from opentelemetry import trace
from sagaguard.idempotency import Guard, MemoryStore, scope

assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)
guard = Guard(MemoryStore())
parent = trace.NonRecordingSpan(
    trace.SpanContext(trace_id=1, span_id=2, is_remote=True, trace_flags=trace.TraceFlags(1))
)
seen = []

@guard.effect("peek")
def peek() -> int:
    seen.append(trace.get_current_span())
    return 1

with trace.use_span(parent), scope("s"):
    peek()
# No no-op span was put in between: a propagator in the body still sends the caller's trace.
assert seen == [parent], seen

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

provider = TracerProvider()
exporter = InMemorySpanExporter()
provider.add_span_processor(SimpleSpanProcessor(exporter))
trace.set_tracer_provider(provider)  # set late: the next call is traced all the same
with trace.use_span(parent), scope("s2"):
    peek()
(span,) = exporter.get_finished_spans()
assert span.name == "sagaguard.effect peek", span.name
assert span.attributes["sagaguard.effect.outcome"] == "executed"
assert span.parent.span_id == 2
assert seen[-1].get_span_context().span_id == span.get_span_context().span_id
print("ok")
"""


def test_spans_are_skipped_only_while_no_tracer_provider_is_set() -> None:
    # In a child process: the global provider can be set only once, and this test sets it late.
    done = subprocess.run(
        [sys.executable, "-c", _NO_SDK_CHILD], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


# ------------------------------------------------------------ redis: completing a held claim


def test_redis_complete_of_a_held_claim_returns_the_record_as_stored() -> None:
    import uuid

    from conftest import FakeClock, require_redis

    from sagaguard.idempotency.keys import EffectIdentity
    from sagaguard.idempotency.records import Disposition, State
    from sagaguard.idempotency.stores.redis import RedisStore

    url, clock = require_redis(), FakeClock()
    prefix = f"sg-held-{uuid.uuid4().hex[:8]}"
    store, other = RedisStore(url, clock=clock, prefix=prefix), RedisStore(url, clock=clock, prefix=prefix)
    fp = "f1_" + "0" * 64
    try:
        # A fresh claim, its lease renewed, then completed: the short reply rebuilds what get() reads.
        fresh = EffectIdentity.of("ns", "s", "held", 0)
        token = store.claim(fresh, fp, 10.0).record.token
        clock.advance(3)
        store.heartbeat(fresh.key, token, 10.0)
        clock.advance(1)
        done = store.complete(fresh.key, token, '"r"', 100.0)
        assert done == store.get(fresh.key)
        assert (done.state, done.result, done.error) == (State.SUCCEEDED, '"r"', None)

        # A take-over of a record left in doubt with an error: completing it clears the error.
        doubt = EffectIdentity.of("ns", "s", "held", 1)
        first = store.claim(doubt, fp, 10.0).record.token
        store.fail(doubt.key, first, Disposition.AMBIGUOUS, '{"type": "x"}', 100.0)
        took = store.claim(doubt, fp, 10.0).record
        assert took.error is not None
        done = store.complete(doubt.key, took.token, "1", 100.0)
        assert done == store.get(doubt.key) and done.error is None and done.attempts == 2

        # Completed by another store object (nothing held there), or under a stale token: the full
        # path, with the same answers.
        third = EffectIdentity.of("ns", "s", "held", 2)
        token = store.claim(third, fp, 10.0).record.token
        assert other.complete(third.key, token, "2", 100.0) == store.get(third.key)
        fourth = EffectIdentity.of("ns", "s", "held", 3)
        token = store.claim(fourth, fp, 10.0).record.token
        with pytest.raises(LostOwnership):
            store.complete(fourth.key, token + 1, "3", 100.0)
        assert store.complete(fourth.key, token, "3", 100.0) == store.get(fourth.key)
    finally:
        for key in store._client.scan_iter(match=f"{prefix}:*"):
            store._client.delete(key)
        store.close()
        other.close()


# ------------------------------------------------------------------ records built without __init__



# ------------------------------------------------------------------ redis: the claim's fast packing


@pytest.fixture
def redis_store() -> Iterator[Any]:
    import uuid

    from conftest import FakeClock, require_redis

    from sagaguard.idempotency.stores.redis import RedisStore

    url = require_redis()
    prefix = f"sg-pack-{uuid.uuid4().hex[:8]}"
    store = RedisStore(url, clock=FakeClock(), prefix=prefix)
    try:
        yield store
    finally:
        for key in store._client.scan_iter(match=f"{prefix}:*"):
            store._client.delete(key)
        store.close()


class _Unusual(str):
    """A str subclass: packed as its text (never its repr), by the general packing and every claim."""


@pytest.mark.parametrize(
    "parts",
    [
        ("ns", "order-1", "pay.charge", "f1_" + "a" * 64),
        ("ns", "commande-é", "pay.charge", "f1_" + "a" * 64),  # not ASCII
        ("espace-ñ", "s", "nom-ü", "f1_ü"),
        ("ns", _Unusual("s"), "n", "f1_x"),
        ("ns", "s", "n", _Unusual("f1_x")),
    ],
)
def test_claim_stores_each_argument_as_its_text(redis_store: Any, parts: tuple[str, str, str, str]) -> None:
    from sagaguard.idempotency.keys import EffectIdentity

    store, (namespace, unit, name, fp) = redis_store, parts
    identity = EffectIdentity(namespace, unit, name, 7, derive_key("ns", "s", "n", 7))
    for lease in (30.0, 30, 30.0):
        claimed = store.claim(identity, fp, lease)
        assert claimed.record == store.get(identity.key)
    assert claimed.outcome.value == "existing"
    stored = store.get(identity.key)
    assert (stored.namespace, stored.scope, stored.name) == (namespace, str.__str__(unit), name)
    assert stored.fingerprint == str.__str__(fp)


def test_claim_of_text_with_no_utf8_form_is_a_codec_error(redis_store: Any) -> None:
    from sagaguard.idempotency.keys import EffectIdentity

    with pytest.raises(CodecError):
        redis_store.claim(EffectIdentity("ns", "\ud800", "n", 0, "sg1_x"), "f1_x", 30.0)


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs os.fork")
def test_a_forked_child_gets_its_own_connections(redis_store: Any) -> None:
    """redis-py's pool notices the fork (another pid) and connects afresh in the child; the
    parent's connections, in use or idle, are never shared."""
    import os

    from sagaguard.idempotency.keys import EffectIdentity

    store = redis_store
    identity = EffectIdentity.of("ns", "s", "fork", 0)
    store.claim(identity, "f1_x", 30.0)
    pid = os.fork()
    if pid == 0:  # the child: the store still works
        code = 1
        try:
            child = EffectIdentity.of("ns", "s", "fork", 1)
            code = 0 if store.claim(child, "f1_x", 30.0).outcome.value == "claimed" else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert store.claim(identity, "f1_x", 30.0).outcome.value == "existing"  # and the parent's works


def test_key_deriver_agrees_around_the_kept_ordinals() -> None:
    derive = key_deriver("ns", "pay.charge")
    for ordinal in (*range(70), 10**6):
        assert derive("scope-é", ordinal) == derive_key("ns", "scope-é", "pay.charge", ordinal)
