"""Saga ids a backend cannot store are refused before anything is written, the same on every journal.

Postgres text cannot hold a NUL character: ``"X\\x00a"`` was stored as ``"X"``, and a different saga
``"X"`` was then answered with the other saga's recorded failure and never ran (SQLite and Redis kept
them apart). A lone surrogate raised a raw ``UnicodeEncodeError`` on every backend. Each test runs on
memory, SQLite, Postgres and Redis and checks that no step ran and the journal holds no saga; the
property test runs any text through the runner and asks for exactly that: refused with a typed
error and nothing stored, or stored and found under exactly the id given.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from _sagajournals import JOURNALS, JournalFactory, factory_for
from conftest import FakeClock
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sagaguard.idempotency import CodecError, ConfigurationError
from sagaguard.saga import Saga, SagaRunner, SagaState, StepContext
from sagaguard.saga.agent import AgentRunner, AgentSaga, UndoRegistry
from sagaguard.saga.control import cancel, signal
from sagaguard.saga.journal import SagaJournal
from sagaguard.saga.records import Phase

NUL_ID = "X\x00a"
SURROGATE_ID = "X\ud800"


@pytest.fixture(params=JOURNALS)
def factory(request: pytest.FixtureRequest, clock: FakeClock, tmp_path: Path) -> Iterator[JournalFactory]:
    yield from factory_for(request.param, clock, tmp_path)


class Failing:
    """A one-step saga that records each run and fails when its input says so."""

    def __init__(self) -> None:
        self.ran: list[str] = []
        saga: Saga[str] = Saga("failing", version=1, input=str)
        self.saga = saga

        @saga.step(compensate=None)
        def act(ctx: StepContext, order: str) -> str:
            self.ran.append(ctx.saga_id)
            if order == "fail":
                raise ValueError("declined")
            return order


@pytest.fixture
def journal(factory: JournalFactory) -> SagaJournal:
    return factory.open()


@pytest.fixture
def runner(factory: JournalFactory, journal: SagaJournal) -> SagaRunner:
    return SagaRunner(journal, factory.guard(), wait=0, sleep=lambda _s: None, renewer=False)


def test_a_saga_id_with_a_nul_is_refused_and_never_answers_for_another_saga(
    journal: SagaJournal, runner: SagaRunner
) -> None:
    work = Failing()
    with pytest.raises(ConfigurationError, match="NUL"):
        runner.run(work.saga, NUL_ID, "fail")
    assert work.ran == []
    assert journal.list() == []
    # The saga "X" is its own: it runs, and is not answered with another saga's failure.
    outcome = runner.run(work.saga, "X", "ok")
    assert (outcome.state, outcome.replayed, work.ran) == (SagaState.COMPLETED, False, ["X"])


def test_arun_refuses_a_saga_id_with_a_nul(journal: SagaJournal, runner: SagaRunner) -> None:
    work = Failing()
    with pytest.raises(ConfigurationError, match="NUL"):
        asyncio.run(runner.arun(work.saga, NUL_ID, "ok"))
    assert work.ran == []
    assert journal.list() == []


def test_a_saga_id_with_a_lone_surrogate_is_a_codec_error(journal: SagaJournal, runner: SagaRunner) -> None:
    work = Failing()
    with pytest.raises(CodecError, match="saga id"):
        runner.run(work.saga, SURROGATE_ID, "ok")
    assert work.ran == []
    assert journal.list() == []


@pytest.mark.parametrize("bad", [NUL_ID, SURROGATE_ID, "", 7], ids=repr)
def test_the_journal_itself_refuses_an_unstorable_saga_id(journal: SagaJournal, bad: object) -> None:
    with pytest.raises(ConfigurationError, match="saga id"):
        journal.start(bad, name="failing", version=1, input='"ok"', fingerprint="f", lease=30)  # type: ignore[arg-type]
    assert journal.list() == []


@pytest.mark.parametrize("bad", [NUL_ID, SURROGATE_ID], ids=repr)
def test_loading_an_unstorable_saga_id_is_refused_not_another_saga_found(
    journal: SagaJournal, runner: SagaRunner, bad: str
) -> None:
    runner.run(Failing().saga, "X", "ok")
    with pytest.raises(ConfigurationError, match="saga id"):
        journal.load(bad)


@pytest.mark.parametrize("bad", [NUL_ID, SURROGATE_ID], ids=repr)
def test_operator_actions_refuse_an_unstorable_saga_id(
    journal: SagaJournal, runner: SagaRunner, bad: str
) -> None:
    """On Postgres ``"X\\x00a"`` would be looked up as ``"X"``: a signal or a cancellation meant
    for one saga would reach another."""
    work = Failing()
    runner.run(work.saga, "X", "ok")
    before = journal.load("X")
    with pytest.raises(ConfigurationError, match="saga id"):
        signal(journal, bad, "approved")
    with pytest.raises(ConfigurationError, match="saga id"):
        cancel(journal, bad)
    assert journal.load("X") == before


@pytest.mark.parametrize("bad", [NUL_ID, SURROGATE_ID, "", 7], ids=repr)
@pytest.mark.parametrize("method", ["claim", "take_over", "commit", "reopen", "signal", "cancel"])
def test_every_journal_method_taking_a_saga_id_refuses_an_unstorable_one(
    journal: SagaJournal, runner: SagaRunner, bad: object, method: str
) -> None:
    """Called directly (a custom runner, an operator's script), a journal's own methods check the id
    as ``start`` and ``load`` do: on Postgres ``"X\x00a"`` would otherwise reach the saga ``"X"``."""
    runner.run(Failing().saga, "X", "ok")
    before = journal.load("X")
    assert before is not None
    calls = {
        "claim": lambda: journal.claim(bad, lease=30),  # type: ignore[arg-type]
        "take_over": lambda: journal.take_over(bad, before.saga.token, lease=30),  # type: ignore[arg-type]
        "commit": lambda: journal.commit(bad, before.saga.token, Phase(state=SagaState.FAILED)),  # type: ignore[arg-type]
        "reopen": lambda: journal.reopen(bad, before.saga.token, SagaState.RUNNING, (), None),  # type: ignore[arg-type]
        "signal": lambda: journal.signal(bad, "approved", "null"),  # type: ignore[arg-type]
        "cancel": lambda: journal.cancel(bad, "by hand"),  # type: ignore[arg-type]
    }
    with pytest.raises(ConfigurationError, match="saga id"):
        calls[method]()
    assert journal.load("X") == before
    assert [record.saga_id for record in journal.list()] == ["X"]


@pytest.mark.parametrize("bad", [NUL_ID, SURROGATE_ID], ids=repr)
def test_an_agent_run_id_that_cannot_be_stored_is_refused(
    factory: JournalFactory, journal: SagaJournal, bad: str
) -> None:
    agents = AgentRunner(journal, factory.guard())
    try:
        with pytest.raises(ConfigurationError, match="run id"):
            agents.run(AgentSaga("agent", UndoRegistry()), bad)
    finally:
        agents.renewer.close()
    assert journal.list() == []


@settings(max_examples=30, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(max_size=12))
def test_any_saga_id_is_refused_typed_or_stored_as_given(
    factory: JournalFactory, journal: SagaJournal, runner: SagaRunner, saga_id: str
) -> None:
    work = Failing()
    before = journal.list(limit=1000)
    # The Redis journal also refuses braces (its keys' hash tag is the saga id; docs/backends.md).
    storable = _storable(saga_id) and not (factory.backend == "redis" and ("{" in saga_id or "}" in saga_id))
    try:
        outcome = runner.run(work.saga, saga_id, "ok")
    except ConfigurationError:
        assert not storable
        assert journal.list(limit=1000) == before
        assert work.ran == []
        return
    assert storable
    assert outcome.saga_id == saga_id
    snapshot = journal.load(saga_id)
    assert snapshot is not None and snapshot.saga.saga_id == saga_id


def _storable(text: str) -> bool:
    if not text or "\x00" in text:
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
