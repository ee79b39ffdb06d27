"""The walk of one LangGraph saga tool call: which sagaguard files it visits, and how many calls.

From LangGraph handing the tool call to the adapter to the tool's result, inside an open agent run
on SQLite, profiled with ``sys.setprofile`` (every thread). It counts the library's own functions
only (not LangGraph's, not the tool's body): a measure of how many places a reader follows, not of
speed. The second of two calls is measured (the first imports and prepares).

::

    python bench/toolcall_walk.py                    # ToolGuard(guard, saga=True), the pipeline
    python bench/toolcall_walk.py --api sagatools    # the former SagaTools (deprecated name)

To walk an older tree with the same script: ``git worktree add /tmp/old <commit>``,
``make -C /tmp/old namespace``, then ``PYTHONPATH=/tmp/old/build/namespace python
bench/toolcall_walk.py --api sagatools``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import uuid
from collections import Counter
from types import FrameType
from typing import Any

from langchain_core.messages import AIMessage
from langchain_core.tools import tool
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode

import sagaguard.connectors
from sagaguard.connectors.declare import changes_world
from sagaguard.connectors.frameworks.langgraph import ToolGuard
from sagaguard.idempotency import Guard
from sagaguard.idempotency.stores.sql import SqlStore
from sagaguard.saga.agent import AgentRunner, AgentSaga, UndoRegistry
from sagaguard.saga.journals.sql import SqlJournal

TREE = os.path.dirname(os.path.realpath(os.path.dirname(sagaguard.connectors.__file__)))
UNDOS = UndoRegistry()


@UNDOS.register
def cancel(arguments: dict[str, Any], result: Any | None) -> None:
    """The undo of ``book`` (never run: the walk's run completes)."""


SAGA = AgentSaga("walk", UNDOS)


@tool
def book(hotel: str) -> dict[str, str]:
    """Book a hotel."""
    return {"id": hotel}


class Walk:
    """The library's own calls, counted per file, while :attr:`on`."""

    def __init__(self) -> None:
        self.files: Counter[str] = Counter()
        self.on = False

    def __call__(self, frame: FrameType, event: str, arg: object) -> None:
        if not self.on or event != "call":
            return
        path = os.path.realpath(frame.f_code.co_filename)
        if path.startswith(TREE + os.sep) and os.sep + "." not in path[len(TREE) :]:
            top = os.path.relpath(path, TREE).split(os.sep)[0]
            if top in {"idempotency", "saga", "connectors"}:
                self.files[os.path.relpath(path, TREE)] += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--api", choices=["toolguard", "sagatools"], default="toolguard")
    api = parser.parse_args().api
    url = f"sqlite:///{tempfile.mkdtemp()}/walk.db"
    guard = Guard(SqlStore(url), namespace="walk")
    runner = AgentRunner(SqlJournal(url), guard, sleep=lambda _s: None)
    declare = {"book": changes_world(undo="cancel")}
    handler: Any
    if api == "sagatools":
        from sagaguard.connectors.frameworks.langgraph_saga import SagaTools

        handler = SagaTools(declare, inner=ToolGuard(guard))
    else:
        handler = ToolGuard(guard, saga=True, declare=declare)
    node = ToolNode([book], wrap_tool_call=handler.wrap_tool_call, handle_tool_errors=False)
    builder = StateGraph(MessagesState)
    builder.add_node("tools", node)
    builder.add_edge(START, "tools")
    graph = builder.compile()
    walk = Walk()
    for i in range(2):
        call = {"name": "book", "args": {"hotel": f"h{i}"}, "id": f"call_{i}"}
        with runner.run(SAGA, uuid.uuid4().hex):
            walk.on, walk.files = i == 1, Counter()
            threading.setprofile(walk)  # type: ignore[arg-type]  # ToolNode runs tools in a pool
            sys.setprofile(walk)  # type: ignore[arg-type]
            try:
                graph.invoke({"messages": [AIMessage("", tool_calls=[call])]})
            finally:
                sys.setprofile(None)
                threading.setprofile(None)  # type: ignore[arg-type]
                walk.on = False
    print(f"{api}: {len(walk.files)} files, {sum(walk.files.values())} calls of the library's functions")
    for path, calls in sorted(walk.files.items()):
        print(f"  {calls:4d}  {path}")


if __name__ == "__main__":
    main()
