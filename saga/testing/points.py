"""Kill points: where a child dies (:class:`KillPoint`), the calls it met (:class:`Boundary`), and
the counter that kills it there (:class:`Tripwire`).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NoReturn

from sagaguard.idempotency.testing import sigkill

JOURNAL_METHODS = ("start", "claim", "commit")
"""Journal calls a point can name (``claim`` is the recovery sweeper's take-over)."""
STORE_METHODS = ("claim", "complete", "fail")
"""Store calls a point can name (heartbeats are timing-dependent and change no outcome)."""

_SPEC = re.compile(r"(journal|store)\.([a-z_]+)#([1-9][0-9]*):(before|after)")


@dataclass(frozen=True, slots=True)
class KillPoint:
    """Where a child dies: before or after the ``nth`` call (1-based) of ``target.method``; for a
    claim, the claim of the ``nth`` key (see :class:`Tripwire`).

    Only ``target``, ``method``, ``nth`` and ``when`` identify the point (:attr:`spec`); the rest
    describes it for reports and for picking subsets.
    """

    target: str
    """``journal`` or ``store``."""
    method: str
    nth: int
    when: str
    """``before`` or ``after``."""
    label: str = field(default="", compare=False)
    """What is durable when the process dies here, in words."""
    step: str | None = field(default=None, compare=False)
    """The step running (or being compensated) at the point, if any."""
    compensating: bool = field(default=False, compare=False)
    """The point lies inside a compensation."""

    def __post_init__(self) -> None:
        if not _SPEC.fullmatch(self.spec):
            raise ValueError(f"not a kill point: {self.spec!r}")
        methods = JOURNAL_METHODS if self.target == "journal" else STORE_METHODS
        if self.method not in methods:
            raise ValueError(f"{self.target} points name one of {methods}, not {self.method!r}")

    @property
    def spec(self) -> str:
        """The point as text, e.g. ``journal.commit#3:before`` (what ``--kill`` takes)."""
        return f"{self.target}.{self.method}#{self.nth}:{self.when}"

    @property
    def kind(self) -> str:
        """``journal``, ``effect`` (a store point in a forward step) or ``compensation``."""
        if self.target == "journal":
            return "journal"
        return "compensation" if self.compensating else "effect"

    @classmethod
    def parse(cls, spec: str) -> KillPoint:
        """The point :attr:`spec` names.

        Raises:
            ValueError: not of the form ``target.method#n:before|after``.
        """
        found = _SPEC.fullmatch(spec.strip())
        if found is None:
            raise ValueError(f"not a kill point: {spec!r} (e.g. journal.commit#3:before)")
        target, method, nth, when = found.groups()
        return cls(target, method, int(nth), when)

    def __str__(self) -> str:
        return f"{self.spec} ({self.label})" if self.label else self.spec


@dataclass(frozen=True, slots=True)
class Boundary:
    """One journal or store call as a :class:`Tripwire` saw it."""

    target: str
    method: str
    nth: int
    detail: str = ""
    """For a commit: what the phase writes; for a store call: ``scope|name``."""
    won: bool = False
    """For a claim: it created or took over its record (a store claim: the effect runs next)."""


class Tripwire:
    """Counts journal and store calls, records them, and kills the process at one point.

    Shared by a :class:`CrashingJournal` and a :class:`CrashingSagaStore`, so the recorded
    :attr:`events` are in the order the process made the calls. Thread-safe.

    Writes (``commit``, ``complete``, ``fail``) are numbered per call. Claims (``journal.start``,
    ``journal.claim``, ``store.claim``) are numbered per *key* (saga id, effect key), because a
    process polls a claim while another holder's lease runs out, as often as timing makes it:
    ``store.claim#3`` is the third effect claimed, ``before`` fires before its first claim call and
    ``after`` after the first call that won it (created or took it over).

    Args:
        point: where to die; None only records.
        kill: what dying means; the default is a real SIGKILL
            (:func:`sagaguard.idempotency.testing.sigkill`). In-process tests may pass a function that raises
            a ``BaseException``.
    """

    def __init__(self, point: KillPoint | None = None, *, kill: Callable[[str], NoReturn] = sigkill) -> None:
        self.point = point
        self.events: list[Boundary] = []
        self._kill = kill
        self._counts: dict[tuple[str, str], int] = {}
        self._keys: dict[tuple[str, str], dict[str, int]] = {}
        self._won: set[tuple[str, str, int]] = set()
        self._lock = threading.Lock()

    def before(self, target: str, method: str, key: str | None = None) -> int:
        """Count a call about to be made (a claim of ``key``), and die when the point is before
        it. Returns its number."""
        with self._lock:
            if key is None:
                nth = self._counts.get((target, method), 0) + 1
                self._counts[(target, method)] = nth
                first = True
            else:
                keys = self._keys.setdefault((target, method), {})
                first = key not in keys
                nth = keys.setdefault(key, len(keys) + 1)
        if first:
            self._check(target, method, nth, "before")
        return nth

    def after(self, target: str, method: str, nth: int, detail: str = "", *, won: bool | None = None) -> None:
        """Record a call that returned, and die when the point is after it. ``won`` says whether a
        claim created or took over its record (None for writes)."""
        with self._lock:
            self.events.append(Boundary(target, method, nth, detail, bool(won)))
            if won is None:
                due = True
            else:
                due = won and (target, method, nth) not in self._won
                if due:
                    self._won.add((target, method, nth))
        if due:
            self._check(target, method, nth, "after")

    def _check(self, target: str, method: str, nth: int, when: str) -> None:
        point = self.point
        if point is not None and (point.target, point.method, point.nth, point.when) == (
            target,
            method,
            nth,
            when,
        ):
            self._kill(point.spec)
