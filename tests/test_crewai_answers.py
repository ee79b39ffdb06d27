"""sagaguard.connectors.frameworks.crewai rebuilds a journaled model answer only as a type it was given, never
by importing the module a stored record names.

Before: ``_load_model`` imported whatever ``"module:qualname"`` the record held, so whoever could
write to the ledger chose what got imported. The child runs in the CrewAI venv (as in
tests/test_crewai.py); a canary module records whether it was ever imported.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from test_crewai import CREW_PYTHON, ROOT, child_env, crew_python

__all__ = ["crew_python"]  # the fixture, re-used

CHILD = ROOT / "tests" / "_crewaianswerschild.py"


@pytest.fixture(scope="module")
def report(crew_python: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    canary = tmp_path_factory.mktemp("canary") / "imported"
    env = child_env() | {"SAGAGUARD_CANARY_FILE": str(canary)}
    done = subprocess.run(
        [str(CREW_PYTHON), str(CHILD)], env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
        timeout=240, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    result["canary_file"] = canary.exists()
    return result


def test_a_stored_record_naming_another_type_is_refused_and_never_imported(report: dict[str, object]) -> None:
    assert str(report["forged"]).startswith("UnknownAnswerType: ")
    assert "_crewai_canary:Planted" in str(report["forged"])
    assert str(report["forged_in_list"]).startswith("UnknownAnswerType: ")
    assert report["canary_imported"] is False and report["canary_imported_at_end"] is False
    assert report["canary_file"] is False


def test_without_a_registry_nothing_is_rebuilt(report: dict[str, object]) -> None:
    assert str(report["no_registry"]).startswith("UnknownAnswerType: ")


def test_declared_and_given_models_are_rebuilt_as_themselves(report: dict[str, object]) -> None:
    assert report["declared"] == ["Verdict", {"ok": True, "reason": "r"}]
    assert report["given"] == "value: Other(n=3)"
    assert str(report["not_given"]).startswith("UnknownAnswerType: ")


def test_the_model_clients_tool_calls_are_rebuilt_without_naming_by_data(report: dict[str, object]) -> None:
    assert report["tool_call"] == ["ChatCompletionMessageFunctionToolCall", "call_1"]
