"""What a policy change would have refused over the last days, read from the usage records.

Before a tier, an override or an endpoint policy is saved (the admin's *Preview* button), or a
settings change is made (``manage.py ratelimits_preview``): each subject's recorded requests,
period by period, are replayed against the policy as it would be, and as it is
(:mod:`ratelimits.replay`, which says how, and why the answer is a range). A request is refused
if any of the changed policies refuses it: at least as many as the strictest refuses, at most
what they refuse together.

The records are minutes where minutes are still kept (two days by default) and hours before
that: the longer the periods, the wider the range. Limits whose refusals cannot be told from
counts are named and left out: concurrency limits (they need each request's duration) and
sliding windows.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from django.conf import settings
from django.db.models import Count, F, Min, Q, QuerySet, Sum
from django.utils import timezone

from ..algorithms import Algorithm
from ..choices import FailMode
from ..counters import OVERFLOW
from ..models import EndpointPolicy, Override, SubjectAssignment, Tier, UsageRecord
from ..periods import counted_period
from ..policies.source import get_policy_source
from ..policies.values import Policy, Role
from ..replay import Demand, Limit, fewest_refused, most_refused, period_window
from ..store.database import endpoint_rule_of, override_rule, tier_of

__all__ = [
    "DAYS",
    "TOP",
    "PolicyPreview",
    "SubjectPreview",
    "base_policies_of",
    "preview",
    "preview_endpoint",
    "preview_override",
    "preview_tier",
]

#: The subject kinds usage is counted under: a request's caller (its API key, else its user, else its address).
CALLER_KINDS = ("api_key", "user", "ip")
#: How far back a preview reads by default, and how many subjects it lists (the rest are in the totals).
DAYS = 7
TOP = 20
#: The most records a preview reads (a page's wait stays seconds), and subjects it replays: past
#: them, the busiest subjects' records, and the rest counted as not replayed.
MAX_ROWS = 200_000
MAX_SUBJECTS = 2_000
US = 1_000_000
_LENGTHS = {"minute": 60 * US, "hour": 3600 * US, "day": 86_400 * US}


@dataclass(frozen=True, slots=True)
class SubjectPreview:
    """One subject's recorded requests, and how many of them the new policies would have refused."""

    subject_kind: str
    subject_id: str
    requests: int
    #: What the limits in force refused of them (429s recorded).
    refused_then: int
    fewest: int
    most: int


@dataclass(slots=True)
class PolicyPreview:
    """What a change would have refused of the recorded traffic: a range, and the method behind it."""

    since: datetime
    until: datetime
    #: The policies replayed, as they would be, and as they are (described).
    previewed: list[str]
    current: list[str]
    #: Policies the records cannot replay, and why.
    left_out: list[str] = field(default_factory=list)
    #: What is replayed only in part, or taken as it is not: said beside the figures.
    notes: list[str] = field(default_factory=list)
    requests: int = 0
    refused_then: int = 0
    #: Requests the new policies would have refused: at least, at most (over every arrival order).
    fewest: int = 0
    most: int = 0
    #: The same bounds for the policies as they are: what the records' own 429s should lie within.
    current_fewest: int = 0
    current_most: int = 0
    #: Subjects refused something at least, and possibly.
    subjects_surely: int = 0
    subjects_possibly: int = 0
    subjects: int = 0
    top: list[SubjectPreview] = field(default_factory=list)
    #: The records read: minutes and hours.
    minutes: int = 0
    hours: int = 0
    #: Subjects past the records a preview reads (the quietest): their requests are in ``most``.
    not_replayed_subjects: int = 0
    not_replayed_requests: int = 0
    #: Requests counted in overflow rows (a minute's rows were full): nobody's own, not replayed.
    overflow_requests: int = 0

    @property
    def method(self) -> str:
        return (
            f"Replayed from {self.minutes:,} minute and {self.hours:,} hour records of usage: each subject's "
            "requests in a period may have come at any instant inside it, so the range runs from the "
            "fewest refusals any spreading could meet to the most any bunching could. A window the "
            "records align with (a day's quota over minutes) is exact."
        )


