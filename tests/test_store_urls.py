"""Bad backend URLs are ConfigurationErrors that name the problem, at every entry point.

Before: ``open_store(None)`` and ``open_store(42)`` raised TypeError, ``postgresql://u:p@[::1/x`` a
bare ValueError, and ``postgresql://`` silently wrote to libpq's default database.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from sagaguard.idempotency.backends.urls import check_url, masked
from sagaguard.idempotency.errors import ConfigurationError
from sagaguard.idempotency.outbox.relay import Relay
from sagaguard.idempotency.stores import open_store
from sagaguard.idempotency.stores.sql import SqlStore
from sagaguard.saga.journals import open_journal
from sagaguard.saga.journals.sql import SqlJournal


def _relay(url: Any) -> Any:
    return Relay({}, url)


OPENERS: dict[str, Callable[[Any], Any]] = {
    "open_store": open_store,
    "open_journal": open_journal,
    "relay": _relay,
}

BAD = [
    pytest.param(None, "must be a string", id="none"),
    pytest.param(42, "not int", id="int"),
    pytest.param("postgresql://u:secret@[::1/x", "malformed", id="bad-ipv6"),
    pytest.param("postgresql://", "names no host", id="pg-empty"),
    pytest.param("postgresql://u:secret@db.example", "names no database", id="pg-no-db"),
    pytest.param("postgresql:///shop", "names no host", id="pg-no-host"),
    pytest.param("postgresql://u:secret@db.example:notaport/shop", "malformed", id="pg-bad-port"),
    pytest.param("redis://127.0.0.1:6379/zero", "must be a number", id="redis-bad-db"),
    pytest.param("mysql://u:secret@h/db", "unknown", id="unknown-scheme"),
    pytest.param("shop.db", "unknown", id="no-scheme"),
    # A mistyped separator or no scheme at all printed the password in full.
    pytest.param("redis//u:secret@127.0.0.1:6379/0", "unknown", id="redis-no-colon"),
    pytest.param("postgresql:/u:secret@db.example/shop", "unknown", id="pg-one-slash"),
    pytest.param("u:secret@db.example/shop", "unknown", id="userinfo-no-scheme"),
    pytest.param("postgresql://u@db.example?password=secret", "names no database", id="pg-query-password"),
    # A libpq host list (host:port,host:port) is taken; a malformed one names its problem.
    pytest.param("postgresql://u:secret@a:5432,,b:5433/shop", "malformed host ''", id="pg-list-empty"),
    pytest.param("postgresql://u:secret@a:5432,b:x/shop", "malformed", id="pg-list-bad-port"),
    pytest.param("postgresql://u:secret@a:5432,b:70000/shop", "malformed", id="pg-list-port-range"),
    pytest.param("postgresql://u:secret@a,b/shop?host=c", "both", id="pg-list-twice"),
    pytest.param("postgresql://u:secret@a:1,b:2", "names no database", id="pg-list-no-db"),
    pytest.param("postgresql://u:secret@/shop?host=a,b&port=1,2,3", "2 hosts and 3 ports", id="pg-q-ports"),
    pytest.param("postgresql://u:secret@/shop?host=a,,b", "empty host", id="pg-q-empty-host"),
    pytest.param("postgresql://u:secret@/shop?host=a&port=0", "not a number from 1", id="pg-q-port-zero"),
]


@pytest.mark.parametrize("opener", list(OPENERS), ids=list(OPENERS))
@pytest.mark.parametrize(("url", "says"), BAD)
def test_bad_url_is_a_configuration_error_naming_the_problem(opener: str, url: Any, says: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        OPENERS[opener](url)
    message = str(info.value)
    assert says in message
    assert "secret" not in message  # a password is never echoed


def test_postgres_url_may_name_its_host_and_database_in_the_query() -> None:
    assert check_url("postgresql://u@/shop?host=/var/run/postgresql") == "postgresql"
    assert check_url("postgresql+psycopg://u@h/?dbname=shop") == "postgresql"
    assert check_url("postgres://u@h:5432/shop") == "postgresql"


@pytest.mark.parametrize(
    ("url", "scheme"),
    [
        ("memory://", "memory"),
        ("sqlite://", "sqlite"),
        ("sqlite:///rel.db", "sqlite"),
        ("redis://h:6379/2", "redis"),
        ("rediss://h", "rediss"),
        ("unix:///tmp/redis.sock?db=1", "unix"),
    ],
)
def test_good_urls_pass(url: str, scheme: str) -> None:
    assert check_url(url) == scheme


def test_masked_hides_a_password_even_in_an_unparseable_url() -> None:
    assert masked("postgresql://u:p@ss@[::1/x") == "postgresql://u:***@[::1/x"
    assert masked("redis://:pw@h:6379/0") == "redis://:***@h:6379/0"
    assert masked("sqlite:///a.db") == "sqlite:///a.db"


@pytest.mark.parametrize("cls", [SqlStore, SqlJournal], ids=["SqlStore", "SqlJournal"])
@pytest.mark.parametrize(
    ("url", "says"),
    [
        pytest.param("postgresql://", "names no host", id="pg-empty"),
        pytest.param("postgresql://u:secret@db.example", "names no database", id="pg-no-db"),
        pytest.param("postgresql://u:secret@[::1/x", "malformed", id="bad-ipv6"),
    ],
)
def test_sql_classes_built_from_a_url_check_it_as_open_store_does(cls: Any, url: Any, says: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        cls(url)
    assert says in str(info.value)
    assert "secret" not in str(info.value)


def test_masked_hides_a_password_after_a_mistyped_separator_or_without_a_scheme() -> None:
    assert masked("redis//u:secret@h:6379/0") == "redis//u:***@h:6379/0"
    assert masked("postgresql:/u:secret@h/db") == "postgresql:/u:***@h/db"
    assert masked("u:secret@h/db") == "u:***@h/db"
    assert masked("redis://u:sec/ret@h") == "redis://u:***@h"
    assert masked("postgresql://u@h/db?sslmode=require&password=secret") == (
        "postgresql://u@h/db?sslmode=require&password=***"
    )


@pytest.mark.parametrize(
    "url", ["redis//u:secret@127.0.0.1:6379/0", "postgresql:/u:secret@db.example/shop", "u:secret@h/db"]
)
@pytest.mark.parametrize(
    "command", [["effects", "list", "--store"], ["sagas", "list", "--store"], ["outbox", "status", "--db"]]
)
def test_the_cli_never_prints_the_password_of_a_mistyped_url(
    url: str, command: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    from sagaguard.idempotency.cli import main

    assert main([*command, url]) != 0
    captured = capsys.readouterr()
    assert "secret" not in captured.err + captured.out
    assert "***" in captured.err


def test_an_unknown_redis_query_parameter_is_a_configuration_error() -> None:
    """redis-py hands unknown query parameters to its connection class: a raw TypeError before."""
    from sagaguard.idempotency.stores.redis import RedisStore

    url = "redis://:secret@127.0.0.1:6379/0?socket_timeout_typo=5"
    for opener in (open_store, open_journal, RedisStore):
        with pytest.raises(ConfigurationError, match="malformed redis URL") as info:
            opener(url)
        assert "secret" not in str(info.value)


def test_a_postgres_url_without_psycopg_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    for name in [m for m in sys.modules if m == "psycopg" or m.startswith("psycopg.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "psycopg", None)  # an import of it fails as if not installed
    for opener in (open_store, open_journal, _relay):
        with pytest.raises(ConfigurationError, match=r"pip install 'sagaguard\[postgres\]'"):
            opener("postgresql://u:secret@127.0.0.1:5432/shop")


def test_a_redis_url_without_redis_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    ours = ("sagaguard.idempotency.stores.redis", "sagaguard.saga.journals.redis")
    for name in [m for m in sys.modules if m == "redis" or m.startswith(("redis.", *ours))]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "redis", None)  # an import of it fails as if not installed
    for opener in (open_store, open_journal):
        with pytest.raises(ConfigurationError, match=r"pip install 'sagaguard\[redis\]'") as raised:
            opener("redis://:secret@127.0.0.1:6379/0")
        assert "secret" not in str(raised.value)
