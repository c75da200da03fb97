"""A brand-new project, as a newcomer makes it, following the README's "Use it in your project".

The wheel is built from this checkout and installed, with its runtime requirements only, in a
virtualenv of its own; ``django-admin startproject`` makes the project; the README's steps are
read from the README itself (so it cannot drift from what works) and carried out as written, but
for two things a test must change: the install names the wheel built here instead of a checkout,
and the Redis URL is the test's own server. Then, over HTTP on ``runserver``:

- DRF's ``DEFAULT_THROTTLE_RATES`` (``anon``, ``user`` and two scopes) enforced after the swap;
- a django-ratelimit-style ``@ratelimit(key="ip", rate=...)`` enforced on a plain view;
- the 429 contract: status, ``Retry-After``, the problem body, the headers;
- a bad setting failing ``manage.py check`` under its own id;
- a database whose migrations were never run: no 5xx over 100 requests, the settings' limits held;
- usage: a request made now is in every reader (``GET /v1/usage`` at every granularity,
  ``/v1/rate_limit``'s ``today``, the admin's usage report) within 5 s, and once its minute has
  closed the drain the README's fourth step schedules moves it into the database: with
  ``manage.py ratelimits_drain`` beside the server, and with a Celery worker and beat on RabbitMQ
  (the project's Celery module as Celery's Django guide writes it, plus ``install_beat_schedule``).
"""

from __future__ import annotations

import contextlib
import csv
import http.cookiejar
import io
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.parse
import urllib.request
from base64 import b64encode
from collections.abc import Iterator
from pathlib import Path

import pytest

from .support.celery_app import BROKER_URL, broker_reachable
from .support.processes import REPO, Service
from .support.redis_server import RedisServer, free_port

pytestmark = pytest.mark.slow

README_URL = "redis://127.0.0.1:6379/0"
ROOT_PASSWORD = "fresh-" + secrets.token_hex(8)
#: The README's fourth step with Celery: the project's Celery module as Celery's Django guide
#: writes it, and the one line the step adds.
CELERY_MODULE = """
import os

from celery import Celery

from ratelimits.periodic import install_beat_schedule

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "mysite.settings")

app = Celery("mysite")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
install_beat_schedule(app)
"""
#: What the wheel may bring into a virtualenv: its runtime requirements and theirs, nothing of CI's.
RUNTIME = {"django-ratelimits", "django", "djangorestframework", "redis", "asgiref", "sqlparse", "async-timeout"}
RUNTIME |= {"typing-extensions", "typing_extensions", "tzdata"}
#: What the project's own code adds after the README's steps: DRF views, a plain view, their routes.
API = """
from django.http import HttpResponse
from django.urls import path
from rest_framework.decorators import api_view, throttle_scope
from rest_framework.response import Response
from rest_framework.views import APIView

from django.contrib import admin

from ratelimits.decorators import ratelimit
from ratelimits.views import RateLimitStatusView, UsageView


class Plain(APIView):
    def get(self, request):
        return Response({"ok": True})


class Uploads(APIView):
    throttle_scope = "uploads"

    def post(self, request):
        return Response({"ok": True})


@api_view(["GET"])
@throttle_scope("search")
def search(request):
    return Response({"ok": True})


@ratelimit(key="ip", rate="2/m")
def login(request):
    return HttpResponse("ok")


urlpatterns = [
    path("api/plain", Plain.as_view()),
    path("api/uploads", Uploads.as_view()),
    path("api/search", search),
    path("login", login),
    # The app's customer API, routed as its docs say, and the admin startproject had.
    path("v1/usage", UsageView.as_view()),
    path("v1/rate_limit", RateLimitStatusView.as_view()),
    path("admin/", admin.site.urls),
]
"""
#: The project's throttle rates, as it had them under DRF's throttles; and what the test varies.
SETTINGS = """
import os

REST_FRAMEWORK["DEFAULT_THROTTLE_RATES"] = {"anon": "4/min", "user": "3/min", "uploads": "1/min", "search": "2/min"}
ROOT_URLCONF = "mysite.api"
# Each check below is its own client: the test speaks for them through this one trusted proxy.
RATELIMITS["IDENTITY"] = {"TRUSTED_PROXIES": ["127.0.0.1"]}
# Reading usage is not use: the readers' calls are not limited, nor counted.
RATELIMITS["POLICIES"] = {"EXEMPT_ENDPOINTS": ["usage"]}
if os.environ.get("FRESH_CELERY_QUEUE"):  # the Celery variant: Celery's Django guide, and a queue of the run's own
    CELERY_BROKER_URL = os.environ["FRESH_CELERY_BROKER"]
    CELERY_TASK_DEFAULT_QUEUE = os.environ["FRESH_CELERY_QUEUE"]
    RATELIMITS["USAGE"] = {"DRAIN_EVERY": "2s"}  # the documented cadence setting, short for the test
if os.environ.get("FRESH_BAD_RATE"):
    RATELIMITS["TIERS"] = {"anonymous": {"rate": "0/s"}, "authenticated": {"rate": "5/s"}}
if os.environ.get("FRESH_DATABASE"):
    DATABASES["default"]["NAME"] = os.environ["FRESH_DATABASE"]
    RATELIMITS["POLICIES"] = {"SOURCE": "database"}
"""


