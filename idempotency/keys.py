"""Effect identity: scope + name + ordinal -> key, and argument fingerprints.

A framework re-runs an interrupted unit (saga step, graph node, agent turn) from its first line, so an
effect is identified by the unit's durable identity (the *scope*) plus the call's position in it (the
*ordinal* among calls of the same *name*). The key is a hash of a versioned, length-prefixed encoding of
those parts: fixed length, no separator collisions, no personal data, far under Stripe's 255 characters.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import re
import secrets
from collections.abc import Callable, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Final

from pydantic import BaseModel
from pydantic_core import to_jsonable_python

from sagaguard.idempotency.checks import storable_text
from sagaguard.idempotency.errors import CodecError, ConfigurationError, NoScope

__all__ = [
    "KEY_VERSION",
    "LEGACY_LEDGER",
    "EffectIdentity",
    "Scope",
    "check_ledger_id",
    "current_scope",
    "derive_explicit_key",
    "derive_key",
    "fingerprint",
    "key_deriver",
    "new_ledger_id",
    "provider_key",
    "scope",
    "search_key",
]

KEY_VERSION = 1
"""Bumped whenever the key encoding changes, so old and new keys never collide."""


def _encode_parts(*parts: str | int) -> bytes:
    """Length-prefix every part, so ("a:b", "c") and ("a", "b:c") encode differently.

    Raises:
        CodecError: a part has no UTF-8 form (a lone surrogate).
    """
    out: list[bytes] = []
    for part in parts:
        try:
            raw = str(part).encode("utf-8")
        except UnicodeEncodeError as exc:
            # A lone surrogate (e.g. from json.loads('"\\ud800"')) has no UTF-8 form.
            raise CodecError(f"a key part or argument is not valid unicode: {exc.reason}") from exc
        out.append(len(raw).to_bytes(4, "big"))
        out.append(raw)
    return b"".join(out)


def _storable(label: str, part: object) -> None:
    """Refuse a part of an identity that some backend cannot store as the text it is (the readable
    parts are stored beside the key); see :func:`~sagaguard.idempotency.checks.storable_text`."""
    storable_text(label, part, empty_ok=True)


def derive_key(namespace: str, scope: str, name: str, ordinal: int) -> str:
    """The effect key for an identity: ``sg1_`` followed by 64 hex digits (68 characters).

    Raises:
        ConfigurationError: a part is empty where it must not be, not a str, too long, holds a NUL
            character or a lone surrogate (CodecError), or the ordinal is not an int >= 0.
    """
    return key_deriver(namespace, name)(scope, ordinal)


def key_deriver(namespace: str, name: str) -> Callable[[str, int], str]:
    """:func:`derive_key` with the namespace and the name fixed: ``key_deriver(ns, name)(scope, n)``
    is ``derive_key(ns, scope, name, n)``, the one derivation of every key.

    The hash input is the length-prefixed encoding of ("sagaguard.key", version, namespace, scope,
    name, ordinal); an encoding of parts is the concatenation of each part's, so the parts fixed
    here are encoded once.

    Raises:
        ConfigurationError: as :func:`derive_key`, for the namespace and name now, for a scope or an
            ordinal when the returned function is called.
    """
    if not name:
        raise ConfigurationError("an effect needs a non-empty name")
    if type(namespace) is not str or type(name) is not str:
        raise ConfigurationError("namespace, scope and name must be str")
    _storable("namespace", namespace)
    _storable("name", name)
    head = _encode_parts("sagaguard.key", KEY_VERSION, namespace)
    tail = _encode_parts(name)
    prefix = f"sg{KEY_VERSION}_"

    def derive(scope: str, ordinal: int) -> str:
        if type(ordinal) is not int:
            raise ConfigurationError(f"ordinal must be an int, got {type(ordinal).__name__}")
        if ordinal < 0:
            raise ConfigurationError(f"ordinal must be >= 0, got {ordinal}")
        if type(scope) is not str:
            raise ConfigurationError("namespace, scope and name must be str")
        _storable("scope", scope)
        digest = hashlib.sha256(head + _encode_parts(scope) + tail + _encode_parts(ordinal))
        return prefix + digest.hexdigest()

    return derive


def derive_explicit_key(namespace: str, key: str, name: str) -> str:
    """The effect key for a caller-given key: the namespace and the effect's name enter the hash, so
    one order id used as the key of ``pay.charge`` and of ``mail.receipt`` names two effects.

    Raises:
        ConfigurationError: ``key`` or ``name`` is empty; a part is too long or holds a NUL
            character or a lone surrogate (CodecError).
    """
    if not key or not name:
        raise ConfigurationError("an explicit key and its effect name must not be empty")
    for label, part in (("namespace", namespace), ("key", key), ("name", name)):
        _storable(label, part)
    digest = hashlib.sha256(_encode_parts("sagaguard.explicit", KEY_VERSION, namespace, key, name))
    return f"sg{KEY_VERSION}_{digest.hexdigest()}"


LEGACY_LEDGER: Final = ""
"""The ledger id of a ledger that held records before ledgers had ids (an upgraded database, a Redis
prefix in use): :func:`provider_key` then derives exactly what it derived before, so a record in
doubt from before the upgrade is re-sent under the key it was first sent with."""

_LEDGER_ID = re.compile(r"[A-Za-z0-9_.-]{0,64}")


def new_ledger_id() -> str:
    """A fresh ledger id: 32 random hex digits (128 bits), drawn once when a ledger is created."""
    return secrets.token_hex(16)


def check_ledger_id(ledger: object) -> str:
    """``ledger`` if it is a valid ledger id: at most 64 of ``A-Z a-z 0-9 _ . -``, or empty (the
    legacy derivation, :data:`LEGACY_LEDGER`).

    Raises:
        ConfigurationError: it is not a str or not of that form.
    """
    if type(ledger) is not str or not _LEDGER_ID.fullmatch(ledger):
        raise ConfigurationError(
            f"a ledger id is at most 64 letters, digits, '_', '.' or '-' (or empty), got {ledger!r}"
        )
    return ledger


def provider_key(key: str, ledger: str = LEGACY_LEDGER) -> str:
    """The key to hand to a provider that deduplicates (Stripe ``Idempotency-Key``, an HTTP header).

    Derived from the effect key and the ledger's id (not equal to the key, so a leaked provider key
    reveals nothing of the store), stable across processes and for the life of the ledger: a
    re-send after an in-doubt crash is absorbed by the provider. The ledger id makes two ledgers
    (staging and production, two deployments) that share a provider account, a namespace and a
    scope send different keys, so neither takes the other's answer as its own. The empty id
    (:data:`LEGACY_LEDGER`, what a ledger that held records before ledger ids has) derives the key
    of earlier versions, which had no ledger id.

    Args:
        key: the effect key.
        ledger: the ledger's id (:meth:`~sagaguard.idempotency.store.IdempotencyStore.ledger_id`).
    """
    if ledger == LEGACY_LEDGER:
        digest = hashlib.sha256(_encode_parts("sagaguard.provider", KEY_VERSION, key))
    else:
        # One more length-prefixed part: never the encoding of a legacy key's input.
        digest = hashlib.sha256(_encode_parts("sagaguard.provider", KEY_VERSION, key, ledger))
    return f"sg{KEY_VERSION}p_{digest.hexdigest()[:48]}"


def search_key(key: str, ledger: str = LEGACY_LEDGER) -> str:
    """The effect key qualified by the ledger id: what a connector stamps on the provider's object
    (Stripe metadata, a stored completion's metadata) to find it again when its answer was lost.

    Two ledgers sharing a provider account, a namespace and a scope derive one effect key; the
    ledger id keeps a lookup of one from finding the other's object. In a legacy ledger (empty id)
    it is the key itself, what earlier versions stamped, so their objects are still found.
    """
    return key if ledger == LEGACY_LEDGER else f"{key}@{ledger}"


_JSON = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
"""The canonical encoder."""

_PLAIN = frozenset({str, int, float, bool, type(None)})
"""Exact types that :func:`to_jsonable_python` returns unchanged: a flat mapping of them is encoded
as it is (converting it would also turn a NaN into null, which the encoder refuses instead)."""


def _ordered(value: Any) -> Any:
    """Replace every set (also inside dataclasses and models) by a list in canonical order.

    A set iterates in an order that depends on PYTHONHASHSEED, so converted as is it would give the
    same arguments another fingerprint in another process, and a resumed run a KeyConflict.
    """
    if isinstance(value, dict):
        return {k: _ordered(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_ordered(v) for v in value]
    if isinstance(value, set | frozenset):
        items = [to_jsonable_python(_ordered(v)) for v in value]
        return sorted(items, key=_JSON.encode)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _ordered(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, BaseModel):
        return _ordered(value.model_dump())
    return value


def _canonical(value: Any) -> Any:
    """Convert to plain JSON types so that equal arguments encode to equal text."""
    try:
        return to_jsonable_python(_ordered(value))
    except CodecError:
        raise
    except Exception as exc:
        raise CodecError(f"cannot fingerprint an argument of type {type(value).__name__}: {exc}") from exc


def fingerprint(arguments: Mapping[str, Any]) -> str:
    """A versioned hash of the canonical JSON of ``arguments``.

    Canonical: keys sorted at every depth, no insignificant white space, unicode kept as is, so the
    fingerprint does not depend on dict order or formatting.

    Raises:
        CodecError: an argument cannot be converted to JSON.
    """
    data = dict(arguments)
    if not all(type(k) is str and type(v) in _PLAIN for k, v in data.items()):
        data = _canonical(data)
    try:
        text = _JSON.encode(data)
    except (TypeError, ValueError) as exc:
        raise CodecError(f"cannot fingerprint arguments: {exc}") from exc
    digest = hashlib.sha256(_encode_parts("sagaguard.fingerprint", KEY_VERSION, text))
    return f"f{KEY_VERSION}_{digest.hexdigest()}"


@dataclass(frozen=True, slots=True)
class EffectIdentity:
    """Who an effect is: the readable parts and the key derived from them.

    The readable parts are stored beside the key for listing and reconciliation; they never go on
    spans. ``ledger`` is the id of the ledger the effect is recorded in: it enters the provider key,
    not the effect key (a guard's identities carry its store's; see :meth:`Guard.provider_key
    <sagaguard.idempotency.guard.Guard.provider_key>`).
    """

    namespace: str
    scope: str
    name: str
    ordinal: int
    key: str
    ledger: str = LEGACY_LEDGER
    result_type: str | None = field(default=None, compare=False)
    """The declared type of the effect's result (:func:`~sagaguard.idempotency.result_types.type_name`),
    which the claim records beside the identity; not part of who the effect is (not compared)."""

    @classmethod
    def of(
        cls, namespace: str, scope: str, name: str, ordinal: int, ledger: str = LEGACY_LEDGER
    ) -> EffectIdentity:
        """Build an identity and derive its key."""
        return cls(namespace, scope, name, ordinal, derive_key(namespace, scope, name, ordinal), ledger)

    @classmethod
    def explicit(
        cls, namespace: str, key: str, name: str, ledger: str = LEGACY_LEDGER, result_type: str | None = None
    ) -> EffectIdentity:
        """An identity for a caller-given key. The namespace still enters the hash (tenants)."""
        if not key:
            raise ConfigurationError("an explicit key must not be empty")
        return cls(namespace, key, name, 0, derive_explicit_key(namespace, key, name), ledger, result_type)

    @property
    def provider_key(self) -> str:
        """See :func:`provider_key`: of this identity's key in its ledger."""
        return provider_key(self.key, self.ledger)

    @property
    def search_key(self) -> str:
        """See :func:`search_key`: this identity's key qualified by its ledger."""
        return search_key(self.key, self.ledger)


@dataclass(slots=True)
class Scope:
    """The durable identity of a unit of work that may be re-run from its start.

    Holds a per-name call counter, so the n-th call of an effect name in the scope gets ordinal n.
    The counter is only meaningful for sequential code; parallel calls need a discriminator in the
    scope or an explicit key.
    """

    id: str
    _counters: dict[str, int] = field(default_factory=dict)

    def next_ordinal(self, name: str) -> int:
        """Return the ordinal for the next call of ``name`` and advance the counter."""
        n = self._counters.get(name, 0)
        self._counters[name] = n + 1
        return n


_current: ContextVar[Scope | None] = ContextVar("sagaguard_scope", default=None)


def current_scope() -> Scope:
    """The scope set by the innermost :func:`scope` (or a saga runner or framework adapter).

    Raises:
        NoScope: no scope is set.
    """
    found = _current.get()
    if found is None:
        raise NoScope(
            "no effect scope is set: wrap the unit of work in `with scope('run-id'):` or pass key= explicitly"
        )
    return found


@contextlib.contextmanager
def scope(scope_id: str) -> Iterator[Scope]:
    """Run a block as the unit of work ``scope_id``.

    Every guarded call inside derives its key from ``scope_id``, its name and its ordinal, so running
    the same block again (after a crash) maps each call to the record of its first run.

    Raises:
        ConfigurationError: ``scope_id`` is empty.
    """
    if not scope_id:
        raise ConfigurationError("a scope id must not be empty")
    unit = Scope(scope_id)
    token = _current.set(unit)
    try:
        yield unit
    finally:
        _current.reset(token)
