"""The backend contract's capabilities: a core-only backend runs a project, and a setting that needs
a capability the backend lacks fails ``manage.py check`` naming both (``ratelimits.E183``).

The backend is the one docs/backends.md shows, built from the page's code
(``tests.support.documented_backend``); tests/test_contract.py runs the core contract suite on it.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import SystemCheckError
from django.utils import timezone

from ratelimits.backends import (
    CAPABILITIES,
    BulletinSupport,
    LeaseSupport,
    RegionSupport,
    SettleSupport,
    UsageSupport,
)
from ratelimits.backends.memory import MemoryBackend
from ratelimits.backends.redis import RedisBackend
from ratelimits.checks import E183, W001, W023, check_capabilities, check_deployment
from ratelimits.engine import get_limiter
from ratelimits.usage import drain
from ratelimits.usage.live import read_live

from .factories import ApiKeyFactory
from .support.clients import client_for
from .support.documented_backend import DictBackend
from .support.settings import merged

pytestmark = pytest.mark.django_db

CORE_ONLY = "tests.support.documented_backend.DictBackend"
SHARED_CORE_ONLY = "tests.test_capabilities.SharedDictBackend"

BASE = {
    "BACKEND": CORE_ONLY,
    "USAGE": False,
    "TIERS": {"free": {"rate": "3/m"}},
    "POLICIES": {"DEFAULT_TIERS": {"anonymous": "free", "authenticated": "free"}},
}


class SharedDictBackend(DictBackend):  # type: ignore[misc,valid-type]
    """The documented backend, as a store shared by every worker would say of itself."""

    shared = True


def messages_of(settings: Any, ratelimits: dict[str, Any]) -> list[str]:
    settings.RATELIMITS = ratelimits
    found = check_capabilities()
    assert {message.id for message in found} <= {E183}
    return [message.msg for message in found]


def test_a_project_runs_on_a_backend_with_the_core_only(settings: Any) -> None:
    settings.RATELIMITS = merged(settings.RATELIMITS, BASE)
    call_command("check")  # nothing the settings need is missing: no error
    ApiKeyFactory(raw="sk_core_1", tier="free")
    client = client_for("sk_core_1")
    responses = [client.get("/v1/customers") for _ in range(4)]
    assert [r.status_code for r in responses] == [200, 200, 200, 429]
    assert responses[0]["RateLimit-Policy"] == '"tier:free";q=3;w=60'
    assert 0 < int(responses[3]["Retry-After"]) <= 20  # 3 a minute: the next token within 20 s
    assert isinstance(get_limiter().backend, DictBackend)


def test_usage_left_on_fails_the_check_naming_the_setting_the_capability_and_the_backend(settings: Any) -> None:
    settings.RATELIMITS = merged(settings.RATELIMITS, {**BASE, "USAGE": True})
    with pytest.raises(SystemCheckError) as raised:
        call_command("check")
    assert (
        "(ratelimits.E183) RATELIMITS['USAGE'] is on (as by default), which needs usage counters "
        f"(ratelimits.backends.UsageSupport): RATELIMITS['BACKEND'] '{CORE_ONLY}' has none."
    ) in str(raised.value)
    assert "Add UsageSupport to DictBackend's bases and implement it" in str(raised.value)


def test_the_engine_leaves_out_what_the_backend_lacks(settings: Any) -> None:
    """Run anyway (the check ignored), usage is not counted and nothing reads counters that are not there."""
    settings.RATELIMITS = merged(settings.RATELIMITS, {**BASE, "USAGE": True})
    limiter = get_limiter()
    assert limiter.usage_store is None and limiter.leaser is None and not limiter.counts_usage
    ApiKeyFactory(raw="sk_core_2", tier="free")
    assert client_for("sk_core_2").get("/v1/customers").status_code == 200
    assert drain() == 0
    now = timezone.now()
    assert read_live(now - timedelta(minutes=5), now).error == "DictBackend keeps no usage counters"


@pytest.mark.parametrize(
    ("changes", "capability", "said"),
    [
        ({"USAGE": True}, UsageSupport, "RATELIMITS['USAGE'] is on (as by default)"),
        ({"POLICIES": {"SOURCE": "database"}}, BulletinSupport, "RATELIMITS['POLICIES']['SOURCE'] is the database"),
        (
            {"BACKEND": SHARED_CORE_ONLY, "LOCAL_PATH": {"LEASES": True}},
            LeaseSupport,
            "RATELIMITS['LOCAL_PATH']['LEASES'] is True",
        ),
        (
            {"REGIONS": {"CURRENT": "eu", "STORES": {"eu": "redis://127.0.0.1:1/0", "us": "redis://127.0.0.1:2/0"}}},
            RegionSupport,
            "RATELIMITS['REGIONS']['STORES'] names regions",
        ),
        (
            {"ENDPOINTS": {"exports": {"max_cost": 50}, "charges": {"counts": "no_server_errors"}}},
            SettleSupport,
            "RATELIMITS['ENDPOINTS']['charges'] charges by outcome or trues its cost up",
        ),
    ],
    ids=["usage", "bulletin", "leases", "regions", "settling"],
)
def test_each_setting_that_needs_a_capability_is_refused_without_it(
    settings: Any, changes: dict[str, Any], capability: type, said: str
) -> None:
    found = messages_of(settings, {**BASE, **changes})
    assert len(found) == 1
    assert found[0].startswith(
        f"{said}, which needs {CAPABILITIES[capability]} (ratelimits.backends.{capability.__name__})"
    )


def test_leases_left_at_their_default_are_no_error_where_none_are_taken(settings: Any) -> None:
    """Leases are on by default, as an optimisation: a backend that takes none just goes without."""
    assert messages_of(settings, {**BASE, "BACKEND": SHARED_CORE_ONLY}) == []


def test_the_shipped_backends_have_what_their_settings_need(settings: Any) -> None:
    everything = {
        "USAGE": True,
        "POLICIES": {"SOURCE": "database"},
        "LOCAL_PATH": {"LEASES": True},
        "REGIONS": {"CURRENT": "eu", "STORES": {"eu": "redis://127.0.0.1:1/0", "us": "redis://127.0.0.1:2/0"}},
        "ENDPOINTS": {"exports": {"max_cost": 50, "counts": "successes"}},
    }
    assert messages_of(settings, {**everything, "BACKEND": "redis"}) == []
    assert issubclass(RedisBackend, tuple(CAPABILITIES))
    # Memory keeps usage, the version and (the even split) regions' shares; it is never shared, so
    # leases are not asked of it.
    assert messages_of(settings, {**everything, "BACKEND": "memory"}) == []
    assert not issubclass(MemoryBackend, LeaseSupport)


def test_nothing_is_asked_of_the_backend_while_the_limiter_is_off(settings: Any) -> None:
    """docs/testing.md's recipe for a project's own tests: the limiter off, on the memory backend."""
    assert messages_of(settings, {**BASE, "USAGE": True, "ENABLED": False}) == []


def test_each_need_is_read_on_its_own(settings: Any) -> None:
    """A source that cannot be imported is check_settings' to report: the usage finding still stands."""
    found = messages_of(settings, {**BASE, "USAGE": True, "POLICIES": {"SOURCE": "myproject.nowhere.Source"}})
    assert [message.split(",")[0] for message in found] == ["RATELIMITS['USAGE'] is on (as by default)"]


