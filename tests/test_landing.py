"""The demo's landing page: the keys, every endpoint with a curl line, the admin's pages and the docs."""

from __future__ import annotations

import re
from html import unescape
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from django.core.management import call_command
from django.test import Client

from project.payments.management.commands.seed_demo import DEMO_KEYS
from project.payments.models import ApiKey, hash_key
from project.settings import RATELIMITS as DEMO_RATELIMITS

from .support.settings import merged

pytestmark = pytest.mark.django_db

DOCS = Path(__file__).resolve().parent.parent / "docs"


@pytest.fixture
def demo(settings: Any) -> None:
    settings.RATELIMITS = {**DEMO_RATELIMITS, "BACKEND": "memory"}
    call_command("seed_demo", stdout=StringIO())


def links(html: str, section: str) -> list[str]:
    block = re.search(rf'id="{section}">(.*?)</(?:ul|table)>', html, re.S)
    assert block is not None, section
    return [unescape(href) for href in re.findall(r'href="([^"]+)"', block[1])]


def test_the_page_shows_the_keys_endpoints_admin_and_docs(demo: None, client: Client, admin_client: Client) -> None:
    response = client.get("/")
    assert response.status_code == 200
    html = response.content.decode()
    for _, tier, _, raw in DEMO_KEYS:
        key = ApiKey.objects.get(key_hash=hash_key(raw))
        assert raw in html and f"<code>ApiKey:{key.pk}</code>" in html and f"<td>{tier}</td>" in html
    first, text = DEMO_KEYS[0][3], unescape(html)
    for line in (
        f'curl -i -X POST -H "Authorization: Bearer {first}" -d amount=500 http://testserver/v1/charges',
        f'curl -i -H "Authorization: Bearer {first}" http://testserver/v1/customers',
        f'curl -i -X POST -H "Authorization: Bearer {first}" http://testserver/v1/reports/export',
        f'curl -s -H "Authorization: Bearer {first}" "http://testserver/v1/rate_limit?endpoint=charges&method=POST"',
    ):
        assert line in text, line
    # The policies the admin has now: charges are critical, an export costs 10.
    rows = re.findall(
        r"<tr>\s*<td><code>(\w+ [^<]+)</code>.*?<td>(?:<span[^>]*>(\w+)</span>)?</td>\s*<td>(\d*)</td>", html, re.S
    )
    assert ("POST /v1/charges", "critical", "1") in rows and ("POST /v1/reports/export", "low", "10") in rows
    assert "per caller: 60 / minute, burst 20" in text  # the status endpoint's own limit, as seeded
    assert '<code id="backend">memory</code>' in html

    admin = links(html, "admin-links")
    assert len(admin) == 6
    for url in admin:
        assert admin_client.get(url).status_code == 200, url
    effective = admin_client.get(admin[3])
    assert effective.context["form"].is_valid() and effective.context["rows"], "Acme's effective policy is shown"

    docs = links(html, "docs")
    assert sorted(Path(url).name for url in docs) == sorted(path.stem for path in DOCS.glob("*.md"))
    for url in docs:
        page = client.get(url)
        assert page.status_code == 200 and page["Content-Type"] == "text/plain; charset=utf-8"
        assert page.content.decode() == (DOCS / f"{Path(url).name}.md").read_text()


def test_before_seeding_the_page_says_how(settings: Any, client: Client) -> None:
    settings.RATELIMITS = {**DEMO_RATELIMITS, "BACKEND": "memory"}
    html = client.get("/").content.decode()
    assert html.count("not seeded: run <code>manage.py seed_demo</code>") == len(DEMO_KEYS)


def test_only_the_docs_are_served(client: Client) -> None:
    assert client.get("/docs/nowhere").status_code == 404
    assert client.get("/docs/../settings").status_code == 404
    assert client.get("/docs/%2e%2e%2fREADME").status_code == 404


def test_the_page_names_the_redis_server_limits_are_kept_in(settings: Any, client: Client) -> None:
    # Rendering reads the settings only: no connection to this address is made.
    settings.RATELIMITS = merged(DEMO_RATELIMITS, {"BACKEND": "redis", "REDIS": {"URL": "redis://127.0.0.1:6399/3"}})
    html = client.get("/").content.decode()
    assert '<code id="backend">redis</code> (<code>redis://127.0.0.1:6399/3</code>)' in html


@pytest.mark.parametrize(
    ("backend", "where"), [("memory", "in-process, this server only"), ("redis", "redis://127.0.0.1:6399/3")]
)
def test_seeding_prints_where_limits_are_kept(settings: Any, backend: str, where: str) -> None:
    settings.RATELIMITS = merged(DEMO_RATELIMITS, {"BACKEND": backend, "REDIS": {"URL": "redis://127.0.0.1:6399/3"}})
    out = StringIO()
    call_command("seed_demo", stdout=out)
    assert f"  rate limiting backend: {backend} ({where})\n" in out.getvalue()
