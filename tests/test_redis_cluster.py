"""Redis Cluster: ``redis+cluster://`` URLs, and the store and journal on a real local cluster.

The URL checks need no server. The rest takes the session's ``redis_cluster`` (three primaries,
three replicas, started once; about three seconds): a short smoke test of the store and the journal
across primaries, the key layout's hash tags as the cluster itself sees them, and the persistence
check per node. The full contract suites and the crash tests run on the cluster with ``-m cluster``.
"""

from __future__ import annotations

import json
import uuid
import warnings
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from _rediscluster import LocalCluster
from conftest import FakeClock, _delete_redis_prefix, closed_port, delete_cluster_prefix, require_redis
from redis.cluster import RedisCluster

from sagaguard.idempotency import Guard, MemoryStore
from sagaguard.idempotency.backends.redis_client import connect
from sagaguard.idempotency.backends.redis_persistence import DurabilityWarning, check_persistence
from sagaguard.idempotency.backends.urls import check_url, cluster_url
from sagaguard.idempotency.errors import ConfigurationError, StoreUnavailable
from sagaguard.idempotency.keys import EffectIdentity
from sagaguard.idempotency.records import State
from sagaguard.idempotency.stores import open_store
from sagaguard.idempotency.stores.redis import RedisStore
from sagaguard.saga import Saga, SagaRunner, SagaState, StepContext
from sagaguard.saga.errors import JournalUnavailable
from sagaguard.saga.journals import open_journal
from sagaguard.saga.journals.redis import RedisJournal

# ------------------------------------------------------------------------------------ the URL


def test_a_cluster_url_lists_its_nodes_and_shares_its_options() -> None:
    parsed = cluster_url(
        "redis+cluster://app:s3cret@10.0.0.1:7000,10.0.0.2,[::1]:7002/?socket_keepalive=true"
    )
    assert parsed.nodes == (("10.0.0.1", 7000), ("10.0.0.2", 6379), ("::1", 7002))
    assert parsed.node_url == "redis://app:s3cret@10.0.0.1:7000/0?socket_keepalive=true"
    assert cluster_url("rediss+cluster://h:7000/0").node_url == "rediss://h:7000/0"
    assert check_url("REDIS+CLUSTER://h:7000") == "redis+cluster"


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("redis+cluster://", "malformed node ''"),
        ("redis+cluster://h:7000,,h:7001", "malformed node ''"),
        ("redis+cluster://h:port", "malformed"),
        ("redis+cluster://u:s3cret@h:99999", "malformed"),
        ("redis+cluster://u:s3cret@h:7000/2", "only database 0"),
    ],
)
@pytest.mark.parametrize("opener", [open_store, open_journal], ids=["store", "journal"])
def test_a_bad_cluster_url_is_a_configuration_error_with_the_password_masked(
    url: str, says: str, opener: object
) -> None:
    with pytest.raises(ConfigurationError, match=says) as info:
        opener(url)  # type: ignore[operator]
    assert "s3cret" not in str(info.value)


def test_an_unknown_option_is_refused_before_connecting() -> None:
    # Nothing listens there: the option is refused first (redis-py's cluster client would drop it).
    with pytest.raises(ConfigurationError, match="no_such_option"):
        RedisStore(f"redis+cluster://127.0.0.1:{closed_port()}/?no_such_option=1")


def test_a_prefix_that_would_break_the_hash_tag_is_refused_before_connecting() -> None:
    url = f"redis+cluster://127.0.0.1:{closed_port()}"
    for prefix in ("a{b", "a}b", "{x}"):
        with pytest.raises(ConfigurationError, match="brace-free"):
            RedisStore(url, prefix=prefix)
        with pytest.raises(ConfigurationError, match="brace-free"):
            RedisJournal(url, prefix=prefix)


def test_an_unreachable_cluster_is_unavailable() -> None:
    url = f"redis+cluster://127.0.0.1:{closed_port()},127.0.0.1:{closed_port()}"
    with pytest.raises(StoreUnavailable):
        open_store(url)
    with pytest.raises(JournalUnavailable):
        open_journal(url)


# --------------------------------------------------------------------------- on a real cluster


