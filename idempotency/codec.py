"""JSON codec for recorded results and errors. No pickle, ever.

A result is stored as JSON text and read back as the effect's declared return type. The codec is built
from that type when the effect is decorated, so a type that cannot round-trip through JSON is an error
at definition time, not a lost result after the card was charged.

Supported: ``None``, ``bool``, ``int``, ``float``, ``str``, ``Decimal``, ``datetime``/``date``, ``UUID``,
enums, ``list``/``tuple``/``dict``/``set`` of supported types, ``Optional``/unions, dataclasses,
``TypedDict``, pydantic models (SQLModel models included). Everything pydantic can validate *and*
serialise; arbitrary classes are refused.
"""

from __future__ import annotations

import json
import typing
from typing import Any, Generic, TypeVar

from pydantic import (
    PydanticInvalidForJsonSchema,
    PydanticSchemaGenerationError,
    PydanticUserError,
    TypeAdapter,
    ValidationError,
)
from pydantic_core import PydanticSerializationError

from sagaguard.idempotency.errors import CodecError

__all__ = ["Codec", "ErrorInfo", "decode_error", "encode_error", "type_name"]

T = TypeVar("T")

_JSON = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=True)


class Codec(Generic[T]):
    """Encodes values of one type to JSON text and decodes them back.

    Raises:
        CodecError: at construction, when ``tp`` cannot round-trip through JSON.
    """

    __slots__ = ("_adapter", "_name", "type_name")

    def __init__(self, tp: Any) -> None:
        self._name = getattr(tp, "__name__", repr(tp))
        self.type_name = type_name(tp)
        """The declared type as :func:`type_name` names it (recorded with every claim)."""
        if tp is None or tp is type(None):
            tp = type(None)
        try:
            self._adapter: TypeAdapter[T] = TypeAdapter(tp)
            # Pydantic validates some types it cannot write as JSON (callables, ...); asking for the
            # serialisation schema refuses those now rather than after the effect ran.
            self._adapter.json_schema(mode="serialization")
        except (
            PydanticSchemaGenerationError,
            PydanticInvalidForJsonSchema,
            PydanticUserError,
            TypeError,
            NameError,
        ) as exc:
            raise CodecError(
                f"results of type {self._name} cannot be stored as JSON: {exc}. "
                "Return a dataclass, a pydantic model or plain JSON types."
            ) from exc

    @classmethod
    def for_return_of(cls, hints: dict[str, Any]) -> Codec[Any]:
        """The codec for a function's return annotation (``Any`` when it has none)."""
        return cls(hints.get("return", Any))

    def json_schema(self) -> dict[str, Any]:
        """The JSON schema of the text :meth:`decode` reads (pydantic's, validation mode)."""
        return self._adapter.json_schema()

    def encode(self, value: T) -> str:
        """Value to JSON text.

        Raises:
            CodecError: the value does not fit the declared type or contains something unstorable.
        """
        adapter = self._adapter
        try:
            raw = adapter.dump_json(value, warnings="error")
            try:
                # What is stored must read back, or the record of an effect that happened is lost:
                # check the round trip now, while the caller can still be told.
                adapter.validate_json(raw)
            except ValidationError:
                if b"null" not in raw:
                    raise
                # JSON mode writes NaN and infinities as null; the slower path keeps them.
                raw = _JSON.encode(adapter.dump_python(value, mode="json", warnings="error")).encode()
                adapter.validate_json(raw)
            return raw.decode("utf-8")
        except (PydanticSerializationError, ValidationError, ValueError, TypeError) as exc:
            raise CodecError(f"cannot store a result as {self._name}: {exc}") from exc

    def decode(self, text: str) -> T:
        """JSON text to a value of the declared type.

        Raises:
            CodecError: the text does not validate as the declared type (the type changed since the
                result was recorded, or the record was edited by hand).
        """
        try:
            return self._adapter.validate_json(text)
        except ValidationError as exc:
            raise CodecError(f"recorded result does not read back as {self._name}: {exc}") from exc


def type_name(tp: Any) -> str | None:
    """The name a record keeps of a declared result type, which
    :func:`~sagaguard.idempotency.result_types.recorded_codec` imports back: ``module.QualName`` of a
    class (``"sagaguard.connectors.stripe.Payment"``, ``"builtins.dict"``), of a parametrised
    class's origin (``dict[str, Any]`` is ``"builtins.dict"``: its outer shape only), ``"None"`` for
    ``None``; None for ``Any`` and every other form (unions, ``Literal``...), whose results are not
    checked. A class defined inside a function (``<locals>`` in its name) is not importable: None.
    """
    if tp is None or tp is type(None):
        return "None"
    if tp is Any:  # a class since Python 3.11, but it declares nothing to check
        return None
    origin = typing.get_origin(tp)
    if isinstance(origin, type) and not typing.is_typeddict(tp):
        tp = origin
    if not isinstance(tp, type) or "<locals>" in tp.__qualname__:
        return None
    return f"{tp.__module__}.{tp.__qualname__}"


class ErrorInfo(typing.NamedTuple):
    """A recorded failure: the exception's qualified type name, message and JSON-able args."""

    type_name: str
    message: str
    args: list[Any]


def qualified_name(tp: type[BaseException]) -> str:
    """``module.QualName`` of an exception type."""
    return f"{tp.__module__}.{tp.__qualname__}"


def names_type(recorded: str, tp: type[BaseException]) -> bool:
    """Whether a recorded type name is ``tp``'s: its qualified name, or the name sagaguard's own types
    were recorded under before its packages moved into the ``sagaguard`` namespace (0.1 wrote
    ``saga.errors.StepTimeout`` for what is now ``sagaguard.saga.errors.StepTimeout``)."""
    name = qualified_name(tp)
    return recorded == name or (name.startswith("sagaguard.") and recorded == name.removeprefix("sagaguard."))


def encode_error(exc: BaseException) -> str:
    """An exception as JSON text. Arguments that are not JSON are kept as their ``str``."""
    args: list[Any] = []
    for arg in exc.args:
        try:
            json.dumps(arg, allow_nan=False)
            args.append(arg)
        except (TypeError, ValueError):
            args.append(str(arg))
    return json.dumps(
        {"type": qualified_name(type(exc)), "message": str(exc), "args": args},
        ensure_ascii=False,
    )


def decode_error(text: str) -> ErrorInfo:
    """JSON text written by :func:`encode_error` back to its parts (never to code)."""
    try:
        data = json.loads(text)
        return ErrorInfo(str(data["type"]), str(data["message"]), list(data.get("args", [])))
    except (ValueError, KeyError, TypeError) as exc:
        raise CodecError(f"recorded error is not readable: {exc}") from exc
