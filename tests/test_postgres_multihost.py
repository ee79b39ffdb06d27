"""A libpq multi-host URL (``host1:5432,host2:5433``, ``target_session_attrs=read-write``) reaches
the writable server, through every SQL entry point.

Before: ``check_url`` and SQLAlchemy read the list as one host with the port ``5432,host2:5433``
and refused the URL as malformed, so a Postgres failover could not be followed by the client.
These run against the suite's Postgres, listed second after a port where nothing listens: libpq
tries the first host, fails, and connects to the second (under a second in all).
"""

from __future__ import annotations

import socket
import uuid

import psycopg
from conftest import require_postgres

from sagaguard.idempotency import Guard, scope
from sagaguard.idempotency.backends.sql_engine import make_engine
from sagaguard.idempotency.backends.urls import check_url, masked, postgres_hosts
from sagaguard.idempotency.stores.sql import SqlStore


def _dead_port() -> int:
    """A local port nothing listens on (bound and closed at once)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _multi_host(url: str) -> str:
    """The suite's Postgres URL as the second host of a list whose first host is dead."""
    user_host, _, rest = url.partition("://")[2].partition("/")
    user, _, hostport = user_host.rpartition("@")
    return (
        f"postgresql://{user}@127.0.0.1:{_dead_port()},{hostport}/{rest}"
        + ("&" if "?" in rest else "?")
        + "target_session_attrs=read-write"
    )


def test_a_host_list_moves_into_the_query_where_libpq_takes_it() -> None:
    url = "postgresql://u:secret@db1:5432,db2,[::1]:6000/shop?target_session_attrs=read-write"
    assert check_url(url) == "postgresql"
    assert postgres_hosts(url) == (
        "postgresql://u:secret@/shop?host=db1,db2,::1&port=5432,5432,6000&target_session_attrs=read-write"
    )
    assert masked(url) == url.replace("secret", "***")
    assert postgres_hosts("postgresql://u@db1:5432/shop") == "postgresql://u@db1:5432/shop"  # no list
    engine = make_engine(url)
    args = engine.dialect.create_connect_args(engine.url)[1]
    assert (args["host"], args["port"]) == ("db1,db2,::1", "5432,5432,6000")
    assert args["target_session_attrs"] == "read-write"


def test_a_guarded_call_goes_through_a_multi_host_url_to_the_live_server() -> None:
    url = _multi_host(require_postgres())
    table = f"sg_multihost_{uuid.uuid4().hex[:8]}"
    store = SqlStore(url, table_name=table)
    calls: list[str] = []
    try:
        guard = Guard(store, namespace="multihost")

        @guard.effect("charge")
        def charge(order: str) -> str:
            calls.append(order)
            return f"ch-{order}"

        for _ in range(2):  # the second is replayed from the record
            with scope("o1"):
                assert charge("o1") == "ch-o1"
        assert calls == ["o1"]
        with psycopg.connect(require_postgres()) as conn:
            rows = conn.execute(f'SELECT state FROM "{table}"').fetchall()
        assert rows == [("succeeded",)]
    finally:
        store.close()
        with psycopg.connect(require_postgres(), autocommit=True) as conn:
            conn.execute(f'DROP TABLE IF EXISTS "{table}"')
