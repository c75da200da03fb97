"""The OpenAPI schema (``ratelimits.openapi``): what it documents, and the demo's, against the demo itself.

In process: views of this module's own through drf-spectacular's generator (which operations get
the 429, the 503 and the headers, as ``HEADERS`` says), and what the limiter really sends checked
against what is documented. Then the demo's schema as ``manage.py spectacular --validate
--fail-on-warn`` writes it. Slow: the demo under gunicorn, its Swagger UI from its own static
files, and schemathesis against it (no 500, every response as documented).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections import Counter
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from django.urls import path
from drf_spectacular.generators import SchemaGenerator
from drf_spectacular.openapi import AutoSchema
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema
from drf_spectacular.validation import validate_schema
from rest_framework import generics, serializers
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.throttling import AnonRateThrottle
from rest_framework.views import APIView

from project.payments.management.commands.seed_demo import DEMO_KEYS
from ratelimits.decisions import Decision, Result, Verdict
from ratelimits.headers import rate_limit_headers
from ratelimits.identity import Subject, SubjectKind
from ratelimits.openapi import RETRY_AFTER, RateLimitAutoSchema, documented_headers
from ratelimits.policies import Check, Policy
from ratelimits.problems import CONTENT_TYPE, problem_body, problem_response
from ratelimits.rates import parse_rate
from ratelimits.throttles import RateLimitThrottle

from .support.demo import Demo, demo_server
from .support.http import fetch
from .support.processes import VENV_BIN, manage

IETF = {"RateLimit-Policy", "RateLimit"}
GITHUB = {"X-RateLimit-Limit", "X-RateLimit-Remaining", "X-RateLimit-Used", "X-RateLimit-Reset", "X-RateLimit-Resource"}
EVERY_STYLE = {"X-RateLimit-Degraded", "X-RateLimit-Shadow"}
LOCAL = "X-RateLimit-Local"
PROBLEMS = {"429": "RateLimitQuotaExceeded", "503": "RateLimitReducedCapacity"}


@pytest.fixture(autouse=True)
def rate_limit_schema(settings: Any) -> None:
    """Views built after this (in a test) take ``RateLimitAutoSchema``, as the host's settings would make them."""
    settings.REST_FRAMEWORK = {
        **settings.REST_FRAMEWORK,
        "DEFAULT_SCHEMA_CLASS": "ratelimits.openapi.RateLimitAutoSchema",
    }
    settings.RATELIMITS = {"BACKEND": "memory"}


class ItemSerializer(serializers.Serializer):  # type: ignore[type-arg]
    name = serializers.CharField()


class Limited(generics.GenericAPIView):  # type: ignore[type-arg]
    serializer_class = ItemSerializer
    throttle_classes = [RateLimitThrottle]

    def get(self, request: Request) -> Response:
        return Response({"name": "x"})


class OwnThrottle(RateLimitThrottle):
    """A subclass, as ``RateLimitStatusThrottle`` is."""


class LimitedBySubclass(Limited):
    throttle_classes = [OwnThrottle]


class NotLimited(Limited):
    throttle_classes = [AnonRateThrottle]


def schema_of(*views: type[APIView]) -> dict[str, Any]:
    """The schema of ``views``, routed at ``/<class name>``; valid OpenAPI, or the test fails."""
    patterns = [path(view.__name__, view.as_view()) for view in views]
    schema: dict[str, Any] = SchemaGenerator(patterns=patterns).get_schema(request=None, public=True)
    validate_schema(schema)
    return schema


def operation(schema: dict[str, Any], view: type[APIView], method: str = "get") -> dict[str, Any]:
    found: dict[str, Any] = schema["paths"][f"/{view.__name__}"][method]
    return found


def header_names(response: dict[str, Any]) -> set[str]:
    return set(response.get("headers", {}))


