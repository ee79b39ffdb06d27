"""The research-agent crash experiment (issue 6): a fake world, framework children, and the sweep.

- :mod:`_research.world`: the model, search/fetch tools, Stripe and SMTP the agents run against,
  counting every call; the deterministic plan and the expected clean-run report.
- :mod:`_research.langgraph_child`: the LangGraph research agent, run as a child process.
- :mod:`_research.sweep`: clean run, then SIGKILL at each kill point and resume; measured at the world.
- :mod:`_research.agents_child`: the OpenAI Agents SDK variant (a plug-in of the sweep).
- :mod:`_research.zygote`: the fork server the sweep starts each run from (one fresh process per run,
  imports shared).
- :mod:`_research.failing`: the failing agent's sweep (it books and pays, then a later tool fails and
  its calls are undone as an agent saga): kills in the run and in its compensation, a resume at
  once, the worker's sweep; :mod:`_research.failing_common` (the undos, the desk, the worker side),
  :mod:`_research.failing_langgraph` and :mod:`_research.failing_agents` (the children).

``bench/research_agent.py`` runs the full sweep of every variant and writes the docs table;
``bench/research_failing.py`` does the same for the failing agent.

Import as ``_research.*`` with ``tests/`` on ``sys.path`` (as the suite does: pytest puts it there
for ``tests/conftest.py``); children are started with the project root and ``tests/`` on PYTHONPATH.
"""
