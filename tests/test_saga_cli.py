"""``sagaguard sagas ...``: list, show, signal, cancel and a worker sweep, on a SQLite journal."""

from __future__ import annotations

import importlib
import json
import os
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import click
import pytest

from sagaguard.saga import SagaRunner, SagaState
from sagaguard.saga.cli import main, sagas

pytestmark = pytest.mark.timeout(60)

APP = """
from dataclasses import dataclass

from sagaguard.idempotency import Guard
from sagaguard.idempotency.stores import open_store
from sagaguard.saga import Saga, SagaRegistry, StepContext

guard = Guard(open_store({url!r}))


@dataclass
class Order:
    id: str


hitl: Saga[Order] = Saga("hitl", input=Order)


@hitl.step(compensate=None)
def prepare(ctx: StepContext, order: Order) -> str:
    return "ready"


hitl.wait("approval", payload=dict)


@hitl.step(compensate=None)
def finish(ctx: StepContext, order: Order) -> str:
    return "approved by " + ctx.signal("approval")["by"]


registry = SagaRegistry(hitl)
"""


@pytest.fixture
def app(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[ModuleType, str]]:
    url = f"sqlite:///{tmp_path}/sagaguard.db"
    name = f"sagaapp_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(APP.format(url=url)))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("SAGAGUARD_JOURNAL", url)
    module = importlib.import_module(name)
    yield module, name
    module.guard.close()
    sys.modules.pop(name, None)


def _start(module: ModuleType, saga_id: str) -> None:
    from sagaguard.saga.journals import open_journal

    journal = open_journal(os.environ["SAGAGUARD_JOURNAL"])
    runner = SagaRunner(journal, module.guard, wait=0)
    try:
        assert runner.run(module.hitl, saga_id, module.Order("o1")).state is SagaState.WAITING
    finally:
        runner.close()
        journal.close()


def test_list_show_signal_and_a_worker_sweep(
    app: tuple[ModuleType, str], capsys: pytest.CaptureFixture[str]
) -> None:
    module, name = app
    _start(module, "order-1")
    _start(module, "order-2")
    assert main(["sagas", "list"]) == 0
    out = capsys.readouterr().out
    assert "order-1" in out and "waiting" in out and "approval" in out and "never" in out
    assert main(["sagas", "list", "--json", "--state", "completed"]) == 0
    assert json.loads(capsys.readouterr().out) == []
    assert main(["sagas", "show", "order-1"]) == 0
    out = capsys.readouterr().out
    assert "hitl v1" in out and "0. prepare [compensatable] succeeded" in out and "1. approval" in out

    assert main(["sagas", "signal", "order-1", "approval", "--payload", '{"by": "ana"}']) == 0
    assert "delivered" in capsys.readouterr().out
    assert main(["sagas", "signal", "order-1", "approval", "--payload", "{nope"]) == 2
    assert "not valid JSON" in capsys.readouterr().err

    assert main(["sagas", "worker", "--app", f"{name}:registry", "--once"]) == 0
    out = capsys.readouterr().out
    assert "1 due, 1 driven" in out and "order-1: completed" in out

    assert main(["sagas", "show", "order-1", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["state"] == "completed" and shown["signals"]["approval"] == {"by": "ana"}
    assert [s["state"] for s in shown["steps"]] == ["succeeded"] * 3


def test_cancel_and_errors(app: tuple[ModuleType, str], capsys: pytest.CaptureFixture[str]) -> None:
    module, name = app
    _start(module, "order-3")
    assert main(["sagas", "cancel", "order-3", "--reason", "withdrawn"]) == 0
    assert "requested" in capsys.readouterr().out
    assert main(["sagas", "worker", "--app", f"{name}:hitl", "--once"]) == 0
    assert "order-3: failed" in capsys.readouterr().out  # nothing to undo: failed, with the cause
    assert main(["sagas", "cancel", "order-3"]) == 1
    assert "too_late" in capsys.readouterr().out
    assert main(["sagas", "show", "nope"]) == 1
    assert "no saga 'nope'" in capsys.readouterr().err
    assert main(["sagas", "worker", "--app", "no_such_module:x", "--once"]) == 2
    assert main(["sagas", "list", "--journal", "ftp://x"]) == 2
    assert main(["sagas"]) == 2


def test_the_sagas_group_is_found_by_the_root_through_its_entry_point(app: tuple[ModuleType, str]) -> None:
    from click.testing import CliRunner

    from sagaguard.idempotency.cli import cli
    from sagaguard.saga.journals import open_journal

    open_journal(os.environ["SAGAGUARD_JOURNAL"]).close()  # the app's schema: the CLI creates none
    assert cli.get_command(click.Context(cli), "sagas") is sagas
    result = CliRunner().invoke(cli, ["sagas", "list", "--limit", "5"])
    assert result.exit_code == 0, result.output
    assert "no sagas" in result.output


def test_actions_are_audited_and_shown_on_the_saga(
    app: tuple[ModuleType, str], capsys: pytest.CaptureFixture[str]
) -> None:
    module, name = app
    _start(module, "order-9")
    _start(module, "order-10")
    secret = ["--payload", '{"by": "secret"}']
    assert main(["sagas", "signal", "order-9", "approval", *secret, "--actor", "ana"]) == 0
    assert main(["sagas", "signal", "order-9", "approval", "--actor", "ana"]) == 0  # duplicate: not done
    assert main(["sagas", "reject", "order-10", "--reason", "wrong customer", "--actor", "bob"]) == 0
    assert main(["sagas", "retry", "order-10"]) == 1  # not parked: refused, and recorded
    capsys.readouterr()
    assert main(["sagas", "show", "order-9"]) == 0
    out = capsys.readouterr().out
    # The timeline shows the operators' actions among the saga's own events.
    assert "operator ana (cli): saga.signal ok  (name='approval')" in out
    assert "operator ana (cli): saga.signal refused: duplicate" in out
    assert "secret" not in out  # a payload is never audited
    assert main(["sagas", "show", "order-10", "--json"]) == 0
    audit = json.loads(capsys.readouterr().out)["audit"]
    assert [(e["actor"], e["action"], e["outcome"], e["error"]) for e in audit] == [
        ("bob", "saga.reject", "ok", None),
        (audit[1]["actor"], "saga.retry", "refused", "NotParked"),
    ]
    assert audit[1]["actor"]  # the OS user by default
    assert main(["sagas", "worker", "--app", f"{name}:registry", "--once"]) == 0
    assert "order-10: failed" in capsys.readouterr().out  # rejected before anything to undo
