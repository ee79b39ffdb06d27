"""Putting a message in the outbox, inside the caller's own transaction.

::

    with Session(engine) as session:
        session.add(Order(id="42", state="paid"))
        enqueue(session, "email.receipt", {"order": "42"}, aggregate_type="order", aggregate_id="42")
        session.commit()          # the order and its message, together or not at all

:func:`enqueue` inserts the row at once on the session's connection, inside the session's
transaction (a savepoint included), so it commits with the business data or rolls back with it. A
:class:`sqlalchemy.engine.Connection` works the same way. An ``AsyncSession`` cannot execute from
sync code, so there the row is added to the session and inserted by its flush at commit; or
``await`` :func:`aenqueue`, which inserts it at once.

With ``dedup_key=`` a message is enqueued once per key: the insert is ``ON CONFLICT (dedup_key) DO
NOTHING``, so enqueueing again under the key, in any later transaction, inserts nothing and returns
the message already there (a :class:`~sagaguard.idempotency.errors.KeyConflict` if its type or payload
differ). The unique index makes it atomic: a concurrent enqueue under the key waits for the first
transaction and then finds its row (Postgres), or is serialised behind it (SQLite).
"""

from __future__ import annotations

import hashlib
import json
import threading
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import sqlalchemy as sa
import sqlalchemy.orm
from pydantic_core import to_jsonable_python
from sqlalchemy.dialects import postgresql, sqlite

from sagaguard.idempotency.checks import count, seconds, storable_text
from sagaguard.idempotency.errors import CodecError, ConfigurationError, KeyConflict, StoreError
from sagaguard.idempotency.keys import provider_key as derive_provider_key
from sagaguard.idempotency.outbox.model import (
    DEFAULT_TABLE,
    MessageStatus,
    db_epoch,
    outbox_model,
    outbox_table,
    uuid7,
)
from sagaguard.idempotency.outbox.telemetry import CreateSpan

__all__ = ["DEFAULT_MAX_ATTEMPTS", "MAX_PAYLOAD_BYTES", "aenqueue", "encode_payload", "enqueue"]

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
    # The same check as every stored name: Postgres text cannot hold a NUL, no backend a surrogate.
    return storable_text(label, value)