class LeasesWithoutTheCapability(SharedDictBackend):  # type: ignore[misc,valid-type]
    """A backend written for 0.1: it has the lease methods, but not LeaseSupport among its bases."""

    def lease(self, checks: Any, wants: Any, *, usage: Any = None) -> Any:
        raise AssertionError("never called")

    def give_back(self, grants: Any) -> int:
        raise AssertionError("never called")


def test_a_capabilitys_methods_without_the_capability_are_a_warning(settings: Any) -> None:
    settings.RATELIMITS = {**BASE, "BACKEND": "tests.test_capabilities.LeasesWithoutTheCapability"}
    found = check_capabilities()
    assert [(message.id, message.msg) for message in found] == [
        (
            W023,
            "RATELIMITS['BACKEND'] 'tests.test_capabilities.LeasesWithoutTheCapability' has give_back and lease, but "
            "not ratelimits.backends.LeaseSupport among its bases: the engine never uses them.",
        )
    ]
    assert get_limiter().leaser is None  # and indeed it leases nothing


def test_a_per_process_backend_outside_debug_is_a_warning(settings: Any) -> None:
    """As the memory backend is: the documented DictBackend keeps its state in each process."""
    settings.DEBUG = False
    settings.RATELIMITS = BASE
    found = [message for message in check_deployment() if message.id == W001]
    assert [message.msg for message in found] == [
        f"RATELIMITS['BACKEND'] is '{CORE_ONLY}', whose state lives in each process (its class says shared = False): "
        "every worker process counts on its own."
    ]
    settings.RATELIMITS = {**BASE, "BACKEND": SHARED_CORE_ONLY}
    assert [message for message in check_deployment() if message.id == W001] == []
