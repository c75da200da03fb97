"""Show the limits a caller gets on an endpoint, where each comes from, and what is left right now."""

from __future__ import annotations

import json
from typing import Any

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError, CommandParser

from ...backends import get_backend
from ...choices import HTTP_METHODS
from ...conf import conf
from ...exceptions import ConfigurationError
from ...identity import ASSIGNABLE_KINDS, SubjectKind, normalize_ip
from ...models import validate_endpoint, validate_subject
from ...status import EffectiveLimits, effective_limits, stand_in

KINDS = tuple(kind.value for kind in ASSIGNABLE_KINDS)
_ALIASES = {"organization": "org", "organisation": "org", "key": "api_key"}


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
                "A subject of the caller, repeatable: api_key:ID (what IDENTITY['API_KEY_FUNC'] returns, e.g. "
                "ApiKey:42), user:PK, org:ID, ip:ADDRESS. Without an ip subject the client IP is 'unknown'."
            ),
        )
        parser.add_argument("--endpoint", required=True, help="The endpoint name (the view's throttle_scope).")
        parser.add_argument(
            "--method", default="GET", help=f"The HTTP method: {', '.join(HTTP_METHODS)} (default GET)."
        )
        parser.add_argument("--json", action="store_true", help="Print JSON instead of a table.")

    def handle(self, *args: Any, **options: Any) -> None:
        subjects = parse_subjects(options["subject"])
        endpoint = str(options["endpoint"]).strip()
        try:
            validate_endpoint(endpoint)
        except ValidationError as exc:
            raise CommandError(f"--endpoint: {' '.join(exc.messages)}") from None
        method = str(options["method"]).strip().upper()
        if method not in HTTP_METHODS:
            raise CommandError(f"--method: {options['method']!r} is not one of {', '.join(HTTP_METHODS)}.")

        try:
            caller = stand_in(endpoint=endpoint, method=method, **subjects)
            limits = effective_limits(caller.request, caller.identity)
        except ConfigurationError as exc:
            raise CommandError(f"The rate limit configuration is invalid: {exc}") from None

        report = build_report(limits, method, shared=get_backend().shared)
        if options["json"]:
            self.stdout.write(json.dumps(report, indent=2))
        else:
            self.stdout.write(render(report))


def parse_subjects(values: list[str]) -> dict[str, str]:
    """``["api_key:ApiKey:42", "ip:2001:db8::1"]`` as identifiers by kind; ``CommandError`` naming a bad one."""
    subjects: dict[str, str] = {}
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
        if kind == SubjectKind.IP:
            address = normalize_ip(value)
            if address is None:
                raise CommandError(
                    f"--subject {text!r}: {value!r} is not an IP address such as 203.0.113.7 or 2001:db8::1."
                )
            subjects[kind] = str(address)
            continue
        try:
            subjects[kind] = validate_subject(kind, value)
        except ValidationError as exc:
            raise CommandError(f"--subject {text!r}: {' '.join(exc.messages)}") from None
    return subjects


def build_report(limits: EffectiveLimits, method: str, *, shared: bool = True) -> dict[str, Any]:
    """The effective limits as JSON-safe data (what ``--json`` prints).

    ``shared``: whether the limiter's store is shared with the servers (the ``memory`` backend is
    this process's own, so its figures are not theirs).
    """
    checks = []
    for entry in limits.checks:
        check, seen = entry.check, entry.peek
        policy = check.policy
        reset_after = None if seen is None or seen.reset_after_us is None else round(seen.reset_after_us / 1e6, 3)
        checks.append(
            {
                "policy": policy.name,
                "description": policy.describe(),
                "subject": check.subject.kind,
                "subject_id": check.subject.value,
                "cost": check.cost,
                "origin": entry.kind,
                "origin_detail": entry.origin,
                "shadow": policy.shadow,
                "algorithm": policy.algorithm.value,
                "limit": entry.limit,
                "remaining": seen.remaining if seen else None,
                "reset": seen.reset_at if seen else None,
                "reset_after_seconds": reset_after,
            }
        )
    identity = limits.identity
    return {
        "endpoint": identity.endpoint.value,
        "method": method,
        "subjects": {s.kind: s.value for s in identity.subjects() if s.kind is not SubjectKind.ENDPOINT},
        "policy_source": conf.policies.source,
        "backend": conf.backend,
        "store_shared": shared,
        "degraded": limits.degraded,
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
    elif not report["store_shared"]:
        lines.append(
            f"Limiter store: {report['backend']}, this command's own: the figures are not the servers' "
            "(with the redis backend they are)."
        )
    if not report["checks"]:
        lines.append("No limits apply: the endpoint is exempt or no policy covers this caller.")
        return "\n".join(lines)
    header = ("POLICY", "DESCRIPTION", "SUBJECT", "COST", "ORIGIN", "SHADOW", "REMAINING", "LIMIT", "RESET", "FROM")
    rows = [header]
    for check in report["checks"]:
        degraded = check["remaining"] is None
        slots = check["reset_after_seconds"] is None
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
                "degraded" if degraded else "-" if slots else f"in {check['reset_after_seconds']:g}s",
                check["origin_detail"],
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header) - 1)]
    lines.append("")
    for row in rows:
        cells = [cell.ljust(width) for cell, width in zip(row, widths, strict=False)]
        lines.append("  ".join([*cells, row[-1]]).rstrip())
    return "\n".join(lines)