def test_a_limited_operation_gets_its_429_503_and_the_headers_on_every_response() -> None:
    schema = schema_of(Limited)
    responses = operation(schema, Limited)["responses"]
    assert set(responses) == {"200", "429", "503"}
    for status, name in PROBLEMS.items():
        assert responses[status]["content"] == {CONTENT_TYPE: {"schema": {"$ref": f"#/components/schemas/{name}"}}}
        assert responses[status]["headers"]["Retry-After"] == {"$ref": "#/components/headers/Retry-After"}
    documented = IETF | GITHUB | EVERY_STYLE
    assert header_names(responses["200"]) == documented
    assert header_names(responses["429"]) == header_names(responses["503"]) == documented | {"Retry-After"}
    headers = schema["components"]["headers"]
    assert set(headers) == documented | {"Retry-After"}
    assert headers["Retry-After"]["required"] is True
    # None of them is on every response: an exempt endpoint's carry none.
    assert not any(headers[name]["required"] for name in documented)
    assert {"RateLimitQuotaExceeded", "RateLimitReducedCapacity", "RateLimitViolation"} <= set(
        schema["components"]["schemas"]
    )


def test_a_subclass_of_the_throttle_counts_and_another_throttle_does_not() -> None:
    schema = schema_of(LimitedBySubclass, NotLimited)
    assert set(operation(schema, LimitedBySubclass)["responses"]) == {"200", "429", "503"}
    untouched = operation(schema, NotLimited)["responses"]
    assert set(untouched) == {"200"} and "headers" not in untouched["200"]


def test_an_operation_left_alone_has_none_of_it() -> None:
    schema = schema_of(NotLimited)
    assert set(operation(schema, NotLimited)["responses"]) == {"200"}
    assert "headers" not in schema["components"] and set(schema["components"]["schemas"]) == {"Item"}


@pytest.mark.parametrize(
    ("style", "expected"),
    [("ietf", IETF), ("github", GITHUB), ("both", IETF | GITHUB), ("none", set())],
)
@pytest.mark.parametrize("local", [False, True])
def test_the_documented_headers_follow_the_settings(settings: Any, style: str, expected: set[str], local: bool) -> None:
    settings.RATELIMITS = {"BACKEND": "memory", "HEADERS": {"STYLE": style}, "LOCAL_PATH": {"HEADER": local}}
    schema = schema_of(Limited)
    responses = operation(schema, Limited)["responses"]
    every = expected | EVERY_STYLE | ({LOCAL} if local else set())
    assert header_names(responses["200"]) == every
    assert header_names(responses["429"]) == every | {"Retry-After"}
    assert set(schema["components"]["headers"]) == every | {"Retry-After"}


def test_what_the_view_documents_itself_is_kept_and_gets_the_headers() -> None:
    class OwnDenials(APIView):
        throttle_classes = [RateLimitThrottle]

        @extend_schema(
            responses={200: OpenApiTypes.OBJECT, 400: OpenApiTypes.OBJECT, 429: OpenApiTypes.STR},
            parameters=[],
        )
        def get(self, request: Request) -> Response:
            return Response({})

    responses = operation(schema_of(OwnDenials), OwnDenials)["responses"]
    assert set(responses) == {"200", "400", "429", "503"}
    assert set(responses["429"]["content"]) == {"application/json"}  # the view's own, not replaced
    assert "Retry-After" in header_names(responses["429"]) and "Retry-After" not in header_names(responses["400"])
    assert header_names(responses["400"]) >= IETF | GITHUB


def test_a_schema_class_of_the_host_stays_in_use_behind_it() -> None:
    class HostSchema(AutoSchema):
        def get_tags(self) -> list[str]:
            return ["host"]

    class Schema(RateLimitAutoSchema, HostSchema):
        pass

    class Mixed(Limited):
        schema = Schema()

    found = operation(schema_of(Mixed), Mixed)
    assert found["tags"] == ["host"]
    assert {"429", "503"} <= set(found["responses"])


# What the limiter sends, against what the schema says it sends.

