"""Outbox names a backend cannot store are refused before anything is written, on SQLite and
Postgres alike, and the outbox's limits are checked when it is made.

Before: a message type, aggregate or key with a NUL character reached Postgres (a raw driver error
there, stored as given on SQLite), a lone surrogate raised a raw ``UnicodeEncodeError``, and
``Outbox(max_attempts=0)`` was refused only at the first enqueue.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from _outboxkit import BACKENDS, World, open_world
from conftest import FakeClock
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy.orm import Session

from sagaguard.idempotency import CodecError, ConfigurationError
from sagaguard.idempotency.outbox import Outbox


@pytest.fixture(params=BACKENDS)
def world(request: pytest.FixtureRequest, tmp_path: Path, clock: FakeClock) -> Iterator[World]:
    yield from open_world(request.param, tmp_path, clock)


@pytest.mark.parametrize("field", ["type", "aggregate_type", "aggregate_id", "provider_key", "dedup_key"])
@pytest.mark.parametrize(
    ("bad", "error"), [("a\x00b", ConfigurationError), ("x\ud800", CodecError)], ids=repr
)
def test_an_outbox_name_that_cannot_be_stored_is_refused(
    world: World, field: str, bad: str, error: type[Exception]
) -> None:
    with Session(world.engine) as session:
        with pytest.raises(error, match=field):
            if field == "type":
                world.outbox.enqueue(session, bad, {})
            else:
                world.outbox.enqueue(session, "t", {}, **{field: bad})
        session.commit()
    assert world.rows() == []


def test_a_message_type_that_cannot_be_stored_has_no_handler() -> None:
    outbox = Outbox()
    for bad in ("a\x00b", "x\ud800", ""):
        with pytest.raises(ConfigurationError, match="message type"):
            outbox.register(bad, lambda _m: None)
    assert outbox.handlers == {}


@settings(max_examples=25, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.sampled_from(["type", "aggregate_id", "dedup_key"]), st.text(min_size=1, max_size=10))
def test_any_outbox_name_is_refused_typed_or_stored_as_given(world: World, field: str, text: str) -> None:
    storable = "\x00" not in text and text.encode("utf-8", "surrogatepass").decode("utf-8", "ignore") == text
    before = world.rows()
    with Session(world.engine) as session:
        try:
            if field == "type":
                world.outbox.enqueue(session, text, {})
            else:
                # A dedup key seen before finds its first message: make each example's new.
                world.outbox.enqueue(
                    session, "t", {}, **{field: text if field != "dedup_key" else text + str(len(before))}
                )
        except ConfigurationError:
            assert not storable
            assert world.rows() == before
            return
        session.commit()
    assert storable
    column = {"type": "type", "aggregate_id": "aggregateid", "dedup_key": "dedup_key"}[field]
    stored = [row[column] for row in world.rows() if row not in before]
    assert len(stored) == 1 and stored[0].startswith(text)
