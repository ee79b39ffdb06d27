"""Client instructions per guarded new call, counted by valgrind's callgrind: the same figure on a
loaded machine as on a quiet one, where CPU time moves by tens of percent from run to run.

::

    .venv/bin/python bench/instructions.py                        # memory, SQLite, Postgres, Redis
    .venv/bin/python bench/instructions.py --backends sqlite --calls 500

Each series of bench/store_cpu.py (the floor; on the SQL backends the store's own statements on
the bare driver; the store's claim and record; the guarded call), and the guarded call on the
memory store, runs in a child process under ``valgrind --tool=callgrind`` twice: with ``--calls``
calls and with none, after the same warm-up; the difference over the calls is the figure. It
counts the user-space instructions of the whole client process (every thread), not the kernel's
(system calls, the fsync) and not the time spent waiting: the Python and C code a call runs,
which is what a change to that code moves. Needs valgrind (Debian's package).
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import shutil
import subprocess
import sys
import tempfile
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SERIES = ("floor", "statements", "store", "guarded")
WARM_UP = 200


def _child(backend: str, series: str, calls: int, args: argparse.Namespace) -> None:
    """Run ``calls`` calls of one series after the warm-up (in the process valgrind watches)."""
    warnings.simplefilter("ignore")  # the Redis store's durability warning, once per child
    import store_cpu

    from sagaguard.idempotency import Guard, MemoryStore

    run_id = uuid.uuid4().hex[:8]
    closers: list[Callable[[], object]] = []
    with tempfile.TemporaryDirectory() as tmp:
        tag = uuid.uuid4().hex[:8]
        store: Any
        floor: Any = None
        if backend == "memory":
            store = MemoryStore()
        else:
            store, floor = store_cpu.subjects(backend, args, tmp, tag)
            closers += [floor.close, store.close]
        guard = Guard(store)
        closers.insert(0, guard.close)
        fn: Callable[[int], object]
        if series == "floor":
            fn = floor.sync
        elif series == "statements":
            made = store_cpu.statements(backend, args, tmp, tag)
            assert made is not None, "no statements series on this backend"
            fn = made[0]
            closers.insert(0, made[1])
        else:
            fn = (
                store_cpu.store_pair(store, run_id)
                if series == "store"
                else store_cpu.guarded_noop(guard, run_id)
            )
        for i in range(WARM_UP):
            fn(i)
        for i in range(WARM_UP, WARM_UP + calls):
            fn(i)
        for close in closers:
            close()
        if backend != "memory":
            store_cpu.clean(backend, args, tag, tables=[f"bench_cpu_{tag}"])


def _instructions(backend: str, series: str, calls: int, args: argparse.Namespace) -> int:
    """Instructions of a child running ``calls`` calls of ``series``, as callgrind counts them."""
    command = [
        "valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null",
        sys.executable, __file__, "--child", backend, series, str(calls),
        "--pg-url", args.pg_url, "--redis-url", args.redis_url,
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    found = re.search(r"refs:\s+([\d,]+)", done.stderr)
    if found is None:
        raise RuntimeError(f"no instruction count in valgrind's output:\n{done.stderr[-2000:]}")
    return int(found.group(1).replace(",", ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backends", default="memory,sqlite,postgres,redis")
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--child", nargs=3, metavar=("BACKEND", "SERIES", "CALLS"), help=argparse.SUPPRESS)
    parser.add_argument("--pg-url", default="postgresql://postgres@127.0.0.1:5432/test")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/5")
    args = parser.parse_args()
    if args.child:
        backend, series, calls = args.child
        _child(backend, series, int(calls), args)
        return
    if shutil.which("valgrind") is None:
        sys.exit("valgrind is not installed (Debian: apt-get install valgrind)")
    print(f"instructions per call, {args.calls} calls after {WARM_UP} (callgrind; pid {os.getpid()})")
    for backend in args.backends.split(","):
        names = ("guarded",) if backend == "memory" else SERIES
        if backend == "redis":
            names = tuple(name for name in names if name != "statements")
        got: dict[str, int] = {}
        for name in names:
            base = _instructions(backend, name, 0, args)
            got[name] = (_instructions(backend, name, args.calls, args) - base) // args.calls
        steps = list(got)
        print(
            f"{backend}: "
            + "; ".join(f"{name} {count:,}" for name, count in got.items())
            + "".join(f"; {b} - {a} {got[b] - got[a]:+,}" for a, b in itertools.pairwise(steps))
        )


if __name__ == "__main__":
    main()
