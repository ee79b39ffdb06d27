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

import sagaguard
from sagaguard import idempotency, saga
from sagaguard.idempotency import outbox
from sagaguard.idempotency.cli import main
from sagaguard.saga import journals

ROOT = Path(__file__).resolve().parent.parent

EXPORTED = [
    "AlreadyInProgress", "Applied", "CancelOutcome", "CodecError",
    "CompensationPolicy", "CompensationsFailed", "ConfigurationError", "DeadLetter", "DefinitionError",
    "DefinitionMismatch", "Disposition", "DuplicateStep", "EffectContext", "EffectIdentity", "Event",
    "FORWARD_RETRY", "Guard", "IdempotencyError", "IdempotencyStore", "JournalError", "JournalUnavailable",
    "KeyConflict", "LostOwnership", "LostSagaLease", "MemoryJournal", "MemoryStore",
    "Message", "MessageStatus", "NOT_APPLIED", "NoScope", "NotApplied", "NotAppliedResolution",
    "NotParked", "Operation", "Outbox", "OutboxControl", "OutboxError", "OutboxStatus",
    "OutcomeNotRecorded", "OutcomeUnknown",
    "Policy", "ReconcileRequest", "Record", "RecordNotFound", "RecoveryExhausted",
    "RecoveryReport", "RecoveryWorker", "Relay", "RelaySettings", "ReplayedFailure", "ResultUnavailable",
    "SchemaVersionMismatch",
    "Retry", "Saga", "SagaCancelled", "SagaConflict", "SagaDeadlineExceeded", "SagaError",
    "SagaInProgress", "SagaJournal", "SagaNotFound", "SagaOutcome", "SagaRecord", "SagaRegistry",
    "SagaRunner", "SagaSnapshot", "SagaState", "SagaSuspended", "Scope", "SignalOutcome", "SignalTimeout",
    "SignatureError", "State", "Step", "StepContext", "StepKind",
    "StepMismatch", "StepOrderError", "StepRecord", "StepState", "StepTimeout", "StoreError",
    "StoreUnavailable", "Unknown", "UnknownSaga", "UnstorableType", "__version__", "aenqueue", "arecover",
    "cancel", "compensation_key", "create_tables", "current_effect", "current_message", "current_scope",
    "derive_key", "enqueue", "fingerprint", "open_journal",
    "open_store", "recover", "render", "resolve", "retry", "run_worker", "scope", "signal", "step_scope",
    "timeline",
]  # fmt: skip


def test_public_api_is_locked() -> None:
    """A name added to or dropped from ``sagaguard`` is a decision: this list changes with it."""
    assert sorted(sagaguard.__all__) == sorted(EXPORTED)
    assert len(set(sagaguard.__all__)) == len(sagaguard.__all__)


ENGINE = [
    "ClaimOutcome", "ClaimResult", "LeaseRenewer", "Phase", "SagaFlow", "StartOutcome", "StartResult",
    "decide", "decide_start", "failure_state",
]  # fmt: skip
"""The core packages' public names that the facade leaves out: the engine's parts (the coordinator's
decisions, journal phases, the store protocol's claim results), for backends and tests."""


def test_every_name_is_the_packages_own_object() -> None:
    """Re-exports, not copies: ``sagaguard.Guard is sagaguard.idempotency.Guard``; and every public
    name of the core packages is either re-exported or one of the engine's parts, by decision."""
    sources = [idempotency, saga, outbox, journals]
    for name in sagaguard.__all__:
        if name == "__version__":
            continue
        homes = [m for m in sources if name in m.__all__]
        assert homes, name
        assert all(getattr(m, name) is getattr(sagaguard, name) for m in homes), name
    core = set(idempotency.__all__) | set(saga.__all__)
    assert core - set(sagaguard.__all__) == set(ENGINE)
    assert not set(ENGINE) & set(sagaguard.__all__)


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
        "bad = [m for m in ('sagaguard.connectors', 'redis', 'psycopg', 'stripe', 'httpx', 'openai', "
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
    demo = importlib.import_module("sagaguard.connectors.demo")
    monkeypatch.setattr(demo, "_NEEDS", ("aiosmtpd", "sagaguard_no_such_module"))
    assert demo.main([]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "pip install 'sagaguard[demo]'" in err and "sagaguard_no_such_module" in err
    assert "aiosmtpd" not in err.split("missing:")[1].split(")")[0]  # installed here: not named


def test_every_folder_with_code_is_installed_under_the_namespace() -> None:
    """pyproject.toml lists each package of the three folders as ``sagaguard.<folder>...``, so a new
    sub-package cannot be left out of the wheel, and no folder installs under a top-level name."""
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    folders = ("idempotency", "saga", "connectors")
    found = {"sagaguard"} | {
        "sagaguard." + ".".join(init.parent.relative_to(ROOT).parts)
        for folder in folders
        for init in (ROOT / folder).rglob("__init__.py")
    }
    assert sorted(tool["packages"]) == sorted(found)
    assert tool["package-dir"] == {"sagaguard": "sagaguard"} | {f"sagaguard.{f}": f for f in folders}


def test_no_code_imports_a_folder_by_its_top_level_name() -> None:
    """Every import of the project's own code goes through ``sagaguard.``: a top-level ``import saga``
    works from a checkout's root, never from the installed wheel."""
    import ast

    bare = []
    for folder in ("sagaguard", "idempotency", "saga", "connectors", "tests", "bench", "docs"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                names = (
                    [a.name for a in node.names] if isinstance(node, ast.Import)
                    else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level
                    else []
                )  # fmt: skip
                bare += [f"{path.relative_to(ROOT)}:{node.lineno}" for n in names
                         if n.split(".")[0] in ("idempotency", "saga", "connectors")]  # fmt: skip
    assert bare == []


def test_imports_flow_one_way() -> None:
    """connectors -> saga -> idempotency: the ledger imports neither layer above it, sagas never
    import a connector (the CLI finds their commands through entry points)."""
    import ast

    above = {"idempotency": ("sagaguard.saga", "sagaguard.connectors"), "saga": ("sagaguard.connectors",)}
    wrong = []
    for folder, banned in above.items():
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                names = (
                    [a.name for a in node.names] if isinstance(node, ast.Import)
                    else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level
                    else []
                )  # fmt: skip
                wrong += [f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in names
                          if n.startswith(banned)]  # fmt: skip
    assert wrong == []
