"""The research-agent crash experiment (issue 6): every kill point of every variant, into the docs.

::

    .venv/bin/python bench/research_agent.py                      # every variant, writes the docs table
    .venv/bin/python bench/research_agent.py --variants LangGraph # only those (others' rows are kept)
    .venv/bin/python bench/research_agent.py --limit 5 --no-write # smoke: 5 kill points each, prints
    .venv/bin/python bench/research_agent.py --render-only        # the docs block from the kept results

For each variant (``tests/_research/sweep.py``: LangGraph with sagaguard and alone, plus the plug-ins
such as the OpenAI Agents SDK): a clean run, then one experiment per kill point (SIGKILL there, resume
in a fresh process until finished), counted at the fake world. Each variant's summary and per-phase
breakdown are kept in ``bench/research_agent.json`` (merged by variant name, so variants can be run
separately) and rendered between ``<!-- research:start -->`` and ``<!-- research:end -->`` in
``docs/frameworks/research_agent.md``, with the commands that produced them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
for entry in (ROOT, ROOT / "tests"):  # the project, and tests/ for the harness (_research)
    if str(entry) not in sys.path:
        sys.path.insert(0, str(entry))

from _research.sweep import (  # noqa: E402
    Outcome,
    SweepResult,
    Variant,
    all_variants,
    check_clean,
    clean_run,
    stop_zygotes,
    sweep,
)
from _research.world import ResearchWorld  # noqa: E402

DOC = ROOT / "docs" / "frameworks" / "research_agent.md"
RESULTS = ROOT / "bench" / "research_agent.json"
START, END = "<!-- research:start -->", "<!-- research:end -->"


def record(result: SweepResult, command: str) -> dict[str, Any]:
    """What is kept of one variant's sweep."""
    misses = {o.point: m for o in result.outcomes if (m := result.misses(o))}
    return {
        "summary": result.summary(),
        "phases": result.by_phase(),
        "guarded": result.guarded,
        "misses": misses if result.guarded else {},
        "command": command,
        "when": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.python_implementation()} {platform.python_version()}, {os.cpu_count()} CPUs",
    }


def _mean_max(mean: float, top: int) -> str:
    return f"{mean:.2f} / {top}"


def _count(total: int, points: int) -> str:
    return "0" if total == 0 else f"{total} (at {points} points)"


