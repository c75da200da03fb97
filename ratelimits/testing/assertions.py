"""The 429 contract (docs/contract.md) as assertions on the responses of Django's and DRF's test clients."""

from __future__ import annotations

import json
import math
import re
from typing import TYPE_CHECKING, Any

from ..conf import conf
from ..problems import CONTENT_TYPE, QUOTA_EXCEEDED, REDUCED_CAPACITY
from .schema import Documented, Undocumented, differences, documented, request_of

if TYPE_CHECKING:
    from django.http.response import HttpResponseBase

__all__ = ["assert_not_rate_limited", "assert_rate_limited"]

US = 1_000_000
#: The schema class that documents the limiter's responses (ratelimits.openapi, the ``openapi`` extra).
SCHEMA_CLASS = "ratelimits.openapi.RateLimitAutoSchema"
IETF_HEADERS = ("RateLimit-Policy", "RateLimit")
GITHUB_HEADERS = ("X-RateLimit-Limit", "X-RateLimit-Remaining", "X-RateLimit-Used", "X-RateLimit-Reset")
RESOURCE = "X-RateLimit-Resource"
#: The members every violation of a 429 has, and whether each is a count (an integer >= 0) or a name.
VIOLATION_MEMBERS = {
    "policy": str,
    "subject": str,
    "limit": int,
    "remaining": int,
    "window_seconds": int,
    "retry_after_ms": int,
}

# An RFC 9651 List of Strings with parameters, as the IETF RateLimit headers are written.
_VALUE = r'-?\d+|"(?:[^"\\]|\\.)*"|:[A-Za-z0-9+/=]*:|[A-Za-z*][^;,\s"]*'
_PARAMETER = re.compile(rf"\s*;\s*([a-z*][a-z0-9_.*-]*)(?:=({_VALUE}))?")
_NAME = re.compile(r'\s*"((?:[^"\\]|\\.)*)"')


def assert_rate_limited(
    response: HttpResponseBase,
    *,
    policy: str | None = None,
    retry_after: int | None = None,
    openapi: bool | None = None,
) -> dict[str, Any]:
    """Assert that ``response`` is the limiter's 429; return its problem body.

    Checked: the status; ``Retry-After``, an integer of seconds of at least 1, the body's
    ``retry_after_ms`` rounded up (plus at most ``HEADERS['RETRY_AFTER_JITTER']``); the
    ``application/problem+json`` body, every member of it and that they agree; the rate-limit
    headers ``HEADERS['STYLE']`` asks for, well formed, describing a violated policy. ``policy``: a
    policy that must be among the violated ones; ``retry_after``: the ``Retry-After`` expected, in
    seconds.

    ``openapi``: with ``None``, the response is also checked against the project's own OpenAPI
    schema (status, body, headers) when drf-spectacular generates it and it has the request's
    operation; ``True`` fails when it cannot be; ``False`` leaves the schema out.

    An :class:`AssertionError` lists every difference found.
    """
    where = _described(response)
    if response.status_code != 429:
        got = f"{response.status_code} {_reason(response)}{_excerpt(response)}"
        raise AssertionError(f"{where}: expected 429 Too Many Requests, got {got}")
    problems: list[str] = []
    seconds = _retry_after(response, problems)
    body = _problem(response, problems)
    violated: list[str] = []
    if body is not None:
        violated = _problem_differences(body, problems)
        if seconds is not None and isinstance(body.get("retry_after_ms"), int):
            _wait_differences(body["retry_after_ms"], seconds, problems)
    _header_differences(response, problems, violated=violated if body is not None else None)
    if policy is not None and body is not None and policy not in violated:
        problems.append(f"violated-policies: {violated!r} does not name {policy!r}")
    if retry_after is not None and seconds is not None and seconds != retry_after:
        problems.append(f"Retry-After: {seconds}, expected {retry_after}")
    problems.extend(_schema_differences(response, openapi, body=True))
    if problems:
        raise AssertionError(f"{where}: the 429 is not as expected:\n" + "\n".join(f"- {p}" for p in problems))
    return body or {}


