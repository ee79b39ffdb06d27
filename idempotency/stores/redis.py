"""The Redis store: every primitive is one Lua script, one round trip, one key.

Each record is a hash named ``<prefix>:{<key>}``. Every script touches that one key, and the braces
make it a hash tag, so the layout and the scripts suit Redis Cluster. The fields mirror
:class:`~idempotency.records.Record` except ``key`` (the hash's name): the state as its value,
numbers as text that reads back as the exact float, None as an absent field.

Retention is Redis's own: completing a record (or failing it permanently) sets ``expires_at`` on
the store's clock *and* a TTL a little longer, so Redis evicts finished records itself. IN_PROGRESS
and IN_DOUBT records never carry a TTL. ``claim`` treats a finished record past ``expires_at`` as
absent, and ``purge`` deletes it, whether or not Redis has evicted it yet.

Times come from Redis (``TIME`` inside the script) unless a clock is injected, so workers with
skewed clocks agree on lease expiry. Requires Redis 7 (scripts replicated by their effects, so a
script may read ``TIME`` and then write).
"""

from __future__ import annotations

import json
import json.scanner
import math
import os
import re
import socket
import time
import weakref
from collections.abc import Callable, Collection, Iterator
from typing import Any, Protocol, cast

import redis
from redis._parsers.base import BaseParser
from redis.backoff import NoBackoff
from redis.commands.core import Script
from redis.exceptions import NoScriptError
from redis.retry import Retry

from idempotency import holder as _holder
from idempotency.errors import (
    CodecError,
    ConfigurationError,
    LostOwnership,
    StoreError,
    StoreUnavailable,
)
from idempotency.keys import EffectIdentity
from idempotency.records import ClaimOutcome, ClaimResult, Disposition, Record, State
from idempotency.store import first_token

__all__ = ["RedisStore"]

_FIELDS = (
    "namespace", "scope", "name", "ordinal", "fingerprint", "state", "token",
    "lease_until", "attempts", "created_at", "updated_at", "expires_at", "result", "error", "holder",
)  # fmt: skip
"""Hash fields in reply order. The Lua below indexes them from 1: state is r[6], token r[7]..."""

_TTL_GRACE = 60.0
"""Seconds Redis keeps a finished record past its retention, so that ``claim`` and ``purge``, which
read ``expires_at`` on the store's clock, decide first even if that clock runs a little behind."""

_IDLE_CHECK = 1.0
"""Seconds after which an idle connection is polled for a close by the server before reuse."""

_HMGET_ALL = "redis.call('HMGET', k, " + ", ".join(f"'{f}'" for f in _FIELDS) + ")"

# Every script starts here: ``now`` is the injected clock's reading (ARGV[1]) or Redis's TIME,
# and ``f`` prints a number so that Python's float() reads back the very same double (%.17g
# round-trips; Lua's default %.14g would lose the microseconds).
_NOW = """
local k = KEYS[1]
local now = tonumber(ARGV[1])
if not now then local t = redis.call('TIME'); now = tonumber(t[1]) + tonumber(t[2]) / 1000000 end
local function f(x) return string.format('%.17g', x) end
"""

# The fence of every write after the claim: the caller's token must be the record's and the record
# must still be live. Python turns the marker into LostOwnership with the reason.
_FENCE = """
if not (st == 'in_progress' or st == 'in_doubt') or tonumber(tk) ~= tonumber(ARGV[2]) then
  return cjson.encode({'lost', st or false, tk or false})
end
"""

