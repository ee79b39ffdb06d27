"""Redis phase: guarded calls against two raw round trips, PING, and AWS Powertools on Redis.

Every key this phase writes starts with its own prefix and carries a TTL, and the phase deletes
them when it ends; it never flushes anything.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
import types
import warnings
from collections.abc import Callable
from time import perf_counter_ns
from typing import Any

import redis
from _cases import async_cases, store_cases
from _common import RETENTION, Config, PhaseResult, noop, run_tag
from _harness import Case, interleave, interleave_async
from redis.backoff import NoBackoff
from redis.retry import Retry

from sagaguard.idempotency import Guard, scope
from sagaguard.idempotency.stores.redis import RedisStore
from sagaguard.idempotency.stores.redis_scripts import FIELDS as _FIELDS

_VALUE = "x" * 200  # about the size of a claimed record's fields
_TTL = int(RETENTION)


def client_for(url: str) -> redis.Redis:
    """A redis-py client built exactly as :class:`RedisStore` builds one from a URL."""
    return redis.Redis.from_url(
        url,
        decode_responses=True,
        socket_connect_timeout=2.0,
        socket_timeout=5.0,
        retry=Retry(NoBackoff(), 0),
    )


def _cleanup(client: redis.Redis, *patterns: str) -> int:
    removed = 0
    for pattern in patterns:
        batch: list[str] = []
        for name in client.scan_iter(match=pattern, count=2000):
            batch.append(name)
            if len(batch) >= 1000:
                removed += int(client.unlink(*batch))
                batch = []
        if batch:
            removed += int(client.unlink(*batch))
    return removed


class _LambdaContext:
    """The one thing Powertools asks of a Lambda context here."""

    function_name = "sagaguard-bench"

    @staticmethod
    def get_remaining_time_in_millis() -> int:
        return 300_000


def _powertools(client: redis.Redis, key_prefix: str) -> Callable[..., Any]:
    """Powertools' ``idempotent_function`` over its Redis layer, on our client."""
    # The package's __init__ imports its DynamoDB layer, which needs boto3 (not a dependency of
    # ours, and unused here): a stand-in module for that one layer lets the Redis layer load.
    dynamo = "aws_lambda_powertools.utilities.idempotency.persistence.dynamodb"
    if dynamo not in sys.modules:
        try:
            import boto3  # noqa: F401
        except ImportError:
            stub = types.ModuleType(dynamo)
            stub.DynamoDBPersistenceLayer = None  # type: ignore[attr-defined]
            sys.modules[dynamo] = stub
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the Redis layer is deprecated in favour of an alias
        from aws_lambda_powertools.utilities.idempotency import (
            IdempotencyConfig,
            idempotent_function,
        )
        from aws_lambda_powertools.utilities.idempotency.persistence.redis import (
            RedisCachePersistenceLayer,
        )

        layer = RedisCachePersistenceLayer(client=client)
    config = IdempotencyConfig(expires_after_seconds=_TTL)
    # As inside a Lambda: the remaining time bounds the in-progress record (and spares a warning).
    config.register_lambda_context(_LambdaContext())

    @idempotent_function(
        data_keyword_argument="order", persistence_store=layer, config=config, key_prefix=key_prefix
    )
    def pt_noop(order: dict[str, Any]) -> int:
        return int(order["i"])

    return pt_noop


def _main_cases(client: redis.Redis, guard: Guard, prefix: str, tag: str, total: int) -> dict[str, Case]:
    guarded = guard.effect("bench.noop")(noop)
    pt_noop = _powertools(client, f"{prefix}pt")

    # Replays need a record first: made here, outside any timed region.
    for i in range(total):
        with scope(f"{tag}-r{i}"):
            guarded(i)
        pt_noop(order={"tag": tag, "r": True, "i": i})

    def floor(i: int) -> int:
        key = f"{prefix}:floor:{i}"
        t0 = perf_counter_ns()
        client.set(key, _VALUE, nx=True, ex=_TTL)
        client.set(key, _VALUE, ex=_TTL)
        return perf_counter_ns() - t0

    def ping(i: int) -> int:
        t0 = perf_counter_ns()
        client.ping()
        return perf_counter_ns() - t0

    def new(i: int) -> int:
        with scope(f"{tag}-n{i}"):
            t0 = perf_counter_ns()
            guarded(i)
            return perf_counter_ns() - t0

    def replay(i: int) -> int:
        with scope(f"{tag}-r{i}"):
            t0 = perf_counter_ns()
            guarded(i)
            return perf_counter_ns() - t0

    def pt_new(i: int) -> int:
        order = {"tag": tag, "r": False, "i": i}
        t0 = perf_counter_ns()
        pt_noop(order=order)
        return perf_counter_ns() - t0

    def pt_replay(i: int) -> int:
        order = {"tag": tag, "r": True, "i": i}
        t0 = perf_counter_ns()
        pt_noop(order=order)
        return perf_counter_ns() - t0

    packed_floor, packed_ping = _packed_cases(client, prefix)
    return {
        "floor_set_nx_set": floor,
        "ping": ping,
        "new": new,
        "replay": replay,
        **store_cases(guard.store, tag, total),
        "floor_packed": packed_floor,
        "ping_packed": packed_ping,
        "powertools_new": pt_new,
        "powertools_replay": pt_replay,
    }


def _bulk(value: bytes) -> bytes:
    return b"$%d\r\n%b\r\n" % (len(value), value)


