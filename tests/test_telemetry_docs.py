"""docs/telemetry.md against what the code emits, and the telemetry conventions decided in one place.

tests/_telemetrychild.py runs one of everything in a fresh process (the global OTel providers can be
set once) with the SDK's in-memory exporter and reader; the spans, attributes and metrics it saw are
compared with the tables parsed from the page, both ways.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from sagaguard.idempotency.errors import ConfigurationError, OutcomeUnknown
from sagaguard.idempotency.telemetry import (
    Identifier,
    business_key,
    effect_naming,
    error_type,
    error_type_name,
    expose_identifiers,
    identifier_attributes,
)

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "telemetry.md"
NOT_IN_THE_RUN = {"sagaguard.step.resumed"}
"""Documented attributes the child's run cannot produce (a step resumed after a crash: see
test_saga_telemetry.py); each must still be in the code."""


def _table(section: str) -> list[list[str]]:
    """The rows of the first table under ``## {section}`` (header and rule dropped)."""
    text = PAGE.read_text(encoding="utf-8")
    body = text.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    lines = body.strip().splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = []
    for line in lines[first:]:
        if not line.startswith("|"):
            break  # the first table ends here
        rows.append(line)
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows[2:]]


def _ticked(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


@pytest.fixture(scope="module")
def emitted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("telemetry")
    done = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "_telemetrychild.py"), str(tmp)],
        capture_output=True, text=True, timeout=120, check=False, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    found: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return found


def test_every_span_is_documented_and_every_documented_span_is_emitted(emitted: dict[str, Any]) -> None:
    documented = {}
    for row in _table("Spans"):
        (pattern,), (kind,) = _ticked(row[0]), _ticked(row[1])
        regex = re.escape(pattern).replace(r"\{", "{").replace(r"\}", "}")
        documented[pattern] = (re.compile(re.sub(r"\{[a-z]+\}", r"\\S+", regex) + "$"), kind)
    matched: set[str] = set()
    for span in emitted["spans"]:
        hits = [p for p, (rx, kind) in documented.items() if rx.match(span["name"]) and kind == span["kind"]]
        assert len(hits) == 1, (span["name"], span["kind"], hits)
        matched.add(hits[0])
    assert matched == set(documented)


def test_every_attribute_is_documented_and_emitted(emitted: dict[str, Any]) -> None:
    documented = {_ticked(row[0])[0] for row in _table("Attributes")}
    seen = {a for span in emitted["spans"] for a in span["attributes"]}
    assert seen - documented == set()
    assert documented - seen == NOT_IN_THE_RUN
    code = "".join(p.read_text(encoding="utf-8") for p in (ROOT / "saga").glob("*.py"))
    assert all(f'"{name}"' in code for name in NOT_IN_THE_RUN)


def test_every_metric_and_its_attributes_are_documented(emitted: dict[str, Any]) -> None:
    documented = {_ticked(row[0])[0]: set(_ticked(row[3])) for row in _table("Metrics")}
    seen: dict[str, set[str]] = {}
    for point in emitted["metrics"]:
        seen.setdefault(point["name"], set()).update(point["attributes"])
    assert seen == documented


def test_error_spans_carry_the_qualified_error_type(emitted: dict[str, Any]) -> None:
    failed = [span for span in emitted["spans"] if span["error"]]
    names = {span["name"].split(" ")[0] for span in failed}
    assert names == {"sagaguard.effect", "saga.step", "saga.compensate", "send"}
    assert all(span["error_type"] for span in failed)
    assert {span["error_type"] for span in failed} >= {
        "__main__.Declined", "LookupError", "ConnectionError", "TimeoutError",
        "sagaguard.idempotency.errors.OutcomeUnknown",
    }  # fmt: skip


def test_only_tool_calls_are_genai_spans(emitted: dict[str, Any]) -> None:
    for span in emitted["spans"]:
        genai = [a for a in span["attributes"] if a.startswith("gen_ai.")]
        assert bool(genai) == span["name"].startswith("execute_tool "), span
    assert effect_naming("stripe.refund").span_name == "sagaguard.effect stripe.refund"
    assert effect_naming("langgraph.tool.search", tool=True).span_name == "execute_tool langgraph.tool.search"


def test_identifiers_are_off_by_default_and_on_when_chosen(emitted: dict[str, Any]) -> None:
    optional = {"sagaguard.saga.id", "sagaguard.effect.scope", "sagaguard.business_key"}
    split = emitted["split"]
    before, after = emitted["spans"][:split], emitted["spans"][split:]
    assert before and after
    assert not [s for s in before if optional & set(s["attributes"])]  # a business key was set, too
    assert optional <= {a for s in after for a in s["attributes"]}


def test_expose_identifiers_in_process() -> None:
    assert identifier_attributes("trip-1") == {}
    previous = expose_identifiers(Identifier.SAGA_ID, "business_key")
    try:
        assert identifier_attributes("trip-1") == {"sagaguard.saga.id": "trip-1"}
        with business_key("order-9"):
            assert identifier_attributes() == {"sagaguard.business_key": "order-9"}
        with pytest.raises(ConfigurationError, match="order_id"):
            expose_identifiers("order_id")
        with pytest.raises(ConfigurationError), business_key(""):
            pass
    finally:
        expose_identifiers(*previous)
    assert identifier_attributes("trip-1") == {}


def test_error_type_names() -> None:
    assert error_type(OutcomeUnknown) == "sagaguard.idempotency.errors.OutcomeUnknown"
    assert error_type(KeyError("k")) == "KeyError"
    assert error_type(TimeoutError) == "TimeoutError"
    assert error_type_name("builtins.KeyError") == "KeyError"