KEY = Subject(SubjectKind.API_KEY, "k")
FAST = Policy("tier:free", parse_rate("10/s"), 20)
TRIAL = Policy("trial", parse_rate("1/s"), 1, shadow=True)
NOW_US = 1_796_011_260_000_000


def decisions() -> dict[str, Decision]:
    """An allowed decision that says everything (a shadow violation, leased tokens), a 429, both 503s."""
    allowed = Decision.from_results(
        [Result(Check(FAST, KEY), True, 19, 50_000, 0), Result(Check(TRIAL, KEY), False, 0, 900_000, 900_000)],
        now_us=NOW_US,
    )
    limited = Decision.from_results([Result(Check(FAST, KEY), False, 0, 2_000_000, 66_000)], now_us=NOW_US)
    return {
        "allowed": replace(allowed, local="lease"),
        "limited": limited,
        "shed": Decision(Verdict.SHED, (), retry_after_us=1_000_000),
        "unavailable": Decision(Verdict.UNAVAILABLE, (), retry_after_us=2_000_000, degraded=True),
    }


def coerce(value: str, schema: dict[str, Any]) -> Any:
    """A header's text as its schema's type (the header schemas are strings or integers)."""
    return int(value) if schema["type"] == "integer" else value


@pytest.mark.parametrize("style", ["ietf", "github", "both"])
def test_every_header_the_limiter_sends_is_documented_and_matches(settings: Any, style: str) -> None:
    settings.RATELIMITS = {"BACKEND": "memory", "HEADERS": {"STYLE": style}, "LOCAL_PATH": {"HEADER": True}}
    documented = {header.name: header for header in documented_headers()}
    sent: set[str] = set()
    for name, decision in decisions().items():
        headers = rate_limit_headers(decision)
        if name != "allowed":
            response = problem_response(decision)
            headers = {header: response[header] for header in [*headers, "Retry-After"]}
        for header, value in headers.items():
            schema = RETRY_AFTER.schema if header == "Retry-After" else documented[header].schema
            jsonschema.validate(coerce(value, schema), schema)
        sent |= set(headers)
    assert sent == set(documented) | {"Retry-After"}  # and every documented header was seen


def test_the_problem_bodies_are_documented_member_by_member() -> None:
    components = schema_of(Limited)["components"]
    bodies = {
        "429": [problem_body(decisions()["limited"])],
        "503": [problem_body(decisions()[k]) for k in ("shed", "unavailable")],
    }
    for status, sent in bodies.items():
        schema = components["schemas"][PROBLEMS[status]]
        for body in sent:
            # Validated with the components beside it, so that its $refs resolve.
            jsonschema.validate(body, {**schema, "components": components})
            assert set(schema["required"]) <= set(body) <= set(schema["properties"])
    violation = components["schemas"]["RateLimitViolation"]
    assert set(violation["required"]) == set(violation["properties"]) == set(bodies["429"][0]["violations"][0])


# The demo's schema, as its management command writes it.

#: Every operation of the demo API: all of them are limited by RateLimitThrottle (or the status view's subclass).
DEMO_OPERATIONS = {
    ("get", "/v1/charges"),
    ("post", "/v1/charges"),
    ("get", "/v1/customers"),
    ("get", "/v1/balance"),
    ("post", "/v1/reports/export"),
    ("get", "/v1/rate_limit"),
    ("get", "/v1/usage"),
    ("get", "/v1/usage/quota"),
}


def demo_env(database_url: str) -> dict[str, str]:
    return {**os.environ, "DJANGO_SETTINGS_MODULE": "project.settings", "DATABASE_URL": database_url}