def render(results: dict[str, dict[str, Any]]) -> str:
    """The markdown block: the summary table, then each variant's per-phase table."""
    lines = [
        "| variant | kill points | model calls re-paid per crash (mean / max) | duplicate charges | "
        "duplicate emails | same report as the clean run | email parked for an operator |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, found in results.items():
        s = found["summary"]
        lines.append(
            f"| {name} | {s['kill_points']} | {_mean_max(s['repaid_mean'], s['repaid_max'])} | "
            f"{_count(s['duplicate_charges'], s['points_with_duplicate_charges'])} | "
            f"{_count(s['duplicate_emails'], s['points_with_duplicate_emails'])} | "
            f"{s['same_report']} / {s['kill_points']} | {s['parked']} |"
        )
    lines.append("")
    lines.append(
        "A clean run pays "
        + ", ".join(f"{f['summary']['clean_model_calls']} model calls ({n})" for n, f in results.items())
        + "."
    )
    for name, found in results.items():
        lines += ["", f"**{name}**, by the step the kill landed in (its first line to its checkpoint):", ""]
        lines += [
            "| step | kill points | re-paid (mean / max) | duplicate charges | duplicate emails "
            "| same report |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for p in found["phases"]:
            lines.append(
                f"| {p['phase']} | {p['kill_points']} | {_mean_max(p['repaid_mean'], p['repaid_max'])} | "
                f"{p['duplicate_charges']} | {p['duplicate_emails']} | {p['same_report']} |"
            )
        if found["guarded"]:
            missed = found["misses"]
            lines.append("")
            lines.append(
                "Targets met at every kill point."
                if not missed
                else "Targets missed at: " + "; ".join(f"`{p}`: {', '.join(m)}" for p, m in missed.items())
            )
    took = ", ".join(f"{n} {f['summary']['seconds']:.0f} s" for n, f in results.items())
    lines += ["", f"Wall time of each sweep (the clean run and every kill point): {took}."]
    lines += ["", "Produced by:", ""]
    for command in sorted({f["command"] for f in results.values()}):
        lines.append(f"    {command}")
    when = sorted({f"{f['when']} ({f['machine']})" for f in results.values()})
    lines += ["", "Run " + "; ".join(when) + "."]
    return "\n".join(lines)


def write_doc(block: str) -> None:
    """Replace the block between the markers in the docs page.

    Raises:
        SystemExit: the page or its markers are missing.
    """
    text = DOC.read_text()
    if START not in text or END not in text:
        raise SystemExit(f"{DOC} has no {START} ... {END} block")
    pattern = re.compile(re.escape(START) + ".*?" + re.escape(END), re.S)
    DOC.write_text(pattern.sub(lambda _: f"{START}\n{block}\n{END}", text))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--variants", default="", help="only variants whose name contains one of these (comma)"
    )
    parser.add_argument(
        "--limit", type=int, default=0, help="at most this many kill points each (evenly spread)"
    )
    parser.add_argument("--no-write", action="store_true", help="print only; keep the docs and results")
    parser.add_argument(
        "--render-only", action="store_true", help="rewrite the docs block from the kept results"
    )
    args = parser.parse_args(argv)
    if args.render_only:
        write_doc(render(json.loads(RESULTS.read_text())))
        print(f"wrote {DOC.relative_to(ROOT)}")
        return 0
    wanted = [w.strip().lower() for w in args.variants.split(",") if w.strip()]
    variants = [v for v in all_variants() if not wanted or any(w in v.name.lower() for w in wanted)]
    if not variants:
        raise SystemExit("no variant matches --variants")
    command = shlex.join(
        [".venv/bin/python", "bench/research_agent.py", *(argv if argv is not None else sys.argv[1:])]
    )
    fresh: dict[str, dict[str, Any]] = {}

    def progress(outcome: Outcome) -> None:
        print(f"  {outcome.point}: killed={outcome.killed} runs={outcome.runs} finished={outcome.finished}",
              flush=True)  # fmt: skip

    with ResearchWorld() as world, tempfile.TemporaryDirectory(prefix="research-") as tmp:
        for i, variant in enumerate(variants):
            print(f"{variant.name}:", flush=True)
            points = None
            if args.limit:
                traced = _points(world, variant, Path(tmp) / f"probe{i}")
                step = max(1, len(traced) // args.limit)
                points = traced[::step][: args.limit]
            result = sweep(world, variant, Path(tmp) / f"v{i}", points=points, progress=progress)
            stop_zygotes(variant)  # the probe above may have started it; one zygote up at a time
            check_clean(result)
            fresh[variant.name] = record(result, command)
            print(json.dumps(result.summary()), flush=True)
            for row in result.rows():
                if result.guarded and (miss := result.misses(_outcome(result, row["point"]))):
                    print(f"  MISSED {row['point']}: {miss}", flush=True)
    # Read the kept results only now: another variant's sweep may have finished meanwhile.
    kept = {**(json.loads(RESULTS.read_text()) if RESULTS.exists() else {}), **fresh}
    order = [v.name for v in all_variants()]
    results = dict(sorted(kept.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else len(order)))
    block = render(results if not args.no_write else fresh)
    print(block)
    if not args.no_write:
        RESULTS.write_text(json.dumps(results, indent=1) + "\n")
        write_doc(block)
        print(f"wrote {DOC.relative_to(ROOT)} and {RESULTS.relative_to(ROOT)}")
    return 0


def _points(world: ResearchWorld, variant: Variant, folder: Path) -> list[str]:
    """The variant's kill points (its own list, else what a clean run traces)."""
    if variant.points is not None:
        return list(variant.points)
    return clean_run(world, variant, folder)[1]


def _outcome(result: SweepResult, point: str) -> Outcome:
    return next(o for o in result.outcomes if o.point == point)


if __name__ == "__main__":
    sys.exit(main())
