"""The declared result type a record keeps, read back to check an operator's result.

A guarded effect's claim records the name of its declared result type
(:func:`~sagaguard.idempotency.codec.type_name`: ``"sagaguard.connectors.stripe.Payment"``,
``"builtins.dict"``) in :attr:`Record.result_type <sagaguard.idempotency.records.Record.result_type>`.
When an operator resolves the record as applied, :func:`check_result` imports that type again and
decodes the given result with its :class:`~sagaguard.idempotency.codec.Codec`, so a result every
later replay would fail to read back (``CodecError``) is refused before it is written.

::

    check_result("sagaguard.connectors.email.Sent", '{"message_id": "<m1@example.com>"}')
"""

from __future__ import annotations

import functools
import importlib
import json
from typing import Any

from pydantic import ValidationError

from sagaguard.idempotency.codec import Codec
from sagaguard.idempotency.errors import CodecError, ConfigurationError

__all__ = ["ResultMismatch", "ResultTypeUnavailable", "check_result", "expected_shape", "recorded_codec"]

_SHAPE_LIMIT = 600
_PROBLEMS = 5


class ResultMismatch(ConfigurationError):
    """An operator's result does not read back as the effect's recorded result type; nothing was
    changed. The message names the type and shows the shape it expects."""


class ResultTypeUnavailable(ConfigurationError):
    """The record's result type cannot be imported in this process (its module is not installed
    here, or it lives in a script's ``__main__``), so the result cannot be checked; nothing was
    changed."""


def _import(name: str) -> Any:
    """The object ``name`` (``module.Qual.Name``) names: the longest importable module prefix,
    then attributes."""
    if name == "None":
        return None
    parts = name.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        module_name = ".".join(parts[:cut])
        try:
            found: Any = importlib.import_module(module_name)
        except ImportError:
            continue
        try:
            return functools.reduce(getattr, parts[cut:], found)
        except AttributeError:
            break
    raise ResultTypeUnavailable(
        f"the effect's result type {name!r} cannot be imported here, so the result cannot be checked: "
        "resolve it where the application's code is importable (its virtualenv; a type defined in a "
        "script's __main__ only from that script, through resolve_effect)"
    )


@functools.lru_cache(maxsize=64)
def recorded_codec(name: str) -> Codec[Any]:
    """The codec of the result type a record names (imported, then built once per name).

    Raises:
        ResultTypeUnavailable: the type cannot be imported here, or is not a type a codec takes.
    """
    tp = _import(name)
    try:
        return Codec(tp)
    except CodecError as exc:
        raise ResultTypeUnavailable(
            f"the effect's result type {name!r} has no JSON codec here: {exc}"
        ) from exc


def _bare(schema: Any) -> Any:
    """``schema`` without its titles and descriptions (the shape only)."""
    if isinstance(schema, dict):
        return {k: _bare(v) for k, v in schema.items() if k not in ("title", "description")}
    if isinstance(schema, list):
        return [_bare(v) for v in schema]
    return schema


def expected_shape(codec: Codec[Any]) -> str:
    """The JSON schema of what ``codec`` reads, without titles and descriptions, compact, cut to a
    readable length."""
    schema = json.dumps(_bare(codec.json_schema()), separators=(",", ":"), sort_keys=True)
    return schema if len(schema) <= _SHAPE_LIMIT else schema[: _SHAPE_LIMIT - 3] + "..."


def _problems(exc: CodecError) -> str:
    """What pydantic found wrong, one short clause per field (at most five)."""
    cause = exc.__cause__
    if not isinstance(cause, ValidationError):
        return str(exc)
    found = [f"{'.'.join(map(str, e['loc'])) or 'the value'}: {e['msg']}" for e in cause.errors()]
    more = f" (and {len(found) - _PROBLEMS} more)" if len(found) > _PROBLEMS else ""
    return "; ".join(found[:_PROBLEMS]) + more


def check_result(name: str, text: str) -> None:
    """Check that the JSON ``text`` reads back as the result type named ``name``.

    Raises:
        ResultMismatch: it does not (the message names the type and shows its JSON schema).
        ResultTypeUnavailable: the type cannot be imported here.
    """
    codec = recorded_codec(name)
    try:
        codec.decode(text)
    except CodecError as exc:
        raise ResultMismatch(
            f"the result is not a {name}, the type this effect records ({_problems(exc)}); "
            f"expected JSON of this shape: {expected_shape(codec)}"
        ) from None
