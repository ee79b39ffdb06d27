"""Email from an agent's tool through the transactional outbox: the tool commits the message and
returns at once; the relay sends it. The agent dies right after the commit and resumes: the tool
runs again, finds the message it committed, and one email reaches the (local) SMTP server."""

import os

import sqlalchemy as sa
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage, HumanMessage
from langchain_core.tools import tool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition

from sagaguard.connectors.email import Email, EmailEffects, SmtpSettings
from sagaguard.connectors.frameworks.langgraph import JournaledChatModel, ToolGuard
from sagaguard.connectors.testing.smtp import SmtpSink
from sagaguard.idempotency import Guard, open_store
from sagaguard.idempotency.outbox import Outbox

store = open_store(os.environ.get("SAGAGUARD_STORE", "sqlite:///agent_email.db"))
guard = Guard(store)
engine = sa.create_engine("sqlite:///outbox.db")  # where the outbox table lives
outbox = Outbox()
outbox.create_tables(engine)
crash = [True]

with SmtpSink() as smtp_server:
    mail = EmailEffects(guard, SmtpSettings(smtp_server.host, smtp_server.port), outbox=outbox,
                        sender="shop@shop.example")  # fmt: skip

    @tool
    def send_receipt(order: str) -> str:
        """Email the customer the receipt of an order."""
        receipt = Email(to=["ada@example.com"], subject=f"Receipt for {order}", text="Thank you.")
        message_id = mail.send_later(engine, receipt)  # committed: the relay sends it
        if crash:
            crash.pop()
            raise RuntimeError("the agent died right after the commit")
        return f"receipt queued ({message_id})"

    answers = iter(
        [
            AIMessage("", tool_calls=[{"name": "send_receipt", "args": {"order": "o-9"}, "id": "call_9"}]),
            AIMessage("The receipt is on its way."),
        ]
    )
    model = JournaledChatModel(inner=GenericFakeChatModel(messages=answers), guard=guard)
    tools = ToolGuard(guard)  # send_receipt stays read-only: its email is an effect of its own

    def agent(state: MessagesState) -> dict[str, list[object]]:
        return {"messages": [model.invoke(state["messages"])]}

    builder = StateGraph(MessagesState)
    builder.add_node("agent", agent)
    builder.add_node("tools", ToolNode([send_receipt], wrap_tool_call=tools.wrap_tool_call))
    builder.add_edge(START, "agent")
    builder.add_conditional_edges("agent", tools_condition)
    builder.add_edge("tools", "agent")
    graph = builder.compile(checkpointer=InMemorySaver())

    config = {"configurable": {"thread_id": "order-o-9"}}
    try:
        graph.invoke({"messages": [HumanMessage("Send the receipt of o-9")]}, config, durability="sync")
    except RuntimeError:
        print("the agent died right after the tool committed the email")
    state = graph.invoke(None, config, durability="sync")  # resumed: the tool finds its message
    outbox.relay(engine).run(until_idle=True)  # the relay delivers; an in-doubt send parks here
    assert smtp_server.count() == 1, smtp_server.count()
    print(f"final answer: {state['messages'][-1].content}; emails sent: {smtp_server.count()}")

engine.dispose()
guard.close()
store.close()