def _packed_cases(client: redis.Redis, prefix: str) -> tuple[Case, Case]:
    """SET NX + SET and PING sent pre-packed on a connection of the same client's pool.

    The hard floor: no redis-py command path (pool checkout, retry wrapper, reply callbacks),
    which the store's scripts also bypass.
    """
    conn = client.connection_pool.make_connection()
    conn.connect()
    ping_cmd = b"*1\r\n$4\r\nPING\r\n"
    value, ttl = _bulk(_VALUE.encode()), _bulk(str(_TTL).encode())

    def floor(i: int) -> int:
        t0 = perf_counter_ns()
        key = _bulk(f"{prefix}:pfloor:{i}".encode())
        conn.send_packed_command(
            (b"".join((b"*6\r\n$3\r\nSET\r\n", key, value, b"$2\r\nNX\r\n$2\r\nEX\r\n", ttl)),),
            check_health=False,
        )
        conn.read_response(disable_decoding=True)
        conn.send_packed_command(
            (b"".join((b"*5\r\n$3\r\nSET\r\n", key, value, b"$2\r\nEX\r\n", ttl)),), check_health=False
        )
        conn.read_response(disable_decoding=True)
        return perf_counter_ns() - t0

    def ping(i: int) -> int:
        t0 = perf_counter_ns()
        conn.send_packed_command((ping_cmd,), check_health=False)
        conn.read_response(disable_decoding=True)
        return perf_counter_ns() - t0

    return floor, ping


def _load_million(client: redis.Redis, prefix: str, rows: int) -> tuple[list[str], float]:
    """``rows`` finished records in the store's own hash format, pipelined HSET + PEXPIRE."""
    now = time.time()
    fixed = {
        "namespace": "bench",
        "name": "bench.noop",
        "ordinal": "0",
        "fingerprint": "f1_" + "0" * 64,
        "state": "succeeded",
        "token": "1",
        "lease_until": repr(now + 60),
        "attempts": "1",
        "created_at": repr(now),
        "updated_at": repr(now),
        "expires_at": repr(now + RETENTION),
        "result": "0",
    }
    # Every field a finished record has; the rest (an error, the holder, a declared result type) are
    # left out, as on a record written without them.
    assert set(fixed) | {"scope"} == set(_FIELDS) - {"error", "holder", "result_type"}
    names: list[str] = []
    t0 = time.perf_counter()
    batch = 5000
    for start in range(0, rows, batch):
        pipe = client.pipeline(transaction=False)
        for i in range(start, min(start + batch, rows)):
            name = f"{prefix}:{{sg1_{os.urandom(32).hex()}}}"
            names.append(name)
            pipe.hset(name, mapping={**fixed, "scope": f"million-{i}"})
            pipe.pexpire(name, _TTL * 1000)
        pipe.execute()
    return names, time.perf_counter() - t0


def _million(cfg: Config, result: PhaseResult, tag: str) -> None:
    """New calls on an empty store against one holding a million records, interleaved.

    The full store lives in another logical database (``--redis-million-db``), so the empty one
    really is empty of our records; both are on the same server and client settings.
    """
    base, _, _ = cfg.redis_url.rpartition("/")
    full_url = f"{base}/{cfg.redis_million_db}"
    prefix = f"sgbm{os.getpid()}"
    empty_client, full_client = client_for(cfg.redis_url), client_for(full_url)
    names: list[str] = []
    try:
        names, seconds = _load_million(full_client, prefix, cfg.million_rows)
        result.info["redis_million_load_s"] = round(seconds, 1)
        result.info["redis_million_db"] = cfg.redis_million_db
        guards = {
            "empty": Guard(RedisStore(empty_client, prefix=prefix), namespace="bench", retention=RETENTION),
            "million": Guard(RedisStore(full_client, prefix=prefix), namespace="bench", retention=RETENTION),
        }
        cases: dict[str, Case] = {}
        for label, guard in guards.items():
            fn = guard.effect("bench.noop")(noop)

            def case(i: int, fn: Callable[[int], int] = fn, label: str = label) -> int:
                with scope(f"{tag}-m{label}{i}"):
                    t0 = perf_counter_ns()
                    fn(i)
                    return perf_counter_ns() - t0

            cases[f"{label}_new"] = case
        n = cfg.iterations("redis")
        result.add("redis.million", interleave(cases, n, warmup=cfg.warmup("redis")))
        for guard in guards.values():
            guard.close()
    finally:
        for start in range(0, len(names), 1000):
            full_client.unlink(*names[start : start + 1000])
        _cleanup(empty_client, f"{prefix}:*")
        _cleanup(full_client, f"{prefix}:*")
        empty_client.close()
        full_client.close()


def run(cfg: Config) -> PhaseResult:
    result = PhaseResult()
    tag = run_tag()
    prefix = f"sgb{os.getpid()}"
    client = client_for(cfg.redis_url)
    info = client.info("server")
    result.info["redis_version"] = info.get("redis_version")
    result.info["redis_py"] = redis.__version__
    store = RedisStore(client, prefix=prefix)
    guard = Guard(store, namespace="bench", retention=RETENTION)
    n, warm = cfg.iterations("redis"), cfg.warmup("redis")
    try:
        cases = _main_cases(client, guard, prefix, tag, n + warm)
        result.add("redis", interleave(cases, n, warmup=warm))
        acases, guards = async_cases(store, tag)
        result.add("redis.async", asyncio.run(interleave_async(acases, n, warmup=warm)))
        for g in guards:
            g.close()
        if cfg.million:
            _million(cfg, result, tag)
    finally:
        guard.close()
        result.info["redis_keys_removed"] = _cleanup(client, f"{prefix}:*", f"{prefix}pt#*")
        client.close()
    return result