def preview(
    new: Sequence[Policy],
    old: Sequence[Policy],
    *,
    records: Q,
    days: int = DAYS,
    now: datetime | None = None,
    shared: bool = False,
) -> PolicyPreview:
    """What ``new`` (replacing ``old``) would have refused of the records ``records`` selects over
    the last ``days``: per subject, or, ``shared``, as one budget of all of them together (an
    endpoint's limit for all callers), listed as one subject."""
    until = (now or timezone.now()).replace(second=0, microsecond=0)
    since = until - timedelta(days=days)
    if not settings.USE_TZ:  # the records' times are naive UTC then
        until, since = until.astimezone(UTC).replace(tzinfo=None), since.astimezone(UTC).replace(tzinfo=None)
    replayable_new, left_out, notes = _replayable(new)
    replayable_old, _, _ = _replayable(old)
    result = PolicyPreview(
        since=since,
        until=until,
        previewed=[policy.describe() for policy in replayable_new],
        current=[policy.describe() for policy in replayable_old],
        left_out=left_out,
        notes=notes,
    )
    by_subject = _demand(records, since, until, result, overflow=shared)
    if shared:
        by_subject = _pooled(by_subject)
    found: list[SubjectPreview] = []
    for (kind, subject), (periods, refused_then) in by_subject.items():
        requests = sum(period.requests for period in periods)
        fewest, most = _bounds(periods, replayable_new, requests, _us(since))
        current_fewest, current_most = _bounds(periods, replayable_old, requests, _us(since))
        result.requests += requests
        result.refused_then += refused_then
        result.fewest += fewest
        result.most += most
        result.current_fewest += current_fewest
        result.current_most += current_most
        result.subjects += 1
        result.subjects_surely += fewest > 0
        result.subjects_possibly += most > 0
        if most > 0:
            found.append(SubjectPreview(kind, subject, requests, refused_then, fewest, most))
    found.sort(key=lambda s: (-s.most, -s.fewest, s.subject_kind, s.subject_id))
    result.top = found[:TOP]
    # Subjects not replayed, and overflow rows: none to all of their requests (the range stays a bound).
    unknown = result.not_replayed_requests + result.overflow_requests
    result.requests += unknown
    result.most += unknown
    result.current_most += unknown
    result.subjects += result.not_replayed_subjects
    result.subjects_possibly += result.not_replayed_subjects
    return result


def _replayable(policies: Iterable[Policy]) -> tuple[list[Policy], list[str], list[str]]:
    """The policies the records can replay; those they cannot, and notes on those replayed in part."""
    kept: list[Policy] = []
    left_out: list[str] = []
    notes: list[str] = []
    for policy in policies:
        if policy.holds_slots:
            left_out.append(f"{policy.describe()}: requests in flight cannot be told from counts per period")
        elif policy.algorithm is Algorithm.SLIDING_WINDOW:
            left_out.append(f"{policy.describe()}: a sliding window is not replayed from counts")
        else:
            kept.append(policy)
            if policy.period is not None:
                notes.append(f"{policy.describe()} is replayed in the tier's own periods, not each customer's anchor")
    return kept, left_out, notes


def limit_of(policy: Policy) -> Limit:
    """A policy as :mod:`ratelimits.replay` replays it."""
    rate = policy.rate
    if policy.algorithm is Algorithm.FIXED_WINDOW:
        period = policy.period
        if period is not None:
            return Limit(
                rate.limit, rate.period_us, rate.limit, window_of=lambda at: counted_period(period.bounds(at), at)[0]
            )
        window = period_window(rate.period_us)
        return Limit(rate.limit, rate.period_us, rate.limit, window_of=window, window_us=rate.period_us)
    return Limit(rate.limit, rate.period_us, policy.burst)


def _bounds(periods: Sequence[Demand], policies: Sequence[Policy], requests: int, since_us: int) -> tuple[int, int]:
    """Refused by any of ``policies``: at least the most any one surely refuses, at most all they
    may refuse together (never more than the requests). A soft quota refuses nothing."""
    fewest, most = 0, 0
    for policy in policies:
        if policy.soft or policy.shadow:  # admits past its limit; or only reports
            continue
        limit = limit_of(policy)
        fewest = max(fewest, fewest_refused(periods, limit))
        most += most_refused(periods, limit, since_us)
    return fewest, min(most, requests)


