"""The failed-authentication limit across worker processes: the demo under ``gunicorn --workers 2 --threads 4``.

Eight client threads send 1,000 guessed bearer tokens (the finding's flood) to the demo, whose
``IDENTITY['FAILED_AUTH']`` allows a burst of 20 and 10 a minute. Whatever worker a guess lands
on, at most the burst (plus what refilled while the flood ran) gets a 401; the rest get the 429
contract.
"""

from __future__ import annotations

import math
import secrets
import threading
import time
from collections.abc import Iterator

import pytest

from .support.demo import Demo, demo_server
from .support.http import Reply, fetch

pytestmark = pytest.mark.slow

GUESSES, CLIENTS = 1000, 8
#: The demo's IDENTITY['FAILED_AUTH'] (project/settings.py).
BURST, PER_MINUTE = 20, 10
ACME_KEY = "sk_free_demo_acme_0000000000"


@pytest.fixture
def demo() -> Iterator[Demo]:
    with demo_server("failed_auth", workers=2, threads=4) as server:
        yield server


def test_a_flood_of_guesses_across_workers_gets_at_most_the_burst_of_401s(demo: Demo) -> None:
    replies: list[Reply] = []
    lock = threading.Lock()

    def client(count: int) -> None:
        for _ in range(count):
            token = "sk_guess_" + secrets.token_hex(12)
            reply = fetch(demo.port, "GET", "/v1/customers", headers={"Authorization": f"Bearer {token}"})
            with lock:
                replies.append(reply)

    start = time.monotonic()
    threads = [threading.Thread(target=client, args=(GUESSES // CLIENTS,)) for _ in range(CLIENTS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    elapsed = time.monotonic() - start
    statuses = [reply.status for reply in replies]
    refilled = math.ceil(elapsed * PER_MINUTE / 60)
    print(f"\n{len(replies)} guesses in {elapsed:.1f} s: {statuses.count(401)} 401s, {statuses.count(429)} 429s")
    assert len(replies) == GUESSES
    assert set(statuses) == {401, 429}
    assert BURST <= statuses.count(401) <= BURST + refilled
    limited = [reply for reply in replies if reply.status == 429]
    assert all(int(reply.headers["Retry-After"]) >= 1 for reply in limited)
    assert all(reply.json()["violated-policies"] == ["failed-auth"] for reply in limited)
    # The valid key from the same address is refused too while the address is over its limit
    # (per-IP semantics); once the flood stops, nothing else is held against it.
    valid = fetch(demo.port, "GET", "/v1/customers", headers={"Authorization": f"Bearer {ACME_KEY}"})
    assert valid.status == 429 and valid.json()["violated-policies"] == ["failed-auth"]
