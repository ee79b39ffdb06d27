"""The Redis store and journal warn at open when the server would lose records on a restart.

Each test starts its own redis-server on a free port (with or without the append-only file, or with
CONFIG disabled), so the check reads a real server's settings.
"""

from __future__ import annotations

import shutil
import warnings
from collections.abc import Callable
from typing import Any

import pytest

from sagaguard.idempotency.backends.redis_persistence import DurabilityWarning
from sagaguard.idempotency.stores.redis import RedisStore
from sagaguard.saga.journals.redis import RedisJournal

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")

ServerFactory = Callable[..., str]
"""conftest's ``redis_server``: starts a server of the test's own, returns its URL."""


def _open(kind: str, url: str) -> Any:
    return RedisStore(url) if kind == "store" else RedisJournal(url)


def _warnings_opening(kind: str, url: str) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _open(kind, url).close()
    return [str(w.message) for w in caught if issubclass(w.category, DurabilityWarning)]


KINDS = ["store", "journal"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_server_without_persistence_warns(kind: str, redis_server: ServerFactory) -> None:
    messages = _warnings_opening(kind, redis_server("--appendonly", "no", "--save", ""))
    assert len(messages) == 1
    assert "no persistence" in messages[0] and "appendonly yes" in messages[0]


@pytest.mark.parametrize("kind", KINDS)
def test_snapshots_alone_warn(kind: str, redis_server: ServerFactory) -> None:
    messages = _warnings_opening(kind, redis_server("--appendonly", "no", "--save", "3600 1"))
    assert len(messages) == 1
    assert "only snapshots" in messages[0]


@pytest.mark.parametrize("kind", KINDS)
def test_an_append_only_server_opens_quietly(kind: str, redis_server: ServerFactory) -> None:
    assert _warnings_opening(kind, redis_server("--appendonly", "yes")) == []


@pytest.mark.parametrize("kind", KINDS)
def test_a_server_refusing_config_says_so_and_opens(kind: str, redis_server: ServerFactory) -> None:
    url = redis_server("--appendonly", "yes", "--rename-command", "CONFIG", "")
    messages = _warnings_opening(kind, url)
    assert len(messages) == 1
    assert "cannot check" in messages[0]


def test_the_warning_can_refuse_the_server(redis_server: ServerFactory) -> None:
    url = redis_server("--appendonly", "no", "--save", "")
    with warnings.catch_warnings():
        warnings.simplefilter("error", DurabilityWarning)
        for _ in range(2):  # every open, not only the first
            with pytest.raises(DurabilityWarning):
                RedisStore(url)


def test_each_server_is_checked_once_per_process(redis_server: ServerFactory) -> None:
    url = redis_server("--appendonly", "no", "--save", "")
    assert len(_warnings_opening("store", url)) == 1
    assert _warnings_opening("store", url) == []
