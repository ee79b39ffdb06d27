"""Effect identity (docs/concepts.md): keys, fingerprints, explicit keys, scopes and ordinals."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import string
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from sagaguard.idempotency.errors import CodecError, ConfigurationError, NoScope
from sagaguard.idempotency.keys import (
    KEY_VERSION,
    EffectIdentity,
    Scope,
    current_scope,
    derive_explicit_key,
    derive_key,
    fingerprint,
    key_deriver,
    provider_key,
    scope,
)

HEX = set(string.hexdigits.lower()) - set(string.ascii_uppercase)

# Text a backend can store: no NUL (refused at derivation; see test_nul_in_a_part_is_refused).
storable = st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",))
parts = st.text(storable, max_size=40)
names = st.text(storable, min_size=1, max_size=40)
ordinals = st.integers(min_value=0, max_value=2**40)
identities = st.tuples(parts, parts, names, ordinals)

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text()
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
arguments = st.dictionaries(st.text(max_size=10), json_values, max_size=6)


def reversed_order(value: Any) -> Any:
    """The same JSON value with every dict built in the opposite insertion order."""
    if isinstance(value, dict):
        return {k: reversed_order(value[k]) for k in reversed(list(value))}
    if isinstance(value, list):
        return [reversed_order(v) for v in value]
    return value


def canonical_text(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


# ------------------------------------------------------------------------------------- keys


@given(identities)
def test_key_is_deterministic_with_a_fixed_shape(identity: tuple[str, str, str, int]) -> None:
    key = derive_key(*identity)
    assert key == derive_key(*identity)
    assert key == EffectIdentity.of(*identity).key
    assert len(key) == 68
    assert len(key) < 255  # Stripe's Idempotency-Key limit
    assert key.startswith(f"sg{KEY_VERSION}_")
    assert set(key[4:]) <= HEX


@given(identities, identities)
def test_distinct_identities_get_distinct_keys(
    a: tuple[str, str, str, int], b: tuple[str, str, str, int]
) -> None:
    assume(a != b)
    assert derive_key(*a) != derive_key(*b)


@given(st.text(storable, min_size=1, max_size=9))
def test_moving_a_boundary_between_parts_changes_the_key(text: str) -> None:
    # Every way of cutting one string into (namespace, scope, name) must give its own key:
    # no separator can make ("a:b", "c") and ("a", "b:c") collide.
    splits = [
        (text[:i], text[i:j], text[j:]) for i in range(len(text)) for j in range(i, len(text))
    ]
    keys = {derive_key(ns, sc, nm, 0) for ns, sc, nm in splits}
    assert len(keys) == len(splits)


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (("ns", "a:b", "c", 0), ("ns", "a", "b:c", 0)),
        (("ns", "a/b", "c", 0), ("ns", "a", "b/c", 0)),
        (("ns:a", "b", "c", 0), ("ns", "a:b", "c", 0)),
        (("ns", "s", "charge1", 0), ("ns", "s", "charge", 10)),
        (("ns", "s", "charge", 1), ("ns", "s", "charge", 10)),
        (("", "ns", "n", 0), ("ns", "", "n", 0)),
        (("ns", "s\x01", "n", 0), ("ns", "s", "\x01n", 0)),
    ],
)
def test_separator_lookalikes_do_not_collide(
    a: tuple[str, str, str, int], b: tuple[str, str, str, int]
) -> None:
    assert derive_key(*a) != derive_key(*b)


@given(identities, parts)
def test_namespace_is_part_of_the_hash(identity: tuple[str, str, str, int], other: str) -> None:
    namespace, scope_id, name, ordinal = identity
    assume(other != namespace)
    assert derive_key(namespace, scope_id, name, ordinal) != derive_key(other, scope_id, name, ordinal)


@pytest.mark.parametrize(
    "unicode_parts",
    [
        ("租户", "スレッド/チェックポイント", "stripe.charge", 0),
        ("tenant", "thread-🚀", "émail.send", 2),
        ("tenant", "é", "n", 0),  # precomposed
        ("tenant", "e\u0301", "n", 0),  # decomposed: another string, another key
    ],
)
def test_unicode_parts(unicode_parts: tuple[str, str, str, int]) -> None:
    key = derive_key(*unicode_parts)
    assert len(key) == 68
    assert key.isascii()


def test_unicode_normal_forms_are_distinct_keys() -> None:
    assert derive_key("t", "é", "n", 0) != derive_key("t", "e\u0301", "n", 0)


@given(st.text(alphabet="ghijklmnopqrstuvwxyz@.", min_size=6, max_size=30))
def test_key_reveals_no_readable_part(secret: str) -> None:
    key = derive_key("tenant", secret, secret, 0)
    assert secret not in key
    assert secret not in provider_key(key)


def test_key_version_is_in_the_key() -> None:
    assert derive_key("ns", "s", "n", 0).startswith("sg1_")


def test_known_vectors() -> None:
    # Stored records must stay findable after an upgrade: the encoding may only change together
    # with KEY_VERSION. If this fails, bump KEY_VERSION; never edit the expected values.
    key = derive_key("tenant", "run-1", "stripe.charge", 0)
    assert key == "sg1_dfcd0ecf812650bdd4959d559162cd50d6d744c62c3169e7cc466febabfaf408"
    assert provider_key(key) == "sg1p_8dd3edd2affacf2cb47043b7840aa1b4ea60b42564976862"
    assert (
        fingerprint({"currency": "eur", "amount": 1000})
        == "f1_fdfb39bfb6cb5552ead975b13a465fa16356eb3006ab4014cc8c7e11adad0ffd"
    )


def test_known_vectors_of_every_derivation() -> None:
    # Golden values computed before the derivations' fast copies were dropped: the one path left
    # must give the same bytes (a drift would give a retried call a new key and run it twice).
    # If this fails, bump KEY_VERSION; never edit the expected values.
    derive = key_deriver("tenant", "stripe.charge")
    assert derive("run-1", 0) == derive_key("tenant", "run-1", "stripe.charge", 0)
    assert derive("run-1", 0) == "sg1_dfcd0ecf812650bdd4959d559162cd50d6d744c62c3169e7cc466febabfaf408"
    assert derive("スレッド", 3) == "sg1_018ff87c0c91e0aa1aa61e3ac3266d145611907dfdcc6e6b79857b046c648b41"
    assert derive("run-1", 100) == "sg1_dececb1ecf846c4e19e92df7f97abf8531bb5b2504e8821ded46fe383577e334"
    explicit = "sg1_dd80208b254fdbbd251dd3dd27bce03819e293a1ac54f2d5e569ec21f5015d7b"
    assert derive_explicit_key("tenant", "order-42", "pay.charge") == explicit
    assert EffectIdentity.explicit("tenant", "order-42", "pay.charge").key == explicit
    flat = {"b": 1.5, "a": "é", "c": None, "d": True, "e": -7}
    assert fingerprint(flat) == "f1_6779be40a2bd0b73708bd4080405cce54198c11cf7bb7e937de14821eb5900ab"
    nested = {"items": [{"sku": "x", "qty": 2}], "tags": {"b", "a"}, "n": 10**20}
    assert fingerprint(nested) == "f1_0d2b3eb65c93c9fcef865097b2f0ac1df8ef24ae01dbeab000ad961e50ffd8b6"
    assert fingerprint({}) == "f1_3ba2a67d8b29fdc4d6b8afa5709bc4ef8f19e7d5d099e9787e4fce694e9c7293"
    one = "f1_a7d33e5b14bef79a305b06435ab3d4522aa35b5bda986926cd63cd6c43c8320e"
    assert fingerprint({"amount": 1000}) == one


@pytest.mark.parametrize("part", ["namespace", "scope", "name"])
@pytest.mark.parametrize("bad", ["a\x00b", "\x00", "x\ud800"])
def test_unstorable_text_in_a_part_is_refused(part: str, bad: str) -> None:
    # Postgres cannot store a NUL, no backend a lone surrogate: refused when the key is derived.
    args = {"namespace": "ns", "scope": "s", "name": "n"} | {part: bad}
    with pytest.raises(ConfigurationError, match=part):
        derive_key(args["namespace"], args["scope"], args["name"], 0)
    with pytest.raises(ConfigurationError, match=part):
        EffectIdentity.of(args["namespace"], args["scope"], args["name"], 0)
    if part == "scope":
        with pytest.raises(ConfigurationError, match="scope"):
            key_deriver("ns", "n")(bad, 0)
    else:
        with pytest.raises(ConfigurationError, match=part):
            key_deriver(args["namespace"], args["name"])


@pytest.mark.parametrize("bad", ["a\x00b", "x\udfff"])
def test_unstorable_explicit_key_is_refused(bad: str) -> None:
    with pytest.raises(ConfigurationError, match="key"):
        derive_explicit_key("ns", bad, "n")
    with pytest.raises(ConfigurationError, match="key"):
        EffectIdentity.explicit("ns", bad, "n")
    with pytest.raises(ConfigurationError, match="name"):
        EffectIdentity.explicit("ns", "order-1", bad)


@pytest.mark.parametrize(
    ("args", "problem"),
    [
        (("ns", "s", "", 0), "empty name"),
        (("ns", "s", "n", -1), "negative ordinal"),
        (("x" * 4097, "s", "n", 0), "long namespace"),
        (("ns", "x" * 4097, "n", 0), "long scope"),
        (("ns", "s", "x" * 4097, 0), "long name"),
    ],
)
def test_bad_identity_is_configuration_error(args: tuple[str, str, str, int], problem: str) -> None:
    with pytest.raises(ConfigurationError):
        derive_key(*args)
    with pytest.raises(ConfigurationError):
        EffectIdentity.of(*args)


def test_longest_allowed_parts() -> None:
    assert len(derive_key("x" * 4096, "y" * 4096, "z" * 4096, 2**63)) == 68


def test_lone_surrogate_in_a_part_is_configuration_error() -> None:
    with pytest.raises(ConfigurationError):
        derive_key("ns", "thread-\ud800", "n", 0)


def test_provider_key_is_derived_stable_and_short() -> None:
    identity = EffectIdentity.of("tenant", "run-1", "stripe.charge", 0)
    pk = identity.provider_key
    assert pk == provider_key(identity.key)
    assert pk != identity.key
    assert identity.key[4:] not in pk
    assert pk.startswith(f"sg{KEY_VERSION}p_")
    assert len(pk) < 255
    assert pk != EffectIdentity.of("tenant", "run-1", "stripe.charge", 1).provider_key


# ----------------------------------------------------------------------------- explicit keys


def test_explicit_key() -> None:
    identity = EffectIdentity.explicit("tenant-a", "order-42-charge", "stripe.charge")
    assert identity.namespace == "tenant-a"
    assert identity.scope == "order-42-charge"
    assert identity.name == "stripe.charge"
    assert identity.ordinal == 0
    assert len(identity.key) == 68
    assert "order-42" not in identity.key
    assert identity == EffectIdentity.explicit("tenant-a", "order-42-charge", "stripe.charge")


def test_explicit_key_is_namespaced() -> None:
    assert (
        EffectIdentity.explicit("tenant-a", "k", "e").key
        != EffectIdentity.explicit("tenant-b", "k", "e").key
    )


def test_explicit_key_differs_from_derived_key_of_same_text() -> None:
    assert EffectIdentity.explicit("ns", "k", "e").key != EffectIdentity.of("ns", "k", "e", 0).key


def test_empty_explicit_key_is_configuration_error() -> None:
    with pytest.raises(ConfigurationError):
        EffectIdentity.explicit("ns", "", "e")


# ------------------------------------------------------------------------------ fingerprints


@given(arguments)
def test_fingerprint_ignores_dict_order(args: dict[str, Any]) -> None:
    fp = fingerprint(args)
    assert fp == fingerprint(reversed_order(args))
    assert fp.startswith(f"f{KEY_VERSION}_")
    assert len(fp) == 67
    assert set(fp[3:]) <= HEX


@given(arguments, arguments)
def test_fingerprint_differs_for_different_arguments(a: dict[str, Any], b: dict[str, Any]) -> None:
    assume(canonical_text(a) != canonical_text(b))
    assert fingerprint(a) != fingerprint(b)


def test_fingerprint_nested_order() -> None:
    a = {"customer": {"id": "c1", "address": {"city": "Köln", "zip": "50667"}}, "amount": 1}
    b = {"amount": 1, "customer": {"address": {"zip": "50667", "city": "Köln"}, "id": "c1"}}
    assert fingerprint(a) == fingerprint(b)
    assert fingerprint(a) != fingerprint({**a, "amount": 2})


def test_fingerprint_keeps_list_order() -> None:
    assert fingerprint({"items": [1, 2]}) != fingerprint({"items": [2, 1]})


@given(st.text(), st.text())
def test_fingerprint_unicode(a: str, b: str) -> None:
    assume(a != b)
    assert fingerprint({"name": a}) == fingerprint({"name": a})
    assert fingerprint({"name": a}) != fingerprint({"name": b})
    assert fingerprint({a: 1}) != fingerprint({b: 1})


def test_fingerprint_of_dataclasses_and_models() -> None:
    import pydantic

    @dataclasses.dataclass
    class Line:
        sku: str
        qty: int

    class Order(pydantic.BaseModel):
        id: str
        lines: list[Line]

    order = Order(id="o1", lines=[Line("a", 1), Line("b", 2)])
    same = Order(id="o1", lines=[Line("a", 1), Line("b", 2)])
    assert fingerprint({"order": order}) == fingerprint({"order": same})
    assert fingerprint({"order": order}) != fingerprint(
        {"order": Order(id="o1", lines=[Line("a", 1), Line("b", 3)])}
    )


@pytest.mark.parametrize(
    "bad",
    [
        {"x": object()},
        {"x": float("nan")},
        {"x": float("inf")},
        {"x": threading.Lock()},
    ],
    ids=["object", "nan", "inf", "lock"],
)
def test_unfingerprintable_argument_is_codec_error(bad: dict[str, Any]) -> None:
    with pytest.raises(CodecError):
        fingerprint(bad)


_FP_OF_A_SET = (
    "from sagaguard.idempotency.keys import fingerprint; "
    "print(fingerprint({'tags': {'alpha', 'beta', 'gamma', 'delta', 'epsilon'}}))"
)


def test_fingerprint_of_a_set_is_stable_across_processes() -> None:
    root = str(Path(__file__).resolve().parent.parent)
    seen = set()
    for seed in ("1", "2", "3", "4"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": root}
        out = subprocess.run(
            [sys.executable, "-c", _FP_OF_A_SET], capture_output=True, text=True, env=env, check=True
        )
        seen.add(out.stdout.strip())
    assert len(seen) == 1, seen


# ------------------------------------------------------------------------- scope and ordinals


def test_no_scope_raises_no_scope() -> None:
    with pytest.raises(NoScope) as info:
        current_scope()
    assert isinstance(info.value, ConfigurationError)


def test_scope_sets_and_restores_the_contextvar() -> None:
    with scope("run-1") as outer:
        assert current_scope() is outer
        assert outer.id == "run-1"
        with scope("run-1/child") as inner:
            assert current_scope() is inner
        assert current_scope() is outer
    with pytest.raises(NoScope):
        current_scope()


def test_scope_is_restored_after_an_exception() -> None:
    with pytest.raises(RuntimeError), scope("run-1"):
        raise RuntimeError("boom")
    with pytest.raises(NoScope):
        current_scope()


def test_ordinals_count_per_name() -> None:
    with scope("run-1") as unit:
        assert [unit.next_ordinal("charge") for _ in range(3)] == [0, 1, 2]
        assert unit.next_ordinal("email") == 0
        assert unit.next_ordinal("charge") == 3


def test_rerun_of_a_scope_maps_calls_to_the_same_keys() -> None:
    def run() -> list[str]:
        with scope("saga-7/step-2") as unit:
            return [
                derive_key("t", unit.id, name, unit.next_ordinal(name))
                for name in ("charge", "email", "charge")
            ]

    first, second = run(), run()
    assert first == second
    assert len(set(first)) == 3


def test_empty_scope_id_is_configuration_error() -> None:
    with pytest.raises(ConfigurationError), scope(""):
        pass


def test_scope_does_not_leak_into_other_threads() -> None:
    seen: list[BaseException | Scope] = []

    def look() -> None:
        try:
            seen.append(current_scope())
        except NoScope as exc:
            seen.append(exc)

    with scope("run-1"):
        t = threading.Thread(target=look)
        t.start()
        t.join()
    assert isinstance(seen[0], NoScope)


def test_scopes_of_concurrent_tasks_are_separate() -> None:
    async def unit(scope_id: str) -> list[tuple[str, int]]:
        with scope(scope_id):
            out = []
            for _ in range(3):
                await asyncio.sleep(0)  # let the other task run in between
                current = current_scope()
                out.append((current.id, current.next_ordinal("call")))
            return out

    async def main() -> list[list[tuple[str, int]]]:
        return list(await asyncio.gather(unit("a"), unit("b")))

    a, b = asyncio.run(main())
    assert a == [("a", 0), ("a", 1), ("a", 2)]
    assert b == [("b", 0), ("b", 1), ("b", 2)]
