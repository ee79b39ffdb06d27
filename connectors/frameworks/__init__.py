"""Agent framework adapters, each importing its framework only in its own module.

- :mod:`~sagaguard.connectors.frameworks.langgraph` (guarded tools, journaled model calls) and
  :mod:`~sagaguard.connectors.frameworks.langgraph_saga` (agent sagas);
- :mod:`~sagaguard.connectors.frameworks.langchain` (``create_agent`` middleware) and
  :mod:`~sagaguard.connectors.frameworks.langchain_saga`;
- :mod:`~sagaguard.connectors.frameworks.openai_agents` and
  :mod:`~sagaguard.connectors.frameworks.openai_agents_saga` (the OpenAI Agents SDK);
- :mod:`~sagaguard.connectors.frameworks.crewai` and :mod:`~sagaguard.connectors.frameworks.crewai_saga`;
- :mod:`~sagaguard.connectors.frameworks.dbos`, :mod:`~sagaguard.connectors.frameworks.dbos_saga`,
  :mod:`~sagaguard.connectors.frameworks.temporal` and
  :mod:`~sagaguard.connectors.frameworks.temporal_saga` (durable-execution engines).

``import sagaguard.connectors.frameworks`` imports no framework.
"""
