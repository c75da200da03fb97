"""Show the limits a caller gets on an endpoint, where each comes from, and what is left right now."""

from __future__ import annotations

import ipaddress
import json
import math
from typing import Any

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.http import HttpRequest

from ...conf import conf
from ...engine import Decision, Result, get_limiter, get_policy_source
from ...exceptions import ConfigurationError
from ...identity import Address, Identity, Subject, normalize_ip
from ...models import validate_endpoint, validate_subject
from ...policies import Check

KINDS = ("api_key", "user", "org", "ip")
_ALIASES = {"organization": "org", "organisation": "org", "key": "api_key"}
#: Where a check's values come from, by the start of the policy source's explanation.
_ORIGINS = (
    ("default tier", "tier"),
    ("assignment", "assignment"),
    ("override", "override"),
    ("endpoint policy", "endpoint"),
    ("RATELIMITS['DIMENSIONS']", "dimension"),
)


class Command(BaseCommand):
    help = (
        "Show every limit a caller is subject to on an endpoint: the policy, where it comes from "
        "(tier, assignment, override, endpoint), and the live remaining/limit/reset, without consuming anything."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--subject",
            action="append",
            default=[],
            metavar="KIND:ID",
            help=(
                "A subject of the caller, repeatable: api_key:ID (what API_KEY_FUNC returns, e.g. ApiKey:42), "
                "user:PK, org:ID, ip:ADDRESS. Without an ip subject the client IP is 'unknown'."
            ),
        )
        parser.add_argument("--endpoint", required=True, help="The endpoint name (the view's throttle_scope).")
        parser.add_argument("--method", default="GET", help="The HTTP method (default GET).")
        parser.add_argument("--json", action="store_true", help="Print JSON instead of a table.")

    def handle(self, *args: Any, **options: Any) -> None:
        subjects = parse_subjects(options["subject"])
        endpoint = str(options["endpoint"]).strip()
        try:
            validate_endpoint(endpoint)
        except ValidationError as exc:
            raise CommandError(f"--endpoint: {' '.join(exc.messages)}") from None
        method = str(options["method"]).strip().upper()
        if not method.isascii() or not method.isalpha():
            raise CommandError(f"--method: {options['method']!r} is not an HTTP method such as GET or POST.")

        identity = Identity(
            ip=subjects.get("ip") or Subject("ip", "unknown"),
            endpoint=Subject("endpoint", endpoint),
            user=subjects.get("user"),
            api_key=subjects.get("api_key"),
            organization=subjects.get("org"),
        )
        request = HttpRequest()
        request.method = method
        if "ip" in subjects:
            request.META["REMOTE_ADDR"] = str(ipaddress.ip_network(identity.ip.value, strict=False).network_address)
        try:
            source = get_policy_source()
            explain = getattr(source, "explain", None)
            explained: list[tuple[Check, str]]
            if explain is not None:
                explained = [(e.check, e.origin) for e in explain(request, identity)]
            else:
                explained = [(check, "settings") for check in source.checks_for(request, identity)]
            decision = get_limiter().decide([check for check, _ in explained], consume=False)
        except ConfigurationError as exc:
            raise CommandError(f"The rate limit configuration is invalid: {exc}") from None

        report = build_report(identity, method, explained, decision)
        if options["json"]:
            self.stdout.write(json.dumps(report, indent=2))
        else:
            self.stdout.write(render(report))


def parse_subjects(values: list[str]) -> dict[str, Subject]:
    """``["api_key:ApiKey:42", "ip:2001:db8::1"]`` as subjects by kind; ``CommandError`` naming a bad one."""
    subjects: dict[str, Subject] = {}
    for text in values:
        kind, colon, value = text.partition(":")
        kind = _ALIASES.get(kind.strip().lower(), kind.strip().lower())
        if not colon:
            raise CommandError(
                f"--subject {text!r}: expected KIND:ID, e.g. api_key:ApiKey:42, user:7, org:acme or ip:203.0.113.7."
            )
        if kind not in KINDS:
            raise CommandError(f"--subject {text!r}: unknown kind {kind!r}; use one of {', '.join(KINDS)}.")
        if kind in subjects:
            raise CommandError(f"--subject {text!r}: a caller has one {kind} subject; {kind} is given twice.")
        if kind == "ip":
            address = normalize_ip(value)
            if address is None:
                raise CommandError(
                    f"--subject {text!r}: {value!r} is not an IP address such as 203.0.113.7 or 2001:db8::1."
                )
            subjects[kind] = Subject("ip", ip_value(address))
            continue
        try:
            subjects[kind] = Subject(kind, validate_subject(kind, value))
        except ValidationError as exc:
            raise CommandError(f"--subject {text!r}: {' '.join(exc.messages)}") from None
    return subjects


