"""The research agent resumed at once (issue 14): SIGKILL at named points and at seeded random times,
then a supervisor's restart in a fresh process with ``Guard(store)``'s defaults, until it finishes.

::

    .venv/bin/python bench/research_resume.py --seed 1414 --random 6 --fanout 4   # writes the docs table
    .venv/bin/python bench/research_resume.py --no-write                          # prints it only

The harness is ``tests/_research/resume.py`` (the same code the ``-m sweep`` tests assert on); this
entry point runs it from bench/, like ``bench/research_agent.py`` runs the kill-point sweep. The table
goes between ``<!-- resume:start -->`` and ``<!-- resume:end -->`` in
``docs/frameworks/research_agent.md``; docs/benchmarks.md links to it.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for entry in (ROOT, ROOT / "tests"):  # the project, and tests/ for the harness (_research)
    if str(entry) not in sys.path:
        sys.path.insert(0, str(entry))

from _research.resume import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
