"""A response against the project's own OpenAPI schema, as drf-spectacular generates it: its status, body and headers.

drf-spectacular (and jsonschema, which it depends on) is imported only when a response is
checked: the kit needs neither. The schema is generated once per URLconf and generated again
after any setting changes.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any, NamedTuple

from django.core.signals import setting_changed
from django.http import HttpRequest
from rest_framework.settings import api_settings

if TYPE_CHECKING:
    from django.http.response import HttpResponseBase

__all__ = ["RATE_LIMIT_HEADERS", "Documented", "Undocumented", "differences", "documented", "request_of"]

#: The response headers of the limiter: a documented response must document those it sends.
RATE_LIMIT_HEADERS = re.compile(r"(x-)?ratelimit(-.+)?|retry-after", re.IGNORECASE)


class Undocumented(NamedTuple):
    """An operation of the schema that documents no response of the status sent."""

    operation: str
    status: int

    def __str__(self) -> str:
        return f"the project's schema documents no {self.status} for {self.operation}"


class Documented(NamedTuple):
    """What the schema says of one response: its operation, and the response object of its status."""

    operation: str
    response: dict[str, Any]
    components: dict[str, Any]


def request_of(response: HttpResponseBase) -> HttpRequest | None:
    """The request Django's (or DRF's) test client made for ``response``; ``None`` for a response made by hand."""
    request = getattr(response, "wsgi_request", None) or getattr(response, "asgi_request", None)
    return request if isinstance(request, HttpRequest) else None


def documented(response: HttpResponseBase) -> Documented | Undocumented | str:
    """The schema's response object for ``response``'s operation and status; or its operation, which
    documents no such status; or why there is nothing to check against."""
    try:
        from drf_spectacular.openapi import AutoSchema
    except ImportError:
        return "drf-spectacular is not installed"
    schema_class = api_settings.DEFAULT_SCHEMA_CLASS
    if not (isinstance(schema_class, type) and issubclass(schema_class, AutoSchema)):
        return "REST_FRAMEWORK['DEFAULT_SCHEMA_CLASS'] is not drf-spectacular's AutoSchema (nor a subclass)"
    request = request_of(response)
    if request is None:
        return "the response carries no request to find its operation by (it was not made by a test client)"
    schema = _schema(getattr(request, "urlconf", None))
    method = (request.method or "GET").lower()
    operation = f"{method.upper()} {request.path_info}"
    found = _operation(schema, _schema_path(request.path_info), method)
    if found is None:
        return f"the project's schema has no operation {operation}"
    path, documented_operation = found
    responses: dict[str, Any] = documented_operation.get("responses", {})
    status = str(response.status_code)
    described = responses.get(status, responses.get("default"))
    if described is None:
        return Undocumented(f"{method.upper()} {path}", response.status_code)
    components: dict[str, Any] = schema.get("components", {})
    return Documented(f"{method.upper()} {path}", _resolved(described, components), components)


def differences(response: HttpResponseBase, found: Documented, *, body: bool) -> list[str]:
    """How ``response`` differs from ``found``: its body (if ``body``) and the rate-limit headers, one line each."""
    problems: list[str] = []
    where = f"the schema's {response.status_code} of {found.operation}"
    if body:
        problems.extend(_body_differences(response, found, where))
    documented_headers = {
        name: _resolved(header, found.components) for name, header in found.response.get("headers", {}).items()
    }
    for name, header in documented_headers.items():
        value = response.headers.get(name)
        if value is None:
            if header.get("required"):
                problems.append(f"{name}: missing, though {where} requires it")
            continue
        schema = header.get("schema", {})
        problems.extend(f"{name}: {value!r} {error}" for error in _errors(_typed(value, schema), schema, found))
    known = {name.lower() for name in documented_headers}
    undocumented = [
        name for name in response.headers if RATE_LIMIT_HEADERS.fullmatch(name) and name.lower() not in known
    ]
    if undocumented:
        problems.append(
            f"{', '.join(undocumented)} sent, but not documented in {where} "
            "(ratelimits.openapi.RateLimitAutoSchema documents them: docs/openapi.md)"
        )
    return problems


def _body_differences(response: HttpResponseBase, found: Documented, where: str) -> list[str]:
    content: dict[str, Any] = found.response.get("content", {})
    media_type = (response.headers.get("Content-Type") or "").split(";")[0].strip()
    if media_type not in content:
        return [f"Content-Type: {media_type!r} is not one {where} documents ({', '.join(content) or 'none'})"]
    schema = content[media_type].get("schema")
    if schema is None:
        return []
    try:
        document = json.loads(getattr(response, "content", b""))
    except ValueError:
        return [f"body: not JSON, though {where} documents {media_type}"]
    return [f"body: {error}" for error in _errors(document, schema, found)]


def _errors(value: Any, schema: dict[str, Any], found: Documented) -> list[str]:
    """Where ``value`` breaks ``schema`` (an OpenAPI schema object whose ``$ref`` point into the components)."""
    from jsonschema import Draft202012Validator  # type: ignore[import-untyped]

    # With the components beside it, the schema's "#/components/..." references resolve.
    validator = Draft202012Validator(_json_schema({**schema, "components": found.components}))
    located = []
    for error in sorted(validator.iter_errors(value), key=lambda e: list(map(str, e.absolute_path))):
        path = "".join(f"[{part!r}]" for part in error.absolute_path)
        located.append(f"{path} {error.message}".strip() if path else error.message)
    return located


def _json_schema(schema: Any) -> Any:
    """An OpenAPI 3.0 schema object as JSON Schema: ``nullable`` becomes a ``null`` alternative."""
    if isinstance(schema, list):
        return [_json_schema(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    converted = {key: _json_schema(value) for key, value in schema.items() if key != "nullable"}
    if schema.get("nullable") is True:
        return {"anyOf": [converted, {"type": "null"}]}
    return converted


def _typed(value: str, schema: dict[str, Any]) -> Any:
    """A header's text as the type its schema gives (the text itself if it is not one)."""
    kind = schema.get("type")
    try:
        if kind == "integer":
            return int(value) if value.strip().lstrip("-").isdigit() else value
        if kind == "number":
            return float(value)
    except ValueError:
        pass
    return value


