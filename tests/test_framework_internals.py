"""The framework internals the adapters still read, pinned to the versions where they hold.

LangGraph has no public API for a run's durability mode: the adapter reads
``configurable["__pregel_durability"]`` (docs/frameworks/langgraph.md). This test fails when a
LangGraph release outside the range below is installed, or when the key stops saying the mode, so
the adapter is checked again before such a release is supported.
"""

from __future__ import annotations

from importlib.metadata import version
from typing import Any

from langgraph.checkpoint.memory import InMemorySaver
from langgraph.config import get_config
from langgraph.graph import START, StateGraph
from typing_extensions import TypedDict

from sagaguard.connectors.frameworks.langgraph import check_durability

LANGGRAPH = (1, 2)
"""The LangGraph major versions (from, to excluded) where ``__pregel_durability`` holds."""


class State(TypedDict):
    seen: str


def test_langgraph_is_in_the_range_where_the_durability_key_holds() -> None:
    major = int(version("langgraph").split(".")[0])
    assert LANGGRAPH[0] <= major < LANGGRAPH[1]


def test_the_durability_key_says_the_mode() -> None:
    def node(state: State) -> dict[str, Any]:
        check_durability(strict=True)  # refuses anything but "sync", read from the key
        return {"seen": str(get_config()["configurable"].get("__pregel_durability"))}

    graph = StateGraph(State)
    graph.add_node("node", node)
    graph.add_edge(START, "node")
    compiled = graph.compile(checkpointer=InMemorySaver())
    result = compiled.invoke({"seen": ""}, {"configurable": {"thread_id": "t"}}, durability="sync")
    assert result["seen"] == "sync"
