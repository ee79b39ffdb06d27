"""Run under the CrewAI venv by tests/test_crewai_answers.py: rebuilds journaled model answers and
prints what happened as one JSON line."""

from __future__ import annotations

import json
import sys
from typing import Any

from crewai import Agent, Crew, Task
from pydantic import BaseModel

from sagaguard.connectors.frameworks.crewai import CrewGuard, UnknownAnswerType, dump_answer, load_answer
from sagaguard.idempotency import Guard, MemoryStore


class Verdict(BaseModel):
    ok: bool
    reason: str


class Other(BaseModel):
    n: int


def outcome(fn: Any) -> str:
    try:
        value = fn()
    except UnknownAnswerType as exc:
        return f"UnknownAnswerType: {exc}"
    return f"value: {value!r}"


def main() -> None:
    report: dict[str, Any] = {}
    forged = {"model": {"type": "_crewai_canary:Planted", "data": {"value": "x"}}}
    guard = CrewGuard(Guard(MemoryStore()))
    report["forged"] = outcome(lambda: load_answer(forged, guard._models))
    report["forged_in_list"] = outcome(
        lambda: load_answer({"models": [dump_answer(Verdict(ok=True, reason="r"))["model"], forged["model"]]},
                            {**guard._models})
    )
    report["no_registry"] = outcome(lambda: load_answer(dump_answer(Verdict(ok=True, reason="r"))))
    report["canary_imported"] = "_crewai_canary" in sys.modules

    # A type the crew declares (a task's output_pydantic) is rebuilt as itself.
    agent = Agent(role="r", goal="g", backstory="b", llm="gpt-4o-mini")
    task = Task(description="d", expected_output="e", agent=agent, output_pydantic=Verdict)
    declared = CrewGuard(Guard(MemoryStore()))
    declared.protect(Crew(agents=[agent], tasks=[task]))
    rebuilt = load_answer(dump_answer(Verdict(ok=True, reason="r")), declared._models)
    report["declared"] = [type(rebuilt).__name__, rebuilt.model_dump()]
    # ... and one given with models=, but not another of the same module.
    given = CrewGuard(Guard(MemoryStore()), models=[Other])
    report["given"] = outcome(lambda: load_answer(dump_answer(Other(n=3)), given._models))
    verdict = dump_answer(Verdict(ok=False, reason=""))
    report["not_given"] = outcome(lambda: load_answer(verdict, given._models))

    # The model client's tool-call type is known without being named by data.
    from openai.types.chat import ChatCompletionMessageFunctionToolCall

    call = ChatCompletionMessageFunctionToolCall.model_validate(
        {"id": "call_1", "type": "function", "function": {"name": "pay", "arguments": "{}"}}
    )
    back = load_answer(dump_answer([call]), CrewGuard(Guard(MemoryStore()))._models)
    report["tool_call"] = [type(back[0]).__name__, back[0].id]
    report["canary_imported_at_end"] = "_crewai_canary" in sys.modules
    print(json.dumps(report))


if __name__ == "__main__":
    main()
