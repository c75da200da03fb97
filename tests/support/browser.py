"""Debian's Chromium driven by Playwright, for the admin pages' browser tests.

Chromium comes from Debian's packages (never ``playwright install``), a prerequisite that ``make
test`` installs in the open (its ``browser`` target). A test never installs it: if /usr/bin/chromium
is missing, the ``chromium`` fixture fails, never skips, with the command that installs it.
Screenshots go to test-artifacts/.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .processes import REPO

__all__ = ["ARTIFACTS", "PASSWORD", "chromium", "launch", "log_in", "watch"]

CHROMIUM = "/usr/bin/chromium"
#: What keeps Chromium quiet on a machine with no network but loopback.
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
ARTIFACTS = REPO / "test-artifacts"
#: The admin password the browser tests' superusers log in with.
PASSWORD = "correct horse battery staple"


@pytest.fixture(scope="session")
def chromium() -> str:
    """The path of Debian's Chromium; a failure that says how to install it when it is missing."""
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(
            f"{CHROMIUM} is missing: the browser tests need Debian's chromium. Run `make browser`, "
            "or as root `apt-get update && apt-get install -y chromium`."
        )
    return CHROMIUM


@contextlib.contextmanager
def launch(chromium: str) -> Iterator[Any]:
    """A headless Chromium (a Playwright ``Browser``), closed afterwards.

    Do every database query before entering: Playwright's sync API runs an event loop in this
    thread, and Django refuses ORM calls from there.
    """
    from playwright.sync_api import sync_playwright  # only the browser tests need Playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS, headless=True)
        try:
            yield browser
        finally:
            browser.close()


def watch(page: Any) -> list[str]:
    """Every console error, page error, failed request and HTTP error of ``page``, as it happens.

    Chromium asks for /favicon.ico by itself and the admin declares none: that is not the page's fault.
    """
    problems: list[str] = []

    def on_console(msg: Any) -> None:
        if msg.type == "error" and not msg.location.get("url", "").endswith("/favicon.ico"):
            problems.append(f"console {msg.type}: {msg.text} at {msg.location}")

    def on_response(response: Any) -> None:
        if response.status >= 400 and not response.url.endswith("/favicon.ico"):
            problems.append(f"HTTP {response.status}: {response.url}")

    page.on("console", on_console)
    page.on("pageerror", lambda exc: problems.append(f"page error: {exc}"))
    page.on("requestfailed", lambda req: problems.append(f"request failed: {req.url} {req.failure}"))
    page.on("response", on_response)
    return problems


def log_in(page: Any, url: str, username: str, password: str = PASSWORD) -> None:
    """Open ``url`` logged out, log in on the admin's form it sends us to, and come back to ``url``."""
    page.goto(url)
    assert "/admin/login/" in page.url
    page.fill("#id_username", username)
    page.fill("#id_password", password)
    page.click("input[type=submit]")
    page.wait_for_url(f"{url}*")


def screenshot_path(name: str) -> Path:
    """Where a screenshot called ``name`` goes (an earlier run's copy removed)."""
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / name
    path.unlink(missing_ok=True)
    return path
