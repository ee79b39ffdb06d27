"""The environment of a child process that must import this very copy of sagaguard.

Crash tests and demos start children with ``sys.executable``. A child finds the ``sagaguard`` package
the parent imported when the folder holding it comes first on its ``PYTHONPATH``: the installed
copy, an editable checkout, or a tree the caller put on ``sys.path`` itself.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["child_environment"]


def child_environment(*paths: str, **extra: str) -> dict[str, str]:
    """This process's environment for a child: the folder holding the imported ``sagaguard`` package
    first on ``PYTHONPATH`` (after ``paths``, before what was there), output unbuffered, plus ``extra``.

    The folder is taken as imported, not resolved: a tree of links that lays the repository out as
    installed stays the child's way to its files.
    """
    import sagaguard

    home = str(Path(sagaguard.__file__).parent.parent)
    path = os.pathsep.join(p for p in (*paths, home, os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path, **extra}
