"""The demo answers a JSON body it cannot read with a 400 problem, and logs its 5xx with ``DEBUG=0``.

DRF's ``JSONParser`` turns only a ``ValueError`` into a 400: 100,000 nested ``[`` make ``json.load``
raise ``RecursionError``, which was a 500, and with ``DEBUG=0`` Django logged it nowhere (its
logging prints request errors only with ``DEBUG`` on, and mails them to ``ADMINS`` otherwise).

The slow tests run the demo as it is deployed: ``project.settings`` with ``DEBUG=0`` under
``gunicorn project.wsgi``, on a SQLite file of its own (``migrate`` and ``seed_demo``), its
output in a log file. The 500 is a real one: the table the view reads is renamed away under it.
"""

from __future__ import annotations

import contextlib
import io
import os
import secrets
import shutil
import sqlite3
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from rest_framework.exceptions import NotAuthenticated, ParseError

from project.payments.management.commands.seed_demo import DEMO_KEYS
from project.payments.problems import JSONParser, exception_handler
from ratelimits.checks import composes_problems
from ratelimits.problems import CONTENT_TYPE

from .support.http import Reply, fetch, serving
from .support.processes import Service, gunicorn, manage
from .support.redis_server import free_port

#: Far deeper than Python's recursion limit (1,000 by default) lets ``json`` follow.
DEPTH = 100_000
ACME_KEY = DEMO_KEYS[0][3]
START_TIMEOUT = 30.0
#: How long a line the worker wrote may take to show in its log: written before the response is
#: sent, so at once; the bound only keeps a broken test from hanging.
LOG_TIMEOUT = 10.0


# -- the parser and the handler, in process ------------------------------------------------------


@pytest.mark.parametrize(
    "body",
    [
        b"[" * DEPTH,  # the probe's body: never closed
        b"[" * DEPTH + b"]" * DEPTH,  # well formed, only too deep
        b'{"amount": 500, "metadata": ' + b'{"a": ' * DEPTH + b"1" + b"}" * DEPTH + b"}",
    ],
    ids=["unclosed", "closed", "nested-in-a-charge"],
)
def test_json_nested_too_deep_is_a_parse_error(body: bytes) -> None:
    with pytest.raises(ParseError, match="nested too deeply"):
        JSONParser().parse(io.BytesIO(body), "application/json", {})


def test_json_within_the_limit_parses_as_drfs_parser_does() -> None:
    nested = JSONParser().parse(io.BytesIO(b"[" * 100 + b"]" * 100), "application/json", {})
    depth = 0
    while nested:
        [nested] = nested
        depth += 1
    assert depth == 99 and nested == []
    assert JSONParser().parse(io.BytesIO(b'{"amount": 500}'), "application/json", {}) == {"amount": 500}
    with pytest.raises(ParseError, match="JSON parse error - Expecting"):
        JSONParser().parse(io.BytesIO(b"{bad"), "application/json", {})


def test_a_parse_error_is_a_400_problem_and_the_rest_is_drfs() -> None:
    response = exception_handler(ParseError("JSON parse error - nested too deeply"), {})
    assert response is not None and response.status_code == 400
    assert response["Content-Type"] == CONTENT_TYPE
    assert response.content == (
        b'{"type": "about:blank", "title": "Bad Request", "status": 400, '
        b'"detail": "JSON parse error - nested too deeply"}'
    )
    other = exception_handler(NotAuthenticated(), {})
    assert other is not None and other.status_code == 401 and other["Content-Type"] != CONTENT_TYPE
    assert exception_handler(RuntimeError("a bug"), {}) is None  # DRF re-raises it: a 500, logged


def test_the_demos_handler_still_renders_ratelimits_denials() -> None:
    """What system check ``ratelimits.W002`` reads: the handler calls ratelimits' own first."""
    assert composes_problems(exception_handler)


# -- the demo under gunicorn, DEBUG=0 ------------------------------------------------------------


