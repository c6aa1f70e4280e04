# `make run` and `make test` each build .venv from scratch when it is missing.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
GIN ?= configs/tiny_rollverify.gin

.PHONY: run test lint bench mutants clean

$(VENV)/.installed: pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
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
	$(PY) -m pytest -q -n 2 --dist loadfile

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
	$(PY) scripts/mutation_report.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache mutants .jax_cache