def use_it_steps() -> dict[str, str]:
    """The code blocks of the README's "Use it in your project", by the name of their marker."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    section = text.split("## Use it in your project", 1)[1].split("\n## ", 1)[0]
    blocks = dict(re.findall(r"<!-- use-it: (\w+) -->\n```\w+\n(.*?)```", section, flags=re.DOTALL))
    assert set(blocks) == {"install", "settings", "commands"}, "the README's steps lost their markers"
    return blocks


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The package's wheel, built from a copy of this checkout."""
    work = tmp_path_factory.mktemp("wheel")
    source = work / "source"
    shutil.copytree(
        REPO,
        source,
        ignore=shutil.ignore_patterns(".git", ".venv*", ".*_cache", "build", "*.egg-info", "site", "__pycache__"),
    )
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(work), "."], cwd=source)
    [built] = work.glob("django_ratelimits-*.whl")
    return built


@pytest.fixture(scope="module")
def project(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path, RedisServer]]:
    """The new project, set up by the README's steps: (its directory, its virtualenv's python, its Redis)."""
    root = tmp_path_factory.mktemp("fresh")
    steps = use_it_steps()
    run([sys.executable, "-m", "venv", str(root / "venv")])
    python = root / "venv" / "bin" / "python"
    # 1. The install, as written but for its target: this checkout's wheel.
    install = steps["install"].strip().split()
    assert install[:4] == ["python", "-m", "pip", "install"] and len(install) == 5, steps["install"]
    run([str(python), "-m", "pip", "install", "--disable-pip-version-check", "-q", str(wheel)])
    frozen = run([str(python), "-m", "pip", "freeze"]).splitlines()
    installed = {re.split(r"==| @ ", line)[0].lower() for line in frozen if line.strip()}
    assert "django-ratelimits" in installed and installed <= RUNTIME, installed
    # The wheel carries the client's package too: its name, and the deprecated one, import.
    run([str(python), "-W", "ignore::DeprecationWarning", "-c", "import ratelimits_client, ratelimits.client"])
    site = root / "site"
    site.mkdir()
    run([str(root / "venv" / "bin" / "django-admin"), "startproject", "mysite", str(site)], cwd=root)
    with RedisServer() as redis_server:
        # 2. The settings, appended to startproject's as written: only the Redis is the test's own.
        assert README_URL in steps["settings"]
        settings = site / "mysite" / "settings.py"
        with settings.open("a", encoding="utf-8") as out:
            out.write("\n" + steps["settings"].replace(README_URL, redis_server.url))
            out.write(SETTINGS)
        (site / "mysite" / "api.py").write_text(textwrap.dedent(API), encoding="utf-8")
        # 3. The commands, as written.
        for line in steps["commands"].strip().splitlines():
            words = line.split()
            assert words[:2] == ["python", "manage.py"], line
            output = run([str(python), *words[1:]], cwd=site)
            if words[2] == "check":
                assert "System check identified no issues" in output, output
        run(
            [
                str(python),
                "manage.py",
                "shell",
                "-c",
                "from django.contrib.auth.models import User; User.objects.create_user('ada', password='lovelace'); "
                f"User.objects.create_superuser('root', 'root@example.com', {ROOT_PASSWORD!r})",
            ],
            cwd=site,
        )
        yield site, python, redis_server


