"""What the CrewAI children of the tests and of ``bench/crewai_checkpoint.py`` run under: offline,
and, where a race is looked for, on busy cores."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

OFFLINE = {
    "CREWAI_DISABLE_TELEMETRY": "true",
    "CREWAI_DISABLE_TRACKING": "true",
    "CREWAI_DISABLE_VERSION_CHECK": "true",
    "CREWAI_TRACING_ENABLED": "false",
    "OTEL_SDK_DISABLED": "true",
}
"""CrewAI's telemetry, tracing and version check off: the children reach nothing but local servers."""


@contextmanager
def busy_cores(count: int) -> Iterator[None]:
    """``count`` CPU-hog processes running within it, killed (and reaped) when it ends."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
