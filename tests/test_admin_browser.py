"""The effective policy page in a real headless browser: Debian's Chromium driven by Playwright.

The page is served by pytest-django's ``live_server`` (tests/support/browser.py has the browser);
the screenshot is written to test-artifacts/effective-policy.png.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
from django.urls import reverse
from django.utils import timezone

from ratelimits.admin import EffectivePolicyForm
from ratelimits.engine import get_limiter, get_policy_source
from ratelimits.models import AuditEntry, Delivery, EndpointPolicy, Override, SubjectAssignment, Tier, WebhookEndpoint
from ratelimits.store import notices
from ratelimits.thresholds import Crossing

from .support.browser import PASSWORD, launch, log_in, screenshot_path, watch
from .support.receiver import Receiver
from .support.settings import merged

API_KEY = "ApiKey:3"

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(900)]


@pytest.fixture
def policies(settings: Any) -> dict[str, Any]:
    settings.RATELIMITS = merged(settings.RATELIMITS, {"POLICIES": {"SOURCE": "database"}})
    # Own tiers: an earlier transactional test may have flushed the ones the migrations seed.
    partner = Tier.objects.create(name="browser-partner", rate="100/s", burst=200)
    contract = Tier.objects.create(name="browser-contract", rate="1000/s", burst=2000)
    SubjectAssignment.objects.create(subject_kind="api_key", subject_id=API_KEY, tier=partner)
    org = SubjectAssignment.objects.create(subject_kind="org", subject_id="acme", tier=contract)
    EndpointPolicy.objects.create(endpoint="charges", per_caller_rate="100/d", endpoint_rate="1000/d")
    override = Override.objects.create(
        subject_kind="api_key",
        subject_id=API_KEY,
        endpoint="charges",
        rate="10/h",
        burst=10,
        reason="incident 42: integrator retry storm",
        expires_at=timezone.now() + dt.timedelta(days=1),
    )
    return {"override": override, "org_assignment": org}


def test_effective_policy_page_in_chromium(
    chromium: str, live_server: Any, django_user_model: Any, policies: dict[str, Any]
) -> None:
    # All database work happens before Playwright starts: its sync API runs an event loop in
    # this thread, and Django refuses ORM calls from there.
    django_user_model.objects.create_superuser("ops", "ops@example.com", PASSWORD)
    override = policies["override"]
    form = EffectivePolicyForm({"api_key": API_KEY, "org": "acme", "endpoint": "charges", "method": "GET"})
    assert form.is_valid(), form.errors
    caller = form.caller()
    checks = get_policy_source().checks_for(caller.request, caller.identity)
    for _ in range(3):  # three requests' worth, on the live server's (process-wide) limiter
        assert get_limiter().decide(checks).allowed
    screenshot = screenshot_path("effective-policy.png")
    after_screenshot = screenshot_path("effective-policy-after-reset.png")
    page_url = live_server.url + reverse("admin:ratelimits_effective_policy")

    with launch(chromium) as browser:
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        problems = watch(page)
        # Logged out: the admin sends us to its login form, which brings us back afterwards.
        log_in(page, page_url, "ops")
        assert page.title().startswith("Effective policy")
        stylesheet = page.evaluate("getComputedStyle(document.querySelector('#header')).backgroundColor")
        assert stylesheet not in ("", "rgba(0, 0, 0, 0)"), "the admin's CSS did not load"

        page.fill("#id_api_key", API_KEY)
        page.fill("#id_org", "acme")
        page.fill("#id_endpoint", "charges")
        page.select_option("#id_method", "GET")
        page.click("#effective-form input[type=submit]")
        page.wait_for_selector("#effective-checks")

        rows = page.eval_on_selector_all(
            "#effective-checks tbody tr",
            "rows => rows.map(r => Array.from(r.cells, c => c.textContent.trim()))",
        )
        headers = page.eval_on_selector_all("#effective-checks thead th", "ths => ths.map(th => th.textContent)")
        page.screenshot(path=str(screenshot), full_page=True)

        # Reset the subject's counters: confirm the dialog, the POST carries the CSRF token.
        dialogs: list[str] = []
        page.once("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.accept()))
        page.click("#reset-form input[name=reset]")
        page.wait_for_selector(".messagelist .success")
        message = page.text_content(".messagelist .success")
        after_reset = page.eval_on_selector_all(
            "#effective-checks tbody tr",
            "rows => rows.map(r => Array.from(r.cells, c => c.textContent.trim()))",
        )
        page.screenshot(path=str(after_screenshot), full_page=True)

    assert problems == []
    assert screenshot.stat().st_size > 10_000
    assert [h.strip() for h in headers][:5] == ["Policy", "Limit", "Subject", "Cost", "From"]
    by_policy = {row[0]: row for row in rows}
    name = f"override:{override.pk}"
    assert set(by_policy) == {name, "tier:browser-contract", "endpoint:charges", "endpoint-all:charges"}
    assert by_policy[name][1:6] == [
        "10 / hour, burst 10",
        "api_key",
        "1",
        f"override #{override.pk}: incident 42: integrator retry storm",
        "7 / 10",
    ]
    full_in = int(by_policy[name][6].removesuffix(" s"))
    assert 1020 <= full_in <= 1080  # three tokens at one per 360 s, minus the seconds the browser took
    assert by_policy["tier:browser-contract"][2] == "org"
    assert by_policy["tier:browser-contract"][4] == f"assignment #{policies['org_assignment'].pk} (browser-contract)"
    assert by_policy["tier:browser-contract"][5].endswith(" / 2000")  # 1000/s: refilled at once
    assert by_policy["endpoint:charges"][4:6] == ["endpoint policy, per caller", "97 / 100"]
    assert by_policy["endpoint-all:charges"][4:6] == ["endpoint policy, all callers", "997 / 1000"]

    assert dialogs == ["Clear every counter of this subject? The action is audited."]
    assert message is not None and f"Counters reset for api_key {API_KEY}." in message
    remaining = {row[0]: (row[5], row[6]) for row in after_reset}
    assert remaining[name] == ("10 / 10", "0 s")
    assert remaining["endpoint:charges"] == ("100 / 100", "0 s")
    assert remaining["endpoint-all:charges"][0] == "997 / 1000"  # shared by every caller: kept
    entry = AuditEntry.objects.get(action="reset")
    assert (entry.actor.username, entry.object_id) == ("ops", f"api_key:{API_KEY}")


def test_subject_field_suggests_api_keys_in_chromium(
    chromium: str, live_server: Any, django_user_model: Any, settings: Any
) -> None:
    """Typing a name in an override's subject field offers the API key as the limiter names it."""
    from project.payments.models import ApiKey

    settings.RATELIMITS = merged(settings.RATELIMITS, {"IDENTITY": {"API_KEY_MODEL": "payments.ApiKey"}})
    django_user_model.objects.create_superuser("ops", "ops@example.com", PASSWORD)
    key, _ = ApiKey.issue(name="Initech billing", tier="free", organization="initech")
    add_url = live_server.url + reverse("admin:ratelimits_override_add")
    with launch(chromium) as browser:
        page = browser.new_page()
        problems = watch(page)
        log_in(page, add_url, "ops")
        page.select_option("#id_subject_kind", "api_key")
        page.type("#id_subject_id", "Initech")
        page.wait_for_selector("#id_subject_id-suggestions option", state="attached")
        options = page.eval_on_selector_all(
            "#id_subject_id-suggestions option", "os => os.map(o => [o.value, o.label])"
        )
    assert problems == []
    assert options == [[f"ApiKey:{key.pk}", str(key)]]


