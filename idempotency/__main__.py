"""``python -m idempotency``: the ``sagaguard`` command line (see :mod:`idempotency.cli`)."""

from idempotency.cli import main

raise SystemExit(main())