# ARGV: now, lease, namespace, name, fingerprint, scope, ordinal, first_token (random, from Python:
# a new record starts there; a replaced or taken-over one counts on from its own token), holder. The lease,
# namespace and name come together, so the store packs them once per effect (see claim). Tokens stay
# strings in the reply: cjson prints numbers with 14 digits, which would round a 15-digit token.
_CLAIM = (
    _NOW
    + f"local r = {_HMGET_ALL}\n"
    + """
local st = r[6]
if not st or ((st == 'succeeded' or st == 'failed') and r[12] and tonumber(r[12]) <= now) then
  local tok, n, lu = ARGV[8], f(now), f(now + tonumber(ARGV[2]))
  if st and tonumber(r[7]) then tok = f(tonumber(r[7]) + 1) end
  -- DEL drops the old result, error, expires_at and TTL at once: a live record has no TTL.
  if st then redis.call('DEL', k) end
  redis.call('HSET', k, 'namespace', ARGV[3], 'scope', ARGV[6], 'name', ARGV[4],
    'ordinal', ARGV[7], 'fingerprint', ARGV[5], 'state', 'in_progress', 'token', tok,
    'lease_until', lu, 'attempts', 1, 'created_at', n, 'updated_at', n, 'holder', ARGV[9])
  return cjson.encode({'claimed', ARGV[3], ARGV[6], ARGV[4], ARGV[7], ARGV[5], 'in_progress',
    tok, lu, 1, n, n, false, false, false, ARGV[9]})
end
if (st == 'in_progress' or st == 'in_doubt') and tonumber(r[8]) <= now and r[5] == ARGV[5] then
  -- A live record never has a TTL (only finishing sets one), so no PERSIST is needed here.
  r[6], r[7], r[8], r[9], r[11], r[15] = 'in_doubt', f(tonumber(r[7]) + 1),
    f(now + tonumber(ARGV[2])), tonumber(r[9]) + 1, f(now), ARGV[9]
  redis.call('HSET', k, 'state', r[6], 'token', r[7], 'lease_until', r[8], 'attempts', r[9],
    'updated_at', r[11], 'holder', r[15])
  table.insert(r, 1, 'took_over')
  return cjson.encode(r)
end
table.insert(r, 1, 'existing')
return cjson.encode(r)
"""
)

# ARGV: now, token, result, retention, ttl_ms (empty: no TTL). The reply leaves out the result,
# which the caller already holds.
_COMPLETE = (
    _NOW
    + f"local r = {_HMGET_ALL}\nlocal st, tk = r[6], r[7]\n"
    + _FENCE
    + """
r[6], r[11], r[12] = 'succeeded', f(now), f(now + tonumber(ARGV[4]))
redis.call('HSET', k, 'state', r[6], 'result', ARGV[3], 'expires_at', r[12], 'updated_at', r[11])
if r[14] then redis.call('HDEL', k, 'error') end
if ARGV[5] ~= '' then redis.call('PEXPIRE', k, ARGV[5]) end
r[13], r[14] = false, false
table.insert(r, 1, 'ok')
return cjson.encode(r)
"""
)

# The same write as _COMPLETE, for a caller that holds the record as its claim returned it: only
# the fields a holder's writes can have changed since (the lease, by heartbeats) and the new times
# come back, so the script reads 3 fields instead of 14 and the reply is a few bytes.
# ARGV: now, token, result, retention, ttl_ms.
_COMPLETE_HELD = (
    _NOW
    + "local st, tk, lu = unpack(redis.call('HMGET', k, 'state', 'token', 'lease_until'))\n"
    + _FENCE
    + """
local n, ea = f(now), f(now + tonumber(ARGV[4]))
redis.call('HSET', k, 'state', 'succeeded', 'result', ARGV[3], 'expires_at', ea, 'updated_at', n)
redis.call('HDEL', k, 'error')
if ARGV[5] ~= '' then redis.call('PEXPIRE', k, ARGV[5]) end
return cjson.encode({'ok', lu, n, ea})
"""
)

_HELD_MAX = 4096
"""Claimed records a store remembers for :data:`_COMPLETE_HELD`; past this many (claims never
completed nor failed, e.g. by code driving the store itself) it forgets them all and starts afresh."""

_FIXED_MAX = 1024
"""Effects (namespace, name and lease) whose packed claim arguments a store keeps; past this many it
forgets them all and starts afresh."""

