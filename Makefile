# Two entry points: `make demo` runs the demo API, `make test` runs the whole test suite.
# Both create the virtualenv and install the pinned requirements on first use.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
HOST ?= 127.0.0.1
PORT ?= 8000
# The test suite's PostgreSQL (trust auth on this machine kind); SQLite runs the same tests too.
TEST_DATABASE_URL ?= postgres://postgres@127.0.0.1:5432/postgres
# The newer Django releases the suite also runs on (they need Python 3.12), and the Python to run
# them with: python3.12 on PATH, else one pyenv installed. Empty: those runs are left out, and said so.
DJANGO_NEXT ?= 6.0.10 6.1.3
PYTHON_NEXT ?= $(shell for p in python3.12 $$HOME/.pyenv/versions/3.12*/bin/python3.12; do \
	"$$p" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null && { echo "$$p"; break; }; done)

.PHONY: demo test test-django-next lint bench clean

$(STAMP): requirements/base.txt requirements/ci.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --disable-pip-version-check -q -r requirements/ci.txt
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python manage.py migrate --noinput -v 0
	$(BIN)/python manage.py seed_demo --url http://$(HOST):$(PORT)
	RATELIMITS_DEMO_TIMER=1 $(BIN)/python manage.py runserver $(HOST):$(PORT)

test: $(STAMP)
	$(BIN)/ruff check ratelimits project tests bench
	$(BIN)/mypy
	DATABASE_URL=$(TEST_DATABASE_URL) $(BIN)/pytest
	DATABASE_URL=sqlite:///:memory: $(BIN)/pytest -m django_db
	$(MAKE) --no-print-directory test-django-next

# Every suite but the slow multi-process ones, on SQLite, once per newer Django release.
test-django-next:
	@if [ -z "$(PYTHON_NEXT)" ]; then \
		echo "*** no Python 3.12 found: the suite did NOT run on Django $(DJANGO_NEXT) (set PYTHON_NEXT)"; exit 0; fi
	@set -e; for version in $(DJANGO_NEXT); do \
		venv=.venv-django-$$version; \
		if [ ! -f $$venv/.installed ] || [ requirements/ci.txt -nt $$venv/.installed ]; then \
			test -x $$venv/bin/python || "$(PYTHON_NEXT)" -m venv $$venv; \
			$$venv/bin/pip install --disable-pip-version-check -q -r requirements/ci.txt; \
			$$venv/bin/pip install --disable-pip-version-check -q "Django==$$version"; \
			touch $$venv/.installed; \
		fi; \
		echo "--- Django $$version on $$($$venv/bin/python -V)"; \
		DATABASE_URL=sqlite:///:memory: $$venv/bin/pytest -q -m "not slow"; \
	done

bench: $(STAMP)
	$(BIN)/python -m bench

clean:
	rm -rf $(VENV) .venv-django-* demo.sqlite3