def newcomers_env(**extra: str) -> dict[str, str]:
    """The environment of a newcomer's shell: none of this test suite's settings or paths."""
    ours = {"DATABASE_URL", "PYTHONPATH", "VIRTUAL_ENV", "REDIS_URL"}
    env = {key: value for key, value in os.environ.items() if not key.startswith("DJANGO_") and key not in ours}
    return {**env, "PYTHONUNBUFFERED": "1", **extra}


def run(argv: list[str], *, cwd: Path | None = None, env: dict[str, str] | None = None) -> str:
    env = newcomers_env() if env is None else env
    result = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, f"{' '.join(argv)} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout + result.stderr


@contextlib.contextmanager
def serving(project: tuple[Path, Path, RedisServer], logs: Path, **env: str) -> Iterator[tuple[str, Service]]:
    """The project under Django's runserver, with ``env`` added: its base URL, and the server."""
    site, python, _ = project
    port = free_port()
    service = Service(
        "runserver", [str(python), "manage.py", "runserver", "--noreload", f"127.0.0.1:{port}"], logs, cwd=site
    )
    service.start(env=newcomers_env(**env))
    try:
        service.wait_for_log(r"Quit the server with", 60, "runserver ready")
        yield f"http://127.0.0.1:{port}", service
    finally:
        service.stop()


@pytest.fixture
def server(project: tuple[Path, Path, RedisServer], tmp_path: Path) -> Iterator[str]:
    """The project under runserver, as its base URL."""
    with serving(project, tmp_path) as (base, _):
        yield base


def call(
    base: str, path: str, *, client: str, method: str = "GET", user: str | None = None
) -> tuple[int, dict[str, str], bytes]:
    """One request, as the client at address ``client`` (through the trusted proxy)."""
    headers = {"X-Forwarded-For": client}
    if user:
        headers["Authorization"] = "Basic " + b64encode(user.encode()).decode()
    req = urllib.request.Request(base + path, method=method, headers=headers, data=b"" if method == "POST" else None)
    try:
        with urllib.request.urlopen(req, timeout=10) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read()


def codes(base: str, path: str, count: int, **how: str) -> list[int]:
    return [call(base, path, **how)[0] for _ in range(count)]


def test_drfs_rates_are_kept_after_the_swap_and_the_429_keeps_the_contract(server: str) -> None:
    # anon 4/min, per client address, on a view with no scope of its own.
    assert codes(server, "/api/plain", 5, client="203.0.113.1") == [200, 200, 200, 200, 429]
    # user 3/min for an authenticated caller, whatever its address.
    assert codes(server, "/api/plain", 4, client="203.0.113.2", user="ada:lovelace") == [200, 200, 200, 429]
    # The scope uploads, 1/min, on a view's throttle_scope.
    assert codes(server, "/api/uploads", 2, client="203.0.113.3", method="POST") == [200, 429]
    # The scope search, 2/min, on a function view's @throttle_scope.
    assert codes(server, "/api/search", 2, client="203.0.113.4") == [200, 200]
    status, headers, body = call(server, "/api/search", client="203.0.113.4")
    assert status == 429
    assert headers["Content-Type"] == "application/problem+json"
    problem = json.loads(body)
    assert problem["status"] == 429 and problem["violated-policies"] == ["endpoint:search"]
    assert 1 <= int(headers["Retry-After"]) <= 30 and int(headers["Retry-After"]) * 1000 >= problem["retry_after_ms"]
    assert headers["RateLimit-Policy"] and headers["X-RateLimit-Remaining"] == "0"