def enqueue(
    session: Any,
    type: str,
    payload: Any = None,
    *,
    aggregate_type: str | None = None,
    aggregate_id: str | None = None,
    headers: Mapping[str, str] | None = None,
    provider_key: str | None = None,
    dedup_key: str | None = None,
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
        dedup_key: enqueue once per key (no personal data in it): if a message with this key is
            already in the table (committed, or earlier in this transaction), nothing is inserted
            and its id is returned. Kept until the message is purged after delivery. Not with an
            ``AsyncSession`` (use :func:`aenqueue`).
        delay: seconds before the message may be delivered.
        max_attempts: deliveries tried before the message is dead-lettered.
        message_id: the id to use: a UUIDv7 made now (:func:`~sagaguard.idempotency.outbox.uuid7`); one is
            made by default.
        table_name: the outbox table.
        clock: seconds since the epoch for the row's times; by default the database's clock.
        max_payload_bytes: refuse larger payloads.

    Returns:
        The message id (with ``dedup_key``: of the message already there, if one is).

    Raises:
        CodecError: the payload is not JSON or too large.
        KeyConflict: a message with ``dedup_key`` is there with another type or payload.
        ConfigurationError: any other bad argument.
    """
    values, text_id = _values(
        type, payload, aggregate_type=aggregate_type, aggregate_id=aggregate_id, headers=headers,
        provider_key=provider_key, dedup_key=dedup_key, delay=delay, max_attempts=max_attempts,
        message_id=message_id, clock=clock, max_payload_bytes=max_payload_bytes,
    )  # fmt: skip
    with CreateSpan(type, text_id, values["aggregateid"]) as span:
        values["traceparent"], values["tracestate"] = span.traceparent, span.tracestate
        if isinstance(session, sa.orm.Session):
            return _created(span, text_id, _insert(session.connection(), table_name, values, text_id, delay))
        if isinstance(session, sa.Connection):
            return _created(span, text_id, _insert(session, table_name, values, text_id, delay))
        if _is_async_session(session):
            if dedup_key is not None:
                # Finding the message already there takes a query, which sync code cannot await.
                raise ConfigurationError("enqueue(dedup_key=) in an AsyncSession: use `await aenqueue(...)`")
            # An AsyncSession cannot execute from sync code: the row joins its unit of work instead
            # and is inserted by the flush at commit (or rolled back with the rest).
            if clock is None and delay:
                values["available_at"] = db_epoch() + float(delay)
            session.add(_plain_model(table_name)(**values))
            return text_id
        raise ConfigurationError(
            f"enqueue() takes a SQLAlchemy Session, AsyncSession or Connection, not {type_name(session)}"
        )


async def aenqueue(
    session: Any,
    type: str,
    payload: Any = None,
    *,
    aggregate_type: str | None = None,
    aggregate_id: str | None = None,
    headers: Mapping[str, str] | None = None,
    provider_key: str | None = None,
    dedup_key: str | None = None,
    delay: float = 0.0,
    max_attempts: int = DEFAULT_MAX_ATTEMPTS,
    message_id: uuid.UUID | None = None,
    table_name: str = DEFAULT_TABLE,
    clock: Callable[[], float] | None = None,
    max_payload_bytes: int = MAX_PAYLOAD_BYTES,
) -> str:
    """:func:`enqueue` into an ``AsyncSession`` (SQLAlchemy's or SQLModel's): the row is inserted at
    once on the session's connection, inside its transaction, so ``dedup_key`` works there too.

    Raises:
        CodecError, KeyConflict, ConfigurationError: as :func:`enqueue`.
    """
    values, text_id = _values(
        type, payload, aggregate_type=aggregate_type, aggregate_id=aggregate_id, headers=headers,
        provider_key=provider_key, dedup_key=dedup_key, delay=delay, max_attempts=max_attempts,
        message_id=message_id, clock=clock, max_payload_bytes=max_payload_bytes,
    )  # fmt: skip
    if not _is_async_session(session):
        raise ConfigurationError(f"aenqueue() takes an AsyncSession, not {type_name(session)}")
    dialect = session.bind.dialect if session.bind is not None else session.sync_session.get_bind().dialect
    with CreateSpan(type, text_id, values["aggregateid"]) as span:
        values["traceparent"], values["tracestate"] = span.traceparent, span.tracestate
        statement = _statement(dialect.name, table_name, values, delay)
        if dedup_key is None:
            await session.execute(statement)
            return text_id
        if (await session.execute(statement)).first() is not None:
            return text_id
        found = _existing((await session.execute(_lookup(table_name, dedup_key))).first(), values)
        return _created(span, text_id, found)


def _created(span: CreateSpan, text_id: str, message_id: str) -> str:
    """``message_id``, marking the span when it is not the message just built (deduplicated)."""
    if message_id != text_id:
        span.found(message_id)
    return message_id


def _values(
    type: str,
    payload: Any,
    *,
    aggregate_type: str | None,
    aggregate_id: str | None,
    headers: Mapping[str, str] | None,
    provider_key: str | None,
    dedup_key: str | None,
    delay: float,
    max_attempts: int,
    message_id: uuid.UUID | None,
    clock: Callable[[], float] | None,
    max_payload_bytes: int,
) -> tuple[dict[str, Any], str]:
    """The row's values and the message id as text, every argument checked (nothing is written
    before this passes)."""
    _text("type", type)
    count("max_attempts", max_attempts)
    seconds("delay", delay, zero_ok=True)
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
    if dedup_key is not None:
        values["dedup_key"] = _text("dedup_key", dedup_key)
    if now is not None:
        values.update(created_at=now, updated_at=now, available_at=now + delay)
    return values, text_id


def _is_async_session(session: Any) -> bool:
    return callable(getattr(session, "add", None)) and hasattr(session, "sync_session")


_COLUMNS = (
    "id", "aggregatetype", "aggregateid", "type", "payload", "headers", "traceparent", "tracestate",
    "provider_key", "status", "attempts", "max_attempts",
)  # fmt: skip
_TIMES = ("created_at", "updated_at", "available_at")
_insert_cache: dict[tuple[str, str, bool, bool], tuple[str, tuple[str, ...] | None]] = {}
_plain_cache: dict[str, type] = {}
_cache_lock = threading.Lock()


def _insert_sql(
    dialect: sa.Dialect, table_name: str, clocked: bool, keyed: bool
) -> tuple[str, tuple[str, ...] | None]:
    """INSERT text for the driver (and the parameter order for positional drivers), built once;
    ``keyed``: with the dedup key, ``ON CONFLICT DO NOTHING``."""
    key = (dialect.name, table_name, clocked, keyed)
    found = _insert_cache.get(key)
    if found is None:
        values: dict[str, Any] = {name: sa.bindparam(name) for name in _COLUMNS}
        if clocked:
            values.update({name: sa.bindparam(name) for name in _TIMES})
        else:
            values.update(created_at=db_epoch(), updated_at=db_epoch())
            values["available_at"] = db_epoch() + sa.bindparam("delay", type_=sa.Double())
        if keyed:
            values["dedup_key"] = sa.bindparam("dedup_key")
        compiled: Any = _upsert(dialect.name, table_name, values, keyed, returning=False).compile(
            dialect=dialect
        )
        found = (str(compiled.string), compiled.positiontup)
        with _cache_lock:
            _insert_cache[key] = found
    return found


def _insert(conn: sa.Connection, table_name: str, values: dict[str, Any], text_id: str, delay: float) -> str:
    """Insert on the caller's connection, inside its transaction, through the driver itself (its
    DBAPI connection: ``Connection.connection.driver_connection``; psycopg prepares the statement
    once per connection); returns the message id (with a dedup key already taken: the message
    already there).

    The transaction is SQLAlchemy's: begun here if the connection has none yet (as the statement
    would have begun it), so the caller's ``commit()`` commits the message with their data. The
    insert does not pass through SQLAlchemy's execution events.
    """
    dialect = conn.dialect
    keyed = "dedup_key" in values
    sql, order = _insert_sql(dialect, table_name, "created_at" in values, keyed)
    params = dict(values, delay=float(delay))
    if not conn.in_transaction():
        conn.begin()  # what executing a statement on the connection does (autobegin)
    cursor: Any = conn.connection.driver_connection.cursor()  # type: ignore[union-attr]
    try:
        if dialect.driver == "psycopg":
            cursor.execute(sql, params, prepare=True)
        elif dialect.name == "postgresql":
            cursor.execute(sql, params)
        else:
            params["id"] = values["id"].hex  # what sa.Uuid stores where there is no native UUID
            cursor.execute(sql, tuple(params[k] for k in order or ()))
        # The row count says whether the upsert inserted: cheaper than RETURNING, which makes the
        # driver build a result for one row.
        inserted = cursor.rowcount == 1
    finally:
        cursor.close()
    if not keyed or inserted:
        return text_id
    return _existing(conn.execute(_lookup(table_name, values["dedup_key"])).first(), values)


def _upsert(
    dialect: str, table_name: str, row: dict[str, Any], keyed: bool, *, returning: bool = True
) -> sa.Insert:
    """The INSERT; ``keyed``: ``ON CONFLICT (dedup_key) DO NOTHING`` (``returning``: and
    ``RETURNING id``, so a row comes back only if one was inserted)."""
    table = outbox_table(table_name)
    if not keyed:
        return sa.insert(table).values(row)
    insert = postgresql.insert(table) if dialect == "postgresql" else sqlite.insert(table)
    upsert = insert.values(row).on_conflict_do_nothing(
        index_elements=["dedup_key"], index_where=sa.text("dedup_key IS NOT NULL")
    )
    return upsert.returning(table.c.id) if returning else upsert


def _statement(dialect: str, table_name: str, values: dict[str, Any], delay: float) -> sa.Insert:
    """The INSERT as a Core statement with its values, for an AsyncSession (see :func:`_upsert`)."""
    row = dict(values)
    if "created_at" not in row:
        row["available_at"] = db_epoch() + float(delay)  # created_at, updated_at: column defaults
    return _upsert(dialect, table_name, row, "dedup_key" in row)


def _lookup(table_name: str, dedup_key: str) -> sa.Select[Any]:
    table = outbox_table(table_name)
    return sa.select(table.c.id, table.c.type, table.c.payload).where(table.c.dedup_key == dedup_key)


def _existing(row: Any, values: Mapping[str, Any]) -> str:
    """The id of the message already enqueued under the dedup key, after checking it is the same
    message (type and payload, compared as JSON so key order does not matter)."""
    if row is None:
        # The unique index refused the insert, yet no row has the key: it was purged in between.
        raise StoreError("the outbox message under this dedup key vanished during enqueue; try again")
    ident, type, payload = row
    if type != values["type"] or json.loads(payload) != json.loads(values["payload"]):
        raise KeyConflict(
            values["dedup_key"], _digest(type, payload), _digest(values["type"], values["payload"])
        )
    return str(ident if isinstance(ident, uuid.UUID) else uuid.UUID(str(ident)))


def _digest(type: str, payload: str) -> str:
    return hashlib.sha256(f"{type}\n{payload}".encode()).hexdigest()


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
