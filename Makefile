# One command for each thing a user does. `make test` sets everything up itself.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# Pinned: on these machines pip takes this CPU build from local disk; an unpinned
# torch would download a multi-GB CUDA build.
TORCH  := torch==2.13.0
STAMP  := $(VENV)/.installed
LINT   := $(wildcard hyper_parallel tests benchmarks examples docs/_hooks)

.PHONY: install test test-fast lint format demo bench docs matrix clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check "$(TORCH)"
	$(PY) -m pip install -q --disable-pip-version-check -e ".[test,docs,hf]" "$(TORCH)"
	touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check $(LINT)
	$(VENV)/bin/ruff format --check $(LINT)

format: $(STAMP)
	$(VENV)/bin/ruff check --fix $(LINT)
	$(VENV)/bin/ruff format $(LINT)

test: $(STAMP) lint
	$(PY) -m pytest

test-fast: $(STAMP)
	$(PY) -m pytest -m "not slow and not distributed"

demo: $(STAMP)
	$(VENV)/bin/hyper-parallel demo --mesh dp=2,tp=2

# Every configuration of the matrix (tests/matrix): refused with the same finding by every
# gate, or trained on gloo ranks and matched to one device; one row each, then a summary.
matrix: $(STAMP)
	$(PY) -m tests.matrix.run_matrix

# Measures every section, then writes docs/benchmarks.md's table and the quoted figures.
bench: $(STAMP)
	$(PY) benchmarks/run_all.py --write-docs

docs: $(STAMP)
	$(VENV)/bin/mkdocs serve

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache outputs site