def test_the_banner_and_the_origins_an_operator_reads_in_chromium(
    chromium: str, live_server: Any, django_user_model: Any, settings: Any
) -> None:
    """The settings source: the tier table says it is not enforced and links to the limits in force;
    the effective policy of a key ``POLICIES['TIER_FUNC']`` places names the function, not a default."""
    from .factories import ApiKeyFactory

    settings.RATELIMITS = merged(
        settings.RATELIMITS,
        {
            "TIERS": {"walk-in": {"rate": "5/m"}, "member": {"rate": "20/s"}, "gold": {"rate": "50/s"}},
            "POLICIES": {
                "DEFAULT_TIERS": {"anonymous": "walk-in", "authenticated": "member"},
                "TIER_FUNC": "project.payments.auth.tier_of",
            },
            "IDENTITY": {"API_KEY_MODEL": "payments.ApiKey"},
        },
    )
    Tier.objects.create(name="browser-seeded", rate="1/s", burst=5)  # a row the settings source never reads
    key = ApiKeyFactory(tier="gold")
    django_user_model.objects.create_superuser("ops", "ops@example.com", PASSWORD)
    tiers_url = live_server.url + reverse("admin:ratelimits_tier_changelist")
    effective_url = live_server.url + reverse("admin:ratelimits_effective_policy")
    screenshot = screenshot_path("limits-in-force.png")

    with launch(chromium) as browser:
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        problems = watch(page)
        log_in(page, tiers_url, "ops")
        assert page.is_visible("#ratelimits-source-banner")
        banner = page.text_content("#ratelimits-source-banner") or ""
        assert page.is_visible("text=browser-seeded")  # the row is listed, and said to be ignored
        page.click("#ratelimits-source-banner a")
        page.wait_for_selector("#limits-tiers")
        title = page.title()
        tiers = page.eval_on_selector_all(
            "#limits-tiers tbody tr", "rows => rows.map(r => Array.from(r.cells, c => c.textContent.trim()))"
        )
        page.screenshot(path=str(screenshot), full_page=True)

        page.goto(f"{effective_url}?api_key=ApiKey:{key.pk}&endpoint=customers&method=GET")
        page.wait_for_selector("#effective-checks")
        checks = page.eval_on_selector_all(
            "#effective-checks tbody tr", "rows => rows.map(r => Array.from(r.cells, c => c.textContent.trim()))"
        )

    assert problems == []
    assert "Not enforced:" in banner and "the limits in force are written in the settings" in banner
    assert title.startswith("Limits in force")
    by_tier = {row[0]: row for row in tiers}
    assert set(by_tier) == {"gold", "member", "walk-in"}  # the enforced ones: not the seeded row
    assert by_tier["walk-in"][2] == "5 / minute, burst 5" and by_tier["walk-in"][5] == "anonymous"
    assert by_tier["gold"][6] == "RATELIMITS['TIERS']['gold']"
    [gold] = [row for row in checks if row[0] == "tier:gold"]
    assert gold[4] == "RATELIMITS['POLICIES']['TIER_FUNC'] returned 'gold'"