# ARGV: now, token, disposition, error, retention, ttl_ms. The reply leaves out the error.
_FAIL = (
    _NOW
    + f"local r = {_HMGET_ALL}\nlocal st, tk = r[6], r[7]\n"
    + _FENCE
    + """
if ARGV[3] == 'retryable' then redis.call('DEL', k); return '["deleted"]' end
r[11] = f(now)
if ARGV[3] == 'permanent' then
  r[6], r[12] = 'failed', f(now + tonumber(ARGV[5]))
  redis.call('HSET', k, 'state', r[6], 'error', ARGV[4], 'expires_at', r[12], 'updated_at', r[11])
  if ARGV[6] ~= '' then redis.call('PEXPIRE', k, ARGV[6]) end
else
  r[6], r[8] = 'in_doubt', '0'
  redis.call('HSET', k, 'state', r[6], 'error', ARGV[4], 'lease_until', '0', 'updated_at', r[11])
end
r[14] = false
table.insert(r, 1, 'ok')
return cjson.encode(r)
"""
)

# ARGV: now, token, lease, holder. Compare-and-set on the token, the lease not looked at: the caller
# found the holder dead (see RedisStore.take_over). A refusal answers 'lost', and Python None.
_TAKE_OVER = (
    _NOW
    + f"local r = {_HMGET_ALL}\nlocal st, tk = r[6], r[7]\n"
    + _FENCE
    + """
r[6], r[7], r[8], r[9], r[11], r[15] = 'in_doubt', f(tonumber(r[7]) + 1), f(now + tonumber(ARGV[3])),
  tonumber(r[9]) + 1, f(now), ARGV[4]
redis.call('HSET', k, 'state', r[6], 'token', r[7], 'lease_until', r[8], 'attempts', r[9],
  'updated_at', r[11], 'holder', r[15])
table.insert(r, 1, 'took_over')
return cjson.encode(r)
"""
)

# ARGV: now, token, lease.
_HEARTBEAT = (
    _NOW
    + "local st, tk = unpack(redis.call('HMGET', k, 'state', 'token'))\n"
    + _FENCE
    + """
local lu = f(now + tonumber(ARGV[3]))
redis.call('HSET', k, 'lease_until', lu, 'updated_at', f(now))
return cjson.encode({'ok', lu})
"""
)

# ARGV: now. Checks again inside the script: a record claimed afresh since the scan survives.
_PURGE = (
    _NOW
    + """
local st, ea = unpack(redis.call('HMGET', k, 'state', 'expires_at'))
if (st == 'succeeded' or st == 'failed') and ea and tonumber(ea) <= now then
  return redis.call('DEL', k)
end
return 0
"""
)


class _Connection(Protocol):
    """The part of a redis-py connection the fast path uses (redis-py leaves it untyped)."""

    @property
    def is_connected(self) -> bool: ...
    def can_read(self, timeout: float = 0) -> bool: ...
    def send_packed_command(self, command: tuple[bytes], check_health: bool = True) -> None: ...
    def read_response(self, disable_decoding: bool = False) -> bytes: ...
    def disconnect(self) -> None: ...


_OUTCOMES = {o.value: o for o in ClaimOutcome}
_STATES = {s.value: s for s in State}
_EXISTING = ClaimOutcome.EXISTING  # a module global: an enum member read off its class costs more
_new_record = Record.from_fields
_new_claim = ClaimResult.from_fields

# ConnectionError covers BusyLoadingError (still loading). The others are failovers under way (a
# replica not yet promoted, a cluster reshuffling slots): transient like a lost connection.
_TRANSIENT = (redis.ConnectionError, redis.TimeoutError, redis.exceptions.ReadOnlyError,
              redis.exceptions.TryAgainError, redis.exceptions.ClusterDownError)  # fmt: skip


def _store_error(exc: redis.RedisError) -> StoreError:
    """Our error for a driver error; the caller raises it ``from exc``."""
    if isinstance(exc, _TRANSIENT):
        return StoreUnavailable(f"redis is unavailable: {exc}")
    return StoreError(f"redis failed: {exc}")