@dataclass(frozen=True)
class Demo:
    server: Service
    database: Path

    def post_json(self, body: bytes) -> Reply:
        headers = {"Authorization": f"Bearer {ACME_KEY}", "Content-Type": "application/json"}
        return fetch(self.server.port, "POST", "/v1/charges", headers=headers, body=body)


@pytest.fixture(scope="module")
def demo() -> Iterator[Demo]:
    with contextlib.ExitStack() as cleanup:
        home = Path(tempfile.mkdtemp(prefix="ratelimits-demo-errors-"))
        cleanup.callback(shutil.rmtree, home, ignore_errors=True)
        database = home / "demo.sqlite3"
        env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "project.settings",
            "DATABASE_URL": f"sqlite:///{database}",
            "SECRET_KEY": "demo-errors-test-" + secrets.token_hex(8),
            "DEBUG": "0",
            "PYTHONUNBUFFERED": "1",
        }
        env.pop("REDIS_URL", None)  # the memory backend: these tests are about the demo's answers
        manage(env, "migrate", "--noinput", "-v", "0")
        manage(env, "seed_demo")
        server = gunicorn("demo-errors", port=free_port(), logs=home / "logs")
        cleanup.callback(server.stop, grace=10)
        server.start(env)
        server.wait_until(lambda: serving(server.port), START_TIMEOUT, "answer to GET /admin/login/")
        yield Demo(server, database)


def assert_bad_request_problem(reply: Reply, detail: str) -> None:
    assert reply.status == 400, reply.text[:500]
    assert reply.headers["Content-Type"] == CONTENT_TYPE
    body = reply.json()
    assert {k: body[k] for k in ("type", "title", "status")} == {
        "type": "about:blank",
        "title": "Bad Request",
        "status": 400,
    }
    assert body["detail"].startswith("JSON parse error - ") and detail in body["detail"]
    assert "RateLimit-Policy" in reply.headers  # decided under the caller's limits, as any 400 is


@pytest.mark.slow
def test_the_demo_answers_deeply_nested_json_with_a_400_problem(demo: Demo) -> None:
    assert_bad_request_problem(demo.post_json(b"[" * DEPTH), "nested too deeply")
    assert_bad_request_problem(demo.post_json(b"[" * DEPTH + b"]" * DEPTH), "nested too deeply")
    assert demo.post_json(b'{"amount": 500, "currency": "usd"}').status == 201  # the worker serves on


@pytest.mark.slow
def test_the_demo_answers_malformed_json_with_a_400_problem(demo: Demo) -> None:
    assert_bad_request_problem(demo.post_json(b"{bad"), "Expecting property name")
    assert_bad_request_problem(demo.post_json(b'{"amount": 500'), "Expecting ',' delimiter")


@pytest.mark.slow
def test_a_5xx_is_logged_with_debug_off_and_a_4xx_is_not(demo: Demo) -> None:
    assert demo.post_json(b"{bad").status == 400
    database = sqlite3.connect(demo.database)
    try:
        database.execute("ALTER TABLE payments_customer RENAME TO payments_customer_away")
        database.commit()
        reply = fetch(demo.server.port, "GET", "/v1/customers", headers={"Authorization": f"Bearer {ACME_KEY}"})
    finally:
        database.execute("ALTER TABLE payments_customer_away RENAME TO payments_customer")
        database.commit()
        database.close()
    assert reply.status == 500
    demo.server.wait_for_log(r"Internal Server Error: /v1/customers\n", LOG_TIMEOUT, "the 500's log line")
    log = demo.server.log_text()
    assert "no such table: payments_customer" in log  # with its traceback: what to fix
    assert "Bad Request" not in log  # a client's 400 is not the server's error: no line for it
    assert (
        fetch(demo.server.port, "GET", "/v1/customers", headers={"Authorization": f"Bearer {ACME_KEY}"}).status == 200
    )
