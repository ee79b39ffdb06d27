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
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel
from pydantic_core import to_jsonable_python

from idempotency.errors import CodecError, ConfigurationError, NoScope

__all__ = [
    "KEY_VERSION",
    "EffectIdentity",
    "Scope",
    "current_scope",
    "derive_explicit_key",
    "derive_key",
    "fingerprint",
    "key_deriver",
    "provider_key",
    "scope",
]

KEY_VERSION = 1
"""Bumped whenever the key encoding changes, so old and new keys never collide."""

_MAX_PART = 4096


def _encode_parts(*parts: str | int) -> bytes:
    """Length-prefix every part, so ("a:b", "c") and ("a", "b:c") encode differently."""
    out: list[bytes] = []
    append = out.append
    for part in parts:
        try:
            raw = (part if type(part) is str else str(part)).encode("utf-8")
        except UnicodeEncodeError as exc:
            # A lone surrogate (e.g. from json.loads('"\\ud800"')) has no UTF-8 form.
            raise CodecError(f"a key part or argument is not valid unicode: {exc.reason}") from exc
        append(len(raw).to_bytes(4, "big"))
        append(raw)
    return b"".join(out)


# The constant leading parts of each hash input, encoded once (the encoding is a concatenation, so
# head + rest is byte for byte the encoding of all the parts).
_KEY_HEAD = _encode_parts("sagaguard.key", KEY_VERSION)
_PROVIDER_HEAD = _encode_parts("sagaguard.provider", KEY_VERSION)
_FINGERPRINT_HEAD = _encode_parts("sagaguard.fingerprint", KEY_VERSION)
_FINGERPRINT_PREFIX = f"f{KEY_VERSION}_"


def derive_key(namespace: str, scope: str, name: str, ordinal: int) -> str:
    """The effect key for an identity: ``sg1_`` followed by 64 hex digits (68 characters).

    Raises:
        ConfigurationError: a part is empty where it must not be, too long, or the ordinal is negative.
    """
    if not name:
        raise ConfigurationError("an effect needs a non-empty name")
    if type(ordinal) is not int:
        raise ConfigurationError(f"ordinal must be an int, got {type(ordinal).__name__}")
    if not (type(namespace) is str and type(scope) is str and type(name) is str):
        raise ConfigurationError("namespace, scope and name must be str")
    if ordinal < 0:
        raise ConfigurationError(f"ordinal must be >= 0, got {ordinal}")
    for label, part in (("namespace", namespace), ("scope", scope), ("name", name)):
        if len(part) > _MAX_PART:
            raise ConfigurationError(f"{label} is longer than {_MAX_PART} characters")
    digest = hashlib.sha256(_KEY_HEAD + _encode_parts(namespace, scope, name, ordinal))
    return f"sg{KEY_VERSION}_{digest.hexdigest()}"


_TAILS_KEPT = 64
"""Ordinals for which a key deriver keeps the encoded end of the hash input (name and ordinal)."""


def key_deriver(namespace: str, name: str) -> Callable[[str, int], str]:
    """:func:`derive_key` with the namespace and the name fixed: ``key_deriver(ns, name)(scope, n)``
    equals ``derive_key(ns, scope, name, n)``.

    A guarded function derives a key on every call with the same namespace and name, so those are
    checked and encoded once, here, and each call encodes only its scope and ordinal.

    Raises:
        ConfigurationError: as :func:`derive_key`, for the namespace and name now, for a scope or an
            ordinal when the returned function is called (CodecError for a scope with no UTF-8 form).
    """
    derive_key(namespace, "", name, 0)  # the same checks and errors as a full derivation
    head = _KEY_HEAD + _encode_parts(namespace)
    tail = _encode_parts(name)
    # The encoded name and ordinal that end the hash input, for the first ordinals (most effects are
    # called a few times per scope): each call then encodes only its scope.
    tails = [tail + _encode_parts(n) for n in range(_TAILS_KEPT)]
    sha256, prefix = hashlib.sha256, f"sg{KEY_VERSION}_"

    def derive(scope: str, ordinal: int) -> str:
        if type(scope) is not str or type(ordinal) is not int or ordinal < 0 or len(scope) > _MAX_PART:
            return derive_key(namespace, scope, name, ordinal)  # raises the error it would have
        try:
            raw = scope.encode()
        except UnicodeEncodeError:
            return derive_key(namespace, scope, name, ordinal)  # raises CodecError
        if ordinal < _TAILS_KEPT:
            rest = tails[ordinal]
        else:
            count = str(ordinal).encode()
            rest = tail + len(count).to_bytes(4, "big") + count
        return prefix + sha256(head + len(raw).to_bytes(4, "big") + raw + rest).hexdigest()

    return derive


def derive_explicit_key(namespace: str, key: str, name: str) -> str:
    """The effect key for a caller-given key: the namespace and the effect's name enter the hash, so
    one order id used as the key of ``pay.charge`` and of ``mail.receipt`` names two effects.

    Raises:
        ConfigurationError: ``key`` or ``name`` is empty or too long.
    """
    if not key or not name:
        raise ConfigurationError("an explicit key and its effect name must not be empty")
    for label, part in (("namespace", namespace), ("key", key), ("name", name)):
        if len(part) > _MAX_PART:
            raise ConfigurationError(f"{label} is longer than {_MAX_PART} characters")
    digest = hashlib.sha256(_encode_parts("sagaguard.explicit", KEY_VERSION, namespace, key, name))
    return f"sg{KEY_VERSION}_{digest.hexdigest()}"


