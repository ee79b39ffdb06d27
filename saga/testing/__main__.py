"""``python -m saga.testing child ...`` (see :func:`saga.testing.child.child_main`)."""

from __future__ import annotations

import sys

from saga.testing.child import main

if __name__ == "__main__":
    sys.exit(main())