def test_a_django_ratelimit_style_decorator_is_enforced(server: str) -> None:
    assert codes(server, "/login", 3, client="203.0.113.5") == [200, 200, 429]


def test_a_bad_setting_fails_manage_py_check_with_its_id(project: tuple[Path, Path, RedisServer]) -> None:
    site, python, _ = project
    result = subprocess.run(
        [str(python), "manage.py", "check"],
        cwd=site,
        env=newcomers_env(FRESH_BAD_RATE="1"),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode != 0
    assert "ratelimits.E110" in result.stderr and "RATELIMITS['TIERS']['anonymous']['rate']: '0/s'" in result.stderr


def test_a_database_never_migrated_gives_no_5xx_and_the_settings_limits_hold(
    project: tuple[Path, Path, RedisServer], tmp_path: Path
) -> None:
    never_migrated = str(tmp_path / "never-migrated.sqlite3")
    with serving(project, tmp_path, FRESH_DATABASE=never_migrated) as (base, service):
        statuses = codes(base, "/api/plain", 100, client="203.0.113.6")
        log = service.log_text()
    assert not [s for s in statuses if s >= 500], log[-4000:]
    assert statuses[:4] == [200] * 4 and set(statuses[4:]) == {429}  # DRF's anon rate, from the settings
    assert log.count("the policy tables cannot be read") == 1, log[-4000:]
    assert "run manage.py migrate" in log


# -- usage, in every reader, and drained ---------------------------------------------------------------


def admin_opener(base: str) -> urllib.request.OpenerDirector:
    """A browser's session in the admin, logged in as the superuser (its login form, its CSRF token)."""
    opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(http.cookiejar.CookieJar()))
    login = base + "/admin/login/"
    form = opener.open(login, timeout=10).read().decode()
    match = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', form)
    assert match, form[:2000]
    fields = {"csrfmiddlewaretoken": match[1], "username": "root", "password": ROOT_PASSWORD, "next": "/admin/"}
    with opener.open(urllib.request.Request(login, data=urllib.parse.urlencode(fields).encode()), timeout=10) as page:
        assert page.url.endswith("/admin/"), page.url
    return opener


def readers(base: str, admin: urllib.request.OpenerDirector, client: str) -> dict[str, int | bool]:
    """What each reader says ``client`` was allowed today, and whether the customer API's rows are live."""
    today = time.strftime("%Y-%m-%dT00:00:00Z", time.gmtime())
    tomorrow = time.strftime("%Y-%m-%dT00:00:00Z", time.gmtime(time.time() + 86_400))
    found: dict[str, int | bool] = {}
    live = False
    for granularity in ("minute", "hour", "day"):
        query = urllib.parse.urlencode({"granularity": granularity, "from": today, "to": tomorrow})
        status, _, body = call(base, f"/v1/usage?{query}", client=client)
        assert status == 200, body
        rows = json.loads(body)["results"]
        found[f"usage by {granularity}"] = sum(row["allowed"] for row in rows)
        live = live or any(row["live"] for row in rows)
    status, _, body = call(base, "/v1/rate_limit?endpoint=search", client=client)
    assert status == 200, body
    found["today"] = json.loads(body)["today"]["allowed"]
    query = urllib.parse.urlencode(
        {"subject": f"ip:{client}", "granularity": "minute", "from": today, "to": tomorrow, "format": "csv"}
    )
    with admin.open(f"{base}/admin/ratelimits/fleetsettings/usage/?{query}", timeout=10) as response:
        header, *rows = csv.reader(io.StringIO(response.read().decode()))
    found["admin report"] = sum(int(row[header.index("Allowed")]) for row in rows)
    found["live"] = live
    return found


