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
HOST ?= 127.0.0.1
PORT ?= 8000
# The test suite's PostgreSQL (trust auth on this machine kind); SQLite runs the same tests too.
TEST_DATABASE_URL ?= postgres://postgres@127.0.0.1:5432/postgres
# The newer Django releases the suite also runs on (they need Python 3.12), and the Python to run
# them with: python3.12 on PATH, else one pyenv installed. Empty: those runs are left out, and said so.
DJANGO_NEXT ?= 6.0.10 6.1.3
PYTHON_NEXT ?= $(shell for p in python3.12 $$HOME/.pyenv/versions/3.12*/bin/python3.12; do \
	"$$p" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null && { echo "$$p"; break; }; done)

.PHONY: demo docs test browser test-django-next lint bench clean settings-reference

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(DEMO_STAMP): requirements/base.txt requirements/docs.txt pyproject.toml | $(BIN)/python
	$(PIP_INSTALL) -r requirements/base.txt -r requirements/docs.txt
	touch $@

$(CI_STAMP): requirements/base.txt requirements/docs.txt requirements/ci.txt pyproject.toml | $(BIN)/python
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
	$(BIN)/ruff check ratelimits project tests bench
	$(BIN)/mypy
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

clean:
	rm -rf $(VENV) .venv-django-* demo.sqlite3 site

# docs/configuration.md's tables of every setting, written again from ratelimits.conf's declarations.
settings-reference: $(DEMO_STAMP)
	$(BIN)/python -m tests.support.reference