def ip_value(address: Address) -> str:
    """The IP subject of an address, as requests get it: IPv6 aggregated to ``IPV6_PREFIX`` (``/64``)."""
    prefix = conf.ipv6_prefix
    if isinstance(address, ipaddress.IPv6Address) and prefix < 128:
        return str(ipaddress.IPv6Network((address, prefix), strict=False))
    return str(address)


def origin_kind(origin: str) -> str:
    for start, kind in _ORIGINS:
        if origin.startswith(start):
            return kind
    return origin if origin == "settings" else "other"


def build_report(
    identity: Identity, method: str, explained: list[tuple[Check, str]], decision: Decision
) -> dict[str, Any]:
    """The effective limits as JSON-safe data (what ``--json`` prints)."""
    results: list[Result | None]
    if decision.degraded or len(decision.results) != len(explained):
        results = [None] * len(explained)
    else:
        results = list(decision.results)
    checks = []
    for (check, origin), result in zip(explained, results, strict=True):
        policy = check.policy
        row: dict[str, Any] = {
            "policy": policy.name,
            "description": policy.describe(),
            "subject": check.subject.kind,
            "subject_id": check.subject.value,
            "cost": check.cost,
            "origin": origin_kind(origin),
            "origin_detail": origin,
            "shadow": policy.shadow,
            "algorithm": policy.algorithm.value,
            "limit": policy.capacity,
            "remaining": None,
            "reset": None,
            "reset_after_seconds": None,
        }
        if result is not None:
            # A peek reports what would remain after one more request; add that request back.
            remaining = result.remaining + check.cost if result.allowed else result.remaining
            row["remaining"] = min(remaining, result.limit)
            row["reset"] = math.ceil((decision.now_us + result.reset_us) / 1_000_000)
            row["reset_after_seconds"] = round(result.reset_us / 1_000_000, 3)
        checks.append(row)
    return {
        "endpoint": identity.endpoint.value,
        "method": method,
        "subjects": {s.kind: s.value for s in identity.subjects() if s.kind != "endpoint"},
        "policy_source": conf.policy_source,
        "degraded": decision.degraded,
        "checks": checks,
    }


def render(report: dict[str, Any]) -> str:
    subjects = ", ".join(f"{kind}={value}" for kind, value in report["subjects"].items())
    lines = [
        f"Effective limits for {report['method']} {report['endpoint']} ({subjects})",
        f"Policy source: {report['policy_source']}",
    ]
    if report["degraded"]:
        lines.append("Limiter store: unreachable (degraded); live values are unknown.")
    if not report["checks"]:
        lines.append("No limits apply: the endpoint is exempt or no policy covers this caller.")
        return "\n".join(lines)
    header = ("POLICY", "DESCRIPTION", "SUBJECT", "COST", "ORIGIN", "SHADOW", "REMAINING", "LIMIT", "RESET", "FROM")
    rows = [header]
    for check in report["checks"]:
        degraded = check["remaining"] is None
        rows.append(
            (
                check["policy"],
                check["description"],
                check["subject"],
                str(check["cost"]),
                check["origin"],
                "yes" if check["shadow"] else "no",
                "degraded" if degraded else str(check["remaining"]),
                str(check["limit"]),
                "degraded" if degraded else f"in {check['reset_after_seconds']:g}s",
                check["origin_detail"],
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header) - 1)]
    lines.append("")
    for row in rows:
        cells = [cell.ljust(width) for cell, width in zip(row, widths, strict=False)]
        lines.append("  ".join([*cells, row[-1]]).rstrip())
    return "\n".join(lines)
