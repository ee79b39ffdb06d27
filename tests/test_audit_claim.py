"""A bulk action id is claimed in the ledger itself: of two claimers racing on one id (each with
its own connections, as two console processes have), exactly one gets it, on SQLite, Postgres and
Redis; the audit table set's naming, its option in ``sagaguard db`` and its refusals."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from conftest import require_postgres, require_redis

from sagaguard.idempotency.audit import AuditEntry, AuditFilter, AuditLog, MemoryAudit, TargetKind, open_audit
from sagaguard.idempotency.audit.sql import SqlAudit
from sagaguard.idempotency.audit.sql_schema import audit_table_for
from sagaguard.idempotency.cli import main as cli_main
from sagaguard.idempotency.errors import ConfigurationError, SchemaVersionMismatch
from sagaguard.idempotency.stores.sql import make_engine

pytestmark = pytest.mark.timeout(60)

IDS = 25
"""Action ids the two claimers race on."""


def _bulk(action_id: str, actor: str) -> AuditEntry:
    return AuditEntry(
        at=1000.0, actor=actor, action="bulk.saga.cancel", kind=TargetKind.BULK, target=action_id,
        args={"count": 3}, source="console",
    )  # fmt: skip


@pytest.fixture(params=["memory", "sqlite", "postgres", "redis"])
def two_logs(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[AuditLog, AuditLog]]:
    """Two audit logs on one ledger, each with connections of its own."""
    if request.param == "memory":
        shared = MemoryAudit()
        yield shared, shared
        return
    if request.param == "redis":
        from sagaguard.idempotency.audit.redis import RedisAudit

        url, prefix = require_redis(), f"sgclaim{uuid.uuid4().hex[:8]}"
        logs = (RedisAudit(url, prefix=prefix), RedisAudit(url, prefix=prefix))
        try:
            yield logs
        finally:
            logs[0]._client.delete(f"{prefix}:audit", f"{{{prefix}:audit}}:bulk")  # type: ignore[attr-defined]
            for log in logs:
                log.close()
        return
    url = f"sqlite:///{tmp_path}/claims.db" if request.param == "sqlite" else require_postgres()
    table = f"sg_claim_{uuid.uuid4().hex[:8]}"  # a table of this test's own in the shared database
    sql_logs = (SqlAudit(url, table_name=table), SqlAudit(url, table_name=table, create=False))
    try:
        yield sql_logs
    finally:
        for log in sql_logs:
            log.close()
        engine = make_engine(url)
        with engine.begin() as conn:
            conn.exec_driver_sql(f"DROP TABLE IF EXISTS {table}")
            conn.exec_driver_sql(f"DROP TABLE IF EXISTS {table}_version")
        engine.dispose()


def test_two_racing_claimers_one_wins_each_action_id(two_logs: tuple[AuditLog, AuditLog]) -> None:
    ids = [uuid.uuid4().hex for _ in range(IDS)]
    barrier = threading.Barrier(2)
    won: dict[str, list[str]] = {"ana": [], "bob": []}
    errors: list[BaseException] = []

    def claimer(log: AuditLog, actor: str) -> None:
        barrier.wait()
        try:
            for action_id in ids:
                if log.claim(_bulk(action_id, actor)) is not None:
                    won[actor].append(action_id)
        except BaseException as exc:  # shown by the assertion below
            errors.append(exc)

    pairs = zip(two_logs, won, strict=True)
    threads = [threading.Thread(target=claimer, args=pair) for pair in pairs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert sorted(won["ana"] + won["bob"]) == sorted(ids)  # each id won exactly once
    entries = [e for e in two_logs[0].list(limit=1000) if e.kind is TargetKind.BULK]
    assert sorted(e.target for e in entries) == sorted(ids)  # one entry per id, by its winner
    assert {e.target: e.actor for e in entries} == {i: a for a, mine in won.items() for i in mine}
    assert two_logs[1].claim(_bulk(ids[0], "cy")) is None  # a later claim finds it taken


def test_claim_takes_only_bulk_entries_and_record_never_does() -> None:
    log = MemoryAudit()
    saga = AuditEntry(at=1.0, actor="ana", action="saga.cancel", kind=TargetKind.SAGA, target="s")
    with pytest.raises(ConfigurationError, match="only a bulk"):
        log.claim(saga)
    with pytest.raises(ConfigurationError, match="claim"):
        log.record(_bulk(uuid.uuid4().hex, "ana"))


def test_the_audit_table_is_named_after_the_effects_table(tmp_path: Path) -> None:
    assert audit_table_for() == "sagaguard_audit"
    assert audit_table_for("shop_effects") == "shop_audit"
    assert audit_table_for("fx") == "fx_audit"
    with pytest.raises(ConfigurationError, match="audit table name"):
        audit_table_for("x" * 48)  # 54 characters: no room for its index names in Postgres
    with pytest.raises(ConfigurationError, match="audit table name"):
        SqlAudit(f"sqlite:///{tmp_path}/x.db", table_name="no such")

    url = f"sqlite:///{tmp_path}/two.db"  # two stores in one database keep separate audits
    shop, main_log = open_audit(url, effects_table="shop_effects"), open_audit(url)
    try:
        shop.record(AuditEntry(at=1.0, actor="ana", action="saga.cancel", kind=TargetKind.SAGA, target="s1"))
        assert [e.target for e in shop.list()] == ["s1"] and main_log.list() == []
    finally:
        shop.close()
        main_log.close()


def _version(url: str, table: str, revision: str | None) -> None:
    engine = make_engine(url)
    with engine.begin() as conn:
        if revision is None:
            conn.exec_driver_sql(f"DROP TABLE {table}_version")
        else:
            conn.exec_driver_sql(f"UPDATE {table}_version SET version_num = '{revision}'")
    engine.dispose()


def test_db_upgrade_takes_the_audit_table_and_a_read_refuses_until_then(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"sqlite:///{tmp_path}/db.sqlite"

    def opening() -> AuditLog:
        return open_audit(url, create=False, effects_table="shop_effects")

    with pytest.raises(SchemaVersionMismatch, match="--audit-table shop_audit") as missing:
        opening()
    assert missing.value.state == "empty" and missing.value.table_set == "audit"
    args = ["--store", url, "--only", "audit", "--audit-table", "shop_audit"]
    assert cli_main(["db", "upgrade", *args]) == 0
    assert "audit (shop_audit): created at audit_0001" in capsys.readouterr().out
    assert cli_main(["db", "status", *args]) == 0
    opening().close()

    _version(url, "shop_audit", "audit_0099")  # as a newer sagaguard would leave it
    for create in (False, True):  # never downgraded
        with pytest.raises(SchemaVersionMismatch, match="audit_0099, newer than"):
            open_audit(url, create=create, effects_table="shop_effects")


def test_an_audit_table_made_before_versioned_schemas_gets_the_unique_claim(tmp_path: Path) -> None:
    """The console's first release created the table at open, without a revision and without the
    unique index on bulk action ids: reading refuses it, ``create`` (or ``db upgrade``) adopts it."""
    url = f"sqlite:///{tmp_path}/old.db"
    SqlAudit(url).record(
        AuditEntry(at=1.0, actor="ana", action="saga.cancel", kind=TargetKind.SAGA, target="s")
    )
    engine = make_engine(url)
    with engine.begin() as conn:
        conn.exec_driver_sql("DROP INDEX ux_sagaguard_audit_bulk")
    engine.dispose()
    _version(url, "sagaguard_audit", None)
    with pytest.raises(SchemaVersionMismatch, match="before versioned schemas"):
        SqlAudit(url, create=False)
    log = SqlAudit(url, create=True)  # create=True: upgraded in place
    try:
        assert [e.target for e in log.list(AuditFilter())] == ["s"]  # kept
        action_id = uuid.uuid4().hex
        assert log.claim(_bulk(action_id, "ana")) is not None
        assert log.claim(_bulk(action_id, "bob")) is None
    finally:
        log.close()
    engine = make_engine(url)
    with engine.connect() as conn:
        assert "ux_sagaguard_audit_bulk" in {
            i["name"] for i in sa.inspect(conn).get_indexes("sagaguard_audit")
        }
    engine.dispose()
