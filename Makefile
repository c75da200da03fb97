# Entry points: `make demo` runs the demo API, `make test` runs the whole test suite (what CI runs),
# `make docs` builds the documentation site. Each creates the virtualenv on first use and installs
# what it needs: the demo the runtime requirements (and the docs site's), the tests the CI set.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# One stamp per requirements set: `make demo` then `make test` adds the CI tools to the same venv.
DEMO_STAMP := $(VENV)/.installed-demo
CI_STAMP := $(VENV)/.installed-ci
PIP_INSTALL := $(BIN)/pip install --disable-pip-version-check -q
# Strict: a missing page, link or anchor fails the build (mkdocs.yml's validation). Not --quiet,
# which hides the warnings that strict mode counts, and so passes a broken site.
MKDOCS_BUILD := $(BIN)/mkdocs build --strict --site-dir site
# The browser tests drive Debian's Chromium (never a browser download of Playwright's own).
CHROMIUM := /usr/bin/chromium
# The client distribution, its virtualenv for `make test-client`, and the files its wheel is built from.
CLIENT := clients/python
CLIENT_VENV := .venv-client
CLIENT_STAMP := $(CLIENT_VENV)/.installed
CLIENT_PIP := $(CLIENT_VENV)/bin/pip -q --disable-pip-version-check
CLIENT_FILES := $(shell find $(CLIENT) -type f -not -path '$(CLIENT)/tests/*' -not -path '*/__pycache__/*' \
	-not -path '*.egg-info/*' -not -path '$(CLIENT)/build/*')
HOST ?= 127.0.0.1
PORT ?= 8000
# The test suite's PostgreSQL (trust auth on this machine kind); SQLite runs the same tests too.
TEST_DATABASE_URL ?= postgres://postgres@127.0.0.1:5432/postgres
# The newer Django releases the suite also runs on (they need Python 3.12), and the Python to run
# them with: python3.12 on PATH, else one pyenv installed. Empty: those runs are left out, and said so.
DJANGO_NEXT ?= 6.0.10 6.1.3
PYTHON_NEXT ?= $(shell for p in python3.12 $$HOME/.pyenv/versions/3.12*/bin/python3.12; do \
	"$$p" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null && { echo "$$p"; break; }; done)

.PHONY: demo docs test browser test-client test-django-next lint bench clean settings-reference module-map flake-check

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(DEMO_STAMP): requirements/base.txt requirements/docs.txt pyproject.toml | $(BIN)/python
	$(PIP_INSTALL) -r requirements/base.txt -r requirements/docs.txt
	touch $@

# requirements/ci.txt installs the client distribution (clients/python) editable: its metadata too.
$(CI_STAMP): requirements/base.txt requirements/docs.txt requirements/ci.txt pyproject.toml $(CLIENT)/pyproject.toml | $(BIN)/python
	$(PIP_INSTALL) -r requirements/ci.txt
	touch $@

docs: $(DEMO_STAMP)
	$(MKDOCS_BUILD)

demo: docs
	$(BIN)/python manage.py migrate --noinput -v 0
	$(BIN)/python manage.py seed_demo --url http://$(HOST):$(PORT)
	RATELIMITS_DEMO_TIMER=1 $(BIN)/python manage.py runserver $(HOST):$(PORT)

test: $(CI_STAMP) browser
	$(MKDOCS_BUILD)
	$(BIN)/ruff check ratelimits project tests bench clients
	$(BIN)/mypy
	$(MAKE) --no-print-directory test-client
	DATABASE_URL=$(TEST_DATABASE_URL) $(BIN)/pytest
	DATABASE_URL=sqlite:///:memory: $(BIN)/pytest -m django_db
	$(MAKE) --no-print-directory test-django-next

# Debian's Chromium for the browser tests, installed here in the open when it is missing: as root,
# else through sudo; without either, the command to run is printed and the target fails.
browser:
	@if [ -x $(CHROMIUM) ]; then echo "browser tests: $(CHROMIUM) ($$($(CHROMIUM) --version 2>/dev/null))"; exit 0; fi; \
	if [ "$$(id -u)" = 0 ]; then sudo=""; \
	elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then sudo="sudo -n"; \
	else echo "*** $(CHROMIUM) is missing: the browser tests need Debian's chromium. Run as root:"; \
		echo "***   apt-get update && apt-get install -y chromium"; exit 1; fi; \
	echo "browser tests: $(CHROMIUM) is missing, installing Debian's chromium:"; \
	set -ex; \
	$$sudo env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 update -qq; \
	$$sudo env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 install -y -qq chromium; \
	test -x $(CHROMIUM)