def test_a_plan_by_the_month_is_set_up_in_chromium(chromium: str, live_server: Any, django_user_model: Any) -> None:
    """A tier sold by the month in Paris, its bad zone refused on the field, then a customer's anchor."""
    django_user_model.objects.create_superuser("plans", "plans@example.com", PASSWORD)
    tier_url = live_server.url + reverse("admin:ratelimits_tier_add")
    assignment_url = live_server.url + reverse("admin:ratelimits_subjectassignment_add")

    with launch(chromium) as browser:
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        problems = watch(page)
        log_in(page, tier_url, "plans")
        page.fill("#id_name", "metered")
        page.fill("#id_rate", "25/s")
        page.fill("#id_quota", "1000000/month")
        page.fill("#id_quota_zone", "Europe/Pariss")
        page.select_option("#id_quota_mode", "soft")
        page.click("input[name=_save]")
        page.wait_for_selector(".errornote")
        zone_errors = page.text_content(".field-quota_zone .errorlist") or ""
        page.fill("#id_quota_zone", "Europe/Paris")
        page.click("input[name=_save]")
        page.wait_for_selector(".messagelist .success")

        page.goto(assignment_url)
        page.select_option("#id_subject_kind", "api_key")
        page.fill("#id_subject_id", "ApiKey:77")
        # The tier is an autocomplete: wait for the list it opens with, then for the search's own
        # answer. A search typed while the first list is in flight aborts it (select2 does), and an
        # option clicked from that list would leave the search in flight for the save to abort.
        with page.expect_response(lambda response: "autocomplete" in response.url and "term=" not in response.url):
            page.click(".field-tier .select2-selection")
        with page.expect_response(lambda response: "term=metered" in response.url):
            page.fill(".select2-search__field", "metered")
        page.click(".select2-results__option >> text=metered")
        page.fill("#id_quota_anchor_0", "2026-05-17")
        page.fill("#id_quota_anchor_1", "10:00:00")
        page.click("input[name=_save]")
        page.wait_for_selector(".messagelist .success")
        page.screenshot(path=str(screenshot_path("plan-by-the-month.png")), full_page=True)

    assert problems == []
    assert "not a time zone this system knows" in zone_errors
    tier = Tier.objects.get(name="metered")
    assert (tier.quota, tier.quota_zone, tier.quota_mode) == ("1000000/month", "Europe/Paris", "soft")
    assignment = SubjectAssignment.objects.get(subject_id="ApiKey:77")
    assert assignment.tier == tier
    assert assignment.quota_anchor == timezone.make_aware(dt.datetime(2026, 5, 17, 10, 0))


