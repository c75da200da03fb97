"""Usage counting and its drain into UsageRecord: exact totals, exactly once."""

from __future__ import annotations

import time
from typing import Any

import pytest
from rest_framework.test import APIClient

from ratelimits import engine
from ratelimits.models import UsageBatch, UsageRecord
from ratelimits.usage import drain

from .factories import ApiKeyFactory
from .support.settings import merged

pytestmark = pytest.mark.django_db

LIMITS = {
    "TIERS": {"anonymous": {"rate": "5/m"}, "authenticated": {"rate": "3/m"}},
    "IDENTITY": {"ORGANIZATION_FUNC": "project.payments.auth.organization_of"},
    "ENDPOINTS": {"reports.export": {"cost": 2}},
}


@pytest.fixture(params=["memory", "redis"])
def backend_settings(request: pytest.FixtureRequest, settings: Any) -> str:
    if request.param == "redis":
        request.getfixturevalue("use_redis")
    settings.RATELIMITS = {**settings.RATELIMITS, **LIMITS}
    return str(request.param)


def totals(**where: Any) -> dict[str, int]:
    rows = UsageRecord.objects.filter(**where)
    return {m: sum(getattr(r, m) for r in rows) for m in ("allowed", "throttled", "shed", "degraded", "tokens")}


def later() -> float:
    """A clock two minutes ahead: every minute counted so far is closed."""
    return time.time() + 120


def test_known_traffic_drains_to_exact_totals(backend_settings: str) -> None:
    key = ApiKeyFactory(raw="sk_usage_1", organization="acme")
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION="Bearer sk_usage_1")
    statuses = [client.get("/v1/customers").status_code for _ in range(5)]
    assert statuses == [200, 200, 200, 429, 429]
    anonymous = APIClient(REMOTE_ADDR="198.51.100.5")
    assert [anonymous.get("/t/ping").status_code for _ in range(6)] == [200] * 5 + [429]

    engine.get_limiter().flush_usage(now=True)  # the second 429 came from memory: counted in the store now
    assert drain(now=later()) >= 1
    subject = f"ApiKey:{key.pk}"
    assert totals(subject_kind="api_key", subject_id=subject) == {
        "allowed": 3,
        "throttled": 2,
        "shed": 0,
        "degraded": 0,
        "tokens": 3,
    }
    row = UsageRecord.objects.get(subject_id=subject)
    assert (row.organization, row.tier, row.endpoint, row.granularity) == (
        "acme",
        "authenticated",
        "customers",
        "minute",
    )
    assert totals(subject_kind="ip", subject_id="198.51.100.5")["allowed"] == 5
    assert totals(subject_kind="ip", subject_id="198.51.100.5")["throttled"] == 1
    # Nothing left to drain: a second drain applies nothing and changes nothing.
    before = totals()
    assert drain(now=later()) == 0
    assert totals() == before


def test_a_batch_is_applied_once_even_if_the_drain_dies_before_forgetting_it(backend_settings: str) -> None:
    client = APIClient(REMOTE_ADDR="198.51.100.6")
    for _ in range(4):
        client.get("/t/ping")
    backend = engine.get_limiter().backend
    batches = backend.claim_usage(int(later() // 60))  # claimed by a drain that then "dies"
    assert 1 <= len(batches) <= 2  # two when the requests straddled a minute's end
    # The next drain finds the claimed batches again and applies them...
    assert drain(now=later()) == len(batches)
    # ...and a duplicate delivery of the same batch (it was never forgotten) applies nothing.
    assert all(UsageBatch.objects.filter(batch=batch).exists() for batch, _ in batches)
    assert drain(now=later()) == 0
    assert totals(subject_id="198.51.100.6")["allowed"] == 4


def test_open_minutes_are_not_drained(backend_settings: str) -> None:
    APIClient(REMOTE_ADDR="198.51.100.7").get("/t/ping")
    assert drain(now=time.time() - 120) == 0
    assert not UsageRecord.objects.exists()
    assert drain(now=later()) == 1


def test_degraded_decisions_are_counted_and_added_when_the_store_returns(settings: Any, own_redis: Any) -> None:
    settings.RATELIMITS = merged(
        LIMITS, {"BACKEND": "redis", "REDIS": {"URL": own_redis.url}, "FAILURE": {"BREAKER_COOLDOWN": "50ms"}}
    )
    client = APIClient(REMOTE_ADDR="198.51.100.8")
    assert client.get("/t/ping").status_code == 200
    own_redis.kill()
    assert [client.get("/t/ping")["X-RateLimit-Degraded"] for _ in range(3)] == ["1", "1", "1"]
    own_redis.start()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and engine.get_limiter().breaker.state != "closed":
        client.get("/t/ping")  # probes until the breaker closes
    assert engine.get_limiter().breaker.state == "closed"
    client.get("/t/ping")  # its end flushes what was counted while Redis was away
    stored = own_redis.client()
    fields = [field for key in stored.scan_iter(match="rl:usage:*") for field in stored.hkeys(key)]
    stored.close()
    assert any(field.endswith(b"d") for field in fields)
    assert not [field for field in fields if b"198.51.100.8" in field]  # named by digest, as decisions count
    drain(now=later())
    counted = totals(subject_id="198.51.100.8")
    assert counted["degraded"] == 3


def test_a_drain_killed_after_committing_does_not_count_twice(backend_settings: str) -> None:
    """Committed, but killed before the store forgot the batch: the next drain only forgets it."""

    class ForgetsNothing:
        """The store as seen by a drain that dies right after its database commit."""

        def __init__(self, backend: Any) -> None:
            self.backend = backend

        def claim_usage(self, before_minute: int) -> Any:
            return self.backend.claim_usage(before_minute)

        def lease_usage(self, batch: str, seconds: float) -> Any:
            return self.backend.lease_usage(batch, 0.001)  # long run out by the time anyone looks again

        def finish_usage(self, batch: str) -> None:
            raise SystemExit("killed before forgetting the batch")

    client = APIClient(REMOTE_ADDR="198.51.100.9")
    for _ in range(3):
        client.get("/t/ping")
    backend = engine.get_limiter().backend
    with pytest.raises(SystemExit):
        drain(ForgetsNothing(backend), now=later())  # type: ignore[arg-type]
    assert totals(subject_id="198.51.100.9")["allowed"] == 3
    # Once the dead drain's lease ran out, the next drain finds the batch, recognises it, and forgets it.
    deadline = time.monotonic() + 10
    while backend.claim_usage(int(later() // 60)):
        assert time.monotonic() < deadline, "the dead drain's batch was never taken over"
        assert drain(now=later()) == 0
    assert totals(subject_id="198.51.100.9")["allowed"] == 3
