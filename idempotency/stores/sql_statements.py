"""The effects table's hot statements, as SQL text (``:name`` parameters, every value bound).

A guarded new call makes two of them, each its own transaction (autocommit): the claim (for a new
key its ``insert`` alone), then the record of its outcome (``complete``, or
``permanent``/``ambiguous``/``retryable`` for a failure).
Every write after a claim is fenced: ``key = :key AND token = :token AND state IN (live)``, so a
writer whose claim was taken over changes nothing.

The claim starts, on both dialects, with a plain ``insert`` (``ON CONFLICT (key) DO NOTHING``), a
statement of its own (its own transaction), which settles a new key alone: the row it inserted is
the claim's record (on Postgres on its own clock the statement returns the two times it read,
``created_at`` and ``lease_until``; otherwise the store bound them). A record in the way makes it
insert nothing, write nothing and lock nothing, and only then does the full ``claim`` follow:

- Postgres, one statement: the record in the way is read in the statement's snapshot (``cur``);
  when none blocks (no record, or one that may be replaced: finished and expired, or taken over:
  live with its lease run out and the same fingerprint) the upsert runs and returns the row it
  wrote, else the blocking record comes back as it is. A replay therefore takes no row lock and
  writes nothing (an upsert whose ``DO UPDATE`` declines still locks the row, and its commit would
  wait for a WAL flush). A new key costs one round trip and one commit, as the claim alone did, and
  less of the server's CPU (a plain insert, no read of a record in the way, no ``RETURNING`` of
  the whole row); a replay, or a record replaced or taken over, costs one more round trip.
- SQLite: the ``claim`` upsert and, if it returns nothing, the ``get`` of that record, in one
  ``BEGIN IMMEDIATE`` transaction.

Whatever happens between the insert and the claim (another claim, a purge) the claim sees and
decides as it would have alone. An inserted row starts at the random ``:first_token``; ``DO UPDATE``
counts on from the old token.

Times: the database's clock (``clock_timestamp()`` on Postgres), read inside the statement, unless
the store binds ``:now`` (an injected clock; always on SQLite, which runs in this process, so its
clock is this host's: ``time.time()`` is the same instant as ``julianday('now')``, to the
microsecond).
"""

from __future__ import annotations

from typing import Final

from sagaguard.idempotency.stores.sql_schema import COLUMNS

__all__ = ["DB_NOW", "effect_statements"]

DB_NOW: Final = {  # the database's time in seconds since the epoch, as a double
    "postgresql": "CAST(extract(epoch FROM clock_timestamp()) AS DOUBLE PRECISION)",
    "sqlite": "((julianday('now') - 2440587.5) * 86400.0)",
}
_LIVE = "('in_progress', 'in_doubt')"
_FINISHED = "('succeeded', 'failed')"


def _claimable(row: str, at: str, fingerprint: str) -> str:
    """A record ``row`` a claim at ``at`` may replace (finished, expired) or take over (live, lease
    run out, same fingerprint)."""
    return (
        f"(({row}.state IN {_FINISHED} AND {row}.expires_at <= {at}) OR "
        f"({row}.state IN {_LIVE} AND {row}.lease_until <= {at} AND {row}.fingerprint = {fingerprint}))"
    )


def _upsert(table: str, source: str, guard: str, at: str) -> str:
    # The proposed row carries "now" (created_at) and "now + lease" (lease_until), so DO UPDATE
    # reads the clock from `excluded`: one reading per statement. SQLite needs a WHERE to parse
    # INSERT .. SELECT followed by ON CONFLICT.
    fresh = f"e.state IN {_FINISHED}"  # in DO UPDATE: replacing an expired finished record

    def pick(column: str) -> str:
        return f"{column} = CASE WHEN {fresh} THEN excluded.{column} ELSE e.{column} END"

    return f"""
    INSERT INTO {table} AS e (key, namespace, scope, name, ordinal, fingerprint, state,
                              token, lease_until, attempts, created_at, updated_at, holder, result_type)
    SELECT :key, :namespace, :scope, :name, :ordinal, :fingerprint, 'in_progress',
           CAST(:first_token AS BIGINT), {at} + CAST(:lease AS DOUBLE PRECISION), 1,
           {at}, {at}, :holder, :result_type
    {source} WHERE {guard}
    ON CONFLICT (key) DO UPDATE SET
        {pick("namespace")}, {pick("scope")}, {pick("name")}, {pick("ordinal")},
        {pick("fingerprint")}, {pick("created_at")},
        state = CASE WHEN {fresh} THEN 'in_progress' ELSE 'in_doubt' END,
        token = e.token + 1,
        attempts = CASE WHEN {fresh} THEN 1 ELSE e.attempts + 1 END,
        lease_until = excluded.lease_until,
        updated_at = excluded.updated_at,
        expires_at = CASE WHEN {fresh} THEN NULL ELSE e.expires_at END,
        result = CASE WHEN {fresh} THEN NULL ELSE e.result END,
        error = CASE WHEN {fresh} THEN NULL ELSE e.error END,
        holder = excluded.holder,
        result_type = CASE WHEN {fresh} THEN excluded.result_type
                           ELSE COALESCE(excluded.result_type, e.result_type) END
    WHERE {_claimable("e", "excluded.created_at", "excluded.fingerprint")}
    RETURNING true AS won, {COLUMNS}"""


