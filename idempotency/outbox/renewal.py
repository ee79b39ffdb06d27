"""Renewing a relay's claims while its handlers run: one background thread per relay, every path.

A relay claims a batch under a lease. A handler slower than the lease would otherwise lose its
message to another relay, which delivers it again (and again, until it is dead-lettered, although
every delivery succeeded). :class:`ClaimRenewer` calls the relay's renew function every
``interval`` seconds for as long as a batch is in hand, whichever thread runs the handlers (the
relay's own thread for one aggregate, a pool for several), so a long handler keeps its claim. It
holds the batch on a :class:`~sagaguard.idempotency.renewal.Renewer`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from sagaguard.idempotency.renewal import Renewer

__all__ = ["ClaimRenewer"]


class ClaimRenewer:
    """Calls a batch's renew function from a daemon thread while the batch is delivered.

    The thread starts on first use. A renew function that raises is logged and called again at the
    next interval: a claim that cannot be renewed is found lost when the batch is settled.
    """

    def __init__(self, name: str) -> None:
        self._renewer = Renewer(name)

    @contextlib.contextmanager
    def renewing(self, renew: Callable[[], None], interval: float) -> Iterator[None]:
        """Within the block, ``renew()`` is called every ``interval`` seconds (first after one
        interval); leaving the block stops it and waits for a call in progress to return."""

        def again() -> bool:
            renew()
            return True

        handle = self._renewer.hold(again, interval)
        try:
            yield
        finally:
            self._renewer.release(handle, wait=True)

    def close(self) -> None:
        """Stop the thread (a relay's close)."""
        self._renewer.close()
