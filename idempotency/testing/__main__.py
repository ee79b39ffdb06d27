"""``python -m idempotency.testing counter ...`` (see :func:`idempotency.testing.counter_server.main`)."""

from __future__ import annotations

import sys

from idempotency.testing.counter_server import main

if __name__ == "__main__":
    sys.exit(main())
