"""Names a backend cannot store are refused before anything is written, the same on every backend.

Postgres text cannot hold a NUL character (the driver cuts the string there, so the stored name
would differ from the caller's and every replay would end in a KeyConflict); no backend can store
a lone surrogate (it has no UTF-8 form). Each test runs on memory, SQLite, Postgres and Redis
(the ``store`` fixture) and checks that the body never ran and the store holds no record.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

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
