# `make run` and `make test` each build .venv from scratch when it is missing, with the first of python3.11,
# python3.12, python3.13, python3 that is Python 3.11 to 3.13 (pyproject's requires-python); PYTHON=... picks one.
SUPPORTED := import sys; sys.exit(not (3, 11) <= sys.version_info[:2] <= (3, 13))
ifeq ($(origin PYTHON),undefined)
PYTHON := $(firstword $(foreach p,python3.11 python3.12 python3.13 python3,$(shell command -v $(p) >/dev/null 2>&1 \
	&& $(p) -c '$(SUPPORTED)' 2>/dev/null && echo $(p))))
endif
VENV := .venv
PY := $(VENV)/bin/python
GIN ?= configs/tiny_rollverify.gin

.PHONY: run test lint bench mutants clean

$(VENV)/.installed: pyproject.toml
	@if [ ! -x $(PY) ]; then \
	  if [ -z "$(PYTHON)" ]; then \
	    echo "error: no Python 3.11-3.13 found (tried python3.11, python3.12, python3.13, python3): install one" \
	      "(e.g. apt install python3.11 python3.11-venv, brew install python@3.11, or uv python install 3.11) or" \
	      "pass its path: make PYTHON=/path/to/python3.11 $(MAKECMDGOALS)" >&2; exit 2; fi; \
	  if ! $(PYTHON) -c '$(SUPPORTED)' 2>/dev/null; then \
	    echo "error: PYTHON=$(PYTHON) is not Python 3.11-3.13 ($$($(PYTHON) --version 2>&1)): pass one that is," \
	      "e.g. make PYTHON=python3.11 $(MAKECMDGOALS)" >&2; exit 2; fi; \
	  { $(PYTHON) -m venv $(VENV) && [ -x $(PY) ]; } || { echo "error: $(PYTHON) -m venv made no $(PY): install" \
	    "the venv module (Debian/Ubuntu: apt install python3.X-venv), then make clean and run this again" >&2; \
	    exit 2; }; \
	elif ! $(PY) -c '$(SUPPORTED)' 2>/dev/null; then \
	  echo "error: $(VENV) has $$($(PY) --version 2>&1), not 3.11-3.13: make clean, then make" \
	    "PYTHON=/path/to/python3.11 $(MAKECMDGOALS)" >&2; exit 2; \
	fi
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PY) -m pip install -q -e '.[test]'
	touch $@

run: $(VENV)/.installed
	$(PY) -m rollverify_jax.train --gin_file=$(GIN)

test: $(VENV)/.installed-test
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=15

lint: $(VENV)/.installed-test
	$(VENV)/bin/ruff check .

bench: $(VENV)/.installed
	$(PY) scripts/bench_model.py
	$(PY) scripts/bench_rollout.py

# Mutation testing (not in CI: hours on 2 cores); writes docs/mutation.md. See docs/testing.md.
mutants: $(VENV)/.installed-test
	$(PY) -m pip install -q -e '.[test,mutation]'
	JAX_COMPILATION_CACHE_DIR=$(CURDIR)/.jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 \
		JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0 $(VENV)/bin/mutmut run --max-children 2
	$(PY) -m rollverify_jax.studies.mutation_report

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache mutants .jax_cache
