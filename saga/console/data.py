"""What the console reads: counts, filtered pages of effects and sagas, one saga with its effects.

Everything here reads; nothing writes. Listing is keyset-paged (``after`` the last id shown) over
the store's and the journal's own ``list``, and a count stops at :data:`COUNT_CAP` so a huge ledger
costs a bounded read: the home page then says "1000+".
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from sagaguard.idempotency.audit import AuditEntry, AuditFilter, AuditLog
from sagaguard.idempotency.guard import Guard
from sagaguard.idempotency.keys import derive_explicit_key
from sagaguard.idempotency.operator import holder_gone
from sagaguard.idempotency.records import Record, State
from sagaguard.idempotency.store import IdempotencyStore
from sagaguard.saga.agent.call import ToolCall
from sagaguard.saga.agent.definition import tool_outcomes
from sagaguard.saga.decisions import CallOutcome
from sagaguard.saga.journal import SagaJournal
from sagaguard.saga.records import FOREVER, SagaRecord, SagaSnapshot, SagaState, StepRecord, StepState
from sagaguard.saga.timeline import Event, timeline

__all__ = [
    "COUNT_CAP",
    "EFFECT_LISTS",
    "PAGE",
    "SAGA_LISTS",
    "Count",
    "Page",
    "SagaView",
    "effect_page",
    "effect_counts",
    "saga_counts",
    "saga_page",
    "saga_view",
]

COUNT_CAP = 1000
"""A count stops here (shown as ``1000+``)."""
PAGE = 50
"""Items per page."""
_SCAN = 500
_SCAN_CAP = 20_000
"""Rows read at most to fill one filtered page."""

EFFECT_LISTS: dict[str, tuple[State, ...]] = {
    "in_doubt": (State.IN_DOUBT,),
    "in_progress": (State.IN_PROGRESS,),
    "failed": (State.FAILED,),
}
"""The effect lists an operator works through; succeeded records are not listed (millions)."""

SAGA_LISTS: dict[str, tuple[SagaState, ...]] = {
    "needs_attention": (SagaState.NEEDS_ATTENTION,),
    "compensating": (SagaState.COMPENSATING,),
    "running_past_lease": (SagaState.RUNNING,),
    "waiting": (SagaState.WAITING,),
    "running": (SagaState.RUNNING,),
    "failed": (SagaState.FAILED,),
    "compensated": (SagaState.COMPENSATED,),
    "completed": (SagaState.COMPLETED,),
}
"""The saga lists; ``running_past_lease`` keeps the RUNNING sagas whose runner's lease ran out."""

T = TypeVar("T")


@dataclass(frozen=True)
class Count:
    """How many items a list holds (up to :data:`COUNT_CAP`) and its oldest one."""

    name: str
    count: int
    capped: bool
    oldest_id: str | None = None
    oldest_at: float | None = None

    @property
    def shown(self) -> str:
        return f"{self.count}+" if self.capped else str(self.count)


@dataclass(frozen=True)
class Page(Generic[T]):
    """One page of a filtered list, and the id to continue after (None on the last page)."""

    items: list[T]
    next_after: str | None


def _effects(store: IdempotencyStore, states: Sequence[State], after: str | None) -> Iterator[Record]:
    scanned = 0
    while scanned < _SCAN_CAP:
        page = store.list(states=states, limit=_SCAN, after=after)
        yield from page
        scanned += len(page)
        if len(page) < _SCAN:
            return
        after = page[-1].key


def _sagas(journal: SagaJournal, states: Sequence[SagaState], after: str | None) -> Iterator[SagaRecord]:
    scanned = 0
    while scanned < _SCAN_CAP:
        page = journal.list(states=states, limit=_SCAN, after=after)
        yield from page
        scanned += len(page)
        if len(page) < _SCAN:
            return
        after = page[-1].saga_id


