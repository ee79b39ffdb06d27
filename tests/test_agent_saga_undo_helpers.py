"""What an undo gets without plumbing: its dependencies from the registry the agent and the worker
share (``undos.provide`` / ``undos.use``, read with ``dependency``), and the provider key the undone
call's body sent its effect under (``provider_key``), so a booking whose answer was lost is found
by that key.

On main an undo had neither: clients were handed over by hand (a ``configure()`` in the agent,
rebuilt from the environment in the worker), and the key was re-derived with
``EffectIdentity.of(guard.namespace, undoing().key, name, 0).provider_key``, undocumented.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _sagajournals import JournalFactory, factory_for
from conftest import FakeClock

from sagaguard.idempotency import Guard, current_effect, scope
from sagaguard.saga import SagaRegistry, SagaState, cancel, recover
from sagaguard.saga.agent import AgentRunner, AgentSaga, UndoRegistry, undoing
from sagaguard.saga.errors import DefinitionError

pytestmark = pytest.mark.timeout(60)


class Hotel:
    """A client of a booking API that keeps bookings by the caller's idempotency key (``world``:
    the API's state, shared by every client)."""

    def __init__(self, world: dict[str, Any]) -> None:
        self.bookings: dict[str, str] = world.setdefault("bookings", {})
        self.cancelled: list[str] = world.setdefault("cancelled", [])

    def book(self, key: str) -> str:
        return self.bookings.setdefault(key, f"bk-{len(self.bookings) + 1}")

    def cancel_by_key(self, key: str) -> None:
        self.cancelled.append(self.bookings[key])


class Crash(BaseException):
    """The agent's process dies here."""


@pytest.fixture(params=("memory", "sqlite"))
def factory(request: pytest.FixtureRequest, clock: FakeClock, tmp_path: Path) -> Iterator[JournalFactory]:
    yield from factory_for(request.param, clock, tmp_path)


def test_an_undo_gets_its_client_and_the_lost_calls_provider_key_in_the_worker(
    factory: JournalFactory, clock: FakeClock
) -> None:
    from sagaguard.saga.agent import dependency, provider_key

    world: dict[str, Any] = {}
    agents_hotel = Hotel(world)
    built: list[Hotel] = []

    def client() -> Hotel:  # how the worker builds its client (from its settings, in real life)
        built.append(Hotel(world))
        return built[-1]

    undos = UndoRegistry()
    undos.provide("hotel", client)

    @undos.register
    def cancel_booking(arguments: Any, result: Any) -> None:
        assert result is None  # the booking's answer was lost in the crash
        dependency("hotel", Hotel).cancel_by_key(provider_key("booking.hotel"))

    agent = AgentSaga("trip_agent", undos)
    journal, guard = factory.open(), factory.guard()
    runner = AgentRunner(journal, guard, sleep=lambda _s: None)

    def book() -> str:
        # The adapters run a tool's body in its call's scope; its guarded effects are keyed there.
        with scope(run.call_key("c1")):
            guard.run("booking.hotel", lambda: agents_hotel.book(current_effect().provider_key))
        raise Crash  # killed before the call's answer was recorded

    try:
        with pytest.raises(Crash), runner.run(agent, "trip-u") as run:
            run.call("book_hotel", book, {"hotel": "ritz"}, undo="cancel_booking", call_id="c1")
    finally:
        runner.close()
    assert cancel(factory.open(), "trip-u").value == "requested"
    clock.advance(3600)  # the dead process's lease has run out
    report = recover(factory.open(), Guard(factory.store()), SagaRegistry(agent), sleep=lambda _s: None)
    assert report.outcomes["trip-u"].state is SagaState.COMPENSATED
    assert agents_hotel.cancelled == ["bk-1"]  # found by the key its body booked under
    assert len(built) == 1  # the worker built its own client, once, from the declared factory


def test_a_dependency_given_in_this_process_wins_and_errors_are_typed() -> None:
    undos = UndoRegistry()
    undos.provide("hotel", lambda: Hotel({}))
    given = Hotel({})
    undos.use("hotel", given)
    assert undos.dependency("hotel", Hotel) is given
    with pytest.raises(TypeError):
        undos.dependency("hotel", str)
    with pytest.raises(LookupError):
        undos.dependency("payments", object)
    with pytest.raises(DefinitionError):
        undos.provide("not a name", lambda: None)
    with pytest.raises(LookupError):
        undoing()
