"""The infrastructure the SQL and Redis backends share: stores, saga journals and the outbox alike.

- :mod:`~sagaguard.idempotency.backends.urls`: checking a store or journal URL before anything opens.
- :mod:`~sagaguard.idempotency.backends.sql_engine`: the SQLAlchemy engine every SQL backend uses.
- :mod:`~sagaguard.idempotency.backends.sql_driver` and :mod:`~sagaguard.idempotency.backends.sql_pq`:
  the hot statements on the driver (sqlite3, and psycopg on Postgres).
- :mod:`~sagaguard.idempotency.backends.redis_client`: the Redis client (one server or a Redis
  Cluster) and its script runner; :mod:`~sagaguard.idempotency.backends.redis_persistence`: the check
  that every server keeps what it is told; :mod:`~sagaguard.idempotency.backends.redis_replicas`: a
  claim that waits for a replica.
- :mod:`~sagaguard.idempotency.backends.kept`: connections threads keep between calls.
- :mod:`~sagaguard.idempotency.backends.offload`: blocking store calls from async code.

Nothing here is public API: the stores (:mod:`sagaguard.idempotency.stores`), the saga journals and
the outbox are.
"""
