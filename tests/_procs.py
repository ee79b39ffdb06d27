"""Open a store backend by name, here or in another process, and race claims across processes.

Used by ``conftest.py`` (``open_backend``) and by the multi-process tests. Run as a script, this file
is the child side of :func:`race_claims_in_processes`: it opens the store that its JSON argument
describes, says ``ready``, and claims one key each time the parent opens a round's gate.

The gate is a pipe whose read end every child inherits: the parent closes the write end, every
child's blocking ``os.read`` returns at once, and all of them claim together. No polling, no sleeps.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from sagaguard.idempotency.keys import EffectIdentity
from sagaguard.idempotency.store import IdempotencyStore
from sagaguard.idempotency.stores.memory import MemoryStore

__all__ = ["open_backend", "race_claims_in_processes"]

Clock = Callable[[], float]


def open_backend(
    backend: str,
    url: str,
    *,
    clock: Clock | None,
    table_name: str | None = None,
    prefix: str | None = None,
) -> IdempotencyStore:
    """Open one store instance of ``backend`` ("memory", "sqlite", "postgres", "redis" or "cluster":
    Redis Cluster).

    ``table_name`` (SQL) and ``prefix`` (Redis) select the data set, so two calls with the same
    arguments, in this process or another, see the same records (memory excepted).
    """
    if backend == "memory":
        return MemoryStore(clock=clock)
    if backend in ("sqlite", "postgres"):
        from sagaguard.idempotency.stores.sql import SqlStore

        return SqlStore(url, clock=clock, table_name=table_name)
    if backend in ("redis", "cluster"):
        from sagaguard.idempotency.stores.redis import RedisStore

        return RedisStore(url, clock=clock, prefix=prefix)
    raise ValueError(f"unknown backend {backend!r}")


def race_claims_in_processes(
    spec: dict[str, Any],
    identity: EffectIdentity,
    *,
    fingerprint: str,
    lease: float,
    round_times: Sequence[float],
    processes: int = 8,
    timeout: float = 120.0,
) -> list[list[dict[str, Any]]]:
    """Start ``processes`` children that each claim ``identity`` once per round, all at once.

    Args:
        spec: ``backend``, ``url``, ``table_name``, ``prefix`` of the store to open (see
            ``StoreFactory.spec`` in conftest).
        round_times: the children's (frozen) clock in each round.

    Returns:
        Per round, one dict per child: ``outcome``, ``token``, ``attempts``, ``state``.

    Raises:
        AssertionError: a child failed; its stderr is in the message.
    """
    gates = [os.pipe() for _ in round_times]
    child_spec = {
        **spec,
        "identity": [identity.namespace, identity.scope, identity.name, identity.ordinal],
        "fingerprint": fingerprint,
        "lease": lease,
        "rounds": [{"now": t, "gate": r} for t, (r, _) in zip(round_times, gates, strict=True)],
    }
    read_ends = [r for r, _ in gates]
    # The project root goes on the path, so children import this checkout even when it is not
    # installed (pytest puts it on the parent's path via rootdir, not via the environment).
    root = str(Path(__file__).resolve().parent.parent)
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path}
    procs = [
        subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), json.dumps(child_spec)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            pass_fds=read_ends,
            env=env,
        )
        for _ in range(processes)
    ]
    try:
        for fd in read_ends:
            os.close(fd)
        for proc in procs:
            _expect_line(proc, "ready")
        results: list[list[dict[str, Any]]] = []
        for _, write_end in gates:
            os.close(write_end)  # opens the gate for every child at once
            results.append([json.loads(_expect_line(proc, None)) for proc in procs])
        for proc in procs:
            _, err = proc.communicate(timeout=timeout)
            assert proc.returncode == 0, f"claim child exited {proc.returncode}:\n{err}"
        return results
    finally:
        for _, write_end in gates:
            with contextlib.suppress(OSError):  # already closed when its round ran
                os.close(write_end)
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _expect_line(proc: subprocess.Popen[str], expected: str | None) -> str:
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    if not line or (expected is not None and line != expected):
        proc.kill()
        _, err = proc.communicate()
        raise AssertionError(f"claim child said {line!r} instead of {expected or 'a result'}:\n{err}")
    return line


def _child(spec: dict[str, Any]) -> None:
    now = [spec["rounds"][0]["now"]]
    store = open_backend(
        spec["backend"],
        spec["url"],
        clock=lambda: now[0],
        table_name=spec.get("table_name"),
        prefix=spec.get("prefix"),
    )
    identity = EffectIdentity.of(*spec["identity"])
    store.get(identity.key)  # connect before the race, so the race is about the claim
    print("ready", flush=True)
    for rnd in spec["rounds"]:
        now[0] = rnd["now"]
        while os.read(rnd["gate"], 1):  # returns b"" once the parent closes the write end
            pass
        got = store.claim(identity, spec["fingerprint"], spec["lease"])
        print(
            json.dumps(
                {
                    "outcome": str(got.outcome),
                    "token": got.record.token,
                    "attempts": got.record.attempts,
                    "state": str(got.record.state),
                }
            ),
            flush=True,
        )
    store.close()


if __name__ == "__main__":
    _child(json.loads(sys.argv[1]))
