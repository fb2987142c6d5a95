# fencegate — the two commands: `make run` and `make test`.
# Both bootstrap .venv from nothing but a Python >= 3.11 on PATH.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
CONFIG ?= config/fencegate.example.toml

.PHONY: run test check lint docs dist pytest browser bench bench-replication bench-soak profile chaos demo venv clean all hostile

all: test

venv: $(STAMP)

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "fencegate needs Python >= 3.11, found " + sys.version' 
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[embedded,demo,dev,docs,fast]'
	@touch $@

run: $(STAMP)
	$(BIN)/fencegate serve --config $(CONFIG)

# the fast lane: lint, types, import contracts, the unit and Lua tests (well under a minute)
check: lint
	$(BIN)/python -m pytest -n 0 -q tests/unit tests/lua

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy gateway adapters
	$(BIN)/lint-imports

# the console's browser tests drive Debian's chromium (Playwright's own download is never used);
# installed here when missing, as root on a fresh machine (CI), else the tests fail and say why
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	      apt-get install -y -qq --no-install-recommends chromium; \
	  else echo "make: chromium is missing (run as root, or: sudo apt-get install chromium)" >&2; \
	  fi; }

# two workers, each module's tests on one worker (module fixtures, one Redis per worker);
# PYTEST_WORKERS=0 runs everything in this process
PYTEST_WORKERS ?= 2
pytest: $(STAMP) browser
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# the docs site (mkdocs.yml) into site/; --strict: a broken link or anchor, a missing page
# or a page left out of the nav fails it
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

# the sdist and the wheel into dist/ (tests/integration/test_wheel.py installs the wheel);
# a leftover fencegate.egg-info (SOURCES.txt is read back) could put stale files in the sdist
dist: $(STAMP)
	rm -rf build fencegate.egg-info
	$(BIN)/python -m build --outdir dist .

test: lint docs pytest

# the replicated acknowledgement's cost (redis.replicas_acked 1 vs 0, a Valkey primary + replica)
bench-replication: $(STAMP)
	$(BIN)/python -m benchmarks.replication $(BENCH_ARGS)

bench-soak: $(STAMP)
	$(BIN)/python -m benchmarks.soak $(SOAK_ARGS)

chaos: $(STAMP)
	$(BIN)/python -m tests.chaos.harness --long $(CHAOS_ARGS)
	$(BIN)/python -m tests.chaos.replicas --long $(CHAOS_ARGS)
	$(BIN)/python -m tests.chaos.cluster --long $(CHAOS_ARGS)
	$(BIN)/python -m tests.model.explore --bound large

demo: $(STAMP)
	$(BIN)/fencegate demo

# tenant A attacks (async floods, slow receiver, idle sockets, bodies that never arrive)
# while tenant B's calls are timed; loopback only, bounded (HOSTILE_ARGS=--seconds 60)
hostile: $(STAMP)
	$(BIN)/python -m benchmarks.hostile $(HOSTILE_ARGS)

bench: $(STAMP)
	$(BIN)/python -m benchmarks.run $(BENCH_ARGS)
	$(BIN)/python -m benchmarks.cluster $(BENCH_CLUSTER_ARGS)

profile: $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[profile]'
	$(BIN)/python -m benchmarks.profile $(PROFILE_ARGS)

clean:
	rm -rf $(VENV) .fencegate .pytest_cache .mypy_cache .ruff_cache site dist
