# dist-nce: two commands on a fresh machine.
#   make demo   create .venv, install, run the main job on its embedded default
#   make test   create .venv if missing, run the test suite
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# What gets installed (the torch pin, faiss-cpu or faiss-gpu, the model package) is decided
# in scripts/install.sh, which docker/Dockerfile and the cluster launcher configs run too.
# FAISS=auto picks faiss-gpu when nvidia-smi lists a GPU; `make venv FAISS=cpu` forces one.
FAISS ?= auto
PYTEST_ARGS ?=

.PHONY: venv demo test test-fast bench clean-venv

venv: $(VENV)/.installed

$(VENV)/.installed: setup.py Makefile scripts/install.sh
	$(PYTHON) -m venv $(VENV)
	scripts/install.sh --python $(PY) $(FAISS)
	touch $@

demo: venv
	$(PY) jobs/demo.py

test: venv
	$(PY) -m pytest -q $(PYTEST_ARGS)

test-fast: venv
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

clean-venv:
	rm -rf $(VENV)
