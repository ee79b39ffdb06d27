"""The failing research agent (issue 16, point 9): it books and pays, then a later tool fails and its
tool calls are undone as an agent saga. SIGKILL at every point of the run (from the first call with
an undo) and of its compensation, and at seeded random times; resume at once in a fresh process,
sweep with the worker API, count at the world.

::

    .venv/bin/python bench/research_failing.py --seed 16 --random 6       # writes the docs table
    .venv/bin/python bench/research_failing.py --variants LangGraph --no-write   # prints it only

The harness is ``tests/_research/failing.py`` (the same code the ``-m sweep`` tests of
tests/test_research_failing.py assert on); this entry point runs it from bench/, like
``bench/research_resume.py``. The table goes between ``<!-- failing:start -->`` and
``<!-- failing:end -->`` in ``docs/frameworks/research_agent.md`` (section "A failing agent,
undone").
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for entry in (ROOT, ROOT / "tests"):  # the project, and tests/ for the harness (_research)
    if str(entry) not in sys.path:
        sys.path.insert(0, str(entry))

from _research.failing import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
