"""``python -m connectors.demo``: see :mod:`connectors.demo`."""

import sys

from connectors.demo import main

sys.exit(main())
