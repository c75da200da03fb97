"""Plain HTTP against a server a test started, and the Django admin's forms posted as a browser would."""

from __future__ import annotations

import http.client
import json
import re
import urllib.parse
from dataclasses import dataclass
from html.parser import HTMLParser
from http.cookies import SimpleCookie
from typing import Any

__all__ = ["AdminSession", "Reply", "fetch", "form_fields", "page_errors", "serving"]

HTTP_TIMEOUT = 10.0


@dataclass(frozen=True)
class Reply:
    status: int
    headers: http.client.HTTPMessage
    body: bytes

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", "replace")

    def json(self) -> Any:
        return json.loads(self.body)


def fetch(
    port: int, method: str, path: str, *, headers: dict[str, str] | None = None, body: bytes | None = None
) -> Reply:
    """One request on a fresh connection (gunicorn's sync worker closes it anyway); no redirects followed."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=HTTP_TIMEOUT)
    try:
        connection.request(method, path, body=body, headers=headers or {})
        response = connection.getresponse()
        return Reply(response.status, response.headers, response.read())
    finally:
        connection.close()


class AdminSession:
    """Cookies and form posts, enough for the Django admin."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.cookies: dict[str, str] = {}

    def request(self, method: str, path: str, form: list[tuple[str, str]] | None = None) -> Reply:
        headers = {}
        if self.cookies:
            headers["Cookie"] = "; ".join(f"{name}={value}" for name, value in self.cookies.items())
        body = None
        if form is not None:
            body = urllib.parse.urlencode(form).encode()
            headers["Content-Type"] = "application/x-www-form-urlencoded"
        reply = fetch(self.port, method, path, headers=headers, body=body)
        for header in reply.headers.get_all("Set-Cookie") or []:
            cookie: SimpleCookie = SimpleCookie()
            cookie.load(header)
            self.cookies.update({name: morsel.value for name, morsel in cookie.items()})
        return reply


class FormFields(HTMLParser):
    """The fields a browser would submit from the form with ``id=form_id`` (submit buttons aside)."""

    def __init__(self, form_id: str) -> None:
        super().__init__()
        self.form_id = form_id
        self.fields: list[tuple[str, str]] = []
        self._inside = False
        self._select: str | None = None
        self._options: list[tuple[str, bool]] = []
        self._textarea: str | None = None
        self._text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "form":
            self._inside = a.get("id") == self.form_id
        if not self._inside:
            return
        name = a.get("name")
        if tag == "input" and name:
            kind = (a.get("type") or "text").lower()
            if kind in ("submit", "button", "image", "reset", "file"):
                return
            if kind in ("checkbox", "radio") and "checked" not in a:
                return
            self.fields.append((name, a.get("value") or ("on" if kind == "checkbox" else "")))
        elif tag == "select" and name:
            self._select, self._options = name, []
        elif tag == "option" and self._select is not None:
            self._options.append((a.get("value") or "", "selected" in a))
        elif tag == "textarea" and name:
            self._textarea, self._text = name, []

    def handle_data(self, data: str) -> None:
        if self._textarea is not None:
            self._text.append(data)

    def handle_endtag(self, tag: str) -> None:
        if tag == "form":
            self._inside = False
        elif tag == "select" and self._select is not None:
            chosen = [value for value, selected in self._options if selected] or [v for v, _ in self._options[:1]]
            self.fields.extend((self._select, value) for value in chosen)
            self._select = None
        elif tag == "textarea" and self._textarea is not None:
            text = "".join(self._text)
            self.fields.append((self._textarea, text[1:] if text.startswith("\n") else text))
            self._textarea = None


def form_fields(html: str, form_id: str) -> dict[str, str]:
    parser = FormFields(form_id)
    parser.feed(html)
    parser.close()
    return dict(parser.fields)


def page_errors(html: str) -> str:
    """The admin's error notes and field errors, for assertion messages."""
    found = re.findall(r'<(?:p class="errornote"|ul class="errorlist[^"]*")[^>]*>(.*?)</(?:p|ul)>', html, re.S)
    return " | ".join(re.sub(r"<[^>]+>", " ", f).strip() for f in found) or html[:2000]


def serving(port: int, path: str = "/admin/login/") -> bool:
    """Whether a server on ``port`` answers ``path`` with a 200 (the admin's login page decides no limit)."""
    try:
        return fetch(port, "GET", path).status == 200
    except (OSError, http.client.HTTPException):
        return False
