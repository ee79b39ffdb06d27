"""The ``sagaguard`` import package: its public API (locked), its version, and what it must not import.

The wheel built from this checkout, installed in a fresh virtualenv, is tested in test_wheel.py.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import tomllib
from importlib.metadata import metadata, version
from pathlib import Path

import pytest

import idempotency
import idempotency.outbox
import saga
import saga.journals
import sagaguard
from idempotency.cli import main

ROOT = Path(__file__).resolve().parent.parent

EXPORTED = [
    "AlreadyInProgress", "Applied", "CancelOutcome", "ClaimOutcome", "ClaimResult", "CodecError",
    "CompensationPolicy", "CompensationsFailed", "ConfigurationError", "DeadLetter", "DefinitionError",
    "DefinitionMismatch", "Disposition", "DuplicateStep", "EffectContext", "EffectIdentity", "Event",
    "FORWARD_RETRY", "Guard", "IdempotencyError", "IdempotencyStore", "JournalError", "JournalUnavailable",
    "KeyConflict", "LeaseRenewer", "LostOwnership", "LostSagaLease", "MemoryJournal", "MemoryStore",
    "Message", "MessageStatus", "NOT_APPLIED", "NoScope", "NotApplied", "NotAppliedResolution",
    "NotParked", "Operation", "Outbox", "OutboxControl", "OutboxError", "OutboxStatus",
    "OutcomeNotRecorded", "OutcomeUnknown",
    "Phase", "Policy", "ReconcileRequest", "Record", "RecordNotFound", "RecoveryExhausted",
    "RecoveryReport", "RecoveryWorker", "Relay", "RelaySettings", "ReplayedFailure", "ResultUnavailable",
    "Retry", "Saga", "SagaCancelled", "SagaConflict", "SagaDeadlineExceeded", "SagaError", "SagaFlow",
    "SagaInProgress", "SagaJournal", "SagaNotFound", "SagaOutcome", "SagaRecord", "SagaRegistry",
    "SagaRunner", "SagaSnapshot", "SagaState", "SagaSuspended", "Scope", "SignalOutcome", "SignalTimeout",
    "SignatureError", "StartOutcome", "StartResult", "State", "Step", "StepContext", "StepKind",
    "StepMismatch", "StepOrderError", "StepRecord", "StepState", "StepTimeout", "StoreError",
    "StoreUnavailable", "Unknown", "UnknownSaga", "UnstorableType", "__version__", "aenqueue", "arecover",
    "cancel", "compensation_key", "create_tables", "current_effect", "current_message", "current_scope",
    "decide", "decide_start", "derive_key", "enqueue", "failure_state", "fingerprint", "open_journal",
    "open_store", "recover", "render", "resolve", "retry", "run_worker", "scope", "signal", "step_scope",
    "timeline",
]  # fmt: skip


def test_public_api_is_locked() -> None:
    """A name added to or dropped from ``sagaguard`` is a decision: this list changes with it."""
    assert sorted(sagaguard.__all__) == sorted(EXPORTED)
    assert len(set(sagaguard.__all__)) == len(sagaguard.__all__)


def test_every_name_is_the_packages_own_object() -> None:
    """Re-exports, not copies: ``sagaguard.Guard is idempotency.Guard``; and the core packages'
    public names are all there."""
    sources = [idempotency, saga, idempotency.outbox, saga.journals]
    for name in sagaguard.__all__:
        if name == "__version__":
            continue
        homes = [m for m in sources if name in m.__all__]
        assert homes, name
        assert all(getattr(m, name) is getattr(sagaguard, name) for m in homes), name
    assert set(idempotency.__all__) <= set(sagaguard.__all__)
    assert set(saga.__all__) <= set(sagaguard.__all__)


def test_version_comes_from_pyproject_through_the_metadata() -> None:
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["version"]
    assert sagaguard.__version__ == version("sagaguard") == declared


def test_license_is_spdx_with_its_file() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert project["license"] == "Apache-2.0"
    assert project["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
    assert metadata("sagaguard")["License-Expression"] == "Apache-2.0"


def test_conflicting_extras_each_pin_their_side_of_openai() -> None:
    """``sagaguard[agents,crewai]`` must fail on sagaguard's own requirements (no release of openai
    can be >=3 and <3), before pip backtracks through older releases of either framework."""
    from packaging.requirements import Requirement

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"][
        "optional-dependencies"
    ]
    pins = {}
    for extra in ("agents", "crewai"):
        found = [Requirement(r) for r in extras[extra] if Requirement(r).name == "openai"]
        assert len(found) == 1, extra
        pins[extra] = found[0].specifier
    probes = ["1.40.0", "2.54.0", "2.99.0", "3.0.0", "3.22.1", "4.0.0"]
    assert not [v for v in probes if v in pins["agents"] and v in pins["crewai"]]
    assert "3.0.0" in pins["agents"] and "2.99.0" in pins["crewai"]


def test_import_needs_no_extra() -> None:
    """``import sagaguard`` loads no connector and no optional dependency; nor SQLAlchemy, which the
    outbox's names load on first use."""
    code = (
        "import sys, sagaguard; "
        "bad = [m for m in ('connectors', 'redis', 'psycopg', 'stripe', 'httpx', 'openai', "
        "'opentelemetry.sdk', 'langgraph', 'agents', 'crewai', 'sqlalchemy') if m in sys.modules]; "
        "print(','.join(bad))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == ""


def test_cli_prints_the_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"sagaguard {sagaguard.__version__}"


def test_demo_names_its_extra_when_a_dependency_is_missing(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """One line naming ``sagaguard[demo]`` and exit status 2, not a traceback from a worker.

    (The wheel test runs ``sagaguard demo`` in a virtualenv that really lacks the extra.)
    """
    demo = importlib.import_module("connectors.demo")
    monkeypatch.setattr(demo, "_NEEDS", ("aiosmtpd", "sagaguard_no_such_module"))
    assert demo.main([]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "pip install 'sagaguard[demo]'" in err and "sagaguard_no_such_module" in err
    assert "aiosmtpd" not in err.split("missing:")[1].split(")")[0]  # installed here: not named
