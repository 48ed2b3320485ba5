# dist-nce: two commands on a fresh machine.
#   make demo   create .venv, install, run the main job on its embedded default
#   make test   create .venv if missing, run the test suite
#   make zeshel the Zeshel path on the tiny CPU config, from nothing to a reranker's U.Acc/N.Acc
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# What gets installed (the torch pin, faiss-cpu or faiss-gpu, the model package) is decided
# in scripts/install.sh, which docker/Dockerfile and the cluster launcher configs run too.
# FAISS=auto picks faiss-gpu when nvidia-smi lists a GPU; `make venv FAISS=cpu` forces one.
FAISS ?= auto
PYTEST_ARGS ?=
# Two pytest processes (pytest-xdist), one test file each at a time: most of the suite waits on
# Ray, DeepSpeed and job start-up rather than computing, so two files share the 2 cores well.
# Module-scoped fixtures (a cluster, a trained run) stay within their file. TEST_WORKERS=0: one process.
# Three were slower on 2 cores: 32 min against 27 for two (fresh clones; the run with three shared the
# machine with about 6 CPU-min of other tests, worth ~3 min), with more Ray clusters up at once.
# Files go out longest first (tests/durations.json, ordered by tests/conftest.py), so xdist's own
# reordering (most tests first) is off.
TEST_WORKERS ?= 2
XDIST := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)

# The locks (requirements/*.txt) that scripts/install.sh passes to pip as constraints. `make lock`
# regenerates them from setup.py with uv (`pip install uv`, or UV=/path/to/uv) against PyPI:
# universal (every platform and Python >= 3.10 of setup.py; markers pick the line), one lock per
# FAISS variant, and the dev extra as a separate layer, constrained by both so the packages it
# shares with them have the same pins (Python >= 3.11 there: import-linter 2.17 needs it). The
# variant locks also pin the optional tracking extras (mlflow, wandb): constraints install
# nothing, and `pip install -c requirements/gpu.txt -e '.[gpu,mlflow]'` gets the tested versions.
# Review the diff, then `make clean-venv venv test`.
UV ?= uv
LOCK_FLAGS := --universal --no-python-downloads --default-index https://pypi.org/simple \
	--custom-compile-command "make lock" --quiet
LOCKS := requirements/cpu.txt requirements/gpu.txt requirements/dev.txt

.PHONY: venv demo zeshel test test-fast bench clean-venv lock

venv: $(VENV)/.installed

$(VENV)/.installed: setup.py Makefile scripts/install.sh $(LOCKS)
	$(PYTHON) -m venv $(VENV)
	scripts/install.sh --python $(PY) $(FAISS)
	touch $@

demo: venv
	$(PY) jobs/demo.py

# Synthetic Zeshel worlds -> prepared stores -> retriever (configs/zeshel/retriever_tiny_cpu.yaml; the
# random tiny BERT at data/models/tiny_bert is built by the job on first use) -> its top-64 candidates ->
# the joint reranker over them -> the U.Acc/N.Acc table (runs/zeshel_reranker_tiny/summary.json).
# Running it again reuses the data and resumes or re-reports the finished runs. About 4 min from nothing
# on 2 cores; a wiring check, not a result: the tiny random models stay near chance (N.Acc ~ 1/64).
zeshel: venv
	$(PY) jobs/zeshel_retriever.py --config configs/zeshel/retriever_tiny_cpu.yaml --no-progress
	$(PY) jobs/zeshel_reranker.py --config configs/zeshel/reranker_tiny_cpu.yaml \
	    --set data.candidates_dir=runs/zeshel_tiny/candidates

# The project's own modules are byte-compiled first: where PYTHONDONTWRITEBYTECODE is set (as on these 2-core
# machines), no process writes a .pyc, and each of the hundreds of processes the suite starts (shards, Ray
# Train workers, jobs) compiled again every dist_nce module it imported: ~0.2 CPU-s each, measured. A .pyc
# already there is read whatever that variable says; compileall skips the files that did not change.
COMPILE := $(PY) -m compileall -q dist_nce kb jobs benchmarks tests > /dev/null

test: venv
	$(COMPILE)
	$(PY) -m pytest -q $(XDIST) --durations=25 $(PYTEST_ARGS)

test-fast: venv
	$(COMPILE)
	$(PY) -m pytest -q -m "not slow" $(XDIST) $(PYTEST_ARGS)

clean-venv:
	rm -rf $(VENV)

lock:
	$(UV) pip compile setup.py requirements/base.in --extra gpu --extra mlflow --extra wandb --python-version 3.10 $(LOCK_FLAGS) -o requirements/gpu.txt
	$(UV) pip compile setup.py requirements/base.in --extra cpu --extra mlflow --extra wandb --override requirements/cpu-overrides.txt \
	    --python-version 3.10 $(LOCK_FLAGS) -o requirements/cpu.txt
	$(PYTHON) scripts/extra_requirements.py dev | $(UV) pip compile - -c requirements/cpu.txt -c requirements/gpu.txt \
	    --python-version 3.11 $(LOCK_FLAGS) -o requirements/dev.txt