@pytest.fixture
def prefix(redis_cluster: LocalCluster) -> Iterator[str]:
    unique = f"sgcl-{uuid.uuid4().hex[:10]}"
    yield unique
    delete_cluster_prefix(redis_cluster.url, unique)


def _primaries_of(client: RedisCluster, names: list[str]) -> set[str]:
    return {client.get_node_from_key(name).name for name in names}


def test_guarded_calls_on_a_cluster_run_once_and_list_across_primaries(
    redis_cluster: LocalCluster, prefix: str
) -> None:
    store = RedisStore(redis_cluster.url, prefix=prefix)
    guard = Guard(store)
    ran: Counter[str] = Counter()

    def effect(key: str) -> str:
        ran[key] += 1
        return f"done-{key}"

    keys = [f"order-{i}" for i in range(24)]
    first = [guard.run("charge", lambda k=k: effect(k), key=k) for k in keys]  # type: ignore[misc]
    again = [guard.run("charge", lambda k=k: effect(k), key=k) for k in keys]  # type: ignore[misc]

    assert first == again == [f"done-{k}" for k in keys]
    assert ran == Counter(keys)  # every effect once; the second pass replayed the records
    listed = store.list(limit=1000)
    assert len(listed) == len(keys) and {r.state for r in listed} == {State.SUCCEEDED}
    client, _ = connect(redis_cluster.url, "probe")
    try:
        # The records are spread over the primaries, and the listing found them on each.
        names = [f"{prefix}:{{{r.key}}}" for r in listed]
        assert len(_primaries_of(client, names)) == 3  # type: ignore[arg-type]
    finally:
        client.close()
    store.close()


def test_a_cluster_client_passed_in_is_used_and_left_open(redis_cluster: LocalCluster, prefix: str) -> None:
    client, _ = connect(redis_cluster.url, "probe")
    assert isinstance(client, RedisCluster)
    store = RedisStore(client, prefix=prefix)
    assert Guard(store).run("ping", lambda: 1, key="k") == 1
    store.close()
    assert client.ping()  # still open: the caller's
    client.close()


def test_a_saga_keeps_its_keys_in_one_slot_and_the_sweep_sees_every_primary(
    redis_cluster: LocalCluster, prefix: str
) -> None:
    clock = FakeClock()
    journal = RedisJournal(redis_cluster.url, clock=clock, prefix=prefix)
    ids = [f"trip-{i}" for i in range(12)]
    for saga_id in ids:
        journal.start(saga_id, name="trip", version=1, input="{}", fingerprint="fp", lease=5.0)
        journal.signal(saga_id, "approved", "{}")  # the third key of the saga
    client, _ = connect(redis_cluster.url, "probe")
    try:
        names = [str(n) for n in client.scan_iter(match=f"{prefix}:*", count=1000)]
        slots: dict[str, set[int]] = {}
        for name in names:
            if name.endswith(":due"):
                continue
            saga_id = name[name.index("{") + 1 : name.index("}")]
            slots.setdefault(saga_id, set()).add(int(client.execute_command("CLUSTER KEYSLOT", name)))
        assert set(slots) == set(ids)
        assert all(len(s) == 1 for s in slots.values()), slots  # a saga's scripts touch one slot
        assert len(_primaries_of(client, [f"{prefix}:{{{i}}}" for i in ids])) == 3  # type: ignore[arg-type]
    finally:
        client.close()
    assert {r.saga_id for r in journal.list(limit=100)} == set(ids)
    clock.advance(10.0)  # every lease ran out
    assert {r.saga_id for r in journal.due(limit=100)} == set(ids)
    assert {r.state for r in journal.list(limit=100)} == {SagaState.RUNNING}
    journal.close()


def test_the_persistence_check_reads_every_node(redis_cluster: LocalCluster) -> None:
    client, _ = connect(redis_cluster.url, "probe")
    assert isinstance(client, RedisCluster)
    replica = client.get_replicas()[0]
    node = client.get_redis_connection(replica)
    what = f"effect store {uuid.uuid4().hex[:6]}"  # checked once per server and purpose
    node.config_set("appendonly", "no")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            check_persistence(client, what)
    finally:
        node.config_set("appendonly", "yes")
        client.close()
    messages = [str(w.message) for w in caught if issubclass(w.category, DurabilityWarning)]
    assert len(messages) == 1, messages  # that node, and only that one of the six
    assert replica.name in messages[0] and "no persistence" in messages[0]


