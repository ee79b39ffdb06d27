"""The Redis store: every primitive is one Lua script, one round trip, one key.

Each record is a hash named ``<prefix>:{<key>}``. Every script touches that one key, and the braces
make it a hash tag, so the layout and the scripts suit Redis Cluster: on a ``redis+cluster://`` URL
or a ``RedisCluster`` client each script runs on the primary of its record's slot, and what scans
(``list``, ``purge``) visits every primary. The fields mirror
:class:`~sagaguard.idempotency.records.Record` except ``key`` (the hash's name): the state as its value,
numbers as text that reads back as the exact float, None as an absent field.

Retention is Redis's own: completing a record (or failing it permanently) sets ``expires_at`` on
the store's clock *and* a TTL a little longer, so Redis evicts finished records itself. IN_PROGRESS
and IN_DOUBT records never carry a TTL. ``claim`` treats a finished record past ``expires_at`` as
absent, and ``purge`` deletes it, whether or not Redis has evicted it yet.

Times come from Redis (``TIME`` inside the script) unless a clock is injected, so workers with
skewed clocks agree on lease expiry. Requires Redis 7 (scripts replicated by their effects, so a
script may read ``TIME`` and then write). The scripts are in :mod:`sagaguard.idempotency.stores.redis_scripts`
and run through redis-py's ``register_script`` (``EVALSHA``, loaded again on ``NOSCRIPT``); the
client and its pool are :mod:`sagaguard.idempotency.backends.redis_client`'s.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any

from redis.commands.core import Script

from sagaguard.idempotency import holder as _holder
from sagaguard.idempotency.backends.redis_client import (
    ERRORS,
    MAX_CONNECTIONS,
    RedisClient,
    ScriptRunner,
    connect,
    load_scripts,
    store_error,
)
from sagaguard.idempotency.backends.redis_persistence import check_persistence
from sagaguard.idempotency.backends.redis_replicas import ReplicaWait
from sagaguard.idempotency.checks import storable_text
from sagaguard.idempotency.errors import (
    CodecError,
    ConfigurationError,
    LostOwnership,
    StoreError,
    StoreUnavailable,
)
from sagaguard.idempotency.keys import LEGACY_LEDGER, EffectIdentity, check_ledger_id, new_ledger_id
from sagaguard.idempotency.records import ClaimOutcome, ClaimResult, Disposition, Record, State
from sagaguard.idempotency.store import first_token
from sagaguard.idempotency.stores.redis_scripts import (
    CLAIM,
    COMPLETE,
    FAIL,
    FIELDS,
    HEARTBEAT,
    PURGE,
    TAKE_OVER,
)

__all__ = ["RedisStore", "connect"]

_TTL_GRACE = 60.0
"""Seconds Redis keeps a finished record past its retention, so that ``claim`` and ``purge``, which
read ``expires_at`` on the store's clock, decide first even if that clock runs a little behind."""


def _field(value: Any) -> Any:
    """An optional field of a reply: absent is None (``HMGET``) or False (a script's JSON)."""
    return None if value is None or value is False else value


def _number(value: Any) -> float | None:
    return None if value is None or value is False else float(value)


def _record(key: str, reply: Sequence[Any]) -> Record:
    """Build a record from a marker followed by the fields in :data:`FIELDS` order."""
    _, ns, sc, nm, od, fp, st, tk, lu, at, ca, ua, ea, rs, er, hd, rt = reply
    return Record(
        key=key,
        namespace=ns,
        scope=sc,
        name=nm,
        ordinal=int(od),
        fingerprint=fp,
        state=State(st),
        token=int(tk),
        lease_until=float(lu),
        attempts=int(at),
        created_at=float(ca),
        updated_at=float(ua),
        expires_at=_number(ea),
        result=_field(rs),
        error=_field(er),
        holder=_field(hd),
        result_type=_field(rt),
    )


