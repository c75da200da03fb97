"""The demo's landing page: the keys, every endpoint with a curl line, the admin's pages, the docs site it serves."""

from __future__ import annotations

import re
from collections.abc import Iterator
from html import unescape
from io import StringIO
from pathlib import Path
from typing import Any
from urllib.parse import urljoin, urlsplit

import pytest
from django.core.management import call_command
from django.test import Client

from project.payments.management.commands.seed_demo import DEMO_KEYS
from project.payments.models import ApiKey, hash_key
from project.settings import RATELIMITS as DEMO_RATELIMITS

from .support.processes import REPO
from .support.settings import merged

pytestmark = pytest.mark.django_db

DOCS = REPO / "docs"


@pytest.fixture
def docs_site(built_site: Path, settings: Any) -> Path:
    settings.DOCS_SITE = built_site
    return built_site


def body(response: Any) -> str:
    """The text of a response, streamed (a served file) or not."""
    content = b"".join(response.streaming_content) if response.streaming else response.content
    return content.decode()


@pytest.fixture
def demo(settings: Any) -> None:
    settings.RATELIMITS = {**DEMO_RATELIMITS, "BACKEND": "memory"}
    call_command("seed_demo", stdout=StringIO())


def links(html: str, section: str) -> list[str]:
    block = re.search(rf'id="{section}">(.*?)</(?:ul|table)>', html, re.S)
    assert block is not None, section
    return [unescape(href) for href in re.findall(r'href="([^"]+)"', block[1])]


def test_the_page_shows_the_keys_endpoints_admin_and_docs(
    demo: None, docs_site: Path, client: Client, admin_client: Client
) -> None:
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

    assert '<a href="/docs/" id="docs-site">' in html
    docs = links(html, "docs")
    pages = sorted(path for path in DOCS.glob("*.md") if path.stem != "index")
    assert docs == [f"/docs/{path.stem}.html" for path in pages]
    for url, path in zip(docs, pages, strict=True):
        page = client.get(url)
        assert page.status_code == 200 and page["Content-Type"] == "text/html", url
        title = path.read_text().split("\n", 1)[0].lstrip("# ")
        assert f">{title}<" in unescape(body(page)), url  # the page's own heading, rendered


def site_references(html: str) -> Iterator[str]:
    """Every address a page of the site links to or loads: href and src attributes, CSS url()s."""
    yield from (unescape(url) for url in re.findall(r'\s(?:href|src)="([^"]*)"', html))
    yield from re.findall(r"(?<![\w.])url\(['\"]?([^'\")]+)", html)  # CSS's url(), not a from_url( in code


def test_the_served_site_loads_nothing_from_elsewhere_and_every_link_answers(docs_site: Path, client: Client) -> None:
    # Crawl from the home page: every page, style sheet, script, font and image the site refers to
    # is served by the demo, and nothing is loaded from another host (no CDN, no web fonts).
    seen: set[str] = set()
    queue = ["/docs/"]
    while queue:
        url = queue.pop()
        if url in seen:
            continue
        seen.add(url)
        response = client.get(url)
        assert response.status_code == 200, url
        if not url.endswith(("/", ".html", ".css")):
            continue
        text = body(response)
        loaded = re.findall(r'<(?:script|img|iframe|source)\s[^>]*\bsrc="([^"]+)"', text)
        loaded += [
            href
            for tag in re.findall(r"<link\s[^>]*>", text)
            if 'rel="canonical"' not in tag
            for href in re.findall(r'\bhref="([^"]+)"', tag)
        ]
        assert not [u for u in loaded if urlsplit(u).netloc], f"{url} loads from another host"
        for reference in site_references(text):
            target = urlsplit(urljoin(url, reference))
            if target.scheme in ("", "http") and target.netloc in ("", "testserver") and target.path:
                queue.append(target.path)
            else:
                assert target.scheme in ("http", "https", "mailto"), (url, reference)
    pages = {url for url in seen if url.endswith(".html")}
    assert {f"/docs/{path.stem}.html" for path in DOCS.glob("*.md")} <= pages
    assert any(url.endswith(".css") for url in seen) and any(url.endswith(".js") for url in seen)


def test_before_the_site_is_built_the_docs_say_how(settings: Any, tmp_path: Path, client: Client) -> None:
    settings.RATELIMITS = {**DEMO_RATELIMITS, "BACKEND": "memory"}
    settings.DOCS_SITE = tmp_path / "site"
    for url in ("/docs/", "/docs/contract.html", "/docs/nowhere"):
        response = client.get(url)
        assert response.status_code == 404, url
        assert "Run <code>make docs</code>" in response.content.decode(), url
    html = client.get("/").content.decode()
    assert 'id="docs-not-built"' in html and 'id="docs-site"' not in html
    assert "/docs/contract.html" in html  # the pages still listed, as they will be


def test_before_seeding_the_page_says_how(settings: Any, client: Client) -> None:
    settings.RATELIMITS = {**DEMO_RATELIMITS, "BACKEND": "memory"}
    html = client.get("/").content.decode()
    assert html.count("not seeded: run <code>manage.py seed_demo</code>") == len(DEMO_KEYS)


def test_only_the_docs_are_served(docs_site: Path, client: Client) -> None:
    assert client.get("/docs/nowhere.html").status_code == 404
    assert client.get("/docs/css/").status_code == 404  # no directory listings
    assert client.get("/docs//etc/passwd").status_code == 404  # under the site, where there is none
    for outside in ("/docs/../README.md", "/docs/%2e%2e%2fREADME.md", "/docs/css/../../pyproject.toml"):
        assert client.get(outside).status_code == 400, outside  # Django's SuspiciousFileOperation


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