def effect_statements(table: str, dialect: str, *, bound_now: bool) -> dict[str, str]:
    """The statements of an effects table, by name (see the module).

    Args:
        table: the table's name, quoted for the dialect (the only thing formatted in).
        dialect: ``postgresql`` or ``sqlite``.
        bound_now: the time is bound as ``:now`` rather than read from the database's clock.
    """
    # The database's clock is read once per statement, from a one-row source (``c``) that the
    # claim's CTE and every UPDATE join: clock_timestamp() gives another time at each call.
    now = "c.now"
    clock = f"(SELECT {DB_NOW[dialect]} AS now) AS c"
    if bound_now:
        now, clock = "CAST(:now AS DOUBLE PRECISION)", ""
    if dialect == "postgresql":
        x_columns = ", ".join(f"x.{column}" for column in COLUMNS.split(", "))
        claim = f"""
        WITH c AS (SELECT {now if bound_now else DB_NOW[dialect]} AS now),
        cur AS (SELECT {x_columns}, COALESCE({_claimable("x", "c.now", ":fingerprint")}, false) AS open
                FROM {table} AS x, c WHERE x.key = :key),
        won AS ({_upsert(table, "FROM c", "NOT EXISTS (SELECT 1 FROM cur WHERE NOT cur.open)", "c.now")})
        SELECT * FROM won
        UNION ALL SELECT false, {COLUMNS} FROM cur WHERE NOT cur.open"""
    else:
        claim = _upsert(table, f"FROM {clock}" if clock else "", "true", now)
    columns = """key, namespace, scope, name, ordinal, fingerprint, state, token,
                             lease_until, attempts, created_at, updated_at, holder, result_type"""
    if bound_now:  # the inserted row is known to the store: it binds the times
        insert = f"""
        INSERT INTO {table} ({columns})
        VALUES (:key, :namespace, :scope, :name, :ordinal, :fingerprint, 'in_progress',
                :first_token, :lease_until, 1, :now, :now, :holder, :result_type)
        ON CONFLICT (key) DO NOTHING"""
    else:  # Postgres's clock, read once (``c``): the row's times come back, nothing else
        insert = f"""
        INSERT INTO {table} ({columns})
        SELECT :key, :namespace, :scope, :name, :ordinal, :fingerprint, 'in_progress',
               CAST(:first_token AS BIGINT), c.now + CAST(:lease AS DOUBLE PRECISION), 1,
               c.now, c.now, :holder, :result_type
        FROM (SELECT {DB_NOW[dialect]} AS now) AS c
        ON CONFLICT (key) DO NOTHING
        RETURNING created_at, lease_until"""
    fence = f"key = :key AND token = :token AND state IN {_LIVE}"

    def update(assignments: str, returning: str = COLUMNS) -> str:
        source = f" FROM {clock}" if clock else ""
        return f"UPDATE {table} SET {assignments}{source} WHERE {fence} RETURNING {returning}"

    expires = f"expires_at = {now} + CAST(:retention AS DOUBLE PRECISION)"
    succeeded = f"state = 'succeeded', result = :result, error = NULL, {expires}, updated_at = {now}"
    return {
        "claim": claim,
        "insert": insert,
        "get": f"SELECT {COLUMNS} FROM {table} WHERE key = :key",
        "now": f"SELECT {DB_NOW[dialect]}",
        "complete": update(succeeded),
        # The same write for the holder of the claim: while its token holds, only the lease can
        # have changed since (heartbeats), so only it and the times written come back.
        "complete_held": update(succeeded, returning="lease_until, updated_at, expires_at"),
        "permanent": update(f"state = 'failed', error = :error, {expires}, updated_at = {now}"),
        "ambiguous": update(f"state = 'in_doubt', error = :error, lease_until = 0, updated_at = {now}"),
        "retryable": f"DELETE FROM {table} WHERE {fence} RETURNING key",
        # Compare-and-set on the token the caller saw with a dead holder: the fence is every
        # write's, and the lease is not looked at.
        "take_over": update(
            "state = 'in_doubt', token = token + 1, attempts = attempts + 1, "
            f"lease_until = {now} + CAST(:lease AS DOUBLE PRECISION), updated_at = {now}, holder = :holder"
        ),
        "heartbeat": update(
            f"lease_until = {now} + CAST(:lease AS DOUBLE PRECISION), updated_at = {now}",
            returning="lease_until",
        ),
    }
