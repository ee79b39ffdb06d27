"""The research agent on the OpenAI Agents SDK, killed (issue 6): SIGKILLed and resumed from its
session in a fresh process, counted at the world.

The agent (``tests/_research/agents_child.py``) is one SDK ``Agent`` whose model follows the world's
fixed plan, one tool call per answer: search, fetch 11 pages, summarize each (a model call in the
tool), check 15 claims (likewise), write the report (likewise), pay through Stripe, email it. The
conversation lives in an ``SQLiteSession``; the resume goes on from it.

The normal suite kills it at a few points chosen for the gaps the SDK leaves: a loop answer in flight
(it arrived, nothing recorded it), the payment done and recorded but the session not saved (the SDK
saves a step only after its tools finished), and the email accepted by the SMTP server before any
record. With sagaguard the targets hold; the SDK alone charges and emails twice. The full sweep of
both variants (76 kill points each) is ``tests/test_research_agent.py::test_full_sweep`` (``-m
sweep``), which takes every variant of ``_research.sweep.PLUGINS``; ``bench/research_agent.py``
writes its table into docs/frameworks/research_agent.md.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from _research.agents_child import SWEEP_POINTS, answers_in, final_text, variants
from _research.sweep import Outcome, SweepResult, check_clean, experiment, sweep
from _research.world import AGENT_MODEL_CALLS, AGENT_STEPS, ResearchWorld, expected_report

pytestmark = pytest.mark.timeout(300)

GUARDED, PLAIN = variants()
LOOP_IN_FLIGHT = "model_answered#59"
"""The loop's 36th answer (asking for the 13th claim check; the 59th model answer of the run, the
tools' own included) arrived; nothing recorded it yet."""
PAID_NOT_SAVED = "exit:pay#1"
"""The charge is done (and recorded under sagaguard); the session has not saved the step."""
EMAIL_SENT = "email_sent"
"""The SMTP server accepted the message; nothing recorded it yet."""
SUBSET = (LOOP_IN_FLIGHT, PAID_NOT_SAVED, EMAIL_SENT)


@pytest.fixture(scope="module")
def world() -> Iterator[ResearchWorld]:
    with ResearchWorld() as running:
        yield running


@pytest.fixture(scope="module")
def guarded(world: ResearchWorld, tmp_path_factory: pytest.TempPathFactory) -> SweepResult:
    return sweep(world, GUARDED, tmp_path_factory.mktemp("agents-guarded"), points=SUBSET)


@pytest.fixture(scope="module")
def plain(world: ResearchWorld, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Outcome]:
    # No clean run of its own (time): the clean run's counts are the world's constants, which the
    # sagaguard clean run checks.
    folder = tmp_path_factory.mktemp("agents-plain")
    return {
        p: experiment(world, PLAIN, p, folder / str(i)) for i, p in enumerate((PAID_NOT_SAVED, EMAIL_SENT))
    }


def test_the_clean_run_writes_the_expected_report_and_pays_and_emails_once(guarded: SweepResult) -> None:
    check_clean(guarded)
    counted = guarded.clean.counters
    assert (counted["model_calls"], counted["charges"], counted["emails"]) == (AGENT_MODEL_CALLS, 1, 1)
    assert (counted["model_calls_agent"], counted["searches"], counted["fetches"]) == (AGENT_STEPS, 1, 11)
    assert (guarded.clean.result["paid"], guarded.clean.result["replayed"]) == (AGENT_STEPS, 0)


def test_the_sweep_points_are_the_run_s_and_cover_every_tool(guarded: SweepResult) -> None:
    assert (GUARDED.points, PLAIN.points, GUARDED.guarded, PLAIN.guarded) == (
        SWEEP_POINTS,
        SWEEP_POINTS,
        True,
        False,
    )
    assert len(SWEEP_POINTS) >= 50
    assert [p for p in SWEEP_POINTS if p not in guarded.traced] == []
    tools = {p.removeprefix("body:").partition("#")[0] for p in SWEEP_POINTS if p.startswith("body:")}
    assert tools == {"search", "fetch", "summarize", "check_claim", "write_report", "pay", "send_email"}
    kinds = {p.partition("#")[0].partition(":")[0] for p in SWEEP_POINTS}
    assert kinds >= {"session_saved", "model_answered", "model_returned", "body", "exit", "charge_applied"}


def test_sagaguard_meets_the_targets_at_every_kill_point(guarded: SweepResult) -> None:
    """0 duplicate charges and emails, at most the one in-flight model call re-paid, same report."""
    assert [o.point for o in guarded.outcomes] == list(SUBSET)
    assert {o.point: guarded.misses(o) for o in guarded.outcomes} == {p: [] for p in SUBSET}
    outcome = {o.point: o for o in guarded.outcomes}

    # The answer in flight was lost with the process: asked again (1 re-paid), under the same
    # ordinal, since the resume counts the answers the session holds (35 steps saved).
    assert guarded.repaid(outcome[LOOP_IN_FLIGHT]) == 1
    assert outcome[LOOP_IN_FLIGHT].result["paid"] == AGENT_STEPS - 35

    # The session lost the pay step; its answer is replayed from the journal with the same
    # tool_call_id, so the pay tool returns its record: no charge, no model call paid again.
    assert guarded.repaid(outcome[PAID_NOT_SAVED]) == 0
    assert (outcome[PAID_NOT_SAVED].result["replayed"], outcome[PAID_NOT_SAVED].result["paid"]) == (1, 2)
    assert outcome[PAID_NOT_SAVED].counters["payment_intents"] == 1

    # Delivered, the answer lost with the process: SMTP cannot be asked, so the send is parked for
    # an operator (at most once) and the run finishes with its report; nobody is emailed twice.
    assert outcome[EMAIL_SENT].result["email"] == "in_doubt"
    assert outcome[EMAIL_SENT].counters["emails"] == 1


def test_the_sdk_alone_asks_again_and_charges_and_emails_twice(plain: dict[str, Outcome]) -> None:
    for outcome in plain.values():
        assert outcome.killed and outcome.finished, outcome.error
        assert outcome.report == expected_report()  # the content is deterministic here
    # The session never saved the pay step: the resumed run asks the model again (new tool call
    # id) and the pay tool charges again, under the SDK's fresh random idempotency key.
    paid = plain[PAID_NOT_SAVED].counters
    assert (paid["model_calls"] - AGENT_MODEL_CALLS, paid["charges"], paid["emails"]) == (1, 2, 1)
    emailed = plain[EMAIL_SENT].counters
    assert (emailed["model_calls"] - AGENT_MODEL_CALLS, emailed["charges"], emailed["emails"]) == (1, 1, 2)


def test_the_resume_reads_answers_and_the_final_text_off_the_session() -> None:
    user = {"role": "user", "content": "topic"}
    call = {"type": "function_call", "call_id": "c1", "name": "search", "arguments": "{}"}
    out = {"type": "function_call_output", "call_id": "c1", "output": "x"}
    second = {"type": "function_call", "call_id": "c2", "name": "fetch", "arguments": "{}"}
    text = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "done"}]}
    assert answers_in([]) == 0
    assert answers_in([user]) == 0
    assert answers_in([user, call, out]) == 1
    assert answers_in([user, call, second, out, out]) == 1  # parallel calls: one answer
    assert answers_in([user, call, out, second, out, text]) == 3
    # Done once the session ends with the agent's text: a resume then calls nothing.
    assert [final_text(items) for items in ([], [user], [user, call, out], [user, call, out, text])] == [
        None,
        None,
        None,
        "done",
    ]