def assert_not_rate_limited(response: HttpResponseBase, *, headers: bool = True, openapi: bool | None = None) -> None:
    """Assert that the limiter admitted ``response``'s request: no 429 or limiter's 503, and sane rate-limit headers.

    ``headers``: the rate-limit headers ``HEADERS['STYLE']`` asks for must be there, well formed.
    With ``False`` they may be absent (an exempt endpoint, ``ENABLED`` off); those present must
    still be well formed. ``openapi`` as for :func:`assert_rate_limited`, for the headers only (the body is
    the view's own business).
    """
    where = _described(response)
    if response.status_code == 429 or _is_limiters_503(response):
        raise AssertionError(
            f"{where}: expected a response the limiter admitted, got {response.status_code} "
            f"{_reason(response)}{_excerpt(response)}"
        )
    problems: list[str] = []
    _header_differences(response, problems, violated=None, required=headers)
    problems.extend(_schema_differences(response, openapi, body=False))
    if problems:
        raise AssertionError(
            f"{where}: the rate-limit headers are not as expected:\n" + "\n".join(f"- {p}" for p in problems)
        )


def _retry_after(response: HttpResponseBase, problems: list[str]) -> int | None:
    value = response.headers.get("Retry-After")
    if value is None:
        problems.append("Retry-After: missing")
        return None
    if not (value.isascii() and value.isdigit()) or int(value) < 1:
        problems.append(f"Retry-After: {value!r} is not a whole number of seconds of at least 1")
        return None
    return int(value)


def _problem(response: HttpResponseBase, problems: list[str]) -> dict[str, Any] | None:
    """The response's problem document, if it is one (a line in ``problems`` if not)."""
    media_type = (response.headers.get("Content-Type") or "").split(";")[0].strip()
    if media_type != CONTENT_TYPE:
        hint = (
            " (DRF's own body: set REST_FRAMEWORK['EXCEPTION_HANDLER'] to 'ratelimits.drf.exception_handler')"
            if media_type == "application/json"
            else ""
        )
        problems.append(f"Content-Type: {media_type or 'none'!r}, expected {CONTENT_TYPE!r}{hint}")
        return None
    try:
        body = json.loads(getattr(response, "content", b""))
    except ValueError:
        problems.append(f"body: not JSON{_excerpt(response)}")
        return None
    if not isinstance(body, dict):
        problems.append(f"body: {body!r} is not a JSON object")
        return None
    return body


def _problem_differences(body: dict[str, Any], problems: list[str]) -> list[str]:
    """Add how the 429's problem document differs from docs/contract.md to ``problems``; return its policies."""
    expected = {"type": QUOTA_EXCEEDED, "status": 429}
    for member, value in expected.items():
        if body.get(member) != value:
            problems.append(f"body: {member} is {body.get(member)!r}, expected {value!r}")
    for member in ("title", "detail"):
        if not isinstance(body.get(member), str) or not body[member]:
            problems.append(f"body: {member} is {body.get(member)!r}, expected a text")
    if not _is_count(body.get("retry_after_ms")):
        problems.append(f"body: retry_after_ms is {body.get('retry_after_ms')!r}, expected an integer >= 0")
    violated = body.get("violated-policies")
    if not isinstance(violated, list) or not violated or not all(isinstance(name, str) for name in violated):
        problems.append(f"body: violated-policies is {violated!r}, expected a non-empty list of policy names")
        violated = []
    violations = body.get("violations")
    if not isinstance(violations, list) or not violations:
        problems.append(f"body: violations is {violations!r}, expected a non-empty list")
        return violated
    waits = []
    for index, violation in enumerate(violations):
        problems.extend(_violation_differences(index, violation))
        if isinstance(violation, dict) and _is_count(violation.get("retry_after_ms")):
            waits.append(violation["retry_after_ms"])
    named = [v.get("policy") for v in violations if isinstance(v, dict)]
    if violated and sorted(named, key=str) != sorted(violated):
        problems.append(f"body: violations name {named!r}, but violated-policies {violated!r}")
    # The caller must wait for every violated policy: the wait is the longest of theirs.
    if waits and len(waits) == len(violations) and max(waits) != body.get("retry_after_ms"):
        problems.append(
            f"body: retry_after_ms is {body.get('retry_after_ms')!r}, but the longest violation's is {max(waits)}"
        )
    return violated