def _record(key: str, reply: list[Any]) -> Record:
    """Build a record from a marker followed by the fields in ``_FIELDS`` order.

    An absent field is None (``HMGET``) or False (a script's JSON, where Lua has no null).
    """
    _, ns, sc, nm, od, fp, st, tk, lu, at, ca, ua, ea, rs, er, hd = reply
    return _new_record(
        key, ns, sc, nm, int(od), fp, _STATES[st], int(tk), float(lu), int(at),
        float(ca), float(ua),
        None if ea is None or ea is False else float(ea),
        None if rs is None or rs is False else rs,
        None if er is None or er is False else er,
        None if hd is None or hd is False else hd,
    )  # fmt: skip


_READ = 65536
_decoder = json.JSONDecoder()
_decode = _decoder.raw_decode  # json.loads without its two wrapper calls
_scan: Callable[[str, int], tuple[Any, int]] = json.scanner.make_scanner(cast(Any, _decoder))
"""What ``_decode`` calls, without its frame: on text that is no JSON value it raises StopIteration."""
_parse_error = cast(Callable[[str], redis.RedisError], BaseParser.parse_error)
"""redis-py's mapping of an error reply to its exception (``NOSCRIPT`` to ``NoScriptError``, ...)."""


def _reply(sock: socket.socket) -> bytes:
    """Read one reply to a script: a bulk string (its bytes), or an error reply (raised as
    redis-py's exception for it, e.g. ``NoScriptError``, after reading it whole).

    Raises:
        redis.ConnectionError: the server closed the connection, or sent a reply of another kind
            (the connection's state is then unknown, so the caller drops it).
    """
    data = sock.recv(_READ)
    while True:
        if not data:
            raise redis.ConnectionError("Connection closed by server.")
        end = data.find(b"\r\n")
        if end != -1:
            break
        data += sock.recv(_READ)
    kind = data[:1]
    if kind == b"$":
        need = end + 2 + int(data[1:end]) + 2
        while len(data) < need:
            more = sock.recv(_READ)
            if not more:
                raise redis.ConnectionError("Connection closed by server.")
            data += more
        if len(data) == need:
            return data[end + 2 : need - 2]
    elif kind == b"-" and len(data) == end + 2:
        raise _parse_error(data[1:end].decode("utf-8", "replace"))
    raise redis.ConnectionError(f"unexpected reply from redis: {data[:40]!r}")


def _text(value: str | float) -> str:
    """A script argument that is not a plain str, as the text Lua reads."""
    return str.__str__(value) if isinstance(value, str) else repr(value)


def _ttl_ms(retention: float) -> int | str:
    """Milliseconds of TTL for a finished record, or '' (none) when the retention is unbounded.

    Relative to Redis's own clock rather than an absolute ``PEXPIREAT expires_at``: an injected
    clock (tests, simulations) need not agree with Redis's and must not make Redis evict a record
    at once. With Redis's clock the two are the same instant.
    """
    if not math.isfinite(retention):
        return ""
    return math.ceil((max(retention, 0.0) + _TTL_GRACE) * 1000)


def connect(url_or_client: str | redis.Redis, prefix: str) -> tuple[redis.Redis, bool]:
    """The client for a URL (and True: ours to close) or the caller's client (and False).

    From a URL the client fails fast (connect timeout 2 s, read timeout 5 s) and never retries on its
    own: a script whose reply was lost may have run, so whether to try again is the caller's call.
    Shared by every Redis-backed ledger and journal.

    Raises:
        ConfigurationError: the URL is malformed, or ``prefix`` is empty or has braces (it would
            break the hash tag that keeps each record's keys in one cluster slot).
    """
    if not prefix or "{" in prefix or "}" in prefix:
        raise ConfigurationError(f"a redis prefix must be non-empty and brace-free: {prefix!r}")
    if not isinstance(url_or_client, str):
        return url_or_client, False
    try:
        client = redis.Redis.from_url(
            url_or_client,
            decode_responses=True,
            socket_connect_timeout=2.0,
            socket_timeout=5.0,
            retry=Retry(NoBackoff(), 0),
        )
    except ValueError as exc:
        raise ConfigurationError(f"malformed redis URL: {exc}") from exc
    return client, True


_LIVE: weakref.WeakSet[RedisStore] = weakref.WeakSet()
"""Every store, so that a forked child can drop what it inherited and must not share."""


