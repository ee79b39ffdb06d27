"""Where a guarded call's time goes: the memory store (guard only) and Redis, with cProfile.

The component figures are the best of five timeit repeats of each piece on its own, in thread CPU
time, so they add up to less than a whole call (which also pays for the generator, the dispatch and
cache misses).
"""

from __future__ import annotations

import cProfile
import inspect
import io
import itertools
import os
import pstats
import time
import timeit
from collections.abc import Callable
from time import perf_counter_ns

from _cases import store_cases
from _common import RETENTION, Config, PhaseResult, noop, run_tag
from _harness import Case, interleave

from sagaguard.idempotency import Guard, MemoryStore, scope
from sagaguard.idempotency.effect import _current_effect
from sagaguard.idempotency.flow import Flow
from sagaguard.idempotency.keys import EffectIdentity, fingerprint, key_deriver
from sagaguard.idempotency.options import binder, build_spec, codec_for
from sagaguard.idempotency.telemetry import EffectSpan, counter_attributes, effect_counter


def _best_us(fn: Callable[[], object], number: int) -> float:
    # CPU time of this thread: a busy machine preempting us does not count against the piece.
    return min(timeit.repeat(fn, number=number, repeat=5, timer=time.thread_time)) / number * 1e6


def components(number: int) -> list[tuple[str, float]]:
    """Best-case cost of each piece of a new guarded call, in µs."""
    guard = Guard(MemoryStore(), namespace="bench")
    spec = build_spec("bench.noop", int, {}, lease=60.0, retention=RETENTION, wait=10.0)
    signature = inspect.signature(noop)
    identity = EffectIdentity.of("bench", "scope-1", "bench.noop", 0)
    flow = Flow(spec, identity, fingerprint({"i": 1}), {"i": 1})
    codec = codec_for(int)
    store = MemoryStore()
    keys = itertools.count()
    fast_bind = binder(signature, "bench.noop")
    derive = key_deriver("bench", "bench.noop")
    counted = counter_attributes("bench.noop")

    def bind() -> object:
        return fast_bind((1,), {})

    def key() -> object:
        return EffectIdentity("bench", "scope-1", "bench.noop", 0, derive("scope-1", 0))

    def span() -> None:
        s = EffectSpan("bench.noop", counted, flow)
        s.__enter__()
        s.__exit__(None, None, None)

    def counter() -> None:
        effect_counter.add(1, counted[flow.outcome])

    def context() -> None:
        _current_effect.reset(_current_effect.set(guard._context(flow, 1, 1)))

    def heartbeat() -> None:
        guard.heartbeater.unregister(guard.heartbeater.register(identity.key, 1, 60.0))

    def store_ops() -> None:
        ident = EffectIdentity("bench", "s", "bench.noop", 0, f"k{next(keys)}")
        claimed = store.claim(ident, flow.fingerprint, 60.0)
        store.complete(ident.key, claimed.record.token, "1", RETENTION)

    pieces: list[tuple[str, Callable[[], object]]] = [
        ("bind arguments (Signature.bind + apply_defaults, or the direct map)", bind),
        ("fingerprint (flat canonical JSON + sha256)", lambda: fingerprint({"i": 1})),
        ("key derivation (key_deriver + EffectIdentity)", key),
        ("outcome counter alone (the guard without a tracer provider)", counter),
        ("span + outcome counter (EffectSpan enter/exit, API only: what a provider would add to)", span),
        ("heartbeat register + unregister", heartbeat),
        ("EffectContext + contextvar set/reset", context),
        ("codec encode (int)", lambda: codec.encode(1)),
        ("codec decode (int, replay)", lambda: codec.decode("1")),
        ("MemoryStore claim + complete (2 Records built)", store_ops),
    ]  # fmt: skip
    found = [(label, _best_us(fn, number)) for label, fn in pieces]
    guard.close()
    return found


def _cprofile(fn: Callable[[int], object], calls: int, top: int = 14) -> str:
    profile = cProfile.Profile()
    profile.enable()
    for i in range(calls):
        fn(i)
    profile.disable()
    out = io.StringIO()
    stats = pstats.Stats(profile, stream=out).strip_dirs().sort_stats("tottime")
    stats.print_stats(top)
    lines = out.getvalue().splitlines()
    start = next(i for i, line in enumerate(lines) if "ncalls" in line)
    return "\n".join(line.rstrip() for line in lines[start:] if line.strip())


def run(cfg: Config) -> PhaseResult:
    result = PhaseResult()
    tag = run_tag()
    n, warm = cfg.iterations("memory"), cfg.warmup("memory")
    store = MemoryStore()
    guard = Guard(store, namespace="bench", retention=RETENTION)
    guarded = guard.effect("bench.noop")(noop)
    for i in range(n + warm):
        with scope(f"{tag}-r{i}"):
            guarded(i)

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

    cases: dict[str, Case] = {"new": new, "replay": replay, **store_cases(store, tag, n + warm)}
    result.add("memory", interleave(cases, n, warmup=warm))
    result.extra["components"] = components(2000 if cfg.quick else 20000)

    def profiled(i: int) -> None:
        with scope(f"{tag}-p{i}"):
            guarded(i)

    result.extra["cprofile_memory"] = _cprofile(profiled, n)
    guard.close()
    _redis_profile(cfg, result, tag, n // 2)
    return result


def _redis_profile(cfg: Config, result: PhaseResult, tag: str, calls: int) -> None:
    from _redis import _cleanup, client_for

    from sagaguard.idempotency.stores.redis import RedisStore

    client = client_for(cfg.redis_url)
    prefix = f"sgbp{os.getpid()}"
    guard = Guard(RedisStore(client, prefix=prefix), namespace="bench", retention=RETENTION)
    guarded = guard.effect("bench.noop")(noop)

    def profiled(i: int) -> None:
        with scope(f"{tag}-q{i}"):
            guarded(i)

    try:
        for i in range(50):
            profiled(-i - 1)
        result.extra["cprofile_redis"] = _cprofile(profiled, calls)
    finally:
        guard.close()
        _cleanup(client, f"{prefix}:*")
        client.close()
