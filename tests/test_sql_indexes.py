"""The effects table's two secondary indexes are partial, and the store's queries still use them.

Why partial: a guarded call that succeeds writes a record in progress with no expiry, then a
succeeded one; with the index on ``state`` holding only in doubt and failed records, and the one on
``expires_at`` only records that have an expiry, that path writes one index entry instead of four,
and every entry is a page in a commit's flush. The cost would be an operator's listing or the
retention sweep walking the whole table, which these plans rule out.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from conftest import require_postgres

from sagaguard.idempotency.records import State
from sagaguard.idempotency.stores.sql import SqlStore, make_engine


@pytest.fixture(params=["sqlite", "postgres"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[SqlStore]:
    url = f"sqlite:///{tmp_path}/indexes.db" if request.param == "sqlite" else require_postgres()
    engine = make_engine(url)
    table = f"sg_ix_{uuid.uuid4().hex[:10]}"
    store = SqlStore(engine, table_name=table)
    yield store
    with engine.begin() as conn:
        for dropped in (table, f"{table}_version"):
            conn.execute(sa.text(f'DROP TABLE IF EXISTS "{dropped}"'))
    store.close()
    engine.dispose()


def _plan(store: SqlStore, clause: sa.ClauseElement) -> str:
    """The database's plan for ``clause``, as one string (index scans preferred to sequential ones
    on Postgres, whose planner would read an empty table whole)."""
    compiled = clause.compile(dialect=store._engine.dialect, compile_kwargs={"render_postcompile": True})
    sql, order = compiled.string, compiled.positiontup
    params: object = compiled.params if order is None else tuple(compiled.params[k] for k in order)
    raw = store._engine.raw_connection()
    try:
        cursor = raw.cursor()
        if store._postgres:
            cursor.execute("SET LOCAL enable_seqscan = off")
            cursor.execute("EXPLAIN " + sql, params)
        else:
            cursor.execute("EXPLAIN QUERY PLAN " + sql, params)
        plan = " | ".join(str(row[-1]) for row in cursor.fetchall())
        raw.rollback()
        return plan
    finally:
        raw.close()


def _listing_plan(store: SqlStore, states: list[State]) -> str:
    return _plan(store, store._listing(states, None, 100, "k1_"))


def _index_sql(store: SqlStore) -> dict[str, str]:
    """Each secondary index of the store's table, by name: its definition as the database keeps it."""
    table = store._table.name
    with store._engine.connect() as conn:
        if store._postgres:
            rows = conn.execute(
                sa.text("SELECT indexname, indexdef FROM pg_indexes WHERE tablename = :t"), {"t": table}
            )
        else:
            rows = conn.execute(
                sa.text("SELECT name, sql FROM sqlite_master WHERE type = 'index' AND tbl_name = :t"),
                {"t": table},
            )
        return {name: sql for name, sql in rows if sql is not None and not name.endswith("_pkey")}


def test_both_secondary_indexes_are_partial(store: SqlStore) -> None:
    table = store._table.name
    found = _index_sql(store)
    assert sorted(found) == sorted([f"ix_{table}_expiring", f"ix_{table}_rare"])
    assert "WHERE" in found[f"ix_{table}_expiring"].upper()
    assert "IS NOT NULL" in found[f"ix_{table}_expiring"].upper()
    rare = found[f"ix_{table}_rare"]
    assert "in_doubt" in rare and "failed" in rare
    assert "in_progress" not in rare and "succeeded" not in rare


@pytest.mark.parametrize(
    "states",
    [[State.IN_DOUBT], [State.FAILED], [State.FAILED, State.IN_DOUBT]],
    ids=["in-doubt", "failed", "both"],
)
def test_listing_rare_states_is_a_scan_of_their_index(store: SqlStore, states: list[State]) -> None:
    assert f"ix_{store._table.name}_rare" in _listing_plan(store, states)


@pytest.mark.parametrize("state", [State.IN_PROGRESS, State.SUCCEEDED], ids=["in-progress", "succeeded"])
def test_listing_other_states_walks_the_primary_key(store: SqlStore, state: State) -> None:
    plan = _listing_plan(store, [state])
    assert "_rare" not in plan
    assert ("autoindex" in plan) if not store._postgres else ("_pkey" in plan)


def test_the_retention_sweep_is_a_scan_of_the_expiring_index(store: SqlStore) -> None:
    assert f"ix_{store._table.name}_expiring" in _plan(store, store._purging(10))


def test_listing_finds_what_it_should_through_the_partial_index(store: SqlStore) -> None:
    """The extra condition (the index's, repeated) changes no answer."""
    from sagaguard.idempotency.keys import EffectIdentity
    from sagaguard.idempotency.records import Disposition

    fp = "f1_" + "0" * 64
    made: dict[State, set[str]] = {state: set() for state in State}
    for i, state in enumerate([State.IN_PROGRESS, State.SUCCEEDED, State.FAILED, State.IN_DOUBT] * 3):
        identity = EffectIdentity.of("ix", f"run-{i}", "pay.charge", 0)
        token = store.claim(identity, fp, 60.0).record.token
        if state is State.SUCCEEDED:
            store.complete(identity.key, token, "1", 3600.0)
        elif state is State.FAILED:
            store.fail(identity.key, token, Disposition.PERMANENT, "declined", 3600.0)
        elif state is State.IN_DOUBT:
            store.fail(identity.key, token, Disposition.AMBIGUOUS, "timed out", 3600.0)
        made[state].add(identity.key)
    for state in State:
        assert {r.key for r in store.list(states=[state])} == made[state]
    both = {r.key for r in store.list(states=[State.IN_DOUBT, State.FAILED])}
    assert both == made[State.IN_DOUBT] | made[State.FAILED]
    assert len(store.list()) == 12
