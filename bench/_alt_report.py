"""The markdown block of bench/alternatives.py: the targets, every series, the concurrent rows and
the reading, from the figures of one run."""

from __future__ import annotations

from typing import Any

TITLE = "## Against DBOS and Temporal (`bench/alternatives.py`)"

_WHAT = {
    "bare.charge": "the charge alone, no durability (guard/DBOS group)",
    "bare.charge_2": "the charge alone, no durability (saga/Temporal group)",
    "guard.noop": "`Guard.run`, new key, no-op",
    "guard.charge": "`Guard.run`, new key, the charge",
    "floor.two_commits": "the store's record inserted in one commit and updated in another, bare psycopg",
    "dbos.noop_step": "DBOS no-op step, timed inside its workflow",
    "dbos.charge_step": "DBOS charge step, timed inside its workflow",
    "dbos.noop_workflow": "DBOS workflow of one no-op step, end to end",
    "dbos.charge_workflow": "DBOS workflow of one charge step, end to end",
    "saga.noop_step": "saga of {steps} no-op steps / {steps}",
    "saga.charge_step": "saga of {steps} charge steps / {steps}",
    "temporal.noop_activity": "Temporal workflow of {steps} no-op activities / {steps}",
    "temporal.charge_activity": "Temporal workflow of {steps} charge activities / {steps}",
    "saga.noop_one": "saga of one no-op step, end to end",
    "saga.charge_one": "saga of one charge step, end to end",
    "temporal.noop_one": "Temporal workflow of one no-op activity, end to end",
    "temporal.charge_one": "Temporal workflow of one charge activity, end to end",
}

COMPARISONS: list[tuple[str, str, str, float | None]] = [
    ("guarded effect vs DBOS step, no-op", "guard.noop", "dbos.noop_step", 5.0),
    ("saga step vs Temporal activity, no-op", "saga.noop_step", "temporal.noop_activity", 20.0),
    ("guarded effect vs DBOS step, charge", "guard.charge", "dbos.charge_step", None),
    ("saga step vs Temporal activity, charge", "saga.charge_step", "temporal.charge_activity", None),
    ("guarded effect vs DBOS one-step workflow, no-op", "guard.noop", "dbos.noop_workflow", None),
    ("guarded effect vs DBOS one-step workflow, charge", "guard.charge", "dbos.charge_workflow", None),
    ("one-step saga vs one-activity workflow, no-op", "saga.noop_one", "temporal.noop_one", None),
    ("one-step saga vs one-activity workflow, charge", "saga.charge_one", "temporal.charge_one", None),
]
"""(label, sagaguard's series, the alternative's, the target: how many times faster, or None)."""


_HISTORY = {
    "file": "in an SQLite file (`--db-filename`: durable, as the other sides' Postgres is; "
    "`--temporal-history memory` keeps it in memory, the dev server's default)",
    "memory": "in memory (its default; `--temporal-history file` gives it an SQLite file)",
}

_SERVERS = {
    "sagaguard": "the project's Stripe-compatible server (`sagaguard.connectors.testing.LocalStripe`, "
    "its own process; state in memory, idempotency keys kept as Stripe does). Not `localstripe`: "
    "it pickles its whole store to one file in /tmp on every change, so a charge there takes "
    "longer with every charge before it (threefold within 300 charges on this machine) and the "
    "figures would measure that file; `--stripe localstripe` runs it anyway",
    "localstripe": "`localstripe` (its own process; note that it pickles its whole store to /tmp "
    "on every change, so its charges slow down as the run goes on)",
}


def _fmt(us: float) -> str:
    return f"{us / 1000:.2f} ms" if us >= 1000 else f"{us:.0f} µs"


def verdicts(series: dict[str, dict[str, float]]) -> dict[str, bool]:
    """Each target's label: whether the alternative's p50 is at least the target times sagaguard's."""
    return {
        label: series[theirs]["p50"] >= target * series[ours]["p50"]
        for label, ours, theirs, target in COMPARISONS
        if target is not None
    }


