"""A policy change previewed from the usage records: its range holds what the new policy really
refuses of the same traffic (a day of it, replayed at the instants it came), in the admin and from
the command."""

from __future__ import annotations

import json
import random
import re
from datetime import UTC, datetime, timedelta
from io import StringIO
from typing import Any

import pytest
from django.core.management import call_command
from django.test import Client
from django.urls import reverse

from ratelimits.algorithms import fixed_window, token_bucket
from ratelimits.models import EndpointPolicy, Tier, UsageRecord
from ratelimits.reports.preview import preview_endpoint, preview_tier

from .support.settings import merged
from .test_admin import form_data

pytestmark = pytest.mark.django_db

MINUTE = 60_000_000
#: The day replayed: the 24 hours before NOW, whole minutes.
NOW = datetime(2026, 12, 3, 12, 0, tzinfo=UTC)
DAY_START = int((NOW - timedelta(days=1)).timestamp()) * 1_000_000


def day_of_traffic(seed: int, subjects: int = 30) -> dict[str, list[int]]:
    """Each subject's request instants (us) over the day: quiet, steady, and bursty ones."""
    rng = random.Random(seed)
    traffic = {}
    for n in range(subjects):
        kind = rng.choice(["quiet", "steady", "bursty", "bursty"])
        instants: list[int] = []
        for minute in range(0, 1440, rng.choice([1, 2, 5])):
            base = DAY_START + minute * MINUTE
            if kind == "quiet":
                count = rng.randrange(0, 3)
                instants += [base + rng.randrange(MINUTE) for _ in range(count)]
            elif kind == "steady":
                instants += [base + rng.randrange(MINUTE) for _ in range(rng.randrange(20, 120))]
            elif rng.random() < 0.1:  # a burst inside one second
                at = base + rng.randrange(MINUTE - 1_000_000)
                instants += [at + rng.randrange(1_000_000) for _ in range(rng.randrange(30, 400))]
        traffic[f"ApiKey:{n}"] = sorted(instants)
    return traffic


def refused(instants: list[int], rate: int, period_us: int, burst: int, algorithm: Any = token_bucket) -> list[bool]:
    """Which of ``instants`` the real algorithm refuses."""
    state, out = None, []
    for at in instants:
        outcome = algorithm(state, at, rate, period_us, burst, 1)
        if outcome.allowed:
            state = outcome.new_state
        out.append(not outcome.allowed)
    return out


