"""Putting a message in the outbox, inside the caller's own transaction.

::

    with Session(engine) as session:
        session.add(Order(id="42", state="paid"))
        enqueue(session, "email.receipt", {"order": "42"}, aggregate_type="order", aggregate_id="42")
        session.commit()          # the order and its message, together or not at all

:func:`enqueue` inserts the row at once on the session's connection, inside the session's
transaction (a savepoint included), so it commits with the business data or rolls back with it. A
:class:`sqlalchemy.engine.Connection` works the same way. An ``AsyncSession`` cannot execute from
sync code, so there the row is added to the session and inserted by its flush at commit.
"""

from __future__ import annotations

import json
import math
import threading
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import sqlalchemy as sa
import sqlalchemy.orm
from pydantic_core import to_jsonable_python

from idempotency.errors import CodecError, ConfigurationError
from idempotency.keys import provider_key as derive_provider_key
from idempotency.outbox.model import DEFAULT_TABLE, MessageStatus, db_epoch, outbox_model, uuid7
from idempotency.outbox.telemetry import create_span

__all__ = ["DEFAULT_MAX_ATTEMPTS", "MAX_PAYLOAD_BYTES", "encode_payload", "enqueue"]

DEFAULT_MAX_ATTEMPTS = 10
MAX_PAYLOAD_BYTES = 1 << 20
"""Largest payload accepted by default (1 MiB of JSON text)."""

_JSON = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def encode_payload(payload: Any, limit: int = MAX_PAYLOAD_BYTES) -> str:
    """The payload as compact JSON text.

    Plain JSON types pass as they are; dataclasses, pydantic models, datetimes, UUIDs, decimals,
    enums and sets are converted the way pydantic writes them as JSON.

    Raises:
        CodecError: it cannot be written as JSON (NaN and infinities included) or is over ``limit``
            bytes.
    """
    try:
        text = _JSON.encode(payload)
    except (TypeError, ValueError):
        try:
            text = _JSON.encode(to_jsonable_python(payload))
        except Exception as exc:
            raise CodecError(f"an outbox payload must be JSON: {exc}") from exc
    if len(text) > limit // 4 and len(text.encode("utf-8")) > limit:
        raise CodecError(f"the outbox payload is over {limit} bytes of JSON")
    return text


def _encode_headers(headers: Mapping[str, str] | None) -> str | None:
    if not headers:
        return None
    if not isinstance(headers, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in headers.items()
    ):
        raise ConfigurationError("outbox headers must map str to str")
    return _JSON.encode(dict(headers))


