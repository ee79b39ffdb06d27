"""The audit trail: every backend keeps what an operator did, who, when (the ledger's clock) and
how it ended; the operator API records both outcomes; the CLI's --actor and ``sagaguard audit``."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from conftest import FakeClock, require_postgres, require_redis

from sagaguard.idempotency.audit import (
    AuditEntry,
    AuditFilter,
    AuditLog,
    Outcome,
    TargetKind,
    audited,
    open_audit,
)
from sagaguard.idempotency.cli import main
from sagaguard.idempotency.errors import ConfigurationError, RecordNotFound
from sagaguard.idempotency.keys import EffectIdentity
from sagaguard.idempotency.operator import EffectBusy, NothingToResolve, resolve_effect
from sagaguard.idempotency.records import Disposition, State
from sagaguard.idempotency.stores import MemoryStore, open_store

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(params=["memory", "sqlite", "postgres", "redis"])
def log(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[AuditLog]:
    if request.param == "memory":
        found = open_audit("memory://")
    elif request.param == "sqlite":
        found = open_audit(f"sqlite:///{tmp_path}/audit.db")
    elif request.param == "postgres":
        found = open_audit(require_postgres())
    else:
        from sagaguard.idempotency.audit.redis import RedisAudit

        found = RedisAudit(require_redis(), prefix=f"sgaudit{uuid.uuid4().hex[:8]}")
    try:
        yield found
    finally:
        if request.param == "redis":
            found._client.delete(found._key)  # type: ignore[attr-defined]
        found.close()


def _entry(target: str, at: float, **kw: object) -> AuditEntry:
    fields: dict[str, object] = {
        "at": at, "actor": "ana", "action": "saga.cancel", "kind": TargetKind.SAGA, "target": target,
        "args": {"reason": "withdrawn"}, "source": "cli",
    }  # fmt: skip
    fields.update(kw)
    return AuditEntry(**fields)  # type: ignore[arg-type]


def test_every_backend_records_and_filters_newest_first(log: AuditLog) -> None:
    run = uuid.uuid4().hex[:8]  # Postgres's table is shared: each run filters on its own targets
    a, b = f"{run}-order-1", f"{run}-order-2"
    first = log.record(_entry(a, 1000.0))
    log.record(_entry(b, 1001.0, actor="bob", action="saga.retry", args={"fresh": True}))
    log.record(_entry(a, 1002.0, outcome=Outcome.REFUSED, error="NotParked", message="x" * 900))
    assert first.id
    mine = log.list(AuditFilter(target_prefix=run))
    assert [(e.target, e.at) for e in mine] == [(a, 1002.0), (b, 1001.0), (a, 1000.0)]
    refused = mine[0]
    assert refused.outcome is Outcome.REFUSED and refused.error == "NotParked"
    assert refused.message is not None and len(refused.message) == 500  # clipped
    assert mine[1].args == {"fresh": True} and mine[1].kind is TargetKind.SAGA and mine[1].source == "cli"
    assert [e.at for e in log.list(AuditFilter(target=a))] == [1002.0, 1000.0]
    assert [e.target for e in log.list(AuditFilter(target_prefix=run, actor="bob"))] == [b]
    assert len(log.list(AuditFilter(target_prefix=run, action="saga."))) == 3
    assert [e.at for e in log.list(AuditFilter(target_prefix=run, action="saga.retry"))] == [1001.0]
    assert [e.at for e in log.list(AuditFilter(target_prefix=run, since=1001.0, until=1002.0))] == [1001.0]
    assert len(log.list(AuditFilter(target_prefix=run), limit=2)) == 2


def test_an_entry_refuses_bad_input() -> None:
    with pytest.raises(ConfigurationError, match="actor"):
        _entry("o", 1.0, actor=" ")
    with pytest.raises(ConfigurationError, match="JSON types"):
        _entry("o", 1.0, args={"when": object()})


def _in_doubt(store: MemoryStore, scope: str, lease: float = 30.0) -> str:
    identity = EffectIdentity.of("default", scope, "stripe.charge", 0)
    claimed = store.claim(identity, "fp", lease).record
    store.fail(claimed.key, claimed.token, Disposition.AMBIGUOUS, "{}", 60.0)
    return claimed.key


def test_resolve_effect_records_ok_and_refused_at_the_stores_clock(clock: FakeClock) -> None:
    store = MemoryStore(clock=clock)
    log = open_audit("memory://")
    key = _in_doubt(store, "order-1")
    clock.advance(120.0)
    record = resolve_effect(store, key[:12], applied=True, result='{"id": "pi_1"}', actor="ana", audit=log)
    assert record.state is State.SUCCEEDED and record.result == '{"id":"pi_1"}'
    with pytest.raises(NothingToResolve):
        resolve_effect(store, key, applied=False, actor="bob", audit=log)
    with pytest.raises(RecordNotFound):
        resolve_effect(store, "f" * 64, applied=False, actor="bob", audit=log)
    done, refused, missing = reversed(log.list())
    assert (done.actor, done.action, done.target, done.outcome, done.at) == (
        "ana", "effect.resolve", key, Outcome.OK, store.now(),
    )  # fmt: skip
    assert done.args == {"applied": True, "name": "stripe.charge", "token": record.token}
    assert "pi_1" not in json.dumps(done.to_json())  # the result is never recorded
    assert (refused.outcome, refused.error, refused.actor) == (Outcome.REFUSED, "NothingToResolve", "bob")
    assert (missing.target, missing.error) == ("f" * 64, "RecordNotFound")


def test_a_live_lease_is_refused_and_recorded(clock: FakeClock) -> None:
    store = MemoryStore(clock=clock)
    log = open_audit("memory://")
    identity = EffectIdentity.of("default", "order-2", "stripe.charge", 0)
    claimed = store.claim(identity, "fp", 600.0).record
    key = claimed.key
    with pytest.raises(EffectBusy):
        resolve_effect(store, key, applied=False, actor="ana", audit=log)
    assert store.get(key) is not None
    assert [(e.outcome, e.error) for e in log.list()] == [(Outcome.REFUSED, "EffectBusy")]
    resolve_effect(store, key, applied=False, force=True, actor="ana", audit=log)
    assert store.get(key) is None
    expected = {"applied": False, "name": "stripe.charge", "token": claimed.token, "force": True}
    assert log.list()[0].args == expected


def test_audited_tags_a_returned_refusal_and_records_nothing_without_a_log() -> None:
    log = open_audit("memory://")
    common = {"at": 5.0, "actor": "ana", "action": "saga.cancel", "kind": TargetKind.SAGA, "args": {}}
    value = audited(
        log,
        target="s",
        source="api",
        act=lambda: "too_late",
        refusal=lambda v: v,
        **common,  # type: ignore[arg-type]
    )
    assert value == "too_late"
    assert [(e.outcome, e.error) for e in log.list()] == [(Outcome.REFUSED, "too_late")]
    assert audited(None, target="s", source="api", act=lambda: 1, **common) == 1  # type: ignore[arg-type]


def test_cli_resolve_records_the_actor_and_audit_lists_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"sqlite:///{tmp_path}/ledger.db"
    monkeypatch.setenv("SAGAGUARD_STORE", url)
    store = open_store(url)
    identity = EffectIdentity.of("default", "order-7", "stripe.charge", 0)
    claimed = store.claim(identity, "fp", 0.001).record  # its lease has run out by the resolve
    store.close()
    # Nobody acted yet: no audit table; looking lists nothing and creates none (a versioned table set).
    assert main(["audit"]) == 0
    assert "no audit entries" in capsys.readouterr().out
    engine = sa.create_engine(url)
    assert "sagaguard_audit" not in sa.inspect(engine).get_table_names()
    engine.dispose()
    assert main(["effects", "resolve", claimed.key[:16], "--not-applied", "--actor", "ana"]) == 0
    assert main(["effects", "resolve", claimed.key[:16], "--not-applied"]) == 1  # gone now: refused
    capsys.readouterr()
    assert main(["audit", "--json"]) == 0
    entries = json.loads(capsys.readouterr().out)
    assert [(e["actor"], e["outcome"], e["source"]) for e in entries][-1] == ("ana", "ok", "cli")
    assert entries[-1]["target"] == claimed.key and entries[-1]["time"].endswith("Z")
    assert main(["audit", "--actor", "ana"]) == 0
    out = capsys.readouterr().out
    assert "effect.resolve" in out and "ana" in out and '"applied":false' in out
    assert main(["audit", "--actor", "nobody"]) == 0
    assert "no audit entries matching" in capsys.readouterr().out
    assert main(["audit", "--store", f"sqlite:///{tmp_path}/typo.db"]) == 1
    assert "does not exist" in capsys.readouterr().err
