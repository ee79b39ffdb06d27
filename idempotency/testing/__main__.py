"""``python -m sagaguard.idempotency.testing counter ...`` (see
:func:`sagaguard.idempotency.testing.counter_server.main`)."""

from __future__ import annotations

import sys

from sagaguard.idempotency.testing.counter_server import main

if __name__ == "__main__":
    sys.exit(main())
