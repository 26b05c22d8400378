# The project's entry points. `make demo` and `make test` are the README's two commands; each
# runs `make setup` first, which is idempotent (it does nothing when nothing changed).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.setup-stamp

.PHONY: setup system-deps demo test test-cluster test-fuzz test-engines engines-env lint fmt bench bench-deps clean

# Debian packages the tests need: the PostgreSQL and Redis servers (the suite starts throwaway
# ones when DATABASE_URL/REDIS_URL are unset), Chromium for browser tests, docker-compose to
# validate the compose file, promtool (package prometheus, without recommends: the tool, not the
# service) to lint /metrics. Installed only when missing, and only where we are root with apt.
# kubectl (1.21 or newer: `kubectl kustomize` renders deploy/kubernetes in
# tests/test_deploy_kubernetes.py) is not installed here: Debian's kubernetes-client is 1.20,
# whose kustomize cannot read it; install kubectl from the Kubernetes project's packages.
system-deps:
	@missing=""; \
	command -v initdb >/dev/null 2>&1 || ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || missing="$$missing postgresql"; \
	command -v redis-server >/dev/null 2>&1 || missing="$$missing redis-server"; \
	command -v chromium >/dev/null 2>&1 || missing="$$missing chromium"; \
	command -v docker-compose >/dev/null 2>&1 || docker compose version >/dev/null 2>&1 || missing="$$missing docker-compose"; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing:$$missing"; \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null) \
	      || { echo "could not install:$$missing" >&2; exit 1; }; \
	  else echo "missing system packages:$$missing (install them with your package manager)" >&2; fi; \
	fi; \
	command -v kubectl >/dev/null 2>&1 || echo "missing: kubectl 1.21+ (deploy/kubernetes tests fail without it)" >&2; \
	if ! command -v promtool >/dev/null 2>&1 && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null \
	    || echo "could not install promtool (package prometheus); /metrics lint is skipped" >&2; \
	fi

$(STAMP): pyproject.toml requirements.lock
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -c requirements.lock -e '.[dev]'
	touch $(STAMP)

# Front-end assets (chart library, htmx) come from npm and are served as static files.
node_modules/.setup-stamp: package-lock.json
	npm ci --no-audit --no-fund
	touch node_modules/.setup-stamp

setup: $(STAMP) node_modules/.setup-stamp

# The demo needs the runtime dependencies and the fleet extra (its emulator, agent and gateway),
# not the test tools: a fresh clone serves the UI sooner. A full `make setup` satisfies it too.
RUNTIME_STAMP := $(VENV)/.runtime-stamp
$(RUNTIME_STAMP): pyproject.toml requirements.lock
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	test -f $(STAMP) -a $(STAMP) -nt requirements.lock -a $(STAMP) -nt pyproject.toml \
	  || $(PY) -m pip install --quiet -c requirements.lock -e '.[fleet]'
	touch $(RUNTIME_STAMP)

demo: $(RUNTIME_STAMP) node_modules/.setup-stamp
	$(PY) manage.py demo

# Two pytest-xdist workers (TEST_WORKERS=0 runs in one process), a file at a time, so a module's
# fixtures (a demo stack, a browser) start once; each worker has its own PostgreSQL and Redis.
# A Redis of your own (REDIS_URL set) would be one database and one pub/sub space for both
# workers, so the suite then runs in one process.
TEST_WORKERS ?= $(if $(REDIS_URL),0,2)
test: setup system-deps
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# Real engines (a real vLLM on CPU): the vLLM venv and the tiny model are built once into
# $${PRFAAS_CACHE_DIR:-~/.cache/prfaas} (~4-10 min cold, a few seconds warm), then the tests
# marked `engine` run (each starts vLLM: ~1 min; the role flip restarts it three times).
# Not part of `make test`.
engines-env: setup
	$(PY) -m tests.engines.vllm_env prepare

test-engines: engines-env
	$(PY) -m pytest -m engine tests/engines $(PYTEST_ARGS)

# The tests that touch the live stores (telemetry, reservations, the prefix index, the route
# path, ingest, outcomes), with live state on a real Redis Cluster of three masters and three
# replicas that the session starts (PRFAAS_TEST_REDIS_CLUSTER=1), plus the tests marked
# `redis_cluster` (failover, two web replicas). Its own CI stage; about two minutes here.
CLUSTER_TESTS ?= tests/clusters/live tests/scheduling/api/test_route.py \
	tests/scheduling/api/test_live.py tests/scheduling/test_outcomes.py \
	tests/scheduling/test_traffic_store.py tests/scheduling/test_decision_log.py \
	tests/scheduling/test_route_fastpath.py tests/controlplane/test_redis_scripts.py
test-cluster: setup system-deps
	PRFAAS_TEST_REDIS_CLUSTER=1 $(PY) -m pytest -n0 -m "not engine and not fuzz" $(CLUSTER_TESTS) $(PYTEST_ARGS)

# Schemathesis at size: every check, FUZZ_EXAMPLES examples per operation and the stateful
# phase (tests marked `fuzz`), on the test workers. Its own CI stage, not part of `make test`
# (12 examples there). Measured on the 2-core dev machine: 300 examples, 67 tests, 3.5 min.
FUZZ_EXAMPLES ?= 300
test-fuzz: setup system-deps
	FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(PY) -m pytest -n $(TEST_WORKERS) -m "fuzz or not engine" tests/test_openapi_fuzz.py $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy .
	$(VENV)/bin/lint-imports
	$(PY) manage.py makemigrations --check --dry-run

fmt: setup
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# valgrind for bench/instructions.py (instruction counts: what a noisy machine does not move).
bench-deps:
	@command -v valgrind >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq valgrind >/dev/null) \
	      || { echo "could not install valgrind" >&2; exit 1; }; \
	  else echo "missing system package: valgrind (bench/instructions.py needs it)" >&2; exit 1; fi; }

bench: setup bench-deps
	for f in bench/*.py; do $(PY) $$f || exit 1; done

clean:
	rm -rf $(VENV) var .mypy_cache .ruff_cache .pytest_cache