@dataclass(frozen=True)
class Age:
    """A time range by age: items created at least ``older`` and at most ``newer`` seconds ago
    (None: no bound), against ``now``."""

    now: float
    older: float | None = None
    newer: float | None = None

    def holds(self, created_at: float) -> bool:
        age = self.now - created_at
        return (self.older is None or age >= self.older) and (self.newer is None or age <= self.newer)


def effect_matches(record: Record, prefix: str, age: Age | None = None) -> bool:
    """Whether the effect's name, scope or key starts with ``prefix`` and its age is in ``age``."""
    if age is not None and not age.holds(record.created_at):
        return False
    return not prefix or any(part.startswith(prefix) for part in (record.name, record.scope, record.key))


def saga_matches(
    record: SagaRecord, prefix: str, name: str, view: str, now: float, *, age: Age | None = None
) -> bool:
    """Whether the saga is in the list ``view``, its id starts with ``prefix``, its name with
    ``name``, and its age is in ``age``."""
    if age is not None and not age.holds(record.created_at):
        return False
    if view == "running_past_lease" and not (record.lease_until < FOREVER and record.lease_until <= now):
        return False
    return record.saga_id.startswith(prefix) and record.name.startswith(name)


def _page(
    found: Iterator[T], keep: Callable[[T], bool], key: Callable[[T], str], size: int,
    stop: Callable[[T], bool] = lambda _: False,
) -> Page[T]:  # fmt: skip
    items: list[T] = []
    for item in found:
        if stop(item):
            break
        if keep(item):
            items.append(item)
            if len(items) > size:
                return Page(items[:size], key(items[size - 1]))
    return Page(items, None)


def effect_page(
    store: IdempotencyStore, view: str, *, prefix: str = "", after: str | None = None, size: int = PAGE,
    older: float | None = None, newer: float | None = None, dead_holder: bool = False,
) -> Page[Record]:  # fmt: skip
    """One page of the effect list ``view`` (:data:`EFFECT_LISTS`), in key order, filtered by a
    prefix of the name, scope or key, by age (seconds since it was created) and, with
    ``dead_holder``, to the records held under a live lease by a process provably dead on this
    host (:func:`~sagaguard.idempotency.operator.holder_gone`: an operator settles those without
    forcing, a claimant on this host takes them over at once)."""
    now = store.now()
    age = Age(now, older, newer)
    found = _effects(store, EFFECT_LISTS[view], after)

    def keep(record: Record) -> bool:
        return effect_matches(record, prefix, age) and (not dead_holder or holder_gone(record, now))

    return _page(found, keep, lambda r: r.key, size)


def _past(saga_id: str, prefix: str) -> bool:
    """Whether ``saga_id`` sorts after every id that starts with ``prefix``."""
    return bool(prefix) and saga_id > prefix and not saga_id.startswith(prefix)


def saga_page(
    journal: SagaJournal, view: str, *, prefix: str = "", name: str = "", after: str | None = None,
    size: int = PAGE, older: float | None = None, newer: float | None = None,
) -> Page[SagaRecord]:  # fmt: skip
    """One page of the saga list ``view`` (:data:`SAGA_LISTS`), in id order, filtered by a prefix of
    the id and of the name and by age (seconds since it was created)."""
    now = journal.now()
    age = Age(now, older, newer)
    # Ids that start with the prefix sort after any shorter prefix of it, and end the range once
    # one sorts past it without starting with it: scan only that range.
    start = after if after is not None else (prefix[:-1] or None)
    return _page(
        _sagas(journal, SAGA_LISTS[view], start), lambda r: saga_matches(r, prefix, name, view, now, age=age),
        lambda r: r.saga_id, size, stop=lambda r: _past(r.saga_id, prefix),
    )  # fmt: skip


def _count(name: str, items: Iterator[T], at: Callable[[T], float], ident: Callable[[T], str]) -> Count:
    count, oldest = 0, None
    for item in items:
        count += 1
        if oldest is None or at(item) < at(oldest):
            oldest = item
        if count >= COUNT_CAP:
            break
    if oldest is None:
        return Count(name, 0, False)
    return Count(name, count, count >= COUNT_CAP, ident(oldest), at(oldest))


