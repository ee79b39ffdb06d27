# The two commands a newcomer runs: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint typecheck docs bench clean slow

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/sagaguard demo

test: $(STAMP)
	$(PY) -m pytest -q

slow: $(STAMP)
	$(PY) -m pytest -q -m slow

lint: $(STAMP)
	$(VENV)/bin/ruff check idempotency saga connectors tests bench
	$(VENV)/bin/mypy --strict idempotency saga connectors

docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict --site-dir site

bench: $(STAMP)
	$(PY) -m pip install -q -e '.[bench]'
	$(PY) bench/guard.py

clean:
	rm -rf $(VENV) site .pytest_cache .mypy_cache .ruff_cache
