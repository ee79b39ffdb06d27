"""The guarded call's second floor in bench/fleet.py: the same record, on the bare driver.

The first floor (bench/_subjects.py) writes a two-column row; a guarded call writes the store's
record (identity, fingerprint, state, token, lease, times, holder, result type, then result and
expiry). This floor writes that record without sagaguard, so that the difference between the two
floors is what the record itself costs, and the rest of the gap is sagaguard's code path:

- Postgres, psycopg in autocommit as the first floor: a table made from the store's own table
  definition (``effect_model``: the same columns and both partial indexes), an INSERT of the
  columns a claim writes, then an UPDATE of what a success sets (state, result, error, expiry,
  update time), the key alone in its WHERE: two commits, two round trips;
- Redis Cluster: the record as a hash in the store's key layout (``<prefix>:{<key>}``), an HSET of
  the claim's fields then ``WAIT 1`` in one pipeline to the key's primary, as the store does on a
  cluster, then an HSET of the success's fields and the record's TTL (``PEXPIRE``) in one more:
  four commands, two round trips (the store's scripts do the same writes in three commands).

What this floor leaves out is what the store's statements decide: the claim's INSERT is not
conditional (no check of a record in the way, no take-over), the UPDATE is not fenced by the token,
and nothing is read back. The values are a real claim's (:func:`template`), with the key and the
scope each unit's, at the store's lengths, so the bytes written are the same.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from collections.abc import Callable
from typing import Any

from _common import RETENTION
from _subjects import guard_subject

from sagaguard.idempotency import Guard, derive_key, open_store

SAME_TABLE = "bench_same_effects"
SAME_PREFIX = "sf"
"""The Redis keys' prefix: as long as the store's ``sg`` (a key's bytes are in the AOF), not its, so
the store never reads these hashes as its records."""
NAMESPACE, NAME = "fleet", "bench.noop"
"""The guarded call's, in bench/_fleet_worker.py (its guard's namespace, guard_subject's effect)."""
CLAIMED = ("key", "namespace", "scope", "name", "ordinal", "fingerprint", "state", "token",
           "lease_until", "attempts", "created_at", "updated_at", "holder", "result_type")  # fmt: skip
"""The columns a new claim writes (``sql_statements``' claim), in its order."""
TTL_MS = int(RETENTION * 1000) + 60_000
"""The record's TTL once finished: the retention plus a grace, as the store sets (its exact grace
changes no byte count: the AOF holds an absolute ``PEXPIREAT``)."""


def template(url: str) -> dict[str, Any]:
    """The record one real guarded call leaves in the store at ``url``, read back through the
    store's public API, as JSON-able fields (the worker processes get it in their config)."""
    store = open_store(url)
    guard = Guard(store, namespace=NAMESPACE, retention=RETENTION)
    try:
        guard_subject(guard, "same-template").sync(0)
        record = store.get(derive_key(NAMESPACE, "same-template-s0", NAME, 0))
    finally:
        guard.close()
        store.close()
    if record is None:
        raise RuntimeError("the template's guarded call left no record")
    fields = dataclasses.asdict(record)
    fields["state"] = record.state.value
    return fields


def _claim(template: dict[str, Any], tag: str, i: int) -> dict[str, Any]:
    """Unit ``i``'s claim (its columns): the template's values, the scope the guarded call's unit
    ``i`` has (guard_subject's ``{tag}-s{i}``), a key of the store's length (its prefix, then 64 hex
    digits), the times now."""
    scope = f"{tag}-s{i}"
    digest = hashlib.sha256(scope.encode()).hexdigest()
    now = time.time()
    lease = template["lease_until"] - template["created_at"]
    claim = {**{k: template[k] for k in CLAIMED}, "key": template["key"][: -len(digest)] + digest,
             "scope": scope, "state": "in_progress", "attempts": 1, "lease_until": now + lease,
             "created_at": now, "updated_at": now}  # fmt: skip
    return claim


def _success(i: int) -> dict[str, Any]:
    """What unit ``i``'s success sets: the result the no-op's (``i``, as the store's codec writes an
    int: JSON), the times read now, after the claim (an UPDATE's WAL record holds the bytes that
    changed, so an update time equal to the claim's would write fewer)."""
    now = time.time()
    return {"state": "succeeded", "result": json.dumps(i), "expires_at": now + RETENTION, "updated_at": now}


def create_table(url: str) -> None:
    """The floor's table, from the store's own definition (columns, primary key, partial indexes)."""
    import sqlalchemy as sa

    from sagaguard.idempotency.stores.sql_schema import METADATA, effect_model

    engine = sa.create_engine(url.replace("postgresql://", "postgresql+psycopg://", 1))
    try:
        with engine.begin() as conn:
            METADATA.create_all(conn, tables=[effect_model(SAME_TABLE).__table__])  # type: ignore[attr-defined]
    finally:
        engine.dispose()


def postgres_same(
    url: str, tag: str, template: dict[str, Any]
) -> tuple[Callable[[int], object], Callable[[], None]]:
    """The INSERT commit and the UPDATE commit of the same record, psycopg in autocommit."""
    import psycopg

    create_table(url)
    conn = psycopg.connect(url, autocommit=True)
    insert = f"INSERT INTO {SAME_TABLE} ({', '.join(CLAIMED)}) VALUES ({', '.join(['%s'] * len(CLAIMED))})"
    # The store's success sets error to NULL too (a retried record may hold one); kept, so the
    # statement writes what the store's does.
    update = (
        f"UPDATE {SAME_TABLE} SET state = %s, result = %s, error = NULL, expires_at = %s, "
        "updated_at = %s WHERE key = %s"
    )

    def run(i: int) -> object:
        claim = _claim(template, tag, i)
        conn.execute(insert, [claim[k] for k in CLAIMED])
        conn.execute(update, [*_success(i).values(), claim["key"]])
        return i

    return run, conn.close


def _text(value: Any) -> str:
    # The store's scripts write numbers with %.17g (Python's float() reads back the same double).
    return f"{value:.17g}" if isinstance(value, float) else str(value)


def redis_same(
    url: str, tag: str, template: dict[str, Any]
) -> tuple[Callable[[int], object], Callable[[], None]]:
    """The claim's HSET and ``WAIT 1``, then the success's HSET and ``PEXPIRE``, on the key's
    primary (each pair one pipeline on one connection: ``WAIT`` waits for that connection's
    writes)."""
    from redis.cluster import RedisCluster

    node = url.split("://", 1)[1].split(",", 1)[0]
    client = RedisCluster.from_url(f"redis://{node}", decode_responses=True)

    def run(i: int) -> object:
        claim = _claim(template, tag, i)
        name = f"{SAME_PREFIX}:{{{claim.pop('key')}}}"
        primary = client.get_redis_connection(client.get_node_from_key(name))
        pipe = primary.pipeline(transaction=False)
        pipe.hset(name, mapping={k: _text(v) for k, v in claim.items() if v is not None})
        pipe.wait(1, 1000)  # the store's default: one replica, within a second
        _, acked = pipe.execute()
        if int(acked) < 1:
            raise RuntimeError(f"no replica acknowledged the claim of {name} within a second")
        pipe = primary.pipeline(transaction=False)
        pipe.hset(name, mapping={k: _text(v) for k, v in _success(i).items()})
        pipe.pexpire(name, TTL_MS)
        pipe.execute()
        return i

    return run, client.close
