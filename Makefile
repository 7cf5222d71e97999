# The few targets a newcomer needs. Everything runs from the project's own .venv.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install test lint up bench clean

install: $(BIN)/infergate

$(BIN)/infergate: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e ".[dev]"
	@touch $@

test: install          ## lint, type-check and run the whole test suite
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/pytest -q

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

up: install            ## a whole local stack on :8000 with demo keys in keys.json
	$(BIN)/infergate up --keys-out keys.json

bench: install         ## open-loop benchmark against a running `make up`
	$(BIN)/python -m loadtest.bench --keys keys.json --rate $${RATE:-1000} --duration $${DURATION:-20}

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .mypy_cache .ruff_cache
