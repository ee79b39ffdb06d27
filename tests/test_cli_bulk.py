"""Bulk actions on the command line: ``--all`` over a filtered list, ``--dry-run``, the confirmation,
``--yes``, and the action id that makes a rerun do nothing again (shared with the console's bulk forms).

Run through click's ``CliRunner`` on a SQLite file ledger: effects left in doubt by the guard, and
sagas waiting at a signal, made by the real runner.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from sagaguard.idempotency import Guard, OutcomeUnknown, open_store, scope
from sagaguard.idempotency.audit import AuditFilter, open_audit
from sagaguard.idempotency.cli import cli
from sagaguard.idempotency.records import State
from sagaguard.saga import Saga, SagaRunner, SagaState, StepContext
from sagaguard.saga.journals import open_journal

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    found = f"sqlite:///{tmp_path / 'ledger.db'}"
    monkeypatch.setenv("SAGAGUARD_STORE", found)
    return found


@pytest.fixture
def in_doubt(url: str) -> Iterator[dict[str, str]]:
    """Three effects in doubt, by scope: trip-1, trip-2, other-1."""
    store = open_store(url)
    guard = Guard(store, wait=0)

    @guard.effect("stripe.charge")
    def charge(amount: int) -> int:
        raise TimeoutError("read timed out")

    for scope_id in ("trip-1", "trip-2", "other-1"):
        with scope(scope_id), pytest.raises(OutcomeUnknown):
            charge(1)
    keys = {r.scope: r.key for r in store.list()}
    guard.close()
    yield keys


def invoke(*args: str, stdin: str | None = None) -> tuple[int, str]:
    result = CliRunner().invoke(cli, list(args), input=stdin)
    return result.exit_code, result.output


def states(url: str) -> dict[str, str]:
    store = open_store(url)
    try:
        return {r.scope: r.state.value for r in store.list()}
    finally:
        store.close()


def test_resolve_all_dry_run_then_confirmed_once(url: str, in_doubt: dict[str, str]) -> None:
    code, out = invoke("effects", "list", "--prefix", "trip-", "--json")  # the list it acts on
    assert code == 0 and sorted(r["scope"] for r in json.loads(out)) == ["trip-1", "trip-2"]
    code, out = invoke("effects", "resolve", "--all", "--not-applied", "--prefix", "trip-", "--dry-run")
    assert code == 0, out
    assert "would resolve as not applied 2 effects" in out
    assert in_doubt["trip-1"] in out and in_doubt["other-1"] not in out
    assert states(url) == dict.fromkeys(in_doubt, State.IN_DOUBT.value)  # touched nothing

    # No terminal to ask on (CliRunner's stdin is not one): refused without --yes.
    code, out = invoke("effects", "resolve", "--all", "--not-applied", "--prefix", "trip-")
    assert code == 2 and "--yes" in out
    assert len(states(url)) == 3

    action_id = "a" * 32
    argv = ["effects", "resolve", "--all", "--not-applied", "--prefix", "trip-", "--yes", "--json",
            "--action-id", action_id, "--actor", "ana"]  # fmt: skip
    code, out = invoke(*argv)
    assert code == 0, out
    done = json.loads(out)
    assert done["done"] == 2 and done["repeated"] is False and done["action_id"] == action_id
    assert states(url) == {"other-1": "in_doubt"}

    log = open_audit(url)
    try:
        bulk = log.list(AuditFilter(target=action_id), limit=5)
        each = log.list(AuditFilter(action="effect.resolve"), limit=5)
    finally:
        log.close()
    assert [(e.action, e.actor, e.args["count"]) for e in bulk] == [("bulk.effect.resolve", "ana", 2)]
    assert {e.target for e in each} == {in_doubt["trip-1"], in_doubt["trip-2"]}

    # The same action id again (a rerun, here over every effect in doubt): nothing is done again.
    code, out = invoke("effects", "resolve", "--all", "--not-applied", "--yes", "--action-id", action_id)
    assert code == 0 and "nothing done again" in out
    assert states(url) == {"other-1": "in_doubt"}


def test_resolve_all_usage(url: str, in_doubt: dict[str, str]) -> None:
    assert invoke("effects", "resolve", "--all", "--applied", "--result", "1")[0] == 2
    assert invoke("effects", "resolve", in_doubt["trip-1"], "--all", "--not-applied")[0] == 2
    assert invoke("effects", "resolve", in_doubt["trip-1"], "--not-applied", "--dry-run")[0] == 2
    assert invoke("effects", "resolve", "--all", "--not-applied", "--yes", "--action-id", "nope")[0] == 2


def _on_a_terminal(answer: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run the real command with a pseudo-terminal as stdin, ``answer`` typed in advance."""
    leader, follower = os.openpty()
    try:
        os.write(leader, answer.encode() + b"\n")
        return subprocess.run(
            [sys.executable, "-m", "sagaguard.idempotency", *args], stdin=follower, capture_output=True,
            text=True, timeout=60, check=False,
        )  # fmt: skip
    finally:
        os.close(follower)
        os.close(leader)