# The client distribution (clients/python) as an integrator installs it: its wheel, built from a
# copy of clients/python (setuptools leaves build/ and *.egg-info behind), alone in a virtualenv of
# its own, installed with --no-index (it needs nothing); then its two extras and the test tools of
# $(CLIENT)/requirements-test.txt. Django and redis-py must be absent, and its tests run against the
# installed wheel (a src layout: the checkout's package is not on the path). The virtualenv is made
# again when a file the wheel is built from changes.
$(CLIENT_STAMP): $(CLIENT_FILES)
	rm -rf $(CLIENT_VENV)
	$(PYTHON) -m venv $(CLIENT_VENV)
	@set -e; work=$$(mktemp -d); trap 'rm -rf "$$work"' EXIT; \
	cp -R $(CLIENT) "$$work/source"; rm -rf "$$work/source/build" "$$work"/source/src/*.egg-info; \
	set -x; \
	$(CLIENT_PIP) wheel --no-deps -w "$$work" "$$work/source"; \
	$(CLIENT_PIP) install --no-index "$$work"/ratelimits_client-*.whl; \
	$(CLIENT_PIP) install -r $(CLIENT)/requirements-test.txt "$$(echo "$$work"/ratelimits_client-*.whl)[requests,httpx]"
	touch $@

test-client: $(CLIENT_STAMP)
	@$(CLIENT_VENV)/bin/python -c 'import importlib.metadata as m, importlib.util as u, sys; \
		found = [name for name in ("django", "rest_framework", "redis") if u.find_spec(name)]; \
		sys.exit(f"the client venv holds {found}") if found else None; \
		print("$(CLIENT_VENV):", " ".join(sorted(d.metadata["Name"] for d in m.distributions())))'
	cd $(CLIENT) && ../../$(CLIENT_VENV)/bin/pytest -q -n 4

# Every suite but the slow multi-process ones, on SQLite, once per newer Django release.
test-django-next:
	@if [ -z "$(PYTHON_NEXT)" ]; then \
		echo "*** no Python 3.12 found: the suite did NOT run on Django $(DJANGO_NEXT) (set PYTHON_NEXT)"; exit 0; fi
	@set -e; for version in $(DJANGO_NEXT); do \
		venv=.venv-django-$$version; \
		if [ ! -f $$venv/.installed ] || [ -n "$$(find requirements -newer $$venv/.installed)" ]; then \
			test -x $$venv/bin/python || "$(PYTHON_NEXT)" -m venv $$venv; \
			$$venv/bin/pip install --disable-pip-version-check -q -r requirements/ci.txt; \
			$$venv/bin/pip install --disable-pip-version-check -q "Django==$$version"; \
			touch $$venv/.installed; \
		fi; \
		echo "--- Django $$version on $$($$venv/bin/python -V)"; \
		DATABASE_URL=sqlite:///:memory: $$venv/bin/pytest -q -m "not slow"; \
	done

bench: $(CI_STAMP)
	$(BIN)/python -m bench

# The suites whose assertions are about time, FLAKE_RUNS times over beside a CPU hog (a busy Python
# process per core, as much CPU as a loaded CI machine leaves), so that a margin too thin shows here,
# not in CI (docs/development.md). Each is here for its timing:
#   test_regions.py          a round waits for just after its second's end, and reads that second
#   test_regions_celery.py   a share follows demand within 2 s under a real beat (2.15 s in CI once)
#   test_policy_lock.py      requests' p99 while a policy table is locked, against a baseline's p99
#   clients/python/tests/test_herd.py     1,000 jittered retries spread flat, a herd without jitter spikes
#   test_local_path.py       paced lease traffic (800/s); decisions on leases never wait on a dead store
#   test_async.py            paced leases on the async path; the demo under uvicorn outruns its refill
#   test_faults.py           a paused Redis: the breaker keeps latency down, recovery within its bound
#   test_policy_loading.py   a locked policy table answered from the snapshot in hand, at once
#   test_throttle.py         a retry at the advised moment is admitted, one clearly earlier is not
#   clients/python/tests/test_retries.py  the client's backoff and advised waits, between arrivals
#   test_client.py           a retry after this app's own 429 waits at least the advice, and passes
#   test_cluster.py          a decision over three paused masters waits one pause, not three
#   test_eviction.py         a stalled or absent Redis never hangs the system checks
#   test_slow_bodies.py      a trickled body's 408 after BODY_TIMEOUT; the others served meanwhile
#   test_dead_workers.py     a killed worker's slots back within a lease of gunicorn's respawn
FLAKE_SUITES ?= tests/test_regions.py tests/test_regions_celery.py tests/test_policy_lock.py \
	clients/python/tests/test_herd.py tests/test_local_path.py tests/test_async.py tests/test_faults.py \
	tests/test_policy_loading.py tests/test_throttle.py clients/python/tests/test_retries.py \
	tests/test_client.py tests/test_cluster.py tests/test_eviction.py tests/test_slow_bodies.py \
	tests/test_dead_workers.py
FLAKE_RUNS ?= 10
# Bounds: a test is stopped after FLAKE_TEST_TIMEOUT s (pytest-timeout), a whole run after
# FLAKE_RUN_TIMEOUT s (SIGINT, so that its fixtures stop what they started; SIGKILL a minute later).
FLAKE_TEST_TIMEOUT ?= 300
FLAKE_RUN_TIMEOUT ?= 900
# PostgreSQL, as `make test` (test_policy_loading.py locks a table), in a database of the check's own
# on TEST_DATABASE_URL's server (created if missing): pytest-django's test database is then
# test_ratelimits_flake_check, never the one a `make test` running meanwhile has.
FLAKE_DATABASE_URL ?= $(dir $(TEST_DATABASE_URL))ratelimits_flake_check
flake-check: $(CI_STAMP)
	@$(BIN)/python -c 'import psycopg, sys, urllib.parse; \
		name = urllib.parse.urlsplit(sys.argv[2]).path.lstrip("/"); \
		server = psycopg.connect(sys.argv[1], autocommit=True, connect_timeout=10); \
		found = server.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone(); \
		found or server.execute(f"CREATE DATABASE \"{name}\"")' '$(TEST_DATABASE_URL)' '$(FLAKE_DATABASE_URL)'
	@logs=$$(mktemp -d /tmp/flake-check.XXXXXX); hogs=""; \
	trap 'kill $$hogs 2>/dev/null; wait $$hogs 2>/dev/null' EXIT; \
	trap 'exit 130' INT TERM; \
	for core in $$(seq $$(nproc)); do $(BIN)/python -c 'while True: pass' & hogs="$$hogs $$!"; done; \
	echo "flake-check: $(FLAKE_RUNS) runs beside $$(nproc) CPU hogs (PIDs$$hogs); logs in $$logs"; \
	green=0; \
	for run in $$(seq $(FLAKE_RUNS)); do \
		started=$$(date +%s); \
		if DATABASE_URL=$(FLAKE_DATABASE_URL) timeout -s INT -k 60 $(FLAKE_RUN_TIMEOUT) \
			$(BIN)/pytest -q --durations=5 --timeout=$(FLAKE_TEST_TIMEOUT) $(FLAKE_SUITES) > $$logs/run-$$run.log 2>&1; then \
			green=$$((green + 1)); echo "run $$run: green ($$(( $$(date +%s) - started )) s)"; \
		else \
			echo "run $$run: RED ($$(( $$(date +%s) - started )) s), $$logs/run-$$run.log:"; \
			grep -E '^(FAILED|ERROR)|Timeout' $$logs/run-$$run.log | head -20; \
		fi; \
	done; \
	echo "flake-check: $$green of $(FLAKE_RUNS) green"; \
	test $$green -eq $(FLAKE_RUNS)

clean:
	rm -rf $(VENV) .venv-django-* $(CLIENT_VENV) demo.sqlite3 site

# docs/configuration.md's tables of every setting, written again from ratelimits.conf's declarations.
settings-reference: $(DEMO_STAMP)
	$(BIN)/python -m tests.support.reference

# docs/architecture.md's module map, written from the modules (tests/test_layers.py checks it).
module-map: $(DEMO_STAMP)
	$(BIN)/python -m tests.support.module_map
