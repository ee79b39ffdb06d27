"""``python -m sagaguard.idempotency``: the ``sagaguard`` command line (:mod:`sagaguard.idempotency.cli`)."""

from sagaguard.idempotency.cli import main

raise SystemExit(main())
