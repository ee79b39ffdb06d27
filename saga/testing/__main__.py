"""``python -m sagaguard.saga.testing child ...`` (see :func:`sagaguard.saga.testing.child.child_main`)."""

from __future__ import annotations

import sys

from sagaguard.saga.testing.child import main

if __name__ == "__main__":
    sys.exit(main())
