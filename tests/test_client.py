"""The client against this app: its own 429 (``live_server``, the demo), and the deprecated ``ratelimits.client``.

The client is the ``ratelimits-client`` distribution now (clients/python, imported as
``ratelimits_client``); its own tests, which need no Django, are in clients/python/tests. Here
are the tests that need the app: a live server's 429 and the demo's, and the shim that
re-exports the client from ``ratelimits.client`` for one release.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
import ratelimits_client
import ratelimits_client.policy
from ratelimits_client import RateLimitedError, session

from project.payments.management.commands.seed_demo import DEMO_KEYS

from .support.demo import demo_server
from .support.processes import REPO
from .support.settings import merged


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextlib.contextmanager
def retries_logged() -> Iterator[list[logging.LogRecord]]:
    """The client's DEBUG records. The test settings stop the "ratelimits" logger's propagation,
    so this listens on the client's own logger (still named ``ratelimits.client``)."""
    handler = Records()
    logger = logging.getLogger("ratelimits.client")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield handler.records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def advice_in(record: logging.LogRecord) -> float:
    """The advised wait a retry's DEBUG line names (``"... (advised 0.42 s)"``), in seconds."""
    text = record.args[5] if isinstance(record.args, tuple) else ""
    assert isinstance(text, str) and text.endswith(" s"), record.getMessage()
    return float(text.removesuffix(" s"))


# --- This app's own 429 --------------------------------------------------------------------------


@pytest.fixture
def tight(settings: Any) -> None:
    """Anonymous callers get 1 request a second, burst 1 (the memory backend, shared with the live server)."""
    settings.RATELIMITS = merged(
        settings.RATELIMITS,
        {
            "TIERS": {"anon": {"rate": "1/s", "burst": 1}},
            "POLICIES": {"DEFAULT_TIERS": {"anonymous": "anon", "authenticated": "anon"}},
        },
    )


def test_against_this_apps_own_429(live_server: Any, tight: None) -> None:
    url = live_server.url + "/t/ping"
    with session(max_retries=0) as refusing:
        assert refusing.get(url, timeout=10).status_code == 200
        with pytest.raises(RateLimitedError) as raised:
            refusing.get(url, timeout=10)
    error = raised.value
    assert error.problem is not None and error.problem["violated-policies"] == ["tier:anon"]
    exact = error.problem["retry_after_ms"] / 1000
    assert 0 < exact <= 1.0 and float(error.response.headers["Retry-After"]) == 1.0
    assert error.retry_after == exact  # Retry-After's whole second, to the millisecond
    assert error.response.headers["RateLimit"] == '"tier:anon";r=0;t=1'  # the wait, not the refill

    # The bucket is still empty: refused, then admitted once the advised wait is over.
    with session(advice_spread=0.1) as patient, retries_logged() as records:
        started = time.monotonic()
        response = patient.get(url, timeout=10)
        elapsed = time.monotonic() - started
    assert response.status_code == 200 and response.json() == {"ok": True}
    [record] = records  # one retry, admitted: it was not early
    advised = advice_in(record)
    assert 0 < advised <= exact and elapsed >= advised


@pytest.mark.slow
def test_against_the_demo_a_client_waits_the_exact_wait_and_is_admitted() -> None:
    """Acme's customer listing (2/s, burst 5) spent: the client's retry comes after the exact wait
    the 429 named (under a second, where ``Retry-After`` says 1), within its spread, and passes."""
    acme = next(raw for _, tier, _, raw in DEMO_KEYS if tier == "free")
    with demo_server("client", workers=1, threads=2) as demo, session() as client, retries_logged() as records:
        url = f"http://127.0.0.1:{demo.port}/v1/customers"
        for _ in range(20):  # the burst, then one refusal the client retries through
            assert client.get(url, headers={"Authorization": f"Bearer {acme}"}, timeout=10).status_code == 200
            if records:
                break
    [record] = records  # one retry, admitted: not a microsecond early
    advised, delay = advice_in(record), record.args[4] if isinstance(record.args, tuple) else None
    assert isinstance(delay, float) and 0 < advised < 1.0
    assert advised <= delay <= advised + max(0.1, 0.5 * advised)  # the default spread: half the advice


# --- The deprecated ratelimits.client ----------------------------------------------------------------


def forget_the_shim(monkeypatch: pytest.MonkeyPatch) -> None:
    """Import ``ratelimits.client`` anew in this test (its warning is the import's), as before afterwards."""
    import ratelimits

    for name in [m for m in sys.modules if m == "ratelimits.client" or m.startswith("ratelimits.client.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.delattr(ratelimits, "client", raising=False)


def test_the_old_import_still_works_and_warns(monkeypatch: pytest.MonkeyPatch) -> None:
    forget_the_shim(monkeypatch)
    with pytest.warns(DeprecationWarning) as caught:
        import ratelimits.client as old
    [warning] = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    message = str(warning.message)
    assert "ratelimits.client is deprecated" in message
    assert "ratelimits-client" in message and "import ratelimits_client" in message  # the distribution, the import
    assert warning.filename == __file__  # stacklevel: the line that imported it, where the change is made
    # The same names, and the same objects: an isinstance or except clause sees no difference.
    assert sorted(old.__all__) == sorted(ratelimits_client.__all__)
    for name in old.__all__:
        assert getattr(old, name) is getattr(ratelimits_client, name), name
    with pytest.raises(AttributeError, match=r"ratelimits\.client"):
        old.nothing_of_the_kind  # noqa: B018


def test_the_old_policy_module_still_works_and_warns(monkeypatch: pytest.MonkeyPatch) -> None:
    forget_the_shim(monkeypatch)
    with pytest.warns(DeprecationWarning) as caught:
        old = importlib.import_module("ratelimits.client.policy")
    messages = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
    assert any("import ratelimits_client.policy" in message for message in messages), messages
    assert sorted(old.__all__) == sorted(ratelimits_client.policy.__all__)
    for name in old.__all__:
        assert getattr(old, name) is getattr(ratelimits_client.policy, name), name


def test_the_old_import_brings_nothing_else() -> None:
    """As before it was a distribution of its own: importing it loads no Django, neither HTTP library, and
    nothing of the app's package but the shim (and the package above it)."""
    check = (
        "import sys, warnings; warnings.simplefilter('ignore', DeprecationWarning); import ratelimits.client; "
        "loaded = [m for m in ['django', 'requests', 'httpx', 'redis', 'ratelimits.conf'] if m in sys.modules]; "
        "others = [m for m in sys.modules if m.startswith('ratelimits.') and not m.startswith('ratelimits.client')]; "
        "assert not loaded and not others, (loaded, others)"
    )
    subprocess.run([sys.executable, "-c", check], check=True, timeout=60, cwd=REPO)