def _demand(
    records: Q, since: datetime, until: datetime, result: PolicyPreview, *, overflow: bool = False
) -> dict[tuple[str, str], tuple[list[Demand], int]]:
    """Each subject's periods, oldest first (its endpoints' requests summed), and the 429s recorded:
    minute records where they are kept whole, hour records before. Overflow rows (callers counted
    together once a minute's rows were full) are nobody's own: counted apart, unless ``overflow``
    (a budget of all callers together takes them as a subject of their own)."""
    first_minute = (
        UsageRecord.objects.filter(records, granularity="minute", period_start__gte=since, period_start__lt=until)
        .aggregate(first=Min("period_start"))
        .get("first")
    )
    cut = until
    if first_minute is not None:
        cut = first_minute.replace(minute=0, second=0, microsecond=0)
        if cut != first_minute and UsageRecord.objects.filter(records, granularity="hour", period_start=cut).exists():
            cut += timedelta(hours=1)  # the purge left part of that hour's minutes: its hour has them all
    chosen = UsageRecord.objects.filter(records, period_start__gte=since, period_start__lt=until).filter(
        Q(granularity="minute", period_start__gte=cut) | Q(granularity="hour", period_start__lt=cut)
    )
    chosen = _busiest(chosen, result)
    # (subject kind, subject) -> period start -> [requests, cheapest, dearest, length]
    periods: dict[tuple[str, str], dict[int, list[float]]] = defaultdict(dict)
    refused: dict[tuple[str, str], int] = defaultdict(int)
    costs: dict[str, float] = {}
    rows = chosen.values_list(
        "granularity",
        "period_start",
        "subject_kind",
        "subject_id",
        "endpoint",
        "allowed",
        "throttled",
        "degraded",
        "tokens",
    )
    for granularity, start, kind, subject, endpoint, allowed, throttled, degraded, tokens in rows.iterator(
        chunk_size=5_000
    ):
        if granularity == "minute":
            result.minutes += 1
        else:
            result.hours += 1
        requests = allowed + throttled + degraded
        if not requests:
            continue
        if kind == OVERFLOW and not overflow:
            result.overflow_requests += requests
            continue
        # The row's requests at its average cost; all refused: the endpoint's cost, as in force.
        cost = tokens / allowed if allowed else costs.setdefault(endpoint, _endpoint_cost(endpoint))
        totals = periods[(kind, subject)].setdefault(_us(start), [0.0, cost, cost, float(_LENGTHS[granularity])])
        totals[0] += requests
        totals[1], totals[2] = min(totals[1], cost), max(totals[2], cost)
        refused[(kind, subject)] += throttled
    return {
        key: (
            [
                Demand(start_us, int(length), int(n), cheapest, dearest)
                for start_us, (n, cheapest, dearest, length) in sorted(by_start.items())
            ],
            refused[key],
        )
        for key, by_start in periods.items()
    }


def _endpoint_cost(endpoint: str) -> float:
    """What a request to ``endpoint`` costs, as in force (a GET's: records keep no method)."""
    return float(get_policy_source().endpoint_rule(endpoint, "GET").cost)


def _us(moment: datetime) -> int:
    """A record's start in us since the epoch (a naive one, under ``USE_TZ = False``, is UTC)."""
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return int(moment.timestamp()) * US


def _busiest(chosen: QuerySet[UsageRecord], result: PolicyPreview) -> QuerySet[UsageRecord]:
    """``chosen`` as far as a preview reads it: every subject's records, or, past :data:`MAX_ROWS`,
    those of the subjects with the most requests that fit (:data:`MAX_SUBJECTS` at most); the rest
    are counted in ``result`` as not replayed (a bound of none to all of their requests)."""
    if chosen.count() <= MAX_ROWS:
        return chosen
    subjects = (
        chosen.values("subject_kind", "subject_id")
        .annotate(rows=Count("id"), seen=Sum(F("allowed") + F("throttled") + F("degraded")))
        .order_by("-seen", "subject_kind", "subject_id")
    )
    kept: dict[str, list[str]] = defaultdict(list)
    budget, replayed = MAX_ROWS, 0
    for subject in subjects.iterator(chunk_size=5_000):
        if replayed < MAX_SUBJECTS and subject["rows"] <= budget:
            kept[subject["subject_kind"]].append(subject["subject_id"])
            budget -= subject["rows"]
            replayed += 1
        else:
            result.not_replayed_subjects += 1
            result.not_replayed_requests += subject["seen"] or 0
    which = Q(pk__in=[])
    for kind, ids in kept.items():
        which |= Q(subject_kind=kind, subject_id__in=ids)
    return chosen.filter(which)


def _pooled(
    by_subject: dict[tuple[str, str], tuple[list[Demand], int]],
) -> dict[tuple[str, str], tuple[list[Demand], int]]:
    """Every subject's periods as one budget's (an endpoint's limit for all its callers)."""
    pooled: dict[tuple[int, int], list[float]] = {}
    refused_then = 0
    for periods, refused in by_subject.values():
        refused_then += refused
        for period in periods:
            totals = pooled.setdefault((period.start_us, period.length_us), [0.0, period.cheapest, period.most_cost])
            totals[0] += period.requests
            totals[1], totals[2] = min(totals[1], period.cheapest), max(totals[2], period.most_cost)
    demand = [
        Demand(start_us, length, int(n), cheapest, dearest)
        for (start_us, length), (n, cheapest, dearest) in sorted(pooled.items())
    ]
    return {("endpoint", "all callers"): (demand, refused_then)} if demand else {}


# -- the changes the admin and the command preview ------------------------------------------------