def provider_key(key: str) -> str:
    """The key to hand to a provider that deduplicates (Stripe ``Idempotency-Key``, an HTTP header).

    Derived from the effect key (not equal to it, so a leaked provider key reveals nothing of the
    store), stable across processes: a re-send after an in-doubt crash is absorbed by the provider.
    """
    digest = hashlib.sha256(_PROVIDER_HEAD + _encode_parts(key))
    return f"sg{KEY_VERSION}p_{digest.hexdigest()[:48]}"


_JSON = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
"""The canonical encoder, built once: what ``json.dumps`` with these options builds on every call."""

_PLAIN = frozenset({str, int, float, bool, type(None)})
"""Exact types that :func:`to_jsonable_python` returns unchanged, so a flat mapping of them needs no
conversion (subclasses such as enums and named ints still go through it)."""


_BIG = 10**4000
_quote = json.encoder.encode_basestring  # what the canonical encoder (ensure_ascii=False) writes
_int_repr, _float_repr = int.__repr__, float.__repr__
_sha256 = hashlib.sha256


def _flat_text(data: Mapping[str, Any]) -> str | None:
    """The canonical JSON of a flat mapping of plain values, as :data:`_JSON` writes it, or None.

    The common arguments (a few strings and numbers) skip the general encoder's per-call set-up:
    keys sorted, ``"key":value`` joined by commas, strings quoted by the encoder's own function,
    numbers by ``repr`` as the encoder writes them. None for anything else (a non-str key, a nested
    or non-plain value, a NaN or an infinity), which the general path handles or refuses.
    """
    parts: list[str] = []
    keys: Iterable[Any] = data  # one key needs no sorting (the common case: one argument)
    if len(data) > 1:
        try:
            keys = sorted(data)
        except TypeError:  # keys of types that do not compare
            return None
    for k in keys:
        if type(k) is not str:
            return None
        v = data[k]
        t = type(v)
        if t is str:
            text = _quote(v)
        elif t is int and -_BIG < v < _BIG:  # past 4300 digits repr refuses: the general path says so
            text = _int_repr(v)
        elif t is bool:
            text = "true" if v else "false"
        elif v is None:
            text = "null"
        elif t is float and v - v == 0.0:  # finite: NaN - NaN and inf - inf are NaN
            text = _float_repr(v)
        else:
            return None
        parts.append(f"{_quote(k)}:{text}")
    return "{" + ",".join(parts) + "}"


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
    text = _flat_text(arguments)
    if text is None:
        data = dict(arguments)
        plain = _PLAIN
        if not all(type(k) is str and type(v) in plain for k, v in data.items()):
            data = _canonical(data)
        try:
            text = _JSON.encode(data)
        except (TypeError, ValueError) as exc:
            raise CodecError(f"cannot fingerprint arguments: {exc}") from exc
    try:
        raw = text.encode()
    except UnicodeEncodeError:
        _encode_parts(text)  # raises the CodecError every part with no UTF-8 form gets
        raise
    return _FINGERPRINT_PREFIX + _sha256(_FINGERPRINT_HEAD + len(raw).to_bytes(4, "big") + raw).hexdigest()


@dataclass(frozen=True, slots=True)
class EffectIdentity:
    """Who an effect is: the readable parts and the key derived from them.

    The readable parts are stored beside the key for listing and reconciliation; they never go on
    spans.
    """

    namespace: str
    scope: str
    name: str
    ordinal: int
    key: str

    @classmethod
    def of(cls, namespace: str, scope: str, name: str, ordinal: int) -> EffectIdentity:
        """Build an identity and derive its key."""
        return cls(namespace, scope, name, ordinal, derive_key(namespace, scope, name, ordinal))

    @classmethod
    def explicit(cls, namespace: str, key: str, name: str) -> EffectIdentity:
        """An identity for a caller-given key. The namespace still enters the hash (tenants)."""
        if not key:
            raise ConfigurationError("an explicit key must not be empty")
        return cls(namespace, key, name, 0, derive_explicit_key(namespace, key, name))

    @property
    def provider_key(self) -> str:
        """See :func:`provider_key`."""
        return provider_key(self.key)

    @staticmethod
    def from_fields(namespace: str, scope: str, name: str, ordinal: int, key: str) -> EffectIdentity:
        """Exactly ``EffectIdentity(...)`` with the same arguments, built about three times faster.

        For the guard, which builds one on every call. Like :meth:`Record.from_fields
        <idempotency.records.Record.from_fields>`: the result is a plain frozen identity.
        """
        # The frozen dataclass's __init__ sets each field through object.__setattr__; an unfrozen
        # twin with the same slots takes plain assignments, then becomes the identity by __class__
        # assignment, which Python allows between two classes of one layout.
        identity: Any = _new(_IdentityFields)
        identity.namespace = namespace
        identity.scope = scope
        identity.name = name
        identity.ordinal = ordinal
        identity.key = key
        identity.__class__ = EffectIdentity
        built: EffectIdentity = identity  # typed without a call to cast(), which costs ~0.1 us
        return built


_new = object.__new__
_IdentityFields = type("_IdentityFields", (), {"__slots__": EffectIdentity.__slots__, "__module__": __name__})
"""EffectIdentity's slots without its frozen ``__setattr__``: what :meth:`EffectIdentity.from_fields`
fills."""


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