def _text(label: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigurationError(f"{label} must be a non-empty string, got {value!r}")
    return value


def enqueue(
    session: Any,
    type: str,
    payload: Any = None,
    *,
    aggregate_type: str | None = None,
    aggregate_id: str | None = None,
    headers: Mapping[str, str] | None = None,
    provider_key: str | None = None,
    delay: float = 0.0,
    max_attempts: int = DEFAULT_MAX_ATTEMPTS,
    message_id: uuid.UUID | None = None,
    table_name: str = DEFAULT_TABLE,
    clock: Callable[[], float] | None = None,
    max_payload_bytes: int = MAX_PAYLOAD_BYTES,
) -> str:
    """Add a message to the caller's session, to commit with their data or not at all.

    Args:
        session: a SQLAlchemy/SQLModel ``Session`` or ``AsyncSession`` (the row is added to it), or
            a ``Connection`` (the row is inserted at once, in its transaction).
        type: the message type; the relay hands the message to the handler registered for it.
        payload: JSON-able data (see :func:`encode_payload`).
        aggregate_type: Debezium's ``aggregatetype`` (default: the message type).
        aggregate_id: what the message is about (an order id): messages of one aggregate are
            delivered one at a time, in the order they were enqueued. Default: the message's own
            id, i.e. no ordering with any other message.
        headers: string headers handed to the handler.
        provider_key: the idempotency key handed to the handler; default: one derived from the
            message id (stable across redeliveries).
        delay: seconds before the message may be delivered.
        max_attempts: deliveries tried before the message is dead-lettered.
        message_id: the id to use: a UUIDv7 made now (:func:`~idempotency.outbox.uuid7`); one is made
            by default.
        table_name: the outbox table.
        clock: seconds since the epoch for the row's times; by default the database's clock.
        max_payload_bytes: refuse larger payloads.

    Returns:
        The message id.

    Raises:
        CodecError: the payload is not JSON or too large.
        ConfigurationError: any other bad argument.
    """
    _text("type", type)
    if isinstance(max_attempts, bool) or not isinstance(max_attempts, int) or max_attempts < 1:
        raise ConfigurationError(f"max_attempts must be an int >= 1, got {max_attempts!r}")
    if isinstance(delay, bool) or not isinstance(delay, int | float) or not math.isfinite(delay) or delay < 0:
        raise ConfigurationError(f"delay must be a finite number of seconds >= 0, got {delay!r}")
    if message_id is not None and (not isinstance(message_id, uuid.UUID) or message_id.version != 7):
        # Ids sort by creation: delivery order within an aggregate and purge depend on it.
        raise ConfigurationError(f"message_id must be a UUIDv7 (see uuid7()), got {message_id!r}")
    now = None if clock is None else float(clock())
    ident = message_id if message_id is not None else uuid7(now)
    text_id = str(ident)
    aggregate = _text("aggregate_id", aggregate_id) if aggregate_id is not None else text_id
    values: dict[str, Any] = {
        "id": ident,
        "aggregatetype": _text("aggregate_type", aggregate_type) if aggregate_type is not None else type,
        "aggregateid": aggregate,
        "type": type,
        "payload": encode_payload(payload, max_payload_bytes),
        "headers": _encode_headers(headers),
        "provider_key": _text("provider_key", provider_key)
        if provider_key is not None
        else derive_provider_key(f"outbox:{text_id}"),
        "status": MessageStatus.PENDING,
        "attempts": 0,
        "max_attempts": max_attempts,
    }
    if now is not None:
        values.update(created_at=now, updated_at=now, available_at=now + delay)
    values["traceparent"], values["tracestate"] = create_span(type, text_id, aggregate)
    if isinstance(session, sa.orm.Session):
        _insert(session.connection(), table_name, values, delay)
    elif isinstance(session, sa.Connection):
        _insert(session, table_name, values, delay)
    elif callable(getattr(session, "add", None)) and hasattr(session, "sync_session"):
        # An AsyncSession cannot execute from sync code: the row joins its unit of work instead
        # and is inserted by the flush at commit (or rolled back with the rest).
        if clock is None and delay:
            values["available_at"] = db_epoch() + float(delay)
        session.add(_plain_model(table_name)(**values))
    else:
        raise ConfigurationError(
            f"enqueue() takes a SQLAlchemy Session, AsyncSession or Connection, not {type_name(session)}"
        )
    return text_id


_COLUMNS = (
    "id", "aggregatetype", "aggregateid", "type", "payload", "headers", "traceparent", "tracestate",
    "provider_key", "status", "attempts", "max_attempts",
)  # fmt: skip
_TIMES = ("created_at", "updated_at", "available_at")
_insert_cache: dict[tuple[str, str, bool], tuple[str, tuple[str, ...] | None]] = {}
_plain_cache: dict[str, type] = {}
_cache_lock = threading.Lock()


def _insert_sql(dialect: sa.Dialect, table_name: str, clocked: bool) -> tuple[str, tuple[str, ...] | None]:
    """INSERT text for the driver (and the parameter order for positional drivers), built once."""
    key = (dialect.name, table_name, clocked)
    found = _insert_cache.get(key)
    if found is None:
        model: Any = outbox_model(table_name)
        values: dict[str, Any] = {name: sa.bindparam(name) for name in _COLUMNS}
        if clocked:
            values.update({name: sa.bindparam(name) for name in _TIMES})
        else:
            values.update(created_at=db_epoch(), updated_at=db_epoch())
            values["available_at"] = db_epoch() + sa.bindparam("delay", type_=sa.Double())
        compiled: Any = sa.insert(model.__table__).values(values).compile(dialect=dialect)
        found = (str(compiled.string), compiled.positiontup)
        with _cache_lock:
            _insert_cache[key] = found
    return found


def _insert(conn: sa.Connection, table_name: str, values: dict[str, Any], delay: float) -> None:
    """Insert on the caller's connection, inside its transaction, on the driver's fast path."""
    dialect = conn.dialect
    sql, order = _insert_sql(dialect, table_name, "created_at" in values)
    params = dict(values, delay=float(delay))
    if dialect.name != "postgresql":
        params["id"] = values["id"].hex  # what sa.Uuid stores where there is no native UUID
    conn.exec_driver_sql(sql, params if order is None else tuple(params[k] for k in order))


def _plain_model(table_name: str) -> type:
    """A plain (non-pydantic) ORM class on the outbox table: an AsyncSession adds one of these,
    which costs a fraction of building the SQLModel class."""
    with _cache_lock:
        cls = _plain_cache.get(table_name)
        if cls is None:
            model: Any = outbox_model(table_name)

            def init(self: Any, **values: Any) -> None:
                for name, value in values.items():
                    setattr(self, name, value)

            cls = type(f"OutboxInsert_{table_name}", (), {"__init__": init})
            _registry.map_imperatively(cls, model.__table__)
            _plain_cache[table_name] = cls
        return cls


_registry = sa.orm.registry()


def type_name(value: Any) -> str:
    """The qualified type name of ``value``, for messages."""
    tp = value.__class__
    return f"{tp.__module__}.{tp.__qualname__}"