def _after_fork() -> None:
    """Run in a forked child: the parent's sockets are not the child's to use, and its spare first
    token must not start a record in both processes, so every store drops them. A hook rather than
    a pid check per call: ``os.getpid()`` is a system call, which costs a replay more than its time
    on a hot CPU."""
    for store in list(_LIVE):
        store._idle = []
        store._spare = []


if hasattr(os, "register_at_fork"):  # not on Windows, which has no fork
    os.register_at_fork(after_in_child=_after_fork)


class RedisStore:
    """An effect ledger in Redis, shared by any number of processes and machines.

    Args:
        url_or_client: a ``redis://``, ``rediss://`` or ``unix://`` URL, or a ready ``redis.Redis``
            (one server or a Sentinel master; a ``RedisCluster`` client is not supported yet).
            From a URL the store builds a client that fails fast (connect timeout 2 s, read timeout
            5 s) and never retries on its own: a script whose reply was lost may have run, so
            whether to try again is the guard's decision, not the driver's. A client you pass is
            used with its own timeouts and left open by :meth:`close`.
        clock: seconds since the epoch; inject one to test leases without sleeping. By default
            every script reads Redis's ``TIME``.
        prefix: the first part of every key, so several ledgers can share one database. The store
            owns every key matching ``{prefix}:{*}``.

    Raises:
        ConfigurationError: the URL or the prefix is malformed.
        StoreUnavailable: Redis cannot be reached (the scripts are loaded at once, which checks it).
        StoreError: Redis refused to load the scripts.
    """

    offload_async = False
    """Whether the guard runs this store's calls in a worker thread for async effects."""

    def __init__(
        self,
        url_or_client: str | redis.Redis,
        *,
        clock: Callable[[], float] | None = None,
        prefix: str = "sg",
    ) -> None:
        client, self._owned = connect(url_or_client, prefix)
        self._client = client
        self._decoded = bool(client.get_encoder().decode_responses)
        self._clock = clock
        self._kp = prefix + ":{"
        self._match = re.sub(r"([*?\[\]\\])", r"\\\1", prefix) + ":{*}"
        scripts = [
            client.register_script(s)
            for s in (_CLAIM, _COMPLETE, _FAIL, _HEARTBEAT, _PURGE, _COMPLETE_HELD, _TAKE_OVER)
        ]
        (self._claim, self._complete, self._fail, self._heartbeat, self._purge, self._complete_held,
         self._take_over) = scripts  # fmt: skip
        # The records this store's claims handed out and that are still live, by key: complete()
        # rebuilds the finished record from one of these instead of reading the whole hash back.
        self._held: dict[str, Record] = {}
        # The packed start of each script's EVALSHA (command, SHA, one key), built once.
        self._heads = {
            sc.sha: b"*%d\r\n$7\r\nEVALSHA\r\n$40\r\n%b\r\n$1\r\n1\r\n" % (4 + n, sc.sha.encode())
            for sc, n in (
                (self._claim, 9),
                (self._take_over, 4),
                (self._complete, 5),
                (self._fail, 6),
                (self._heartbeat, 3),
                (self._complete_held, 5),
            )
        }
        self._claim_head = self._heads[self._claim.sha]
        # The packed lease, namespace and name of each effect's claims (see claim), by those three.
        self._claim_fixed: dict[tuple[str, str, float], str] = {}
        self._spare: list[str] = []  # a first token drawn for a claim that did not use it (see claim)
        self._idle: list[tuple[_Connection, float]] = []
        _LIVE.add(self)
        try:
            # One round trip that both checks Redis is there and spares the first calls a NOSCRIPT.
            pipe = client.pipeline(transaction=False)
            for script in scripts:
                pipe.script_load(script.script)
            pipe.execute()
        except redis.RedisError as exc:
            if self._owned:
                client.close()
            raise _store_error(exc) from exc

    def _name(self, key: str) -> str:
        return self._kp + key + "}"

    def _now_arg(self) -> float | str:
        # Empty tells the script to read Redis's TIME.
        return "" if self._clock is None else float(self._clock())

    # redis-py's command path (a pool checkout that polls the socket, a retry wrapper, metrics)
    # costs about 35 us a call on a 2-core machine, more than the round trip to a local Redis. The
    # scripts are the hot path, so they go through connections of the client's pool that the store
    # keeps idle itself, and send one pre-packed EVALSHA: a replay costs about one PING.
    def _send(self, packed: bytes) -> bytes:
        """Send one command and read its reply on one of the store's own connections."""
        try:
            conn, used = self._idle.pop()  # atomic: threads share the list without a lock
        except IndexError:
            conn, used = cast(_Connection, self._client.connection_pool.make_connection()), 0.0
        try:
            # The server may have closed a socket idle for a while (restart, timeout, CLIENT KILL):
            # poll it for the EOF (can_read raises it) and reconnect. Busy sockets skip the 5 us
            # poll; one that died within the last second fails closed with StoreUnavailable.
            if used < time.monotonic() - _IDLE_CHECK and conn.is_connected:
                try:
                    stale = conn.can_read()
                except redis.ConnectionError:
                    stale = True
                if stale:
                    conn.disconnect()  # send_packed_command connects afresh
            sock = getattr(conn, "_sock", None)
            if sock is None:  # a new or dropped connection: redis-py connects it (handshake, AUTH)
                conn.send_packed_command((packed,), check_health=False)
                return conn.read_response(disable_decoding=True)
            # A connected socket: write and read it directly. Only this store uses the connection,
            # one command at a time, so nothing is ever left in redis-py's read buffer; the reply
            # is one bulk string (or an error), which _reply reads whole.
            try:
                sock.sendall(packed)
                return _reply(sock)
            except TimeoutError as exc:
                raise redis.TimeoutError(f"Timeout talking to redis: {exc}") from exc
            except OSError as exc:
                raise redis.ConnectionError(f"Error talking to redis: {exc}") from exc
        except BaseException as exc:
            if not isinstance(exc, redis.ResponseError):  # an error reply is read whole: clean
                conn.disconnect()  # a reply may still be in flight: never reuse the socket
            raise
        finally:
            # Kept even when disconnected (it reconnects on use): no more connections than calls.
            self._idle.append((conn, time.monotonic()))

    def _pack(self, script: Script, key: str, *args: str | float) -> bytes:
        """The EVALSHA of a script on one key, packed as RESP.

        Raises:
            CodecError: a text has no UTF-8 form (a lone surrogate).
        """
        # Each argument as a RESP bulk string (floats as repr, which Lua's tonumber reads exactly;
        # a str subclass, e.g. a StrEnum, as its text, never its repr).
        raws = [self._name(key), *[a if type(a) is str else _text(a) for a in args]]
        text = "".join([f"${len(r)}\r\n{r}\r\n" for r in raws])
        if text.isascii():  # then each length in characters is its length in bytes: one encode
            return self._heads[script.sha] + text.encode()
        try:
            return self._heads[script.sha] + b"".join(
                [b"$%d\r\n%b\r\n" % (len(r), r) for r in [a.encode() for a in raws]]
            )
        except UnicodeEncodeError as exc:  # a lone surrogate: no UTF-8 for it
            raise CodecError(f"text cannot be stored in redis: {exc.reason}") from exc

    def _run(self, script: Script, packed: bytes) -> list[Any]:
        """Run a packed script and decode its JSON reply; one round trip."""
        try:
            try:
                raw = self._send(packed)
            except NoScriptError:
                # Redis restarted or its script cache was flushed. NOSCRIPT means it did not run.
                self._client.script_load(script.script)
                raw = self._send(packed)
            text = raw.decode()
            try:
                reply: list[Any] = _scan(text, 0)[0]  # typed without a call to cast()
                return reply
            except StopIteration:
                _decode(text)  # raises the JSONDecodeError that the scanner only signals
                raise
        except redis.RedisError as exc:
            raise _store_error(exc) from exc
        except ValueError as exc:  # not UTF-8 or not JSON: the hash was written by someone else
            raise StoreError(f"redis holds a malformed record: {exc}") from exc

    def _eval(self, script: Script, key: str, *args: str | float) -> list[Any]:
        """Run a script on one key and decode its JSON reply; one round trip."""
        return self._run(script, self._pack(script, key, *args))

    @staticmethod
    def _lost(key: str, token: int, reply: list[Any]) -> LostOwnership:
        _, state, current = reply
        if state is False:
            return LostOwnership(key, token, "record is gone")
        if int(current) != token:
            return LostOwnership(key, token, f"token is now {int(current)}")
        return LostOwnership(key, token, f"record is already {state}")

    def now(self) -> float:
        """The store's clock: the injected one, or Redis's ``TIME`` (one round trip)."""
        if self._clock is not None:
            return self._clock()
        try:
            seconds, micros = self._client.time()
        except redis.RedisError as exc:
            raise _store_error(exc) from exc
        return int(seconds) + int(micros) / 1000000

    def claim(self, identity: EffectIdentity, fingerprint: str, lease: float) -> ClaimResult:
        """See :meth:`IdempotencyStore.claim`: one script, one round trip.

        The script reads the whole hash, decides and writes in one atomic step, and answers with the
        outcome and the record as it stands, whatever the outcome. A new record starts at the random
        token of :func:`~idempotency.store.first_token`, passed as an argument.
        """
        key, namespace, name, scope = identity.key, identity.namespace, identity.name, identity.scope
        clock = self._clock
        now = "" if clock is None else repr(float(clock()))
        spare = self._spare
        try:
            token = spare.pop() if spare else str(first_token())
        except IndexError:  # another thread took the spare between the check and the pop
            token = str(first_token())
        ordinal = str(identity.ordinal)
        holder = _holder.current()
        # The common case packed as one text: the lease, namespace and name as packed for the last
        # claim of the effect, the rest around them. Pure ASCII (keys and fingerprints are), each
        # length in characters is its length in bytes. Anything else (other text, a str subclass,
        # which _pack writes as its repr) takes the general packing.
        if type(namespace) is str and type(name) is str and type(scope) is str and type(fingerprint) is str:
            fixed = self._claim_fixed.get((namespace, name, lease))
            if fixed is None:
                fixed = self._fix_claim(namespace, name, lease)
            full = self._kp + key + "}"
            text = (
                f"${len(full)}\r\n{full}\r\n${len(now)}\r\n{now}\r\n{fixed}${len(fingerprint)}\r\n{fingerprint}"
                f"\r\n${len(scope)}\r\n{scope}\r\n${len(ordinal)}\r\n{ordinal}\r\n${len(token)}\r\n{token}\r\n"
                f"${len(holder)}\r\n{holder}\r\n"
            )
            packed = self._claim_head + text.encode() if text.isascii() else None
        else:
            packed = None
        if packed is None:
            packed = self._pack(
                self._claim, key, now, float(lease), namespace, name, fingerprint, scope, ordinal, token,
                holder,
            )  # fmt: skip
        reply = self._run(self._claim, packed)
        record = _record(key, reply)
        outcome = _OUTCOMES[reply[0]]
        if outcome is _EXISTING:
            # The script wrote nothing, so the token went unused: still a uniform draw that nothing
            # has seen, as good as the next one. Kept for the next claim, it spares a replay the
            # system call of a fresh draw (a child forgets it at fork, so no two processes share it).
            if not spare:
                spare.append(token)
        else:  # ours now, until complete() or fail()
            held = self._held
            if len(held) >= _HELD_MAX:
                held.clear()
            held[key] = record
        return _new_claim(outcome, record)

    def _fix_claim(self, namespace: str, name: str, lease: float) -> str:
        """The claim's lease, namespace and name packed (ARGV[2] to ARGV[4]), kept for the next call."""
        fixed = self._claim_fixed
        if len(fixed) >= _FIXED_MAX:
            fixed.clear()
        packed = "".join(f"${len(a)}\r\n{a}\r\n" for a in (repr(float(lease)), namespace, name))
        fixed[namespace, name, lease] = packed
        return packed

    def get(self, key: str) -> Record | None:
        """See :meth:`IdempotencyStore.get`: one ``HMGET``."""
        try:
            values = self._client.hmget(self._name(key), _FIELDS)
        except redis.RedisError as exc:
            raise _store_error(exc) from exc
        return self._from_hmget(key, values)

    def _from_hmget(self, key: str, values: list[Any]) -> Record | None:
        if not self._decoded:  # a client passed in without decode_responses
            values = [None if v is None else v.decode() for v in values]
        return None if values[5] is None else _record(key, [None, *values])

    def complete(self, key: str, token: int, result: str, retention: float) -> Record:
        """See :meth:`IdempotencyStore.complete`. Also sets a TTL: the retention plus a grace.

        When this store's own claim handed out ``token`` for ``key``, the finished record is built
        from that claim's record and the few fields the script returns (:data:`_COMPLETE_HELD`):
        while the token holds, nothing else of the record can have changed.
        """
        held = self._held.pop(key, None)
        if held is not None and held.token == token:
            short = self._eval(
                self._complete_held, key, self._now_arg(), str(token), result, float(retention),
                _ttl_ms(retention),
            )  # fmt: skip
            if short[0] == "lost":
                raise self._lost(key, token, short)
            _, lease_until, updated_at, expires_at = short
            return _new_record(
                key, held.namespace, held.scope, held.name, held.ordinal, held.fingerprint,
                State.SUCCEEDED, token, float(lease_until), held.attempts, held.created_at,
                float(updated_at), float(expires_at), result, None, held.holder,
            )  # fmt: skip
        reply = self._eval(
            self._complete, key, self._now_arg(), str(token), result, float(retention),
            _ttl_ms(retention),
        )  # fmt: skip
        if reply[0] == "lost":
            raise self._lost(key, token, reply)
        reply[13] = result  # left out of the reply (the caller holds it), like error below
        return _record(key, reply)

    def fail(
        self, key: str, token: int, disposition: Disposition, error: str, retention: float
    ) -> Record | None:
        """See :meth:`IdempotencyStore.fail`. PERMANENT also sets a TTL like :meth:`complete`."""
        self._held.pop(key, None)
        reply = self._eval(
            self._fail, key, self._now_arg(), str(token), Disposition(disposition).value, error,
            float(retention), _ttl_ms(retention),
        )  # fmt: skip
        if reply[0] == "lost":
            raise self._lost(key, token, reply)
        if reply[0] == "deleted":
            return None
        reply[14] = error
        return _record(key, reply)

    def take_over(self, key: str, token: int, lease: float) -> Record | None:
        """See :meth:`IdempotencyStore.take_over`: one script, one round trip."""
        reply = self._eval(
            self._take_over, key, self._now_arg(), str(token), float(lease), _holder.current()
        )
        if reply[0] == "lost":
            return None
        record = _record(key, reply)
        self._held[key] = record  # ours now, as after a claim
        return record

    def heartbeat(self, key: str, token: int, lease: float) -> float:
        """See :meth:`IdempotencyStore.heartbeat`."""
        reply = self._eval(self._heartbeat, key, self._now_arg(), str(token), float(lease))
        if reply[0] == "lost":
            raise self._lost(key, token, reply)
        return float(reply[1])

    def _purge_batch(self, keys: list[str], now: float | str) -> int:
        pipe = self._client.pipeline(transaction=False)
        for key in keys:
            self._purge(keys=(self._name(key),), args=(now,), client=pipe)
        return sum(int(n) for n in pipe.execute())

    def _scan(self) -> Iterator[str]:
        """The keys of every record (``SCAN``, so O(n) in the database size, never blocking it)."""
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
                    pipe.hmget(self._name(key), _FIELDS)
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
        except redis.RedisError as exc:
            raise _store_error(exc) from exc
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
        except redis.RedisError as exc:
            raise _store_error(exc) from exc
        return deleted

    def close(self) -> None:
        """Close the store's connections, and the client if the store built it from a URL."""
        idle, self._idle = self._idle, []
        for conn, _ in idle:
            conn.disconnect()
        if self._owned:
            self._client.close()
