# The two commands a newcomer runs: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# CrewAI pins openai<3, openai-agents needs openai>=3: CrewAI's tests run children in their own venv.
CREW_VENV ?= .venv-crewai
CREW_STAMP := $(CREW_VENV)/.installed
# The MCP reference servers from the package index (tests/test_mcp_reference.py), each in a venv of its
# own: mcp-server-sqlite needs the 1.x SDK, the mcp extra the 2.x one.
MCPREF_STAMP := .venv-mcp-git/.installed .venv-mcp-sqlite/.installed

.PHONY: demo agent-demo test lint typecheck docs bench clean slow sweep cluster ci namespace

SHELL := bash

# Create the virtualenv and install sagaguard with its dev extras, once (again when pyproject changes).
$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "sagaguard needs Python 3.11+, $(PYTHON) is " + sys.version.split()[0] + " (try: make PYTHON=python3.11 ...)")'
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

$(CREW_STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(CREW_VENV)
	$(CREW_VENV)/bin/python -m pip install -q --upgrade pip
	$(CREW_VENV)/bin/python -m pip install -q -e '.[crewai,stripe]'
	# pytest runs the CrewAI rows of the tool-call conformance table here (tests/test_toolcall_conformance.py).
	$(CREW_VENV)/bin/python -m pip install -q 'pytest>=8' 'pytest-timeout>=2.3'
	touch $(CREW_STAMP)

.venv-mcp-git/.installed:
	$(PYTHON) -m venv .venv-mcp-git
	.venv-mcp-git/bin/python -m pip install -q mcp-server-git
	touch $@

.venv-mcp-sqlite/.installed:
	$(PYTHON) -m venv .venv-mcp-sqlite
	.venv-mcp-sqlite/bin/python -m pip install -q mcp-server-sqlite 'mcp<2'
	touch $@

demo: $(STAMP)
	$(VENV)/bin/sagaguard demo

# The agent demo: a LangGraph agent's tool calls undone by an agent saga (connectors/demo/agent.py).
agent-demo: $(STAMP)
	$(VENV)/bin/sagaguard demo agent

# Postgres (127.0.0.1:5432) and Redis (127.0.0.1:6379) tests are skipped when absent, required when CI=true.
# The suite runs in TEST_WORKERS processes (pytest-xdist), a test file's tests in one of them, since
# most of its time is spent waiting for child processes and servers.
TEST_WORKERS ?= 2
test: $(STAMP) $(CREW_STAMP) $(MCPREF_STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=25

slow: $(STAMP)
	$(PY) -m pytest -q -m slow

# The store and journal contract suites and the crash tests on a local Redis Cluster (tests/_rediscluster.py).
cluster: $(STAMP)
	$(PY) -m pytest -q -m cluster

# The research agent killed at every point, each framework with and without sagaguard (docs/frameworks/research_agent.md).
sweep: $(STAMP)
	$(PY) -m pytest -q -m sweep

# The three folders install as sagaguard.idempotency, sagaguard.saga and sagaguard.connectors
# (pyproject.toml's package-dir). mypy and the API pages read modules by those names from the files,
# so they read them through a tree of links that lays the folders out as installed.
NAMESPACE := build/namespace
namespace:
	@mkdir -p $(NAMESPACE)/sagaguard
	@for f in __init__.py py.typed; do ln -sfn ../../../sagaguard/$$f $(NAMESPACE)/sagaguard/$$f; done
	@for p in idempotency saga connectors; do ln -sfn ../../../$$p $(NAMESPACE)/sagaguard/$$p; done

# mypy names the files by the tree's paths: its output is turned back into the repository's.
lint: $(STAMP) namespace
	$(VENV)/bin/ruff check sagaguard idempotency saga connectors tests bench
	set -o pipefail; MYPYPATH=$(NAMESPACE) $(VENV)/bin/mypy --strict -p sagaguard \
		| sed -E 's#^$(NAMESPACE)/sagaguard/(idempotency|saga|connectors)/#\1/#; s#^$(NAMESPACE)/##'

typecheck: lint

docs: $(STAMP) namespace
	$(VENV)/bin/mkdocs build --strict --site-dir site

bench: $(STAMP)
	$(PY) -m pip install -q -e '.[bench]'
	$(PY) bench/guard.py

ci:
	.ci/run

clean:
	rm -rf $(VENV) $(CREW_VENV) .venv-mcp-git .venv-mcp-sqlite $(NAMESPACE) site .pytest_cache .mypy_cache .ruff_cache