def test_on_a_terminal_it_asks_and_a_no_exits_1_touching_nothing(url: str, in_doubt: dict[str, str]) -> None:
    done = _on_a_terminal("n", "effects", "resolve", "--all", "--not-applied")
    assert done.returncode == 1, done.stderr
    assert "resolve as not applied these 3 effects?" in done.stderr and "Traceback" not in done.stderr
    assert len(states(url)) == 3
    done = _on_a_terminal("y", "effects", "resolve", "--all", "--not-applied", "--prefix", "other-")
    assert done.returncode == 0, done.stderr
    assert "1 done" in done.stdout and "other-1" not in states(url)


HITL: Saga[str] = Saga("bulk_hitl", input=str)


@HITL.step(compensate=None)
def prepare(ctx: StepContext, order: str) -> str:
    return "ready"


HITL.wait("approval")


@pytest.fixture
def waiting(url: str) -> list[str]:
    """Three sagas waiting at a signal: trip-a, trip-b, other-a."""
    journal = open_journal(url)
    store = open_store(url)
    runner = SagaRunner(journal, Guard(store), wait=0)
    try:
        for saga_id in ("trip-a", "trip-b", "other-a"):
            assert runner.run(HITL, saga_id, "o").state is SagaState.WAITING
    finally:
        runner.close()
        journal.close()
        store.close()
    return ["trip-a", "trip-b", "other-a"]


def cancelled(url: str) -> set[str]:
    journal = open_journal(url)
    try:
        return {r.saga_id for r in journal.list(limit=10) if r.cancel_requested}
    finally:
        journal.close()


def test_sagas_cancel_all_previews_then_acts_once(url: str, waiting: list[str]) -> None:
    code, out = invoke(
        "sagas", "list", "--state", "waiting", "--prefix", "trip-", "--name", "bulk_", "--json"
    )
    assert code == 0 and [r["saga_id"] for r in json.loads(out)] == ["trip-a", "trip-b"]
    assert invoke("sagas", "list", "--state", "running_past_lease")[1].strip() == "no sagas in these states"
    assert invoke("sagas", "cancel", "--all", "--state", "waiting", "--older", "3600", "--dry-run")[
        1
    ].startswith("would cancel 0 sagas")  # all younger than an hour
    code, out = invoke("sagas", "cancel", "--all", "--state", "waiting", "--prefix", "trip-", "--dry-run")
    assert code == 0, out
    assert "would cancel 2 sagas" in out and "trip-a" in out and "other-a" not in out
    assert cancelled(url) == set()

    code, out = invoke("sagas", "cancel", "--all", "--state", "waiting", "--prefix", "trip-")
    assert code == 2 and cancelled(url) == set()

    action_id = "b" * 32
    argv = [
        "sagas",
        "cancel",
        "--all",
        "--state",
        "waiting",
        "--prefix",
        "trip-",
        "--yes",
        "--action-id",
        action_id,
    ]
    code, out = invoke(*argv)
    assert code == 0, out
    assert "2 done, 0 refused" in out
    assert cancelled(url) == {"trip-a", "trip-b"}
    code, out = invoke(*argv)
    assert code == 0 and "done already" in out

    code, out = invoke("audit", "--target", action_id, "--json")
    assert code == 0
    assert [e["action"] for e in json.loads(out)] == ["bulk.saga.cancel"]


def test_sagas_reject_all_and_the_one_saga_forms(url: str, waiting: list[str]) -> None:
    code, out = invoke("sagas", "reject", "--all", "--prefix", "other-", "--yes", "--json")
    assert code == 0, out
    assert json.loads(out)["outcomes"] == {"other-a": "requested (the worker undoes its tool calls)"}
    assert invoke("sagas", "cancel", "trip-a", "--prefix", "x")[0] == 2  # filters go with --all
    assert invoke("sagas", "retry")[0] == 2  # a SAGA_ID or --all
    code, out = invoke("sagas", "retry", "--all", "--yes")  # none needs attention: nothing to do
    assert code == 0 and "retry 0 sagas" in out
