"""Show what a change of a tier's or an endpoint's limits would have refused over the last days."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db.models import Q

from ...choices import FailMode
from ...exceptions import ConfigurationError
from ...models import UsageRecord, validate_endpoint
from ...policies.snapshot import endpoint_key, endpoint_rule, tier_policies
from ...policies.source import get_policy_source
from ...policies.values import Origin, OriginKind, Policy, Role
from ...reports.preview import DAYS, TOP, PolicyPreview, preview


class Command(BaseCommand):
    help = (
        "Show what a change of limits would have refused over the last days of recorded usage, before it is made "
        "(in the settings, or anywhere): a tier's rate, burst or quota, or an endpoint's limits. The admin's "
        "Preview button does the same for its tables. The answer is a range: docs/previews.md says why."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        which = parser.add_mutually_exclusive_group(required=True)
        which.add_argument("--tier", help="The tier to change (its name).")
        which.add_argument("--endpoint", help="The endpoint to change (its name, as in RATELIMITS['ENDPOINTS']).")
        parser.add_argument("--rate", help="The new rate: a tier's, or an endpoint's per caller ('30/m').")
        parser.add_argument("--burst", type=int, help="The new burst (default: the rate's limit).")
        parser.add_argument("--quota", help="A tier's new quota ('100000/month'; 'none' to remove it).")
        parser.add_argument("--endpoint-rate", help="An endpoint's new limit for all its callers together.")
        parser.add_argument("--days", type=int, default=DAYS, help=f"How far back to read (default {DAYS}).")
        parser.add_argument("--json", action="store_true", help="Print JSON instead of text.")

    def handle(self, *args: Any, **options: Any) -> None:
        days = options["days"]
        if not 1 <= days <= 90:
            raise CommandError(f"--days: {days} must be between 1 and 90.")
        if options["burst"] is not None and options["burst"] < 1:
            raise CommandError(f"--burst: {options['burst']} must be a positive integer.")
        try:
            previews = self._tier(options) if options["tier"] else self._endpoint(options)
        except ConfigurationError as exc:
            raise CommandError(_flags(str(exc))) from None
        previews = [(label, make(days)) for label, make in previews]
        if options["json"]:
            self.stdout.write(json.dumps([{"limit": label, **_jsonable(p)} for label, p in previews], indent=2))
            return
        for label, found in previews:
            self.stdout.write(_text(label, found, days))

    def _tier(self, options: dict[str, Any]) -> list[tuple[str, Any]]:
        name = options["tier"]
        if options["endpoint_rate"]:
            raise CommandError("--endpoint-rate is an endpoint's: use --rate for a tier.")
        current = get_policy_source().snapshot().tiers.get(name)
        if current is None:
            raise CommandError(f"--tier: {name!r} is not a tier in force (its tiers: {self._tiers()}).")
        rate = next((p for p in current if p.role is Role.RATE), None)
        if rate is None:
            raise CommandError(f"--tier: {name!r} has no rate to change.")
        quota = next((p for p in current if p.role is Role.QUOTA), None)
        config: dict[str, Any] = {"rate": options["rate"] or str(rate.rate), "algorithm": rate.algorithm.value}
        burst = options["burst"] or (None if options["rate"] else rate.burst)
        if burst:
            config["burst"] = burst
        wanted_quota = options["quota"]
        if wanted_quota and wanted_quota.lower() != "none":
            config["quota"] = wanted_quota
            if quota is not None and quota.period is not None:  # the tier's zone and mode stay
                config.update(quota_zone=quota.period.zone, quota_mode="soft" if quota.soft else "hard")
        new = list(tier_policies(name, config, field="--tier", fail_mode=FailMode.OPEN))
        if wanted_quota is None and quota is not None:
            new.append(quota)  # as it is
        return [(f"tier {name}", lambda days: preview(new, current, records=Q(tier=name), days=days))]

    def _endpoint(self, options: dict[str, Any]) -> list[tuple[str, Any]]:
        name = options["endpoint"]
        try:
            validate_endpoint(name)
        except ValidationError as exc:
            raise CommandError(f"--endpoint: {' '.join(exc.messages)}") from None
        if options["quota"]:
            raise CommandError("--quota is a tier's.")
        if options["burst"] and not options["rate"]:
            raise CommandError("--burst goes with --rate: give the endpoint's new rate per caller too.")
        if not (options["rate"] or options["endpoint_rate"]):
            raise CommandError("Give --rate or --endpoint-rate: what the endpoint's limits would be.")
        snapshot = get_policy_source().snapshot()
        current = snapshot.endpoints.get(endpoint_key(name))
        if current is None and not UsageRecord.objects.filter(endpoint=name).exists():
            raise CommandError(f"--endpoint: {name!r} has no rule in force and no usage recorded (a typo?).")
        per_caller = {"rate": options["rate"], **({"burst": options["burst"]} if options["burst"] else {})}
        new = endpoint_rule(
            name,
            field="--endpoint",
            origin=Origin(OriginKind.SETTINGS, "--endpoint"),
            fail_mode=FailMode.OPEN,
            per_caller=per_caller if options["rate"] else _config(current.per_caller if current else None),
            endpoint_wide=options["endpoint_rate"] or _config(current.endpoint_wide if current else None),
        )
        records = Q(endpoint=name)
        found = []
        for label, attribute, shared in (("per caller", "per_caller", False), ("all callers", "endpoint_wide", True)):
            after, before = getattr(new, attribute), getattr(current, attribute) if current else None
            if after is not None or before is not None:
                found.append(
                    (
                        f"endpoint {name}, {label}",
                        lambda days, a=after, b=before, s=shared: preview(
                            [a] if a else [], [b] if b else [], records=records, days=days, shared=s
                        ),
                    )
                )
        if not found:
            raise CommandError("Give --rate or --endpoint-rate: the endpoint has no limit of its own to change.")
        return found

    def _tiers(self) -> str:
        return ", ".join(sorted(get_policy_source().snapshot().tiers)) or "none"


#: What a value's message calls it, and the flag it was given by.
_FLAGS = {
    "--tier['rate']": "--rate",
    "--tier['burst']": "--burst",
    "--tier['quota']": "--quota",
    "--endpoint['rate']": "--rate",
    "--endpoint['endpoint_rate']": "--endpoint-rate",
}


def _flags(message: str) -> str:
    """A policy's message about a value, naming the flag it was given by."""
    for named, flag in _FLAGS.items():
        message = message.replace(named, flag)
    return message


