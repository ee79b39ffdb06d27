"""Shared pieces of the outbox tests: a world per backend (engine, outbox table, a business table).

A test module makes its fixture from :func:`open_world` (on ``sqlite``, a file in ``tmp_path``, and
``postgres``, skipped when Postgres does not answer and failed under ``CI=true``; see conftest).
Each world has its own outbox table and business table, dropped afterwards::

    @pytest.fixture(params=BACKENDS)
    def outbox_world(request, tmp_path, clock):
        yield from open_world(request.param, tmp_path, clock)
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from conftest import FakeClock, require_postgres

from sagaguard.idempotency.outbox import Outbox, OutboxControl, OutboxDb, Relay, RelaySettings, create_tables
from sagaguard.idempotency.stores.sql import make_engine

BACKENDS = ("sqlite", "postgres")


@dataclass
class World:
    """One backend, one outbox table, one business table ``orders(id, total)``."""

    backend: str
    url: str
    engine: sa.Engine
    table: str
    clock: FakeClock
    orders: sa.Table
    outbox: Outbox = field(init=False)
    _relays: list[Relay] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.outbox = Outbox(self.table, clock=self.clock)

    @property
    def postgres(self) -> bool:
        return self.backend == "postgres"

    def control(self, *, clock: Callable[[], float] | None = None) -> OutboxControl:
        return OutboxControl(self.engine, self.table, clock=clock or self.clock)

    def db(self, **options: Any) -> OutboxDb:
        options.setdefault("clock", self.clock)
        return OutboxDb(self.engine, self.table, **options)

    def relay(self, outbox: Outbox | None = None, **settings: Any) -> Relay:
        """A relay on the world's clock; by default no purge, no listening, no status reads."""
        settings.setdefault("purge_every", None)
        settings.setdefault("listen", False)
        worker_id = settings.pop("worker_id", None)
        clock = settings.pop("clock", self.clock)
        relay = Relay(
            outbox or self.outbox, self.engine, RelaySettings(**settings), worker_id=worker_id, clock=clock
        )
        self._relays.append(relay)
        return relay

    def rows(self) -> list[dict[str, Any]]:
        """Every outbox row, in id order."""
        return self._read(f"SELECT * FROM {self.table} ORDER BY id")

    def count_orders(self) -> int:
        return int(self._read(f"SELECT count(*) AS n FROM {self.orders.name}")[0]["n"])

    def _read(self, sql: str) -> list[dict[str, Any]]:
        # A raw autocommit cursor: no BEGIN IMMEDIATE, so it reads the committed state even while
        # a test holds a write transaction open on SQLite.
        fairy = self.engine.raw_connection()
        try:
            conn: Any = fairy.driver_connection
            if self.postgres:
                conn.rollback()
                conn.autocommit = True
            cursor = conn.cursor()
            cursor.execute(sql)
            names = [d[0] for d in cursor.description]
            rows = [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]
            if self.postgres:
                conn.autocommit = False
            return rows
        finally:
            fairy.close()

    def close(self) -> None:
        for relay in self._relays:
            relay.close()
        with self.engine.begin() as conn:
            conn.execute(sa.text(f"DROP TABLE IF EXISTS {self.table}"))
            conn.execute(sa.text(f"DROP TABLE IF EXISTS {self.orders.name}"))
            if self.postgres:
                conn.execute(sa.text(f'DROP FUNCTION IF EXISTS "{self.table}_notify"() CASCADE'))
            conn.execute(sa.text(f"DROP TABLE IF EXISTS {self.table}_version"))
        self.engine.dispose()


def make_world(backend: str, tmp_path: Path, clock: FakeClock, *, create: bool = True) -> World:
    unique = uuid.uuid4().hex[:10]
    url = f"sqlite:///{tmp_path}/outbox.db" if backend == "sqlite" else require_postgres()
    engine = make_engine(url)
    orders = sa.Table(
        f"orders_{unique}",
        sa.MetaData(),
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("total", sa.Integer, nullable=False),
    )
    orders.create(engine)
    world = World(backend, url, engine, f"sg_outbox_{unique}", clock, orders)
    if create:
        create_tables(engine, world.table)
    return world


def open_world(backend: str, tmp_path: Path, clock: FakeClock) -> Iterator[World]:
    """The body of a world fixture: make it, yield it, drop it."""
    world = make_world(backend, tmp_path, clock)
    try:
        yield world
    finally:
        world.close()


class Recorder:
    """A handler that records what it was given, and fails while ``failing`` says so."""

    def __init__(self, failing: Callable[[Any], BaseException | None] | None = None) -> None:
        self.seen: list[Any] = []
        self.failing = failing

    def __call__(self, message: Any) -> None:
        self.seen.append(message)
        if self.failing is not None:
            error = self.failing(message)
            if error is not None:
                raise error

    def payloads(self) -> list[Any]:
        return [m.payload for m in self.seen]
