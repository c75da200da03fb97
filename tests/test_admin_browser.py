"""The effective policy page in a real headless browser: Debian's Chromium driven by Playwright.

Chromium comes from Debian's packages (never ``playwright install``): if /usr/bin/chromium is
missing, the session installs it with apt-get (CI runs as root) and fails, never skips, if it
cannot. The page is served by pytest-django's ``live_server``; the screenshot is written to
test-artifacts/effective-policy.png.
"""

from __future__ import annotations

import datetime as dt
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from django.urls import reverse
from django.utils import timezone

from ratelimits.admin import EffectivePolicyForm
from ratelimits.engine import get_limiter, get_policy_source
from ratelimits.models import AuditEntry, EndpointPolicy, Override, SubjectAssignment, Tier

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"
SCREENSHOT = ARTIFACTS / "effective-policy.png"
API_KEY = "ApiKey:3"
PASSWORD = "correct horse battery staple"

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(900)]


@pytest.fixture(scope="session")
def chromium() -> str:
    """The path of Debian's Chromium, installed with apt-get when missing."""
    if not os.access(CHROMIUM, os.X_OK):
        sudo = [] if os.geteuid() == 0 else ["sudo", "-n"]
        if sudo and shutil.which("sudo") is None:
            pytest.fail(f"{CHROMIUM} is missing and apt-get needs root: run `apt-get install -y chromium` as root.")
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        lock = ["-o", "DPkg::Lock::Timeout=300"]
        steps = [
            [*sudo, "apt-get", *lock, "update", "-qq"],
            [*sudo, "apt-get", *lock, "install", "-y", "-qq", "chromium"],
        ]
        for step in steps:
            done = subprocess.run(step, env=env, capture_output=True, text=True, timeout=800, check=False)
            if done.returncode != 0:
                pytest.fail(
                    f"{CHROMIUM} is missing and `{' '.join(step)}` failed ({done.returncode}):\n"
                    f"{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
                )
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(f"apt-get installed chromium but {CHROMIUM} is still missing.")
    return CHROMIUM


@pytest.fixture
def policies(settings: Any) -> dict[str, Any]:
    settings.RATELIMITS = {**settings.RATELIMITS, "POLICY_SOURCE": "ratelimits.sources.DatabasePolicySource"}
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
    from playwright.sync_api import sync_playwright

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
    ARTIFACTS.mkdir(exist_ok=True)
    SCREENSHOT.unlink(missing_ok=True)
    page_url = live_server.url + reverse("admin:ratelimits_effective_policy")
    problems: list[str] = []

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})

            def on_console(msg: Any) -> None:
                # Chromium asks for /favicon.ico by itself; the admin declares none: not the page's fault.
                if msg.type == "error" and not msg.location.get("url", "").endswith("/favicon.ico"):
                    problems.append(f"console {msg.type}: {msg.text} at {msg.location}")

            page.on("console", on_console)
            page.on("pageerror", lambda exc: problems.append(f"page error: {exc}"))
            page.on("requestfailed", lambda req: problems.append(f"request failed: {req.url} {req.failure}"))
            page.on("response", lambda r: problems.append(f"HTTP {r.status}: {r.url}") if r.status >= 400 else None)

            # Logged out: the admin sends us to its login form, which brings us back afterwards.
            page.goto(page_url)
            assert "/admin/login/" in page.url
            page.fill("#id_username", "ops")
            page.fill("#id_password", PASSWORD)
            page.click("input[type=submit]")
            page.wait_for_url(f"{page_url}*")
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
            page.screenshot(path=str(SCREENSHOT), full_page=True)

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
            page.screenshot(path=str(ARTIFACTS / "effective-policy-after-reset.png"), full_page=True)
        finally:
            browser.close()

    assert problems == []
    assert SCREENSHOT.stat().st_size > 10_000
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
    from playwright.sync_api import sync_playwright

    from project.payments.models import ApiKey

    settings.RATELIMITS = {**settings.RATELIMITS, "API_KEY_MODEL": "payments.ApiKey"}
    django_user_model.objects.create_superuser("ops", "ops@example.com", PASSWORD)
    key, _ = ApiKey.issue(name="Initech billing", tier="free", organization="initech")
    add_url = live_server.url + reverse("admin:ratelimits_override_add")
    problems: list[str] = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page()
            page.on("pageerror", lambda exc: problems.append(f"page error: {exc}"))
            page.on(
                "console",
                lambda msg: (
                    problems.append(msg.text)
                    if msg.type == "error" and not msg.location.get("url", "").endswith("/favicon.ico")
                    else None
                ),
            )
            page.goto(add_url)
            page.fill("#id_username", "ops")
            page.fill("#id_password", PASSWORD)
            page.click("input[type=submit]")
            page.wait_for_url(f"{add_url}*")
            page.select_option("#id_subject_kind", "api_key")
            page.type("#id_subject_id", "Initech")
            page.wait_for_selector("#id_subject_id-suggestions option", state="attached")
            options = page.eval_on_selector_all(
                "#id_subject_id-suggestions option", "os => os.map(o => [o.value, o.label])"
            )
        finally:
            browser.close()
    assert problems == []
    assert options == [[f"ApiKey:{key.pk}", str(key)]]