def _violation_differences(index: int, violation: Any) -> list[str]:
    where = f"body: violations[{index}]"
    if not isinstance(violation, dict):
        return [f"{where} is {violation!r}, expected an object"]
    problems = []
    for member, kind in VIOLATION_MEMBERS.items():
        value = violation.get(member)
        if kind is str and not (isinstance(value, str) and value):
            problems.append(f"{where}.{member} is {value!r}, expected a name")
        elif kind is int and not _is_count(value):
            problems.append(f"{where}.{member} is {value!r}, expected an integer >= 0")
    limit, remaining = violation.get("limit"), violation.get("remaining")
    if isinstance(limit, int) and isinstance(remaining, int) and remaining > limit:
        problems.append(f"{where}: remaining {remaining} is above its limit {limit}")
    return problems


def _wait_differences(retry_after_ms: int, seconds: int, problems: list[str]) -> None:
    """``Retry-After`` is the exact wait rounded up, at least 1 s; jitter may only add to it, within its bound."""
    least = max(math.ceil(retry_after_ms / 1000), 1)
    most = max(math.ceil((retry_after_ms * 1000 + conf.headers.retry_after_jitter_us) / US), 1)
    if not least <= seconds <= most:
        jitter = "RATELIMITS['HEADERS']['RETRY_AFTER_JITTER']"
        expected = f"{least}" if least == most else f"from {least} to {most} ({jitter})"
        problems.append(f"Retry-After: {seconds}, but retry_after_ms {retry_after_ms} makes it {expected}")


def _header_differences(
    response: HttpResponseBase, problems: list[str], *, violated: list[str] | None, required: bool = True
) -> None:
    """Add how the rate-limit headers differ from what ``HEADERS['STYLE']`` asks for to ``problems``.

    ``violated``: on a 429, the body's violated policies, one of which the headers describe.
    """
    style = conf.headers.style
    wanted = {
        *(IETF_HEADERS if style in ("ietf", "both") else ()),
        *((*GITHUB_HEADERS, RESOURCE) if style in ("github", "both") else ()),
    }
    sent = response.headers
    for name in (*IETF_HEADERS, *GITHUB_HEADERS, RESOURCE):
        if name in sent and name not in wanted:
            problems.append(f"{name}: sent, though RATELIMITS['HEADERS']['STYLE'] is {style!r}")
        elif name not in sent and name in wanted and required:
            problems.append(f"{name}: missing (RATELIMITS['HEADERS']['STYLE'] is {style!r})")
    listed: list[str] | None = None
    if "RateLimit-Policy" in sent and "RateLimit-Policy" in wanted:
        listed = _policy_differences(sent["RateLimit-Policy"], problems)
    if "RateLimit" in sent and "RateLimit" in wanted:
        described = _remaining_differences(sent["RateLimit"], problems)
        if described is not None and listed is not None and described not in listed:
            problems.append(f"RateLimit: describes {described!r}, which RateLimit-Policy does not list")
        _describes_a_violation("RateLimit", described, violated, problems)
    if RESOURCE in wanted:
        _github_differences(sent, problems)
        _describes_a_violation(RESOURCE, sent.get(RESOURCE), violated, problems)


def _describes_a_violation(name: str, policy: str | None, violated: list[str] | None, problems: list[str]) -> None:
    # On a 429 the headers describe the violated policy with the longest wait.
    if policy is not None and violated and policy not in violated:
        problems.append(f"{name}: describes {policy!r}, which is not among the violated policies {violated!r}")


def _policy_differences(value: str, problems: list[str]) -> list[str]:
    """The policies ``RateLimit-Policy`` lists (lines in ``problems`` for what is wrong with it)."""
    items = _items(value)
    if not items:
        problems.append(f"RateLimit-Policy: {value!r} is not a List of quoted policy names with parameters")
        return []
    for name, parameters in items:
        if not _positive(parameters.get("q")):
            problems.append(f"RateLimit-Policy: {name!r} has no quota q of at least 1")
        if parameters.get("qu") != '"concurrent-requests"' and not _positive(parameters.get("w")):
            problems.append(f'RateLimit-Policy: {name!r} has neither a window w >= 1 nor qu="concurrent-requests"')
    return [name for name, _ in items]


