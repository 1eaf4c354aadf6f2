# `make serve` and `make test` do all the set-up on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed

.PHONY: install serve test clean proto

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# The CPU wheel of torch first: anything installed before it would pull a CUDA build.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/pdserve up

test: $(STAMP)
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q tests

proto: $(STAMP)
	$(PY) -m proto.generate

clean:
	rm -rf $(VENV) build *.egg-info