def _ttl_ms(retention: float) -> int | str:
    """Milliseconds of TTL for a finished record, or '' (none) when the retention is unbounded.

    Relative to Redis's own clock rather than an absolute ``PEXPIREAT expires_at``: an injected
    clock (tests, simulations) need not agree with Redis's and must not make Redis evict a record
    at once. With Redis's clock the two are the same instant.
    """
    if not math.isfinite(retention):
        return ""
    return math.ceil((max(retention, 0.0) + _TTL_GRACE) * 1000)


def _lost(key: str, token: int, reply: Sequence[Any]) -> LostOwnership:
    """The refusal of a fenced write, from a script's ``lost`` reply."""
    _, state, current = reply
    if state is False:
        return LostOwnership(key, token, "record is gone")
    if int(current) != token:
        return LostOwnership(key, token, f"token is now {int(current)}")
    return LostOwnership(key, token, f"record is already {state}")


class RedisStore:
    """An effect ledger in Redis, shared by any number of processes and machines.

    Args:
        url_or_client: a ``redis://``, ``rediss://`` or ``unix://`` URL, a
            ``redis+cluster://host:port[,host:port...]`` (or ``rediss+cluster://``) URL of a Redis
            Cluster, or a ready ``redis.Redis`` (one server or a Sentinel master) or
            ``redis.cluster.RedisCluster``. From a URL the store builds a client that fails fast
            (connect timeout 2 s, read timeout 5 s), never retries on its own (a script whose
            reply was lost may have run, so whether to try again is the guard's decision, not the
            driver's), and has a blocking pool of ``max_connections`` (per node on a cluster). A
            client you pass is used with its own settings and left open by :meth:`close`.
        clock: seconds since the epoch; inject one to test leases without sleeping. By default
            every script reads Redis's ``TIME``.
        prefix: the first part of every key, so several ledgers can share one database. The store
            owns every key matching ``{prefix}:{*}``.
        max_connections: connections of the pool of a client built from a URL: one per call in
            flight, up to half of them kept by the threads that used them last; past them a call
            waits up to the read timeout for one (see :mod:`sagaguard.idempotency.backends.redis_client`).
        wait_replicas: replicas that must hold a claim before ``claim`` (and ``take_over``) hand
            it to the guard, so that a failover cannot lose a claim whose effect runs: ``WAIT``
            after the claim's script, on the same connection. None (the default): 1 on a Redis
            Cluster, 0 (no wait) on one server. A claim that fewer replicas acknowledged within
            ``replica_timeout`` is :class:`~sagaguard.idempotency.errors.StoreUnavailable` and its
            effect does not run (see :mod:`sagaguard.idempotency.backends.redis_replicas`).
        replica_timeout: seconds ``WAIT`` waits for the replicas.
        ledger_id: the ledger id to derive provider keys with, in place of the one kept at
            ``{prefix}:{ledger}`` (see :meth:`ledger_id`): for a copy of a ledger that must not
            send its original's keys, or a restored one that must keep them (docs/concepts.md).

    Raises:
        ConfigurationError: the URL, the prefix, ``max_connections``, ``wait_replicas`` or
            ``replica_timeout`` is malformed.
        StoreUnavailable: Redis cannot be reached (the scripts are loaded at once, which checks it).
        StoreError: Redis refused to load the scripts.
    """

    offload_async = False
    """Whether the guard runs this store's calls in a worker thread for async effects: no, a call
    is one round trip to Redis, which costs the event loop less than the hop to a thread and back
    (``bench/guard.py`` measures both: its ``redis.async`` series)."""

    def __init__(
        self,
        url_or_client: str | RedisClient,
        *,
        clock: Callable[[], float] | None = None,
        prefix: str = "sg",
        max_connections: int = MAX_CONNECTIONS,
        wait_replicas: int | None = None,
        replica_timeout: float = 1.0,
        ledger_id: str | None = None,
    ) -> None:
        self._ledger = None if ledger_id is None else check_ledger_id(ledger_id)
        replicas = ReplicaWait.of(wait_replicas, replica_timeout)
        try:
            client, self._owned = connect(url_or_client, prefix, max_connections=max_connections)
        except ERRORS as exc:  # a cluster's nodes cannot be reached
            raise store_error(exc) from exc
        self._client = client
        self._replicas = replicas.on(client)
        self._decoded = bool(client.get_encoder().decode_responses)
        self._clock = clock
        self._kp = prefix + ":{"
        self._match = re.sub(r"([*?\[\]\\])", r"\\\1", prefix) + ":{*}"
        scripts = [client.register_script(s) for s in (CLAIM, COMPLETE, FAIL, HEARTBEAT, PURGE, TAKE_OVER)]
        self._claim, self._complete, self._fail, self._heartbeat, self._purge, self._take_over = scripts
        self._scripts = ScriptRunner(client, keep=self._owned)
        try:
            load_scripts(client, scripts)  # checks that Redis is there
        except ERRORS as exc:
            if self._owned:
                client.close()
            raise store_error(exc) from exc
        check_persistence(client, "effect store")  # warns when a restart would lose records
        if self._ledger is None:
            try:
                self.ledger_id()  # read once at open
            except BaseException:
                if self._owned:
                    client.close()
                raise

    def ledger_id(self) -> str:
        """This ledger's id (see :meth:`IdempotencyStore.ledger_id
        <sagaguard.idempotency.store.IdempotencyStore.ledger_id>`): the one given, else the one kept
        at ``{prefix}:{ledger}``, read once at open. A prefix that has none gets one there with
        ``SET NX`` (then read back, so concurrent first opens agree): a fresh id, or the empty id
        when the prefix already holds records (kept by a version before ledger ids). A string key,
        its own slot on a cluster (one key per command), skipped by the record scans (hashes only).

        Raises:
            StoreUnavailable: Redis cannot be reached.
            StoreError: Redis failed, or the kept id is malformed (written by hand).
        """
        if self._ledger is None:
            name = self._kp + "ledger}"
            try:
                kept = self._client.get(name)
                if kept is None:
                    held = next(self._scan(), None) is not None
                    self._client.set(name, LEGACY_LEDGER if held else new_ledger_id(), nx=True)
                    kept = self._client.get(name)
                if kept is None:  # deleted between the two commands: another open will settle it
                    raise StoreError(f"redis lost the ledger id at {name} as it was written")
                text = kept if isinstance(kept, str) else bytes(kept).decode()
            except ERRORS as exc:
                raise store_error(exc) from exc
            except (TypeError, UnicodeDecodeError) as exc:
                raise StoreError(f"redis holds a malformed ledger id at {name}: {exc}") from exc
            try:
                self._ledger = check_ledger_id(text)
            except ConfigurationError as exc:
                raise StoreError(f"redis holds a malformed ledger id at {name}: {exc}") from exc
        return self._ledger

    def _name(self, key: str) -> str:
        return self._kp + key + "}"

    def _now_arg(self) -> float | str:
        # Empty tells the script to read Redis's TIME.
        return "" if self._clock is None else float(self._clock())

    def _run(
        self, script: Script, key: str, *args: str | float | int, replicated: bool = False
    ) -> list[Any]:
        """Run a script on one key and decode its JSON reply; one round trip (two with
        ``replicated`` and replicas to wait for: the script and ``WAIT``, pipelined).

        Raises:
            CodecError: a text has no UTF-8 form (a lone surrogate).
        """
        try:
            if replicated and self._replicas.count:
                text, acked = self._replicas.run(self._client, script, [self._name(key)], args)
                if acked < self._replicas.count:
                    self._unreplicated(key, text, acked)
            else:
                text = self._scripts(script, (self._name(key),), args)
        except UnicodeEncodeError as exc:  # redis-py encodes each argument as UTF-8
            raise CodecError(f"text cannot be stored in redis: {exc.reason}") from exc
        except ERRORS as exc:
            raise store_error(exc) from exc
        try:
            reply: list[Any] = json.loads(text)
        except ValueError as exc:  # not UTF-8 or not JSON: the hash was written by someone else
            raise StoreError(f"redis holds a malformed record: {exc}") from exc
        return reply

    def _unreplicated(self, key: str, text: Any, acked: int) -> None:
        """Refuse a claim too few replicas acknowledged. A fresh claim (nothing ran under it) is
        deleted again, best effort, so the next attempt claims afresh; a taken-over record stays in
        doubt under its new token until its lease runs out, as a record whose worker died does.

        Raises:
            StoreUnavailable: always.
        """
        with contextlib.suppress(ValueError, TypeError, IndexError, *ERRORS):
            reply = json.loads(text)
            if reply[0] == "claimed":
                self._scripts(
                    self._fail, (self._name(key),),
                    (self._now_arg(), str(reply[7]), Disposition.RETRYABLE.value, "", 0.0, ""),
                )  # fmt: skip
        raise StoreUnavailable(
            f"redis: {acked} of {self._replicas.count} replicas acknowledged the claim of {key!r} "
            f"within {self._replicas.timeout:g} s; the effect does not run (a failover could lose it)"
        )

    def now(self) -> float:
        """The store's clock: the injected one, or Redis's ``TIME`` (one round trip)."""
        if self._clock is not None:
            return self._clock()
        try:
            seconds, micros = self._client.time()
        except ERRORS as exc:
            raise store_error(exc) from exc
        return int(seconds) + int(micros) / 1000000

    def claim(self, identity: EffectIdentity, fingerprint: str, lease: float) -> ClaimResult:
        """See :meth:`IdempotencyStore.claim`: one script, one round trip.

        The script reads the whole hash, decides and writes in one atomic step, and answers with the
        outcome and the record as it stands, whatever the outcome. A new record starts at the random
        token of :func:`~sagaguard.idempotency.store.first_token`, passed as an argument.
        """
        reply = self._run(
            self._claim, identity.key, self._now_arg(), float(lease), identity.namespace, identity.name,
            fingerprint, identity.scope, str(identity.ordinal), str(first_token()), _holder.current(),
            identity.result_type or "", replicated=True,
        )  # fmt: skip
        return ClaimResult(ClaimOutcome(reply[0]), _record(identity.key, reply))

    def get(self, key: str) -> Record | None:
        """See :meth:`IdempotencyStore.get`: one ``HMGET``."""
        storable_text("key", key, empty_ok=True)  # a lone surrogate would reach the driver
        try:
            values = self._client.hmget(self._name(key), FIELDS)
        except ERRORS as exc:
            raise store_error(exc) from exc
        return self._from_hmget(key, values)

    def _from_hmget(self, key: str, values: list[Any]) -> Record | None:
        if not self._decoded:  # a client passed in without decode_responses
            values = [None if v is None else v.decode() for v in values]
        return None if values[5] is None else _record(key, [None, *values])

    def complete(self, key: str, token: int, result: str, retention: float) -> Record:
        """See :meth:`IdempotencyStore.complete`. Also sets a TTL: the retention plus a grace."""
        reply = self._run(
            self._complete, key, self._now_arg(), str(token), result, float(retention), _ttl_ms(retention)
        )
        if reply[0] == "lost":
            raise _lost(key, token, reply)
        reply[13] = result  # left out of the reply (the caller holds it), like error below
        return _record(key, reply)

    def fail(
        self, key: str, token: int, disposition: Disposition, error: str, retention: float
    ) -> Record | None:
        """See :meth:`IdempotencyStore.fail`. PERMANENT also sets a TTL like :meth:`complete`."""
        reply = self._run(
            self._fail, key, self._now_arg(), str(token), Disposition(disposition).value, error,
            float(retention), _ttl_ms(retention),
        )  # fmt: skip
        if reply[0] == "lost":
            raise _lost(key, token, reply)
        if reply[0] == "deleted":
            return None
        reply[14] = error
        return _record(key, reply)

    def take_over(self, key: str, token: int, lease: float) -> Record | None:
        """See :meth:`IdempotencyStore.take_over`: one script, one round trip."""
        args = (self._now_arg(), str(token), float(lease), _holder.current())
        reply = self._run(self._take_over, key, *args, replicated=True)
        return None if reply[0] == "lost" else _record(key, reply)

    def heartbeat(self, key: str, token: int, lease: float) -> float:
        """See :meth:`IdempotencyStore.heartbeat`."""
        reply = self._run(self._heartbeat, key, self._now_arg(), str(token), float(lease))
        if reply[0] == "lost":
            raise _lost(key, token, reply)
        return float(reply[1])

    def _purge_batch(self, keys: list[str], now: float | str) -> int:
        pipe = self._client.pipeline(transaction=False)
        for key in keys:
            self._purge(keys=(self._name(key),), args=(now,), client=pipe)
        return sum(int(n) for n in pipe.execute())

    def _scan(self) -> Iterator[str]:
        """The keys of every record (``SCAN``, so O(n) in the database size, never blocking it; a
        cluster client's ``scan_iter`` scans every primary)."""
        skip = len(self._kp)
        for name in self._client.scan_iter(match=self._match, count=1000, _type="hash"):
            yield (name if isinstance(name, str) else name.decode())[skip:-1]

    def list(
        self,
        *,
        states: Collection[State] | None = None,
        namespace: str | None = None,
        limit: int = 100,
        after: str | None = None,
    ) -> list[Record]:
        """See :meth:`IdempotencyStore.list`.

        Redis has no ordered index of keys, so listing scans the whole keyspace of the prefix and
        sorts it: O(n) in the number of records, for operators and tools, never the hot path. The
        records are then read in key order, a pipelined page at a time, until ``limit`` match.
        """
        if limit <= 0:
            return []
        wanted = None if states is None else {State(s) for s in states}
        found: list[Record] = []
        try:
            keys = sorted(k for k in self._scan() if after is None or k > after)
            page = min(max(limit, 100), 1000)
            for start in range(0, len(keys), page):
                chunk = keys[start : start + page]
                pipe = self._client.pipeline(transaction=False)
                for key in chunk:
                    pipe.hmget(self._name(key), FIELDS)
                for key, values in zip(chunk, pipe.execute(), strict=True):
                    rec = self._from_hmget(key, values)  # None: deleted since the scan
                    if (
                        rec is not None
                        and (wanted is None or rec.state in wanted)
                        and (namespace is None or rec.namespace == namespace)
                    ):
                        found.append(rec)
                        if len(found) == limit:
                            return found
        except ERRORS as exc:
            raise store_error(exc) from exc
        return found

    def purge(self, *, limit: int = 1000) -> int:
        """See :meth:`IdempotencyStore.purge`.

        Redis evicts finished records by their TTL on its own; this deletes those past
        ``expires_at`` that it has not evicted yet (within the grace, or under an injected clock).
        A scan, so O(n); each deletion checks the record again in a script, so a record claimed
        afresh in the meantime survives.
        """
        if limit <= 0:
            return 0
        deleted = 0
        now = self._now_arg()
        try:
            batch: list[str] = []
            for key in self._scan():
                batch.append(key)
                # A batch never exceeds what may still be deleted, so the limit holds exactly.
                if len(batch) >= min(limit - deleted, 500):
                    deleted += self._purge_batch(batch, now)
                    batch = []
                    if deleted >= limit:
                        return deleted
            if batch:
                deleted += self._purge_batch(batch, now)
        except ERRORS as exc:
            raise store_error(exc) from exc
        return deleted

    def close(self) -> None:
        """Give back the connections the store's threads kept, and close the client if the store
        built it from a URL (and its pool with it)."""
        self._scripts.close()
        if self._owned:
            self._client.close()
