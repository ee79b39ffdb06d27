"""``python -m sagaguard.connectors.demo``: see :mod:`sagaguard.connectors.demo`."""

import sys

from sagaguard.connectors.demo import main

sys.exit(main())