def test_an_endpoint_charged_by_outcome_and_work_is_set_up_in_chromium(
    chromium: str, live_server: Any, django_user_model: Any, settings: Any
) -> None:
    """An export charged by the rows it returned and never for our 5xx: a max cost below the cost
    refused on its field, then saved, and the limits in force say how it is charged."""
    settings.RATELIMITS = merged(settings.RATELIMITS, {"POLICIES": {"SOURCE": "database"}})
    django_user_model.objects.create_superuser("charges", "charges@example.com", PASSWORD)
    add_url = live_server.url + reverse("admin:ratelimits_endpointpolicy_add")
    in_force_url = live_server.url + reverse("admin:ratelimits_limits_in_force")

    with launch(chromium) as browser:
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        problems = watch(page)
        log_in(page, add_url, "charges")
        page.fill("#id_endpoint", "customers-export")
        page.fill("#id_cost", "2")
        page.select_option("#id_counts", "no_server_errors")
        page.fill("#id_max_cost", "1")
        page.click("input[name=_save]")
        page.wait_for_selector(".errornote")
        max_cost_errors = page.text_content(".field-max_cost .errorlist") or ""
        page.fill("#id_max_cost", "50")
        page.click("input[name=_save]")
        page.wait_for_selector(".messagelist .success")
        listed = page.text_content("#result_list") or ""
        page.goto(in_force_url)
        in_force = page.text_content("#limits-endpoints") or ""
        page.screenshot(path=str(screenshot_path("endpoint-charged-by-outcome.png")), full_page=True)

    assert problems == []
    assert "less than the cost 2" in max_cost_errors
    assert "every response but server errors (5xx), trued up to 50" in listed
    assert "2 (trued up to 50)" in in_force and "every response but server errors (5xx)" in in_force
    row = EndpointPolicy.objects.get(endpoint="customers-export")
    assert (row.cost, row.max_cost, row.counts) == (2, 50, "no_server_errors")


def test_a_tier_change_is_previewed_then_saved_in_chromium(
    chromium: str, live_server: Any, django_user_model: Any, settings: Any
) -> None:
    """An operator lowers a tier's rate, previews what it would have refused of the last week (the
    page shows the range and the customers), then saves it."""
    from datetime import timedelta

    from ratelimits.models import UsageRecord

    settings.RATELIMITS = merged(settings.RATELIMITS, {"POLICIES": {"SOURCE": "database"}})
    django_user_model.objects.create_superuser("previewer", "previewer@example.com", PASSWORD)
    tier = Tier.objects.create(name="browser-metered", rate="100/s", burst=200)
    start = timezone.now().replace(second=0, microsecond=0) - timedelta(hours=3)
    UsageRecord.objects.bulk_create(
        UsageRecord(
            granularity="minute",
            period_start=start + timedelta(minutes=minute),
            subject_kind="api_key",
            subject_id=f"ApiKey:{n}",
            tier="browser-metered",
            endpoint="customers",
            allowed=600 * (n + 1),
            tokens=600 * (n + 1),
        )
        for n in range(3)
        for minute in range(30)
    )
    url = live_server.url + reverse("admin:ratelimits_tier_change", args=[tier.pk])

    with launch(chromium) as browser:
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        problems = watch(page)
        log_in(page, url, "previewer")
        page.fill("#id_rate", "5/s")
        page.fill("#id_burst", "10")
        page.fill("#id_change_reason", "the free tier, cheaper")
        page.click("input[name=_preview]")
        page.wait_for_selector("#ratelimits-preview")
        preview = page.text_content("#ratelimits-preview") or ""
        page.screenshot(path=str(screenshot_path("tier-change-previewed.png")), full_page=True)
        kept = page.input_value("#id_rate")  # the form again, as it was filled
        page.click("input[name=_save]")
        page.wait_for_selector(".messagelist .success")

    assert problems == []
    assert "requests refused" in preview and "ApiKey:2" in preview and "Nothing has been saved" in preview
    assert kept == "5/s"
    saved = Tier.objects.get(pk=tier.pk)
    assert (saved.rate, saved.burst, saved.revision) == ("5/s", 10, tier.revision + 1)  # saved once: by the save