def test_the_docs_example_and_the_cli_run_on_the_cluster(
    redis_cluster: LocalCluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from test_docs_examples import run_example

    from sagaguard.idempotency.cli import main

    try:
        first = run_example("redis_cluster.py", tmp_path, redis_cluster.url)
        again = run_example("redis_cluster.py", tmp_path, redis_cluster.url)
        capsys.readouterr()
        code = main(["--store", redis_cluster.url, "effects", "list", "--state", "succeeded", "--json"])
        listed = json.loads(capsys.readouterr().out)
    finally:
        delete_cluster_prefix(redis_cluster.url, "sg:{")
    assert code == 0 and len(listed) == 6  # the CLI lists the records of every primary
    assert first.returncode == 0, first.stderr
    assert "6 records; invoices sent by this process: 6" in first.stdout
    assert again.returncode == 0, again.stderr
    assert "6 records; invoices sent by this process: 0" in again.stdout  # replayed from the cluster


# ------------------------------------------------------------------- a claim waits for a replica


@pytest.mark.parametrize(
    ("replicas", "timeout"), [(-1, 1.0), (True, 1.0), ("1", 1.0), (1, 0), (1, float("nan")), (1, "1")]
)
def test_bad_replica_settings_are_configuration_errors(replicas: object, timeout: object) -> None:
    with pytest.raises(ConfigurationError, match=r"wait_replicas|replica_timeout"):
        RedisStore(
            f"redis+cluster://127.0.0.1:{closed_port()}", wait_replicas=replicas, replica_timeout=timeout
        )  # type: ignore[arg-type]


def test_a_claim_no_replica_acknowledged_fails_closed_and_is_released(
    redis_cluster: LocalCluster, prefix: str
) -> None:
    store = RedisStore(redis_cluster.url, prefix=prefix, replica_timeout=0.2)  # waits for 1 by default
    guard = Guard(store, namespace="billing")
    ran: list[str] = []
    record = EffectIdentity.explicit("billing", "order-1", "charge").key
    client, _ = connect(redis_cluster.url, "probe")
    assert isinstance(client, RedisCluster)
    try:
        replica = redis_cluster.replica_of(client.get_node_from_key(f"{prefix}:{{{record}}}").port)
    finally:
        client.close()
    redis_cluster.pause(replica)  # the replica of the record's primary stops acknowledging
    try:
        with pytest.raises(StoreUnavailable, match="0 of 1 replicas acknowledged"):
            guard.run("charge", lambda: ran.append("charged"), key="order-1")
    finally:
        redis_cluster.resume(replica)
    assert ran == []  # fail closed: the effect did not run on an unreplicated claim
    assert store.get(record) is None  # the fresh claim was released: the next attempt claims afresh
    guard.run("charge", lambda: ran.append("charged"), key="order-1")
    assert ran == ["charged"]
    store.close()


def test_one_server_does_not_wait_by_default_and_waits_when_told() -> None:
    url = require_redis()  # a server without replicas
    prefix = f"sgcl-{uuid.uuid4().hex[:10]}"
    plain = RedisStore(url, prefix=prefix)
    assert Guard(plain).run("ping", lambda: 1, key="k") == 1  # no WAIT: it would find no replica
    plain.close()
    strict = RedisStore(url, prefix=prefix, wait_replicas=1, replica_timeout=0.05)
    with pytest.raises(StoreUnavailable, match="0 of 1 replicas"):
        Guard(strict, namespace="n").run("ping", lambda: 1, key="k2")
    assert strict.get(EffectIdentity.explicit("n", "k2", "ping").key) is None
    strict.close()
    _delete_redis_prefix(url, prefix)


def test_the_audit_claims_a_bulk_action_id_in_one_slot(redis_cluster: LocalCluster, prefix: str) -> None:
    """The claim's script touches the audit list and the claims' hash: its hash tag puts the hash
    in the list's slot, so the script runs on a cluster and one claim of an id wins."""
    from sagaguard.idempotency.audit import AuditEntry, TargetKind
    from sagaguard.idempotency.audit.redis import RedisAudit

    log = RedisAudit(redis_cluster.url, prefix=prefix)
    claims = f"{{{prefix}:audit}}:bulk"
    try:
        action_id = uuid.uuid4().hex
        entry = AuditEntry(
            at=1.0, actor="ana", action="bulk.saga.cancel", kind=TargetKind.BULK, target=action_id
        )
        assert log.claim(entry) is not None
        assert log.claim(entry) is None
        assert [e.target for e in log.list()] == [action_id]
        client: RedisCluster = log._client  # type: ignore[attr-defined]
        assert client.keyslot(claims) == client.keyslot(f"{prefix}:audit")
    finally:
        log._client.delete(claims)  # type: ignore[attr-defined]
        log.close()


# ------------------------------------------------------------ the saga journal waits for a replica


@pytest.mark.parametrize(
    ("replicas", "timeout"), [(-1, 1.0), (True, 1.0), ("1", 1.0), (1, 0), (1, float("nan")), (1, "1")]
)
def test_bad_replica_settings_of_the_journal_are_configuration_errors(
    replicas: object, timeout: object
) -> None:
    with pytest.raises(ConfigurationError, match=r"wait_replicas|replica_timeout"):
        RedisJournal(
            f"redis+cluster://127.0.0.1:{closed_port()}", wait_replicas=replicas, replica_timeout=timeout
        )  # type: ignore[arg-type]


def _replica_serving(cluster: LocalCluster, name: str) -> int:
    """The port of the replica of the primary that serves ``name``'s slot."""
    client, _ = connect(cluster.url, "probe")
    assert isinstance(client, RedisCluster)
    try:
        return cluster.replica_of(client.get_node_from_key(name).port)
    finally:
        client.close()


def test_a_saga_step_no_replica_acknowledged_fails_closed_and_runs_once_after(
    redis_cluster: LocalCluster, prefix: str
) -> None:
    """The commit that records the first step done and registers the second (with its
    compensation) is refused when the replica does not acknowledge it: the second step does not
    run. Resumed once the replica is back, each step's effect ran once."""
    journal = RedisJournal(redis_cluster.url, prefix=prefix, replica_timeout=0.2)  # 1 by default
    replica = _replica_serving(redis_cluster, f"{prefix}:{{trip-1}}")
    ran: list[str] = []
    paused: list[int] = []
    trip: Saga[str] = Saga("trip", input=str)

    @trip.step(compensate=lambda ctx, order, result: ran.append("refund"))
    def pay(ctx: StepContext, order: str) -> str:
        ran.append("pay")
        if not paused:  # the replica stops acknowledging before this step is recorded done
            redis_cluster.pause(replica)
            paused.append(replica)
        return "paid"

    @trip.step(compensate=lambda ctx, order, result: ran.append("release"))
    def book(ctx: StepContext, order: str) -> str:
        ran.append("book")
        return "booked"

    runner = SagaRunner(journal, Guard(MemoryStore()), lease=0.5, wait=5.0, renewer=False)
    try:
        with pytest.raises(JournalUnavailable, match="0 of 1 replicas acknowledged"):
            runner.run(trip, "trip-1", "o-1")
    finally:
        redis_cluster.resume(replica)
    assert paused and ran == ["pay"]  # fail closed: the next step did not run unrecorded
    outcome = runner.run(trip, "trip-1", "o-1")  # resumed once the lease ran out
    assert outcome.state is SagaState.COMPLETED
    assert ran == ["pay", "book"]  # the first step's guarded effect replayed, not run again
    snapshot = journal.load("trip-1")
    assert snapshot is not None and [s.name for s in snapshot.steps] == ["pay", "book"]
    journal.close()


def test_a_start_waits_for_the_due_index_on_its_own_primary(redis_cluster: LocalCluster, prefix: str) -> None:
    """A saga's start lowers its due-index entry, which lives on one primary: when that is not
    the saga's primary, the entry is written and waited for first, and the saga is not created
    while no replica holds the entry (a saga the sweep could not find would be lost with its
    runner)."""
    journal = RedisJournal(redis_cluster.url, prefix=prefix, replica_timeout=0.2)
    client, _ = connect(redis_cluster.url, "probe")
    assert isinstance(client, RedisCluster)
    try:
        due = client.get_node_from_key(f"{prefix}:due").name
        saga_id = next(
            f"trip-{i}" for i in range(100) if client.get_node_from_key(f"{prefix}:{{trip-{i}}}").name != due
        )
    finally:
        client.close()
    replica = _replica_serving(redis_cluster, f"{prefix}:due")
    redis_cluster.pause(replica)
    try:
        with pytest.raises(JournalUnavailable, match="0 of 1 replicas acknowledged"):
            journal.start(saga_id, name="trip", version=1, input="{}", fingerprint="fp", lease=5.0)
    finally:
        redis_cluster.resume(replica)
    assert journal.load(saga_id) is None  # the saga's script was not sent
    started = journal.start(saga_id, name="trip", version=1, input="{}", fingerprint="fp", lease=5.0)
    assert started.outcome.value == "created"
    journal.close()


def test_one_server_journal_does_not_wait_by_default_and_waits_when_told() -> None:
    url = require_redis()  # a server without replicas
    prefix = f"sgcl-{uuid.uuid4().hex[:10]}"
    plain = RedisJournal(url, prefix=prefix)
    plain.start("s-1", name="trip", version=1, input="{}", fingerprint="fp", lease=5.0)  # no WAIT
    strict = RedisJournal(url, prefix=prefix, wait_replicas=1, replica_timeout=0.05)
    try:
        with pytest.raises(JournalUnavailable, match="0 of 1 replicas acknowledged"):
            strict.start("s-2", name="trip", version=1, input="{}", fingerprint="fp", lease=5.0)
        with pytest.raises(JournalUnavailable, match="0 of 1 replicas acknowledged"):
            strict.signal("s-1", "approved", "{}")
        assert strict.load("s-1") is not None  # a read does not wait
    finally:
        plain.close()
        strict.close()
        _delete_redis_prefix(url, prefix)


def test_a_bulk_action_claim_no_replica_acknowledged_fails_closed_and_is_taken_back(
    redis_cluster: LocalCluster, prefix: str
) -> None:
    """A bulk action's id claimed on a primary whose replica does not acknowledge it is refused
    and taken back: the action does not run, and a resubmission under the same id runs it."""
    from sagaguard.idempotency.audit import AuditEntry, TargetKind
    from sagaguard.idempotency.audit.redis import RedisAudit

    log = RedisAudit(redis_cluster.url, prefix=prefix, replica_timeout=0.2)  # waits for 1 by default
    claims = f"{{{prefix}:audit}}:bulk"
    entry = AuditEntry(
        at=1.0, actor="ana", action="bulk.saga.retry", kind=TargetKind.BULK, target=uuid.uuid4().hex
    )
    replica = _replica_serving(redis_cluster, f"{prefix}:audit")
    redis_cluster.pause(replica)
    try:
        with pytest.raises(StoreUnavailable, match="0 of 1 replicas acknowledged the claim of bulk"):
            log.claim(entry)
    finally:
        redis_cluster.resume(replica)
    try:
        assert log.list() == []  # taken back
        assert log.claim(entry) is not None  # the resubmission acts
        assert log.claim(entry) is None  # and only once
    finally:
        log._client.delete(claims)  # type: ignore[attr-defined]
        log.close()


def test_one_server_audit_does_not_wait_by_default_and_waits_when_told() -> None:
    from sagaguard.idempotency.audit import AuditEntry, TargetKind
    from sagaguard.idempotency.audit.redis import RedisAudit

    url = require_redis()
    prefix = f"sgcl-{uuid.uuid4().hex[:10]}"
    entry = AuditEntry(at=1.0, actor="ana", action="bulk.x", kind=TargetKind.BULK, target=uuid.uuid4().hex)
    strict = RedisAudit(url, prefix=prefix, wait_replicas=1, replica_timeout=0.05)
    plain = RedisAudit(url, prefix=prefix)
    try:
        with pytest.raises(StoreUnavailable, match="0 of 1 replicas"):
            strict.claim(entry)
        assert plain.claim(entry) is not None  # no WAIT; the refused claim was taken back
    finally:
        strict.close()
        plain.close()
        _delete_redis_prefix(url, prefix)
