"""``sagaguard demo --trace FILE``: OpenTelemetry spans as JSON lines, one object per span.

Every demo process (the supervisor and each worker) installs a ``TracerProvider`` whose exporter
appends finished spans to the same file, one ``write`` per span under an exclusive ``flock``, so
lines from several processes never interleave. Spans are exported as they end (a
``SimpleSpanProcessor``): a worker killed with SIGKILL loses only the spans it had not finished.
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

__all__ = ["JsonLinesExporter", "install", "read_spans", "span_json"]


def _hex(value: int, width: int) -> str:
    return format(value, f"0{width}x")


def span_json(span: ReadableSpan) -> dict[str, Any]:
    """One span as a JSON-able object: name, ids, parent, links, attributes, status, times."""
    context = span.get_span_context()
    parent = span.parent
    return {
        "name": span.name,
        "trace_id": _hex(context.trace_id, 32) if context is not None else None,
        "span_id": _hex(context.span_id, 16) if context is not None else None,
        "parent_span_id": _hex(parent.span_id, 16) if parent is not None else None,
        "links": [
            {"trace_id": _hex(link.context.trace_id, 32), "span_id": _hex(link.context.span_id, 16)}
            for link in span.links
        ],
        "attributes": {key: _plain(value) for key, value in (span.attributes or {}).items()},
        "status": span.status.status_code.name,
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "pid": os.getpid(),
    }


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


class JsonLinesExporter(SpanExporter):
    """Appends each span to ``path`` as one JSON line, under an exclusive file lock.

    Args:
        path: the file; created if missing, never truncated here.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        """Write ``spans``; one locked append for the batch."""
        text = "".join(json.dumps(span_json(span), default=str) + "\n" for span in spans)
        try:
            with self.path.open("a", encoding="utf-8") as out:
                fcntl.flock(out.fileno(), fcntl.LOCK_EX)
                try:
                    out.write(text)
                    out.flush()
                finally:
                    fcntl.flock(out.fileno(), fcntl.LOCK_UN)
        except OSError:
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        """Nothing to release: every export opens and closes the file."""


def install(path: str | Path, service: str) -> TracerProvider:
    """Make a provider exporting to ``path`` the global one, for this process.

    Args:
        path: the JSON-lines file.
        service: the ``service.name`` resource attribute (``sagaguard-demo``, ``...-worker``).

    Returns:
        The provider; call ``shutdown()`` before the process exits normally.
    """
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(SimpleSpanProcessor(JsonLinesExporter(path)))
    trace.set_tracer_provider(provider)
    return provider


def read_spans(path: str | Path) -> list[dict[str, Any]]:
    """The spans written to ``path`` (blank and torn lines skipped)."""
    spans: list[dict[str, Any]] = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            spans.append(json.loads(line))
        except ValueError:
            continue
    return spans