def _resolved(item: dict[str, Any], components: dict[str, Any]) -> dict[str, Any]:
    """``item``, or what its ``$ref`` (``#/components/<kind>/<name>``) points to."""
    reference = item.get("$ref")
    if not isinstance(reference, str) or not reference.startswith("#/components/"):
        return item
    kind, _, name = reference.removeprefix("#/components/").partition("/")
    resolved: dict[str, Any] = components.get(kind, {}).get(name, {})
    return resolved


def _operation(schema: dict[str, Any], request_path: str, method: str) -> tuple[str, dict[str, Any]] | None:
    """The schema's path template matching ``request_path`` and its operation for ``method``, if it has one."""
    for path, item in schema.get("paths", {}).items():
        pattern = "".join(
            "[^/]+" if part.startswith("{") else re.escape(part) for part in re.split(r"(\{[^}/]+\})", path)
        )
        if re.fullmatch(pattern, request_path) and method in item:
            return path, item[method]
    return None


def _schema_path(path: str) -> str:
    """``path`` as the schema names it: without ``SCHEMA_PATH_PREFIX`` when ``SCHEMA_PATH_PREFIX_TRIM`` is on."""
    from drf_spectacular.settings import spectacular_settings

    prefix = spectacular_settings.SCHEMA_PATH_PREFIX
    if spectacular_settings.SCHEMA_PATH_PREFIX_TRIM and prefix:
        trimmed = re.sub(f"^{prefix}", "", path)
        return trimmed if trimmed.startswith("/") else f"/{trimmed}"
    return path


#: URLconf (``None``: ``ROOT_URLCONF``) -> the schema generated for it.
_schemas: dict[Any, dict[str, Any]] = {}


def _schema(urlconf: Any) -> dict[str, Any]:
    try:
        return _schemas[urlconf]
    except KeyError:
        pass
    from drf_spectacular.drainage import GENERATOR_STATS
    from drf_spectacular.generators import SchemaGenerator

    generator = SchemaGenerator(urlconf=urlconf)  # type: ignore[no-untyped-call]
    # What drf-spectacular would warn of is for `manage.py spectacular --validate` to say, not each test.
    with GENERATOR_STATS.silence():
        generated: dict[str, Any] = generator.get_schema(request=None, public=True)  # type: ignore[no-untyped-call]
    _schemas[urlconf] = generated
    return generated


def _forget(**kwargs: Any) -> None:
    # Any setting may change the schema: the URLconf, REST_FRAMEWORK, SPECTACULAR_SETTINGS, HEADERS.
    _schemas.clear()


setting_changed.connect(_forget, dispatch_uid="ratelimits.testing.schema.forget")