def test_a_customers_webhook_is_set_up_and_its_deliveries_read_in_chromium(
    chromium: str, live_server: Any, django_user_model: Any, settings: Any
) -> None:
    """An endpoint added as an operator would (a private URL refused on the field first); then a
    notice delivered to it, read in the notices' list and the delivery's log."""
    settings.RATELIMITS = merged(settings.RATELIMITS, {"USAGE": {"NOTICES": {"TIMEOUT": "5s"}}})
    django_user_model.objects.create_superuser("hooks", "hooks@example.com", PASSWORD)
    add_url = live_server.url + reverse("admin:ratelimits_webhookendpoint_add")

    with launch(chromium) as browser:
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        problems = watch(page)
        log_in(page, add_url, "hooks")
        made_secret = page.input_value("#id_secret")  # one made for the operator, to give the customer
        page.select_option("#id_subject_kind", "api_key")
        page.fill("#id_subject_id", "ApiKey:88")
        page.fill("#id_url", "http://10.0.0.5/hooks")
        page.click("input[name=_save]")
        page.wait_for_selector(".errornote")
        url_errors = page.text_content(".field-url .errorlist") or ""
        page.fill("#id_url", "https://hooks.example.com/ratelimits")
        page.click("input[name=_save]")
        page.wait_for_selector(".messagelist .success")
    assert problems == []
    assert "not a public address" in url_errors and "ALLOW_PRIVATE_URLS" in url_errors
    endpoint = WebhookEndpoint.objects.get(subject_id="ApiKey:88")
    assert endpoint.url == "https://hooks.example.com/ratelimits" and endpoint.secret == made_secret
    assert made_secret.startswith("whsec_")

    # A notice for that customer, delivered to a receiver of this test (the endpoint pointed at it).
    settings.RATELIMITS = merged(settings.RATELIMITS, {"USAGE": {"NOTICES": {"ALLOW_PRIVATE_URLS": True}}})
    with Receiver() as receiver:
        WebhookEndpoint.objects.filter(pk=endpoint.pk).update(url=receiver.url)
        [notice] = notices.record(
            [Crossing("api_key", "ApiKey:88", "tier:pro:quota", 80, 1_796_083_200_000_000, 8, 10)]
        )
        assert notices.send_due() == 1
    delivery = Delivery.objects.get(notice=notice)
    list_url = live_server.url + reverse("admin:ratelimits_notice_changelist")
    delivery_url = live_server.url + reverse("admin:ratelimits_delivery_change", args=[delivery.pk])

    with launch(chromium) as browser:
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        problems = watch(page)
        log_in(page, list_url, "hooks")
        row = page.text_content("#result_list tbody tr") or ""
        page.goto(delivery_url)
        log = page.text_content(".inline-group") or ""
        page.screenshot(path=str(screenshot_path("webhook-delivery.png")), full_page=True)
    assert problems == []
    assert "ApiKey:88" in row and "tier:pro:quota" in row and "1 of 1" in row
    assert "204" in log and "log: each attempt" in log.lower()