def render(results: dict[str, Any], meta: dict[str, Any]) -> str:
    """The markdown between the markers."""
    series, info, steps = results["series"], results["info"], meta["steps"]
    held = verdicts(series)
    out = [
        TITLE,
        "",
        f"Produced by `{meta['command']}` on {meta['date']}. Machine: {meta['machine']}. Load average "
        f"before/after: {meta['load_before']} / {meta['load_after']}. Versions: {meta['versions']}. "
        f"Balance: {meta['balance']}.",
        "",
        "Every subject does the same no-op, or the same real effect: a confirmed PaymentIntent "
        "through the `stripe` SDK (one client, connections kept) at "
        f"{_SERVERS[meta['stripe']]}. sagaguard's store and journal and DBOS's system database are "
        "the same fresh Postgres database; the Temporal "
        "dev server (`temporal server start-dev`) keeps its history "
        f"{_HISTORY[meta['temporal_history']]}; worker and "
        "client run in the bench's process with the SDK's defaults (sandboxed workflows; the no-op "
        "activity `async def`, the charge a sync activity on the worker's thread pool). The saga's "
        "charge step calls the SDK directly, as the activity does (a step calling `StripeEffects` "
        "adds the guard's two commits). Each pair's series run interleaved in small alternating "
        "blocks, so load hits both alike; ratios are of p50s from the same run.",
        "",
        "| comparison | sagaguard p50 (p99) | alternative p50 (p99) | alternative / sagaguard "
        "| target | verdict |",
        "|---|---|---|---|---|---|",
    ]
    for label, ours, theirs, target in COMPARISONS:
        a, b = series[ours], series[theirs]
        verdict = "(context)" if target is None else ("**met**" if held[label] else "**not met**")
        limit = "—" if target is None else f"≥ {target:g}x"
        out.append(
            f"| {label} | {_fmt(a['p50'])} ({_fmt(a['p99'])}) | {_fmt(b['p50'])} ({_fmt(b['p99'])}) "
            f"| {b['p50'] / a['p50']:.1f}x | {limit} | {verdict} |"
        )
    bare = series["bare.charge"]["p50"]
    guard_adds = series["guard.charge"]["p50"] - bare
    dbos_adds = series["dbos.charge_step"]["p50"] - bare
    floor, dbos = series["floor.two_commits"], series["dbos.noop_step"]
    out += [
        "",
        f"The bound under the first target: the two commits a guarded call makes, alone (the store's "
        f"record inserted in one commit and updated in another on the bare driver, nothing checked "
        f"or read back, in the same blocks), took {_fmt(floor['p50'])} ({_fmt(floor['p99'])}); a "
        f"DBOS no-op step was {dbos['p50'] / floor['p50']:.1f}x that. No call that claims before "
        "its effect can be further ahead of a DBOS step on this machine than those two commits are.",
        "",
        f"Over the bare charge (p50 {_fmt(bare)}), the guard adds {_fmt(guard_adds)} and a DBOS step "
        f"{_fmt(dbos_adds)}; over its group's bare charge (p50 {_fmt(series['bare.charge_2']['p50'])}), "
        f"a saga step adds {_fmt(series['saga.charge_step']['p50'] - series['bare.charge_2']['p50'])} "
        "and a Temporal activity "
        f"{_fmt(series['temporal.charge_activity']['p50'] - series['bare.charge_2']['p50'])}."
        + (
            f" The Stripe server counted {info['charges_seen']:,} charges for the "
            f"{info['charges_sent']:,} asked for."
            if info.get("charges_seen") is not None
            else ""
        ),
        "",
        "One client at a time (effects/s: 1 / mean):",
        "",
        "| series | what | p50 | p99 | mean | effects/s | samples |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, s in series.items():
        what = _WHAT.get(name, name).format(steps=steps)
        out.append(
            f"| `{name}` | {what} | {_fmt(s['p50'])} | {_fmt(s['p99'])} | {_fmt(s['mean'])} "
            f"| {1e6 / s['mean']:,.0f} | {int(s['n'])} |"
        )
    clients, rounds, window = meta["clients"], meta["rounds"], meta["window"]
    out += [
        "",
        f"{clients} concurrent clients, no-op (threads; Temporal: as many coroutines on the worker's "
        f"loop), {rounds} rounds of {window:g} s per subject, the subjects taking turns. The guard's "
        f"call is one effect; DBOS's, the saga's and Temporal's a run of {steps} (a DBOS workflow "
        f"of {steps} steps, a saga of {steps} steps, a Temporal workflow of {steps} activities):",
        "",
        "| subject | effects per call | calls | effects/s | call p50 | call p99 |",
        "|---|---|---|---|---|---|",
    ]
    for name, c in results["concurrent"].items():
        out.append(
            f"| {name} | {c['effects_per_call']} | {c['calls']} | {c['effects_per_s']:,.0f} "
            f"| {_fmt(c['p50'])} | {_fmt(c['p99'])} |"
        )
    per_activity = (info["temporal_events"] - info["temporal_events_one"]) / max(1, steps - 1)
    out += ["", _reading(series, info, steps, per_activity)]
    return "\n".join(out)


def _reading(
    series: dict[str, dict[str, float]], info: dict[str, Any], steps: int, per_activity: float
) -> str:
    guard, dbos = series["guard.noop"]["p50"], series["dbos.noop_step"]["p50"]
    floor = series["floor.two_commits"]["p50"]
    workflow = series["dbos.noop_workflow"]["p50"]
    saga, temporal = series["saga.noop_step"]["p50"], series["temporal.noop_activity"]["p50"]
    return (
        "What each side durably writes per call, and why. A guarded call is two commits on the "
        "store's table: the claim before the effect, so that a crash in the middle leaves a record "
        "to resolve instead of a blind re-send, then the result. A DBOS step is one read "
        "transaction (has this step already run?) and one commit of its output after it returns; "
        "nothing is written before it, which is why a crash mid-step runs it again; its workflow "
        "adds a status row at its start and the outcome at its end, which the step's own time "
        "leaves out (the one-step workflow rows include them). A saga step is one journal commit "
        "(the previous step's result, this step started and its compensation registered, before "
        f"it touches the world), plus one for the saga's start: {steps + 1} commits for {steps} "
        "steps. A Temporal activity is a round trip through the server: it persisted "
        f"{info['temporal_events_one']} history events for a one-activity workflow and "
        f"{info['temporal_events']} for {steps} activities, {per_activity:g} per activity "
        "(the activity's scheduled, started and completed, and the workflow task that follows it), "
        "with the worker polling for each activity task and each workflow task. On this run the "
        f"no-op guarded call took {guard / 1000:.2f} ms against {dbos / 1000:.2f} ms for a DBOS "
        f"step ({dbos / guard:.1f}x, target 5x: {_held(dbos / guard, 5)}) and "
        f"{workflow / 1000:.2f} ms for a one-step DBOS workflow ({workflow / guard:.1f}x), and a "
        f"saga step {saga / 1000:.2f} ms against {temporal / 1000:.2f} ms for a Temporal activity "
        f"({temporal / saga:.1f}x, target 20x: {_held(temporal / saga, 20)}). A guarded call "
        "cannot drop below its two commits without giving up the claim before the effect, which "
        "is its promise: the same record written in two commits on the bare driver, with nothing "
        f"checked or read back, took {floor / 1000:.2f} ms in the same blocks: a DBOS step took "
        f"{dbos / floor:.1f}x those two commits and the guarded call {guard / floor:.2f}x, so the "
        f"5x target asks for a guarded call at {dbos / 5 / floor:.2f}x the two commits it makes. "
        "A DBOS step is mostly Python and a guarded call mostly commits, so their "
        "ratio moves with the machine's balance of CPU to fsync. With the charge, both sides add "
        "the same effect, so the ratios are smaller; the targets are read on the no-op, what "
        "durability itself costs. The figures come from 2 cores shared with Postgres, the Temporal "
        "server, the Stripe server and other work: absolute times move from run to run, the "
        "interleaved ratios much less."
    )


def _held(ratio: float, target: float) -> str:
    return "met" if ratio >= target else "not met"
