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

.PHONY: demo test lint bench clean

$(STAMP): requirements/base.txt requirements/ci.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --disable-pip-version-check -q -r requirements/ci.txt
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python manage.py migrate --noinput -v 0
	$(BIN)/python manage.py seed_demo
	RATELIMITS_DEMO_TIMER=1 $(BIN)/python manage.py runserver $(HOST):$(PORT)

test: $(STAMP)
	$(BIN)/ruff check ratelimits project tests bench
	$(BIN)/mypy
	DATABASE_URL=$(TEST_DATABASE_URL) $(BIN)/pytest
	DATABASE_URL=sqlite:///:memory: $(BIN)/pytest -m django_db

bench: $(STAMP)
	$(BIN)/python -m bench

clean:
	rm -rf $(VENV) demo.sqlite3