@pytest.fixture(scope="module")
def demo_schema(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """``manage.py spectacular --validate --fail-on-warn`` on the demo's settings: a valid schema, or the test fails."""
    where = tmp_path_factory.mktemp("schema")
    target = where / "schema.json"
    manage(
        demo_env(f"sqlite:///{where / 'demo.sqlite3'}"),
        *("spectacular", "--validate", "--fail-on-warn", "--format", "openapi-json", "--file", str(target)),
    )
    schema: dict[str, Any] = json.loads(target.read_text())
    return schema


def test_the_demo_schema_documents_429_503_and_retry_after_on_every_operation(demo_schema: dict[str, Any]) -> None:
    operations = {(method, route): op for route, item in demo_schema["paths"].items() for method, op in item.items()}
    assert set(operations) == DEMO_OPERATIONS  # the schema and docs views are not part of the API
    for (method, route), found in operations.items():
        responses = found["responses"]
        succeeded = [status for status in responses if status.startswith("2")]
        assert len(succeeded) == 1, (method, route)
        for status, name in PROBLEMS.items():
            assert responses[status]["content"][CONTENT_TYPE]["schema"] == {"$ref": f"#/components/schemas/{name}"}
            assert "Retry-After" in responses[status]["headers"], (method, route, status)
        for status, response in responses.items():
            assert IETF | GITHUB | EVERY_STYLE | {LOCAL} <= header_names(response), (method, route, status)
    assert demo_schema["components"]["securitySchemes"] == {"ApiKey": {"type": "http", "scheme": "bearer"}}


def test_the_demo_documents_its_own_bodies_and_the_status_views(demo_schema: dict[str, Any]) -> None:
    paths = demo_schema["paths"]
    status = paths["/v1/rate_limit"]["get"]
    assert {p["name"]: p.get("required", False) for p in status["parameters"]} == {"endpoint": False, "method": False}
    assert status["responses"]["200"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/RateLimitStatus"
    }
    assert {"from", "to", "granularity", "limit", "offset"} == {
        p["name"] for p in paths["/v1/usage"]["get"]["parameters"]
    }
    assert set(paths["/v1/charges"]["post"]["responses"]) == {"201", "400", "429", "503"}
    assert "requestBody" not in paths["/v1/reports/export"]["post"]


# The demo under gunicorn: its documentation pages and schemathesis.

#: The standard tier's key (100/s, a burst of 200): the run's charges leave every other operation a
#: 2xx to check, whatever the machine's speed. Its 429s come from ``/v1/rate_limit``'s own limit
#: (a burst of 20), which the run spends several times over.
GLOBEX_KEY = next(raw for _, tier, _, raw in DEMO_KEYS if tier == "standard")
#: Cases per operation and phase: enough to meet 2xx, 400 and 429 answers, few enough for ~15 s.
MAX_EXAMPLES = 20
SCHEMATHESIS_TIMEOUT = 120.0
CHECKS = "not_a_server_error,response_schema_conformance,response_headers_conformance,content_type_conformance"


@pytest.fixture(scope="module")
def demo() -> Iterator[Demo]:
    with demo_server("openapi", workers=1, threads=4) as server:
        yield server


def schemathesis(schema: str, demo: Demo, workdir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``schemathesis run`` on ``schema`` against the demo, as the standard tier's key, run in ``workdir``."""
    argv = [
        str(VENV_BIN / "schemathesis"),
        "run",
        schema,
        f"--url=http://127.0.0.1:{demo.port}",
        f"--checks={CHECKS}",
        f"--header=Authorization: Bearer {GLOBEX_KEY}",
        f"--max-examples={MAX_EXAMPLES}",
        "--generation-deterministic",
        "--workers=1",
        "--request-timeout=10",
        "--no-color",
        *args,
    ]
    # Its own directory: no schemathesis.toml of the repository's is read, no report is left there.
    return subprocess.run(argv, cwd=workdir, capture_output=True, text=True, timeout=SCHEMATHESIS_TIMEOUT)


@pytest.mark.slow
def test_the_served_schema_is_the_generated_one(demo: Demo, tmp_path: Path) -> None:
    reply = fetch(demo.port, "GET", "/api/schema/?format=json")
    assert reply.status == 200
    assert "RateLimit" not in reply.headers  # the documentation is not limited
    # Generated on the demo's own database: the integer fields' bounds are the database's.
    target = tmp_path / "schema.json"
    manage(demo_env(demo.database_url), "spectacular", "--format", "openapi-json", "--file", str(target))
    assert reply.json() == json.loads(target.read_text())


@pytest.mark.slow
def test_swagger_ui_is_served_with_its_assets_from_the_demo(demo: Demo) -> None:
    reply = fetch(demo.port, "GET", "/api/docs/")
    assert reply.status == 200 and reply.headers["Content-Type"].startswith("text/html")
    html = reply.text
    assert "://" not in html  # no CDN, nor any other address off the demo
    assets = re.findall(r'<(?:script|link)[^>]*(?:src|href)="([^"]+)"', html)
    assert len(assets) == 4  # the favicon, the stylesheet, the bundle and the standalone preset
    assert all(asset.startswith("/static/drf_spectacular_sidecar/swagger-ui-dist/") for asset in assets), assets
    assert '"validatorUrl": null' in html  # nor does it send the schema to validator.swagger.io
    assert "/api/schema/" in html
    # The demo's static files finders have each of them (runserver serves them; collectstatic copies them).
    found = manage(demo_env(demo.database_url), "findstatic", *(asset.removeprefix("/static/") for asset in assets))
    assert found.stdout.count("drf_spectacular_sidecar/static/drf_spectacular_sidecar/swagger-ui-dist/") == 4


@pytest.mark.slow
def test_schemathesis_finds_no_500_and_every_response_as_documented(demo: Demo, tmp_path: Path) -> None:
    har = tmp_path / "run.har"
    run = schemathesis(
        f"http://127.0.0.1:{demo.port}/api/schema/",
        demo,
        tmp_path,
        "--phases=examples,coverage,fuzzing",
        "--report=har",
        f"--report-har-path={har}",
    )
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert f"{len(DEMO_OPERATIONS)} selected / {len(DEMO_OPERATIONS)} total" in run.stdout
    # The run met every kind of answer the schema documents: it checked them, not only the 2xx.
    entries = json.loads(har.read_text())["log"]["entries"]
    seen = Counter(
        (
            entry["request"]["method"],
            entry["request"]["url"].split("?")[0].split("/", 3)[3],
            entry["response"]["status"],
        )
        for entry in entries
    )
    statuses = {status for (_, _, status) in seen}
    assert {200, 201, 400, 429} <= statuses and 500 not in statuses
    for method, route in DEMO_OPERATIONS:
        assert any(m == method.upper() and r == route.lstrip("/") and s < 300 for m, r, s in seen), (
            method,
            route,
            seen,
        )
    limited = [entry for entry in entries if entry["response"]["status"] == 429]
    names = {header["name"].lower() for entry in limited for header in entry["response"]["headers"]}
    assert {"retry-after", "ratelimit", "x-ratelimit-remaining"} <= names


@pytest.mark.slow
def test_a_schema_that_disagrees_with_the_demo_fails_the_run(
    demo: Demo, demo_schema: dict[str, Any], tmp_path: Path
) -> None:
    """The checks are not vacuous: a header or a problem body documented wrong is caught."""
    wrong = json.loads(json.dumps(demo_schema))
    wrong["components"]["headers"]["X-RateLimit-Remaining"]["schema"] = {"type": "integer", "maximum": -1}
    wrong["components"]["schemas"]["RateLimitQuotaExceeded"]["required"].append("not-sent")
    (tmp_path / "wrong.json").write_text(json.dumps(wrong))
    run = schemathesis(
        "wrong.json", demo, tmp_path, "--phases=coverage", "--include-path=/v1/rate_limit", "--continue-on-failure"
    )
    assert run.returncode != 0, run.stdout
    assert "Response header does not conform to the schema" in run.stdout
    assert "Response violates schema" in run.stdout and '"not-sent" is a required property' in run.stdout