def preview_tier(candidate: Tier, *, days: int = DAYS, now: datetime | None = None) -> PolicyPreview:
    """A tier as the form would save it, against the tier as it is: over its subjects' records (the
    tier each record was counted under; a new tier has none yet)."""
    current = Tier.objects.filter(pk=candidate.pk).first() if candidate.pk else None
    name = current.name if current is not None else candidate.name
    found = preview(_in_force(candidate), _in_force(current), records=Q(tier=name), days=days, now=now)
    if SubjectAssignment.objects.filter(tier__name=name).exclude(subject_kind__in=CALLER_KINDS).exists():
        found.notes.append(
            "the tier's organisations and networks share one budget among their callers, which the records "
            "count apart: they are replayed as each caller's own"
        )
    return found


def _in_force(tier: Tier | None) -> tuple[Policy, ...]:
    """A tier's policies as a request meets them: none for a tier disabled (or none at all)."""
    return tier_of(tier) if tier is not None and tier.enabled else ()


def preview_endpoint(
    candidate: EndpointPolicy, *, days: int = DAYS, now: datetime | None = None
) -> list[PolicyPreview]:
    """An endpoint policy as the form would save it: its limit per caller, over each caller's
    records on the endpoint, and its limit for all callers, over them all as one budget."""
    current = EndpointPolicy.objects.filter(pk=candidate.pk).first() if candidate.pk else None
    new = endpoint_rule_of(candidate) if candidate.enabled and not candidate.exempt else None
    old = endpoint_rule_of(current) if current is not None and current.enabled and not current.exempt else None
    records = Q(endpoint=(current or candidate).endpoint)
    notes = []
    if current is not None and current.cost != candidate.cost:
        notes.append(
            f"the change of cost ({current.cost} to {candidate.cost}) is not replayed on the caller's other limits"
        )
    if candidate.counts != "all" or candidate.max_cost:
        notes.append(
            "what is given back or charged after the response (counts, max_cost) is as the records' tokens say"
        )
    previews = []
    for attribute, shared in (("per_caller", False), ("endpoint_wide", True)):
        after = getattr(new, attribute) if new is not None else None
        before = getattr(old, attribute) if old is not None else None
        if after is not None or before is not None:
            found = preview(
                [after] if after is not None else [],
                [before] if before is not None else [],
                records=records,
                days=days,
                now=now,
                shared=shared,
            )
            found.notes += notes
            previews.append(found)
    return previews


def preview_override(
    candidate: Override, base: Sequence[Policy], *, days: int = DAYS, now: datetime | None = None
) -> PolicyPreview:
    """An override as the form would save it, on its subject's records (its endpoint's, if it
    names one), against the override as it is, else ``base``: the subject's tier's policies."""
    current = Override.objects.filter(pk=candidate.pk).first() if candidate.pk else None
    records = Q(subject_kind=candidate.subject_kind, subject_id=candidate.subject_id)
    if candidate.endpoint:
        records &= Q(endpoint=candidate.endpoint)
    moment = now or timezone.now()
    found = preview(
        overridden(candidate, base) if _applies(candidate, moment) else list(base),
        overridden(current, base) if current is not None and _applies(current, moment) else list(base),
        records=records,
        days=days,
        now=now,
    )
    if candidate.subject_kind not in CALLER_KINDS or "/" in candidate.subject_id:
        found.notes.append(
            f"an override of a {candidate.subject_kind} is shared by its callers, which the records count "
            "apart: only records under this very subject are replayed"
        )
    return found


def _applies(row: Override, moment: datetime) -> bool:
    """Whether an override is in force at ``moment`` (enabled, not expired)."""
    return bool(row.enabled) and (row.expires_at is None or row.expires_at > moment)


def overridden(row: Override, base: Sequence[Policy]) -> list[Policy]:
    """``base`` (a tier's policies) as ``row`` makes them."""
    rule = override_rule(row)
    made: list[Policy] = []
    for policy in base:
        if policy.role is Role.QUOTA:
            made.append(
                rule.quota_of(policy, tier=policy.tier or "", fail_mode=policy.fail_mode, anchor=None)
                if rule.quota
                else policy
            )
        elif not policy.holds_slots:
            made.append(rule.apply(policy, name=policy.name, fail_mode=policy.fail_mode) or policy)
    if rule.quota and not any(policy.role is Role.QUOTA for policy in base):
        made.append(rule.quota_of(None, tier="override", fail_mode=FailMode.OPEN, anchor=None))
    return made


def base_policies_of(subject_kind: str, subject_id: str) -> tuple[Policy, ...]:
    """The policies of the tier a subject's latest records were counted under, as in force now
    (what an override of it replaces); none if it has no records, or its tier is gone."""
    tier = (
        UsageRecord.objects.filter(subject_kind=subject_kind, subject_id=subject_id)
        .exclude(tier="")
        .order_by("-period_start")
        .values_list("tier", flat=True)
        .first()
    )
    return get_policy_source().snapshot().tiers.get(tier, ()) if tier else ()