def effect_counts(store: IdempotencyStore) -> list[Count]:
    """The count and oldest record of each effect list."""
    return [
        _count(view, _effects(store, states, None), lambda r: r.created_at, lambda r: r.key)
        for view, states in EFFECT_LISTS.items()
    ]


def saga_counts(journal: SagaJournal) -> list[Count]:
    """The count and oldest saga of each saga list an operator works through."""
    now = journal.now()
    found = []
    for view in ("needs_attention", "compensating", "running_past_lease", "waiting", "running"):
        items = (r for r in _sagas(journal, SAGA_LISTS[view], None) if saga_matches(r, "", "", view, now))
        found.append(_count(view, items, lambda r: r.created_at, lambda r: r.saga_id))
    return found


@dataclass(frozen=True)
class StepView:
    """A step or tool call as the saga page shows it."""

    index: int
    name: str
    kind: str
    state: str
    tool: str | None
    call_outcome: str | None
    effects: list[Record] = field(default_factory=list)
    arguments: str | None = None
    result: str | None = None
    trace_id: str | None = None


@dataclass(frozen=True)
class SagaView:
    """One saga with its steps, their effect records, its timeline and its audit entries."""

    snapshot: SagaSnapshot
    steps: list[StepView]
    events: list[Event]
    audit: list[AuditEntry]
    now: float


def _call_outcome(row: StepRecord, outcome: CallOutcome | None) -> str | None:
    """A tool call's outcome as ``sagas show`` says it: ``undone`` once its undo ran."""
    if outcome is None:
        return None
    return CallOutcome.UNDONE.value if row.state is StepState.COMPENSATED else outcome.value


def _trace_id(trace: str | None) -> str | None:
    parts = (trace or "").split("-")
    return parts[1] if len(parts) == 4 else None


def saga_view(
    journal: SagaJournal, store: IdempotencyStore | None, audit: AuditLog | None, saga_id: str,
    *, namespace: str = "default",
) -> SagaView | None:  # fmt: skip
    """The saga ``saga_id`` for its page, or None when there is none.

    A tool call's effect record is found by its explicit key; a declared step's (and any
    compensation's) records in doubt, in progress or failed by their scope (``saga_id/step``).
    Succeeded records of declared steps are not looked up (the ledger has no index by scope).
    """
    snapshot = journal.load(saga_id)
    if snapshot is None:
        return None
    outcomes: dict[int, CallOutcome] = {}
    by_scope: dict[str, list[Record]] = {}
    if store is not None:
        outcomes = tool_outcomes(Guard(store, namespace=namespace), snapshot)
        for record in _effects(store, (State.IN_DOUBT, State.IN_PROGRESS, State.FAILED), None):
            if record.scope.startswith(saga_id + "/"):
                step = record.scope[len(saga_id) + 1 :].split("/", 1)[0]
                by_scope.setdefault(step, []).append(record)
    steps = []
    for row in snapshot.steps:
        call = ToolCall.of_row(row)
        effects = list(by_scope.get(row.name, []))
        if call is not None and store is not None:
            call_record = store.get(derive_explicit_key(namespace, call.key, call.effect))
            if call_record is not None and call_record not in effects:
                effects.insert(0, call_record)
        steps.append(
            StepView(
                index=row.index,
                name=row.name,
                kind=row.kind.value,
                state=row.state.value,
                tool=None if call is None else call.tool,
                call_outcome=_call_outcome(row, outcomes.get(row.index)),
                effects=effects,
                arguments=row.compensation,
                result=row.result,
                trace_id=_trace_id(row.trace),
            )
        )
    entries = [] if audit is None else list(reversed(audit.list(AuditFilter(target=saga_id), limit=200)))
    return SagaView(snapshot, steps, timeline(snapshot, outcomes, entries), entries, journal.now())
