"""The Redis journal: every primitive is one Lua script over the keys of one saga.

A saga lives in three keys that share the hash tag ``{<saga id>}``, so every script touches one hash
slot and the layout suits Redis Cluster (a ``redis+cluster://`` URL or a ``RedisCluster`` client;
``list`` scans every primary):

- ``<prefix>:{<id>}``: a hash of the saga row (:class:`~sagaguard.saga.records.SagaRecord`'s fields; numbers
  as text that reads back as the exact float, None as an absent field);
- ``<prefix>:{<id>}:steps``: a hash of step rows: field ``<index>`` is the row as JSON (written by
  Python), ``<index>:s`` and ``<index>:u`` its start and update times (stamped by the script);
- ``<prefix>:{<id>}:signals``: a hash of delivered signals, name to payload.

The recovery sweep needs "which sagas are due" without scanning every saga, and a cluster-safe
script cannot update an index in another slot atomically. So ``<prefix>:due`` is a sorted set whose
score is a *lower bound* of each resumable saga's ``lease_until``: every write that may make a saga
due earlier (a start, a signal, a cancellation, a parking) first lowers its score to 0 in the same
pipeline, and writes that only push ``lease_until`` later leave it alone. :meth:`RedisJournal.due`
reads the entries whose score has passed, checks each saga, and repairs the index with
compare-and-set scripts: a saga not due yet gets its real ``lease_until``, an ended one is removed.
The claim, one script on the saga's keys, stays the only authority, so a stale index can delay a
recovery (by at most one lease when a runner with a shorter lease takes over from one with a
longer lease) but never cause a wrong one.

Every write that the saga's progress rests on (a start, a claim or take-over, a commit of a phase
or of a step with its compensation, a reopen, a signal, a cancellation) waits for replicas as the
store's claim does (:mod:`sagaguard.idempotency.backends.redis_replicas`: ``WAIT`` pipelined behind
the script, and behind the due index's lowering when one primary serves both), so a failover cannot
lose what the journal acknowledged. Reads and the due index's repairs do not wait.

Times come from Redis (``TIME`` inside the script) unless a clock is injected. Requires Redis 7.
Saga ids must not contain ``{`` or ``}`` (they would break the hash tag).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Collection, Sequence
from typing import Any, cast

import redis
from redis.commands.core import Script
from redis.exceptions import NoScriptError

from sagaguard.idempotency.backends.redis_client import (
    ERRORS,
    TRANSIENT,
    RedisClient,
    ScriptRunner,
    connect,
    load_scripts,
)
from sagaguard.idempotency.backends.redis_persistence import check_persistence
from sagaguard.idempotency.backends.redis_replicas import ReplicaWait
from sagaguard.idempotency.errors import ConfigurationError, StoreUnavailable
from sagaguard.saga import lease as _lease
from sagaguard.saga.checks import check_saga_id
from sagaguard.saga.errors import JournalError, JournalUnavailable, LostSagaLease, SagaNotFound
from sagaguard.saga.journals.redis_scripts import (
    CANCEL,
    CLAIM,
    COMMIT,
    FIELDS,
    INDEX_CAS,
    LOAD,
    ORPHAN_GRACE,
    REOPEN,
    SIGNAL,
    START,
    TAKE_OVER,
)
from sagaguard.saga.records import (
    FINAL_STATES,
    RESUMABLE_STATES,
    CancelOutcome,
    Phase,
    SagaRecord,
    SagaSnapshot,
    SagaState,
    SignalOutcome,
    StartOutcome,
    StartResult,
    StepKind,
    StepRecord,
    StepState,
)

__all__ = ["RedisJournal"]


def _error(exc: redis.RedisError | redis.exceptions.RedisClusterException) -> JournalError:
    if isinstance(exc, TRANSIENT):
        return JournalUnavailable(f"redis journal unavailable: {exc}")
    return JournalError(f"redis journal failed: {exc}")


def _text(value: Any) -> Any:
    """Decode bytes replies of a client built without ``decode_responses``."""
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, list):
        return [_text(v) for v in value]
    return value


def _saga(saga_id: str, r: Sequence[Any]) -> SagaRecord:
    return SagaRecord(
        saga_id=saga_id,
        name=r[0],
        version=int(r[1]),
        fingerprint=r[2],
        input=r[3],
        state=SagaState(r[4]),
        token=int(r[5]),
        lease_until=float(r[6]),
        created_at=float(r[7]),
        updated_at=float(r[8]),
        error=r[9],
        deadline=float(r[10] or 0),
        recoveries=int(r[11] or 0),
        waiting_for=r[12],
        wait_until=float(r[13] or 0),
        cancel_requested=r[14] == "1",
        holder=r[15] if len(r) > 15 else None,
    )


def _pairs(flat: Sequence[Any]) -> dict[str, str]:
    return {str(flat[i]): str(flat[i + 1]) for i in range(0, len(flat), 2)}


def _steps(flat: Sequence[Any]) -> tuple[StepRecord, ...]:
    fields = _pairs(flat)
    rows = []
    for key, text in fields.items():
        if ":" in key:
            continue
        data = json.loads(text)
        rows.append(
            StepRecord(
                index=int(key),
                name=data["name"],
                kind=StepKind(data["kind"]),
                state=StepState(data["state"]),
                compensation=data["compensation"],
                result=data["result"],
                error=data["error"],
                not_applied=bool(data["not_applied"]),
                compensation_error=data["compensation_error"],
                attempts=int(data["attempts"]),
                compensation_attempts=int(data["compensation_attempts"]),
                started_at=float(fields[f"{key}:s"]),
                updated_at=float(fields[f"{key}:u"]),
                trace=data.get("trace"),
                resolution=data.get("resolution"),
            )
        )
    return tuple(sorted(rows, key=lambda row: row.index))


def _step_json(row: StepRecord) -> str:
    return json.dumps(
        {
            "name": row.name,
            "kind": row.kind.value,
            "state": row.state.value,
            "compensation": row.compensation,
            "result": row.result,
            "error": row.error,
            "not_applied": row.not_applied,
            "compensation_error": row.compensation_error,
            "attempts": row.attempts,
            "compensation_attempts": row.compensation_attempts,
            "trace": row.trace,
            "resolution": row.resolution,
        },
        ensure_ascii=False,
        separators=(",", ":"),
    )


class RedisJournal:
    """A :class:`~sagaguard.saga.journal.SagaJournal` in Redis, shared by any number of processes.

    Args:
        url_or_client: a ``redis://``, ``rediss://`` or ``unix://`` URL, a
            ``redis+cluster://host:port[,host:port...]`` (or ``rediss+cluster://``) URL of a Redis
            Cluster, or a ready ``redis.Redis`` or ``redis.cluster.RedisCluster`` (left open by
            :meth:`close`). From a URL the client fails fast (connect timeout 2 s,
            read timeout 5 s) and never retries on its own: whether to retry a script whose reply
            was lost is the caller's decision.
        clock: seconds since the epoch; inject one to test leases without sleeping. By default every
            script reads Redis's ``TIME``.
        prefix: the first part of every key; the journal owns ``{prefix}:{*}`` and ``{prefix}:due``.
        wait_replicas: replicas that must hold each write the saga's progress rests on (a start,
            a claim, a commit of a phase or a step with its compensation, a reopen, a signal, a
            cancellation) before the journal acknowledges it: ``WAIT`` after the write's script,
            on the same connection, as :class:`~sagaguard.idempotency.stores.redis.RedisStore`'s
            claim. None (the default): 1 on a Redis Cluster, 0 (no wait) on one server. A write
            that fewer replicas acknowledged within ``replica_timeout`` is
            :class:`~sagaguard.saga.errors.JournalUnavailable`: the step it registers does not
            run, and the saga goes on from what the journal holds when it is resumed.
        replica_timeout: seconds ``WAIT`` waits for the replicas.

    Raises:
        ConfigurationError: the URL, the prefix, ``wait_replicas`` or ``replica_timeout`` is
            malformed.
        JournalUnavailable: Redis cannot be reached (the scripts are loaded at once).
    """

    def __init__(
        self,
        url_or_client: str | RedisClient,
        *,
        clock: Callable[[], float] | None = None,
        prefix: str = "sgj",
        wait_replicas: int | None = None,
        replica_timeout: float = 1.0,
    ) -> None:
        replicas = ReplicaWait.of(wait_replicas, replica_timeout)
        try:
            client, self._owned = connect(url_or_client, prefix)
        except ERRORS as exc:  # a cluster's nodes cannot be reached
            raise _error(exc) from exc
        self._client = client
        self._replicas = replicas.on(client)
        self._clock = clock
        self._prefix = prefix
        self._due_key = f"{prefix}:due"
        sources = (START, CLAIM, LOAD, COMMIT, SIGNAL, CANCEL, INDEX_CAS, REOPEN, TAKE_OVER)
        scripts: list[Script] = [client.register_script(s) for s in sources]
        (self._start, self._claim, self._load, self._commit, self._signal, self._cancel, self._cas,
         self._reopen, self._take_over) = scripts  # fmt: skip
        self._scripts = ScriptRunner(client, keep=self._owned)
        try:
            load_scripts(client, scripts)
        except ERRORS as exc:
            if self._owned:
                client.close()
            raise _error(exc) from exc
        check_persistence(client, "saga journal")  # warns when a restart would lose records

    # -- keys and calls -------------------------------------------------------------------------

    def _keys(self, saga_id: str) -> list[str]:
        if "{" in saga_id or "}" in saga_id or not saga_id:
            raise ConfigurationError(f"the redis journal takes saga ids without braces: {saga_id!r}")
        base = f"{self._prefix}:{{{saga_id}}}"
        return [base, f"{base}:steps", f"{base}:signals"]

    def _now_arg(self) -> float | str:
        return "" if self._clock is None else float(self._clock())

    def _run(
        self,
        script: Script,
        keys: list[str],
        args: Sequence[Any],
        *,
        lower: str | None = None,
        durable: bool = False,
    ) -> Any:
        """Run a script, first lowering ``lower``'s due-index score to 0 in the same round trip;
        a ``durable`` write waits for the replicas (:meth:`_replicated`)."""
        try:
            if durable and self._replicas.count:
                return self._replicated(script, keys, args, lower)
            if lower is None:
                return _text(self._scripts(script, keys, args))
            for _ in range(2):
                # EVALSHA in a plain pipeline: redis-py's script-in-pipeline would add a round trip.
                pipe = self._client.pipeline(transaction=False)
                pipe.zadd(self._due_key, {lower: 0}, lt=True)
                pipe.evalsha(script.sha, len(keys), *keys, *args)
                try:
                    return _text(pipe.execute()[1])
                except NoScriptError:  # Redis restarted or flushed its scripts: NOSCRIPT did not run
                    self._client.script_load(script.script)
            raise JournalError("redis keeps refusing the journal's scripts (NOSCRIPT)")
        except ERRORS as exc:
            raise _error(exc) from exc

    def _replicated(self, script: Script, keys: list[str], args: Sequence[Any], lower: str | None) -> Any:
        """The script's reply once :attr:`_replicas` acknowledged it (and the index's lowering).

        Raises:
            JournalUnavailable: fewer replicas acknowledged it in time (the write may stand on the
                primary, or be lost with it), or the server kept refusing or redirecting it.
            redis.RedisError: as the client raises them.
        """
        first = None if lower is None else (self._due_key, ("ZADD", self._due_key, "LT", 0, lower))
        try:
            reply, acked = self._replicas.run(self._client, script, keys, args, first=first)
        except StoreUnavailable as exc:
            raise JournalUnavailable(f"redis journal unavailable: {exc}") from exc
        wanted = self._replicas.count or 0
        if acked < wanted:
            raise JournalUnavailable(
                f"redis: {acked} of {wanted} replicas acknowledged the journal's write to {keys[0]!r} "
                f"within {self._replicas.timeout:g} s; a failover could lose it, so it is not "
                "acknowledged (what it registers does not run)"
            )
        return _text(reply)

    def _snapshot(self, saga_id: str, reply: Sequence[Any]) -> SagaSnapshot:
        return SagaSnapshot(_saga(saga_id, reply[1]), _steps(reply[2]), _pairs(reply[3]))

    # -- the contract ---------------------------------------------------------------------------

    def now(self) -> float:
        """See :meth:`SagaJournal.now`: the injected clock, or Redis's ``TIME``."""
        if self._clock is not None:
            return float(self._clock())
        try:
            seconds, micros = self._client.time()
        except ERRORS as exc:
            raise _error(exc) from exc
        return int(seconds) + int(micros) / 1_000_000

    def start(
        self,
        saga_id: str,
        *,
        name: str,
        version: int,
        input: str,
        fingerprint: str,
        lease: float,
        timeout: float = 0.0,
        first: StepRecord | None = None,
        holder: str | None = None,
    ) -> StartResult:
        """See :meth:`SagaJournal.start`: one script (after lowering the saga's index entry); a live
        saga found held by a dead holder is then taken over (:mod:`sagaguard.saga.lease`)."""
        check_saga_id(saga_id)
        args: tuple[Any, ...] = (
            self._now_arg(), name, str(version), fingerprint, input, float(lease), float(timeout),
            _lease.current(holder),
        )  # fmt: skip
        if first is not None:
            args += (str(first.index), _step_json(first))
        reply = self._run(self._start, self._keys(saga_id), args, lower=saga_id, durable=True)
        result = StartResult(StartOutcome(reply[0]), self._snapshot(saga_id, reply))
        return _lease.after_start(
            self, result, name=name, version=version, fingerprint=fingerprint, lease=lease, holder=holder
        )

    def claim(self, saga_id: str, *, lease: float, holder: str | None = None) -> SagaSnapshot | None:
        """See :meth:`SagaJournal.claim`: one script; when the saga is not due, a read and (its
        holder dead) :meth:`take_over`."""
        check_saga_id(saga_id)
        args = (self._now_arg(), float(lease), _lease.current(holder))
        reply = self._run(self._claim, self._keys(saga_id), args, durable=True)
        if reply[0] != "not_due":
            return self._snapshot(saga_id, reply)
        return _lease.after_claim(self, saga_id, lease=lease, holder=holder)

    def take_over(
        self, saga_id: str, token: int, *, lease: float, holder: str | None = None
    ) -> SagaSnapshot | None:
        """See :meth:`SagaJournal.take_over`: one script fenced on the token."""
        check_saga_id(saga_id)
        args = (self._now_arg(), str(token), float(lease), _lease.current(holder))
        reply = self._run(self._take_over, self._keys(saga_id), args, durable=True)
        return None if reply[0] == "no" else self._snapshot(saga_id, reply)

    def load(self, saga_id: str) -> SagaSnapshot | None:
        """See :meth:`SagaJournal.load`: one read-only script, a consistent view of the saga."""
        check_saga_id(saga_id)
        reply = self._run(self._load, self._keys(saga_id), (self._now_arg(),))
        return None if reply[0] == "unknown" else self._snapshot(saga_id, reply)

    def commit(self, saga_id: str, token: int, phase: Phase) -> SagaRecord:
        """See :meth:`SagaJournal.commit`: one fenced script; an ended saga leaves the due index."""
        check_saga_id(saga_id)
        args: list[Any] = [
            self._now_arg(),
            str(token),
            float(phase.lease),
            "" if phase.state is None else phase.state.value,
            "1" if phase.error is not None else "0",
            phase.error or "",
            phase.waiting_for or "",
            float(phase.wait_until),
            float(phase.wake_at),
            "1" if phase.wake_on_cancel else "0",
            "1" if phase.unless_cancelled else "0",
        ]
        for row in phase.steps:
            args += [str(row.index), _step_json(row)]
        parking = phase.state is SagaState.WAITING
        lower = saga_id if parking else None
        reply = self._run(self._commit, self._keys(saga_id), args, lower=lower, durable=True)
        if reply[0] == "lost":
            _, state, current = reply
            if state is None:
                raise LostSagaLease(saga_id, token, "saga is unknown")
            if int(current) != token:
                raise LostSagaLease(saga_id, token, f"token is now {int(current)}")
            raise LostSagaLease(saga_id, token, f"saga is already {state}")
        record = _saga(saga_id, reply[1])
        if record.state not in RESUMABLE_STATES:
            self._unindex(saga_id)
        return record

    def reopen(
        self, saga_id: str, token: int, state: SagaState, steps: Sequence[StepRecord], error: str | None
    ) -> SagaRecord | None:
        """See :meth:`SagaJournal.reopen`: one fenced script, after putting the saga in the due index."""
        check_saga_id(saga_id)
        args: list[Any] = [
            self._now_arg(), str(token), SagaState(state).value,
            "1" if error is not None else "0", error or "",
        ]  # fmt: skip
        for row in steps:
            args += [str(row.index), _step_json(row)]
        reply = self._run(self._reopen, self._keys(saga_id), args, lower=saga_id, durable=True)
        if reply[0] != "ok":
            return None
        return _saga(saga_id, reply[1])

    def _unindex(self, saga_id: str) -> None:
        # Best effort: an ended saga never becomes resumable again; a sweep removes it otherwise.
        with contextlib.suppress(*ERRORS):
            self._client.zrem(self._due_key, saga_id)

    def signal(self, saga_id: str, name: str, payload: str) -> SignalOutcome:
        """See :meth:`SagaJournal.signal`: one script (after lowering the saga's index entry)."""
        check_saga_id(saga_id)
        keys = self._keys(saga_id)
        args = (self._now_arg(), name, payload)
        reply = self._run(self._signal, [keys[0], keys[2]], args, lower=saga_id, durable=True)
        if reply == "unknown":
            raise SagaNotFound(saga_id)
        return SignalOutcome(reply)

    def cancel(self, saga_id: str, cause: str) -> CancelOutcome:
        """See :meth:`SagaJournal.cancel`: one script, which reads the saga and its steps
        (:func:`~sagaguard.saga.decisions.cancel_outcome`), after lowering the saga's index entry."""
        check_saga_id(saga_id)
        keys = self._keys(saga_id)
        reply = self._run(self._cancel, keys[:2], (self._now_arg(), cause), lower=saga_id, durable=True)
        if reply == "unknown":
            raise SagaNotFound(saga_id)
        return CancelOutcome(reply)

    def due(self, *, limit: int = 100) -> list[SagaRecord]:
        """See :meth:`SagaJournal.due`: reads the due index, checks each saga, repairs the index."""
        if limit <= 0:
            return []
        now = self.now()
        found: list[SagaRecord] = []
        offset, page = 0, max(limit, 100)
        try:
            while len(found) < limit:
                entries = cast(
                    "list[tuple[Any, float]]",
                    self._client.zrangebyscore(
                        self._due_key, "-inf", now, start=offset, num=page, withscores=True
                    ),
                )
                if not entries:
                    break
                kept = 0
                for member, score in entries:
                    saga_id = _text(member)
                    record = self._check(saga_id, float(score), now)
                    if record is not None:
                        found.append(record)
                        kept += 1
                offset += kept
                if len(entries) < page:
                    break
            found.sort(key=lambda r: (r.lease_until, r.saga_id))
            if len(found) < limit:
                found += self._dead_held(now)
        except ERRORS as exc:
            raise _error(exc) from exc
        return found[:limit]

    def _dead_held(self, now: float) -> list[SagaRecord]:
        """The live sagas whose live lease a dead holder on this host holds: every index entry not
        due yet is read (in pages, pipelined), those held here are probed."""
        host = _lease.host_prefix()
        if host is None:
            return []
        held: list[SagaRecord] = []
        offset, page = 0, 500
        while True:
            entries = self._client.zrangebyscore(self._due_key, f"({now!r}", "+inf", start=offset, num=page)
            ids = [i for i in (_text(m) for m in entries) if "{" not in i and "}" not in i]
            pipe = self._client.pipeline(transaction=False)
            for saga_id in ids:
                pipe.hmget(self._keys(saga_id)[0], FIELDS)
            for saga_id, reply in zip(ids, pipe.execute() if ids else [], strict=True):
                values = _text(reply)
                holder = values[15]
                if values[4] is not None and holder is not None and holder.startswith(host):
                    held.append(_saga(saga_id, values))
            if len(entries) < page:
                return _lease.dead_held(held)
            offset += page

    def _check(self, saga_id: str, score: float, now: float) -> SagaRecord | None:
        """The saga if it is due; else repair its index entry (compare-and-set on the score)."""
        if "{" in saga_id or "}" in saga_id:
            self._cas(keys=[self._due_key], args=[saga_id, score, ""])
            return None
        values = _text(self._client.hmget(self._keys(saga_id)[0], FIELDS))
        if values[4] is None:
            # No saga (yet): a start lowers the entry just before creating it. Look again later.
            new = "" if score > 0 else now + ORPHAN_GRACE
            self._cas(keys=[self._due_key], args=[saga_id, score, new])
            return None
        record = _saga(saga_id, values)
        if record.state in FINAL_STATES or record.state not in RESUMABLE_STATES:
            self._cas(keys=[self._due_key], args=[saga_id, score, ""])
            return None
        if record.lease_until > now:
            self._cas(keys=[self._due_key], args=[saga_id, score, record.lease_until])
            return None
        return record

    def list(
        self,
        *,
        states: Collection[SagaState] | None = None,
        limit: int = 100,
        after: str | None = None,
    ) -> list[SagaRecord]:
        """See :meth:`SagaJournal.list`.

        Redis has no ordered index of ids, so listing scans the prefix's keys and sorts them: O(n)
        in the number of sagas, for operators and tools, never the hot path.
        """
        if limit <= 0:
            return []
        wanted = None if states is None else {SagaState(s) for s in states}
        head = f"{self._prefix}:{{"
        match = head.replace("\\", "\\\\").replace("*", "\\*").replace("?", "\\?").replace("[", "\\[")
        found: list[SagaRecord] = []
        try:
            ids = sorted(
                name[len(head) : -1]
                for name in map(_text, self._client.scan_iter(match=match + "*}", count=1000, _type="hash"))
                if name.endswith("}") and (after is None or name[len(head) : -1] > after)
            )
            for start in range(0, len(ids), 500):
                chunk = ids[start : start + 500]
                pipe = self._client.pipeline(transaction=False)
                for saga_id in chunk:
                    pipe.hmget(self._keys(saga_id)[0], FIELDS)
                for saga_id, raw in zip(chunk, pipe.execute(), strict=True):
                    values = _text(raw)
                    if values[4] is None:
                        continue
                    record = _saga(saga_id, values)
                    if wanted is None or record.state in wanted:
                        found.append(record)
                        if len(found) == limit:
                            return found
        except ERRORS as exc:
            raise _error(exc) from exc
        return found

    def close(self) -> None:
        """Give back the connections the journal's threads kept, and close the client if the
        journal built it from a URL."""
        self._scripts.close()
        if self._owned:
            self._client.close()

    def __repr__(self) -> str:
        return f"RedisJournal(prefix={self._prefix!r})"