def drained(base: str, admin: urllib.request.OpenerDirector) -> bool:
    with admin.open(f"{base}/admin/ratelimits/fleetsettings/usage/", timeout=10) as response:
        return "The last drain moved counters into the database at" in response.read().decode()


def usage_reaches_every_reader_and_the_database(base: str, client: str, drain: Service) -> None:
    admin = admin_opener(base)
    sent = time.monotonic()
    assert codes(base, "/api/plain", 3, client=client) == [200, 200, 200]
    expected = {"usage by minute": 3, "usage by hour": 3, "usage by day": 3, "today": 3, "admin report": 3}
    seen = readers(base, admin, client)
    while any(seen[name] != count for name, count in expected.items()):
        assert time.monotonic() - sent < 5.0, seen  # within 5 s of the request
        time.sleep(0.1)
        seen = readers(base, admin, client)
    assert seen["live"] is True  # not drained yet: read from the store, and said so
    # Once the minute has closed, the drain moves it into the database: the same counts, from rows.
    deadline = time.monotonic() + 150
    while not (drained(base, admin) and readers(base, admin, client) == {**expected, "live": False}):
        assert time.monotonic() < deadline, (readers(base, admin, client), drain.tail())
        assert drain.running, drain.tail()
        time.sleep(1.0)


def test_usage_reaches_every_reader_and_the_sidecar_drains_it(
    project: tuple[Path, Path, RedisServer], tmp_path: Path
) -> None:
    site, python, _ = project
    sidecar = Service("drain", [str(python), "manage.py", "ratelimits_drain", "--every", "1s"], tmp_path, cwd=site)
    sidecar.start(env=newcomers_env())
    try:
        with serving(project, tmp_path) as (base, _):
            usage_reaches_every_reader_and_the_database(base, "203.0.113.7", sidecar)
    finally:
        sidecar.stop()


def test_usage_reaches_every_reader_and_celery_beat_drains_it(
    project: tuple[Path, Path, RedisServer], tmp_path: Path
) -> None:
    """Last in the module: it makes the project a Celery project, undone afterwards."""
    if not broker_reachable():
        pytest.skip(f"no AMQP broker at {BROKER_URL} (set RATELIMITS_TEST_BROKER_URL)")
    site, python, _ = project
    run([str(python), "-m", "pip", "install", "--disable-pip-version-check", "-q", "celery>=5.4"])
    package = site / "mysite"
    init = (package / "__init__.py").read_text(encoding="utf-8")
    (package / "celery.py").write_text(CELERY_MODULE.lstrip(), encoding="utf-8")
    (package / "__init__.py").write_text(init + "\nfrom .celery import app as celery_app\n", encoding="utf-8")
    queue = f"fresh-{secrets.token_hex(4)}"
    env = newcomers_env(FRESH_CELERY_QUEUE=queue, FRESH_CELERY_BROKER=BROKER_URL)
    celery = str(python.parent / "celery")
    worker = Service(
        "celery", [celery, "-A", "mysite", "worker", "-B", "-l", "info", "-Q", queue, "-c", "1"], tmp_path, cwd=site
    )
    worker.start(env=env)
    try:
        worker.wait_for_log(r"Task ratelimits\.drain_usage\[[^]]+\] succeeded", 90, "a drain sent by beat")
        with serving(project, tmp_path, FRESH_CELERY_QUEUE=queue, FRESH_CELERY_BROKER=BROKER_URL) as (base, _):
            usage_reaches_every_reader_and_the_database(base, "203.0.113.8", worker)
    finally:
        worker.stop()
        (package / "__init__.py").write_text(init, encoding="utf-8")
        (package / "celery.py").unlink()