def _remaining_differences(value: str, problems: list[str]) -> str | None:
    """The policy ``RateLimit`` describes (a line in ``problems`` for what is wrong with it)."""
    items = _items(value)
    if items is None or len(items) != 1:
        problems.append(f"RateLimit: {value!r} is not one quoted policy name with parameters")
        return None
    name, parameters = items[0]
    if not parameters.get("r", "").isdigit():
        problems.append(f"RateLimit: {value!r} has no remaining quota r (an integer >= 0)")
    if "t" in parameters and not parameters["t"].isdigit():
        problems.append(f"RateLimit: {value!r} has a reset t that is not an integer >= 0")
    return name


def _github_differences(sent: Any, problems: list[str]) -> None:
    numbers = {}
    for name in GITHUB_HEADERS:
        value = sent.get(name)
        if value is None:
            continue
        if not (value.isascii() and value.isdigit()):
            problems.append(f"{name}: {value!r} is not an integer >= 0")
            continue
        numbers[name] = int(value)
    limit, remaining = numbers.get("X-RateLimit-Limit"), numbers.get("X-RateLimit-Remaining")
    if limit == 0:
        problems.append("X-RateLimit-Limit: 0, expected a limit of at least 1")
    if limit is not None and remaining is not None and remaining > limit:
        problems.append(f"X-RateLimit-Remaining: {remaining} is above X-RateLimit-Limit {limit}")
    if RESOURCE in sent and not sent[RESOURCE].strip():
        problems.append(f"{RESOURCE}: empty, expected a policy name")


def _items(value: str) -> list[tuple[str, dict[str, str]]] | None:
    """``value`` as an RFC 9651 List of Strings with parameters, or ``None`` if it is not one."""
    items = []
    position = 0
    while True:
        name = _NAME.match(value, position)
        if name is None:
            return None
        position = name.end()
        parameters = {}
        while (parameter := _PARAMETER.match(value, position)) is not None:
            parameters[parameter.group(1)] = parameter.group(2) or "?1"
            position = parameter.end()
        items.append((name.group(1), parameters))
        rest = value[position:].lstrip()
        if not rest:
            return items
        if not rest.startswith(","):
            return None
        position = len(value) - len(rest) + 1


def _schema_differences(response: HttpResponseBase, openapi: bool | None, *, body: bool) -> list[str]:
    """How ``response`` differs from the project's schema (``body``: its body too, and its status must be there)."""
    if openapi is False:
        return []
    found = documented(response)
    if isinstance(found, Documented):
        return [f"OpenAPI: {difference}" for difference in differences(response, found, body=body)]
    if isinstance(found, Undocumented) and body:
        # The published schema says the operation never answers what it just did.
        return [f"OpenAPI: {found}: set REST_FRAMEWORK['DEFAULT_SCHEMA_CLASS'] to {SCHEMA_CLASS!r} (docs/openapi.md)"]
    # Not checked against the schema, and why: a failure only when the test asked for it.
    return [f"OpenAPI: not checked: {found}"] if openapi else []


def _is_limiters_503(response: HttpResponseBase) -> bool:
    if response.status_code != 503 or not response.headers.get("Content-Type", "").startswith(CONTENT_TYPE):
        return False
    try:
        return bool(json.loads(getattr(response, "content", b"")).get("type") == REDUCED_CAPACITY)
    except (ValueError, AttributeError):
        return False


def _positive(parameter: str | None) -> bool:
    return parameter is not None and parameter.isdigit() and int(parameter) >= 1


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _described(response: HttpResponseBase) -> str:
    request = request_of(response)
    return f"{request.method} {request.get_full_path()}" if request is not None else "the response"


def _reason(response: HttpResponseBase) -> str:
    return getattr(response, "reason_phrase", "")


def _excerpt(response: HttpResponseBase) -> str:
    content = getattr(response, "content", b"")
    if not content:
        return ""
    text = content[:300].decode("utf-8", "replace")
    return f"; body: {text}{'...' if len(content) > 300 else ''}"
