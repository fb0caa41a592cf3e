# Developer shortcuts; every target is also spelled out in the README.
PYTHON ?= python3

.PHONY: install test test-fast lint format bench

install:  ## torch first, pinned: the pin takes the CPU build instead of CUDA packages
	$(PYTHON) -m pip install torch==2.13.0
	$(PYTHON) -m pip install -e ".[dev]"

test:  ## the whole suite, end-to-end scenarios included (what CI runs)
	$(PYTHON) -m pytest -q

test-fast:  ## skip the slow multi-process and end-to-end scenarios
	$(PYTHON) -m pytest -q -m "not slow"

lint:
	ruff check .
	ruff format --check .

format:
	ruff check --fix .
	ruff format .

bench:  ## every benchmark prints its figures; none asserts a time
	for b in bench/bench_*.py; do echo "== $$b"; $(PYTHON) $$b || exit 1; done
