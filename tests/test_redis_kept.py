"""The Redis store's and journal's kept connections (``ScriptRunner``): each thread keeps the
connection of its scripts between calls; a connection the server closed between calls costs no
call; a script the server forgot (``SCRIPT FLUSH``, a restart) is loaded again; a pool of one is
never kept; a forked child never talks on its parent's sockets; ``close`` gives every kept
connection back. A redis-server of the test's own on a free port (the test kills its clients and
flushes its scripts)."""

from __future__ import annotations

import os
import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterator

import pytest
import redis
from _guardutil import claim_then_fork

from sagaguard.idempotency.keys import EffectIdentity
from sagaguard.idempotency.stores.redis import RedisStore

FP = "f1_" + "a" * 64


@pytest.fixture
def server(redis_server: Callable[..., str]) -> Iterator[redis.Redis]:
    """An admin client of a redis-server of the test's own (conftest's ``redis_server``)."""
    admin = redis.Redis.from_url(redis_server("--save", "", "--appendonly", "no"), decode_responses=True)
    try:
        yield admin
    finally:
        admin.close()


def _store(admin: redis.Redis) -> RedisStore:
    port = admin.connection_pool.connection_kwargs["port"]
    with pytest.warns(UserWarning):  # no persistence on the test's server
        return RedisStore(f"redis://127.0.0.1:{port}/0", prefix=f"sg-kept-{uuid.uuid4().hex[:6]}")


def _call(store: RedisStore) -> None:
    identity = EffectIdentity.of("kept", uuid.uuid4().hex, "pay.charge", 0)
    store.complete(identity.key, store.claim(identity, FP, 30.0).record.token, "1", 60.0)


def _clients(admin: redis.Redis) -> int:
    """The server's client connections other than the admin's own."""
    return len(admin.client_list()) - 1


def _clients_once_closed(admin: redis.Redis, deadline: float = 30.0) -> int:
    """:func:`_clients` once the server has noticed the sockets a client closed, or at
    ``deadline`` seconds: a closed socket leaves the server's list on its next event-loop turn,
    which may come after the admin's ``CLIENT LIST`` (seen under a loaded CI run: 3 for 0)."""
    give_up = time.monotonic() + deadline
    while (left := _clients(admin)) and time.monotonic() < give_up:
        time.sleep(0.01)
    return left


class Threads:
    """Live threads that each make a store call when told, one thread at a time."""

    def __init__(self, n: int, call: Callable[[], None]) -> None:
        self.inboxes: list[queue.Queue[bool]] = [queue.Queue() for _ in range(n)]
        self.done: queue.Queue[BaseException | None] = queue.Queue()
        self.threads = [
            threading.Thread(target=self._work, args=(box, call), daemon=True) for box in self.inboxes
        ]
        for thread in self.threads:
            thread.start()

    def _work(self, inbox: queue.Queue[bool], call: Callable[[], None]) -> None:
        while inbox.get():
            try:
                call()
                self.done.put(None)
            except BaseException as exc:  # reported to the test's thread
                self.done.put(exc)

    def round(self) -> list[BaseException]:
        failed = []
        for inbox in self.inboxes:
            inbox.put(True)
            if (outcome := self.done.get(timeout=60)) is not None:
                failed.append(outcome)
        return failed

    def stop(self) -> None:
        for inbox in self.inboxes:
            inbox.put(False)
        for thread in self.threads:
            thread.join(timeout=60)


def test_each_thread_keeps_its_connection_and_a_kill_between_calls_costs_no_call(
    server: redis.Redis,
) -> None:
    store = _store(server)
    threads = Threads(3, lambda: _call(store))
    try:
        assert threads.round() == []
        # Called one at a time, a shared pool would have served all three with one connection.
        assert _clients(server) == 3, "each live thread keeps its connection between calls"
        killed = server.client_kill_filter(_type="normal", skipme=True)
        assert killed == 3
        assert threads.round() + threads.round() == [], "a closed idle connection is connected afresh"
    finally:
        threads.stop()
        store.close()
    assert _clients_once_closed(server) == 0, "close() gives every kept connection back (and closes the pool)"


def test_scripts_the_server_forgot_are_loaded_again(server: redis.Redis) -> None:
    store = _store(server)
    try:
        _call(store)
        server.script_flush()
        _call(store)  # on the kept connection: NOSCRIPT, loaded, run
        assert store.get(EffectIdentity.of("kept", "x", "pay.charge", 0).key) is None
    finally:
        store.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_never_uses_its_parents_kept_connection(server: redis.Redis) -> None:
    store = _store(server)
    parent = EffectIdentity.of("kept", uuid.uuid4().hex, "pay.charge", 0)
    child = EffectIdentity.of("kept", uuid.uuid4().hex, "pay.charge", 0)
    token = claim_then_fork(store, parent, child, FP, 30.0)  # the parent's connection is kept
    # The parent's connection is intact: its claim completes on it, replies in order.
    assert store.complete(parent.key, token, "1", 60.0).result == "1"
    got = store.get(child.key)
    assert got is not None and got.result == "2"
    store.close()


def test_a_pool_of_one_is_never_kept(server: redis.Redis) -> None:
    port = server.connection_pool.connection_kwargs["port"]
    with pytest.warns(UserWarning):
        store = RedisStore(f"redis://127.0.0.1:{port}/0", prefix="sg-kept-one", max_connections=1)
    try:
        identity = EffectIdentity.of("kept", uuid.uuid4().hex, "pay.charge", 0)
        claimed = store.claim(identity, FP, 30.0).record
        # The thread's next call of another kind needs the pool's one connection: it is there.
        assert store.get(identity.key) is not None
        store.complete(identity.key, claimed.token, "1", 60.0)
    finally:
        store.close()


def test_a_redis_journal_of_its_own_keeps_connections_and_close_gives_them_back(
    server: redis.Redis,
) -> None:
    from sagaguard.saga.journals.redis import RedisJournal

    port = server.connection_pool.connection_kwargs["port"]
    with pytest.warns(UserWarning):
        journal = RedisJournal(f"redis://127.0.0.1:{port}/0", prefix=f"sgj-kept-{uuid.uuid4().hex[:6]}")

    def load_one() -> None:
        assert journal.load(f"saga-{uuid.uuid4().hex}") is None  # a script on the kept connection

    threads = Threads(3, load_one)
    try:
        assert threads.round() == []
        assert _clients(server) == 3, "each live thread keeps its connection between calls"
    finally:
        threads.stop()
        journal.close()
    assert _clients_once_closed(server) == 0