def _config(policy: Policy | None) -> dict[str, Any] | None:
    return None if policy is None else {"rate": str(policy.rate), "burst": policy.burst}


def _jsonable(found: PolicyPreview) -> dict[str, Any]:
    data = asdict(found)
    data["since"], data["until"] = found.since.isoformat(), found.until.isoformat()
    data["method"] = found.method
    return data


def _text(label: str, found: PolicyPreview, days: int) -> str:
    lines = [f"{label}, over the last {days} days ({found.since:%Y-%m-%d %H:%M} to {found.until:%Y-%m-%d %H:%M} UTC):"]
    if not found.subjects:
        lines.append("  no usage was recorded for it: nothing to replay.")
        return "\n".join(lines) + "\n"
    lines += [
        f"  would refuse {_range(found.fewest, found.most)} of {found.requests:,} requests, from "
        f"{_range(found.subjects_surely, found.subjects_possibly)} of {found.subjects:,} subjects",
        f"  as it is now: {_range(found.current_fewest, found.current_most)}; "
        f"the 429s recorded: {found.refused_then:,}",
        f"  replayed: {'; '.join(found.previewed) or 'no limit'}",
    ]
    if found.left_out:
        lines.append(f"  not replayed: {'; '.join(found.left_out)}")
    if found.notes:
        lines.append(f"  note: {'; '.join(found.notes)}")
    if found.top:
        lines.append(f"  the {len(found.top)} most refused (of {TOP} listed at most):")
        width = max(len(f"{row.subject_kind} {row.subject_id}") for row in found.top)
        for row in found.top:
            subject = f"{row.subject_kind} {row.subject_id}"
            lines.append(f"    {subject:<{width}}  {row.requests:>9,} requests  refused {_range(row.fewest, row.most)}")
    lines.append(f"  {found.method}")
    return "\n".join(lines) + "\n"


def _range(fewest: int, most: int) -> str:
    return f"{fewest:,}" if fewest == most else f"{fewest:,} to {most:,}"
