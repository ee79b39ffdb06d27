"""Names a backend cannot store are refused before anything is written, the same on every backend.

Postgres text cannot hold a NUL character (the driver cuts the string there, so the stored name
would differ from the caller's and every replay would end in a KeyConflict); no backend can store
a lone surrogate (it has no UTF-8 form). Each test runs on memory, SQLite, Postgres and Redis
(the ``store`` fixture) and checks that the body never ran and the store holds no record.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sagaguard.idempotency import CodecError, ConfigurationError, Guard, scope
from sagaguard.idempotency.store import IdempotencyStore

NUL_NAME = "a\x00b"
SURROGATE = "x\ud800"


def _body(ran: list[int]) -> Callable[[int], int]:
    def charge(amount: int) -> int:
        ran.append(amount)
        return amount

    return charge


def test_an_effect_name_with_a_nul_is_refused(store: IdempotencyStore) -> None:
    ran: list[int] = []
    guard = Guard(store)
    with pytest.raises(ConfigurationError, match="NUL"), scope("run-1"):
        guard.effect(NUL_NAME)(_body(ran))(5)
    with pytest.raises(ConfigurationError, match="NUL"), scope("run-1"):
        guard.run(NUL_NAME, lambda: _body(ran)(5), arguments={"amount": 5})
    assert ran == []
    assert store.list() == []


def test_a_scope_with_a_nul_is_refused(store: IdempotencyStore) -> None:
    ran: list[int] = []
    charge = Guard(store).effect("pay.charge")(_body(ran))
    with pytest.raises(ConfigurationError, match="scope"), scope(f"run{NUL_NAME}"):
        charge(5)
    assert ran == []
    assert store.list() == []
    with scope("run-1"):  # the same effect under a storable scope runs and replays
        assert charge(5) == 5
        assert charge(5) == 5
    assert ran == [5, 5]
    assert len(store.list()) == 2


def test_a_namespace_with_a_nul_is_refused(store: IdempotencyStore) -> None:
    ran: list[int] = []
    with pytest.raises(ConfigurationError, match="namespace"), scope("run-1"):
        Guard(store, namespace=f"tenant{NUL_NAME}").effect("pay.charge")(_body(ran))(5)
    assert ran == []
    assert store.list() == []


def test_an_explicit_key_with_a_nul_is_refused(store: IdempotencyStore) -> None:
    ran: list[int] = []
    with pytest.raises(ConfigurationError, match="key"):
        Guard(store).run("pay.charge", lambda: _body(ran)(5), key=f"order{NUL_NAME}")
    assert ran == []
    assert store.list() == []


@pytest.mark.parametrize("where", ["name", "scope", "key"])
def test_text_with_no_utf8_form_is_refused(store: IdempotencyStore, where: str) -> None:
    ran: list[int] = []
    guard = Guard(store)
    with pytest.raises(CodecError), scope(SURROGATE if where == "scope" else "run-1"):
        if where == "key":
            guard.run("pay.charge", lambda: _body(ran)(5), key=SURROGATE)
        else:
            guard.effect(SURROGATE if where == "name" else "pay.charge")(_body(ran))(5)
    assert ran == []
    assert store.list() == []


def test_a_guard_refuses_an_unstorable_namespace_when_it_is_made(store: IdempotencyStore) -> None:
    with pytest.raises(ConfigurationError, match="namespace"):
        Guard(store, namespace=f"tenant{NUL_NAME}")
    with pytest.raises(CodecError, match="namespace"):
        Guard(store, namespace=SURROGATE)


@pytest.mark.parametrize(
    ("bad", "error"), [(NUL_NAME, ConfigurationError), (SURROGATE, CodecError)], ids=repr
)
def test_getting_an_unstorable_key_is_refused_on_every_store(
    store: IdempotencyStore, bad: str, error: type[Exception]
) -> None:
    with pytest.raises(error, match="key"):
        store.get(bad)


def _storable(text: str) -> bool:
    if "\x00" in text:
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


@settings(max_examples=30, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.sampled_from(["name", "scope", "key", "namespace"]), st.text(min_size=1, max_size=10))
def test_any_text_is_refused_typed_or_stored_and_replayed_as_given(
    store: IdempotencyStore, where: str, text: str
) -> None:
    """Any text as an effect name, a scope, an explicit key or a namespace, on every backend: either
    refused with a ConfigurationError before the body runs and with nothing stored, or run once and
    replayed (the stored name is the caller's, so the replay finds it)."""
    ran: list[int] = []
    tag = uuid.uuid4().hex  # the other parts are new in every example, so no example replays another
    before = len(store.list(limit=10_000))
    name, scope_id = (text if where == "name" else f"pay.{tag}"), (text if where == "scope" else f"run-{tag}")
    try:
        guard = Guard(store, namespace=text if where == "namespace" else "default")
        charge = guard.effect(name)(_body(ran))
        for _ in range(2):
            with scope(scope_id):
                if where == "key":
                    guard.run(name, lambda: _body(ran)(5), key=text, arguments={"amount": 5})
                else:
                    charge(5)
    except ConfigurationError:
        assert not _storable(text)
        assert ran == []
        assert len(store.list(limit=10_000)) == before
        return
    assert _storable(text)
    assert ran == [5]  # the second call replayed the first's record