def record(traffic: dict[str, list[int]], tier: str, endpoint: str, refusals: dict[str, list[bool]]) -> None:
    """The minute usage records the day leaves, as the limits in force decided it."""
    rows = []
    for subject, instants in traffic.items():
        minutes: dict[int, list[int]] = {}
        for at, was_refused in zip(instants, refusals[subject], strict=True):
            counts = minutes.setdefault(at // MINUTE * MINUTE, [0, 0])
            counts[was_refused] += 1
        for start, (allowed, throttled) in minutes.items():
            rows.append(
                UsageRecord(
                    granularity="minute",
                    period_start=datetime.fromtimestamp(start / 1_000_000, tz=UTC),
                    subject_kind="api_key",
                    subject_id=subject,
                    tier=tier,
                    endpoint=endpoint,
                    allowed=allowed,
                    throttled=throttled,
                    tokens=allowed,
                )
            )
    UsageRecord.objects.bulk_create(rows)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_tier_change_previewed_holds_what_the_new_tier_refuses_of_the_same_day(seed: int) -> None:
    """The target: a day of traffic under 20/s (burst 40), recorded by the minute; the tier then
    previewed at 5/s (burst 10). Replayed at the instants it came, the new tier refuses a number
    inside the range, for the whole and for every subject listed."""
    traffic = day_of_traffic(seed)
    record(traffic, "metered", "customers", {s: refused(i, 20, 1_000_000, 40) for s, i in traffic.items()})
    tier = Tier.objects.create(name="metered", rate="20/s", burst=40)
    tier.rate, tier.burst = "5/s", 10  # the form's values, not saved
    found = preview_tier(tier, now=NOW)
    truth = {subject: sum(refused(instants, 5, 1_000_000, 10)) for subject, instants in traffic.items()}
    assert found.fewest <= sum(truth.values()) <= found.most
    assert found.top and all(row.fewest <= truth[row.subject_id] <= row.most for row in found.top)
    assert found.current_fewest <= found.refused_then <= found.current_most  # the 429s recorded, too
    assert found.fewest > 0 and found.subjects == len([s for s in traffic if traffic[s]])
    assert found.minutes > 1000 and found.hours == 0


def test_a_quota_the_minutes_align_with_is_previewed_exactly() -> None:
    """A quota of so many an hour, from minute records: each hour's count is known, and the range
    is one number, the real one."""
    traffic = day_of_traffic(4, subjects=12)
    hour = 60 * MINUTE
    record(traffic, "metered", "customers", {s: [False] * len(i) for s, i in traffic.items()})
    tier = Tier.objects.create(name="metered", rate="1000/s", burst=1000)
    tier.quota = "2000/h"
    found = preview_tier(tier, now=NOW)
    truth = sum(sum(refused(i, 2000, hour, 2000, fixed_window)) for i in traffic.values())
    assert found.fewest == found.most == truth > 0


def test_an_endpoint_change_is_previewed_per_caller_and_for_all_callers() -> None:
    traffic = day_of_traffic(5, subjects=10)
    record(traffic, "free", "reports.export", {s: [False] * len(i) for s, i in traffic.items()})
    policy = EndpointPolicy(endpoint="reports.export", per_caller_rate="2/s", endpoint_rate="20/s")
    per_caller, all_callers = preview_endpoint(policy, now=NOW)
    truth = sum(sum(refused(i, 2, 1_000_000, 2)) for i in traffic.values())
    assert per_caller.fewest <= truth <= per_caller.most
    everyone = sorted(at for instants in traffic.values() for at in instants)
    assert (
        all_callers.subjects == 1
        and all_callers.fewest <= sum(refused(everyone, 20, 1_000_000, 20)) <= all_callers.most
    )


def test_hours_are_read_where_minutes_are_gone_and_the_range_widens() -> None:
    traffic = day_of_traffic(6, subjects=8)
    record(traffic, "metered", "customers", {s: [False] * len(i) for s, i in traffic.items()})
    tier = Tier.objects.create(name="metered", rate="20/s", burst=40)
    tier.rate, tier.burst = "3/s", 6
    by_minute = preview_tier(tier, now=NOW)
    from ratelimits.usage.records import rollup

    rollup(now=NOW)
    UsageRecord.objects.filter(granularity="minute", period_start__lt=NOW - timedelta(hours=12)).delete()
    mixed = preview_tier(tier, now=NOW)
    truth = sum(sum(refused(i, 3, 1_000_000, 6)) for i in traffic.values())
    assert mixed.hours > 0 and mixed.minutes < by_minute.minutes
    assert mixed.fewest <= by_minute.fewest <= truth <= by_minute.most <= mixed.most


def test_the_admin_previews_a_tier_change_without_saving_it(admin_client: Client, settings: Any) -> None:
    settings.RATELIMITS = merged(settings.RATELIMITS, {"POLICIES": {"SOURCE": "database"}})
    traffic = day_of_traffic(7, subjects=6)
    record(traffic, "metered", "customers", {s: [False] * len(i) for s, i in traffic.items()})
    tier = Tier.objects.create(name="metered", rate="20/s", burst=40)
    url = reverse("admin:ratelimits_tier_change", args=[tier.pk])
    page = admin_client.get(url)
    assert 'name="_preview"' in page.content.decode()
    form = {**form_data(page), "rate": "2/s", "burst": "4", "change_reason": "preview", "_preview": "1"}
    response = admin_client.post(url, form)
    body = response.content.decode()
    assert response.status_code == 200 and 'id="ratelimits-preview"' in body
    assert "requests refused" in body and "ApiKey:" in body and "Nothing has been saved" in body
    tier.refresh_from_db()
    assert (tier.rate, tier.burst) == ("20/s", 40)  # nothing saved
    form["rate"] = "2/x"
    invalid = admin_client.post(url, form)  # refused as a save would be, and nothing previewed
    assert "rate" in invalid.context["adminform"].form.errors
    assert 'id="ratelimits-preview"' not in invalid.content.decode()


def test_the_command_previews_a_settings_change(settings: Any) -> None:
    settings.RATELIMITS = merged(
        settings.RATELIMITS,
        {
            "TIERS": {"metered": {"rate": "20/s", "burst": 40}},
            "POLICIES": {"DEFAULT_TIERS": {"anonymous": "metered", "authenticated": "metered"}},
        },
    )
    traffic = day_of_traffic(8, subjects=6)
    record(traffic, "metered", "customers", {s: [False] * len(i) for s, i in traffic.items()})
    out = StringIO()
    call_command(
        "ratelimits_preview", "--tier", "metered", "--rate", "3/s", "--burst", "6", "--days", "30", "--json", stdout=out
    )
    (found,) = json.loads(out.getvalue())
    truth = sum(sum(refused(i, 3, 1_000_000, 6)) for i in traffic.values())
    assert found["limit"] == "tier metered" and found["fewest"] <= truth <= found["most"]
    text = StringIO()
    call_command("ratelimits_preview", "--tier", "metered", "--rate", "3/s", "--days", "30", stdout=text)
    assert "would refuse" in text.getvalue() and "most refused" in text.getvalue()


def test_an_override_is_previewed_on_its_subjects_records_against_its_tier() -> None:
    """An override of one customer's rate, on that customer's records only, against the rate of the
    tier its records were counted under (as it is in force: the settings' here)."""
    from ratelimits.models import Override
    from ratelimits.policies.source import get_policy_source
    from ratelimits.reports.preview import base_policies_of, preview_override

    tier = next(iter(get_policy_source().snapshot().tiers))
    traffic = day_of_traffic(9, subjects=4)
    record(traffic, tier, "customers", {s: [False] * len(i) for s, i in traffic.items()})
    override = Override(
        subject_kind="api_key",
        subject_id="ApiKey:2",
        rate="2/s",
        burst=2,
        reason="a trial",
        expires_at=NOW + timedelta(days=1),
    )
    base = base_policies_of("api_key", "ApiKey:2")
    assert base and base[0].tier == tier
    found = preview_override(override, base, now=NOW)
    assert found.subjects == (1 if traffic["ApiKey:2"] else 0)
    truth = sum(refused(traffic["ApiKey:2"], 2, 1_000_000, 2))
    assert found.fewest <= truth <= found.most
    assert found.previewed == ["2 / second, burst 2"] or "2 / second" in found.previewed[0]


def test_past_the_records_a_preview_reads_the_quietest_are_counted_not_replayed(monkeypatch: Any) -> None:
    """A tier too big to read whole: the busiest subjects are replayed, the quietest counted as none
    to all of their requests refused; the range still holds what the new tier really refuses."""
    from ratelimits.reports import preview as previews

    traffic = day_of_traffic(10, subjects=12)
    record(traffic, "metered", "customers", {s: [False] * len(i) for s, i in traffic.items()})
    monkeypatch.setattr(previews, "MAX_ROWS", 900)
    tier = Tier.objects.create(name="metered", rate="20/s", burst=40)
    tier.rate, tier.burst = "3/s", 6
    found = preview_tier(tier, now=NOW)
    truth = sum(sum(refused(i, 3, 1_000_000, 6)) for i in traffic.values())
    assert found.not_replayed_subjects > 0 and found.minutes <= 900
    assert found.fewest <= truth <= found.most
    assert found.requests == sum(len(i) for i in traffic.values())


def test_a_disabled_tier_and_an_expired_override_are_previewed_as_limiting_nothing() -> None:
    from ratelimits.models import Override
    from ratelimits.reports.preview import preview_override

    traffic = day_of_traffic(11, subjects=4)
    record(traffic, "metered", "customers", {s: [False] * len(i) for s, i in traffic.items()})
    tier = Tier.objects.create(name="metered", rate="20/s", burst=40)
    tier.rate, tier.burst, tier.enabled = "1/s", 1, False
    assert (preview_tier(tier, now=NOW).fewest, preview_tier(tier, now=NOW).most) == (0, 0)
    expired = Override(subject_kind="api_key", subject_id="ApiKey:1", rate="1/s", reason="over", expires_at=NOW)
    assert preview_override(expired, (), now=NOW).most == 0


@pytest.mark.parametrize(
    ("arguments", "said"),
    [
        (["--tier", "nowhere", "--rate", "1/s"], "is not a tier in force"),
        (["--tier", "anonymous", "--rate", "1/x"], "1/x"),
        (["--endpoint", "reports.export", "--burst", "5"], "--burst goes with --rate"),
        (["--tier", "anonymous", "--burst", "0"], "--burst: 0 must be a positive integer"),
        (["--tier", "anonymous", "--days", "400"], "--days: 400 must be between 1 and 90"),
        (["--endpoint", "reports.export"], "Give --rate or --endpoint-rate"),
    ],
)
def test_the_command_refuses_what_it_cannot_preview(arguments: list[str], said: str) -> None:
    from django.core.management.base import CommandError

    with pytest.raises(CommandError, match=re.escape(said)):
        call_command("ratelimits_preview", *arguments, stdout=StringIO())


def test_the_commands_errors_name_its_flags_and_an_unknown_endpoint_is_refused() -> None:
    from django.core.management.base import CommandError

    with pytest.raises(CommandError, match=re.escape("--rate: '0/s' allows nothing")):
        call_command("ratelimits_preview", "--tier", "anonymous", "--rate", "0/s", stdout=StringIO())
    with pytest.raises(CommandError, match="'nosuch' has no rule in force and no usage recorded"):
        call_command("ratelimits_preview", "--endpoint", "nosuch", "--rate", "1/s", stdout=StringIO())


def test_a_quota_by_the_month_is_noted_as_in_the_tiers_own_periods_not_left_out() -> None:
    traffic = day_of_traffic(12, subjects=3)
    record(traffic, "metered", "customers", {s: [False] * len(i) for s, i in traffic.items()})
    tier = Tier.objects.create(name="metered", rate="20/s", burst=40)
    tier.quota = "100/month"
    found = preview_tier(tier, now=NOW)
    assert found.left_out == [] and any("not each customer's anchor" in note for note in found.notes)
    assert "100 per calendar month" in "; ".join(found.previewed)
