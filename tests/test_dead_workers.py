"""A killed worker's slots come back within a lease: the demo under gunicorn 2x4, its workers SIGKILLed.

Acme (free tier: 2 requests in flight) starts two exports that last a minute, so both its
concurrency slots are held. Every gunicorn worker is then killed with SIGKILL: nothing releases
the slots. Held until ``SHEDDING['SLOT_TTL']`` (60 s), Acme's next request was admitted 59.3 s
later. Now each slot is taken for ``SHEDDING['SLOT_LEASE']`` (3 s) and renewed by its worker's
heartbeat every second while it lives: the running exports keep their slots past a lease, and once
the workers die Acme is admitted again as soon as the master's new workers serve and a lease has
run out.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Iterator

import pytest

from .support.demo import Demo, demo_server
from .support.http import fetch, serving

pytestmark = pytest.mark.slow

ACME_KEY = "sk_free_demo_acme_0000000000"
AUTH = {"Authorization": f"Bearer {ACME_KEY}"}
#: SHEDDING['SLOT_LEASE']'s default: a dead worker's slot outlives its last renewal by at most this.
LEASE_S = 3.0
#: Beyond the later of the lease and the new workers serving: one poll, one request, and a loaded
#: machine's scheduling (the heartbeat renewed at most a beat, 1 s, before the kill: within the lease).
MARGIN_S = 2.0
#: How long the two exports have to fill Acme's concurrency. Each retries a 429 at its Retry-After:
#: the export's rate (600/m at cost 10) admits one a second, and a poll of the state can hold one of
#: Acme's two slots at the moment an export arrives. A few retries of at most a second or two each.
FILL_S = 20.0
#: The bound on everything, well short of SLOT_TTL (60 s): the finding's 59.3 s fails it.
GIVE_UP_S = 40.0


@pytest.fixture
def demo() -> Iterator[Demo]:
    env = {"DEMO_DOWNSTREAM": json.dumps({"seconds": {"export": 60}})}
    with demo_server("dead_workers", workers=2, threads=4, env=env) as server:
        yield server


def test_a_killed_workers_slots_come_back_within_a_lease(demo: Demo) -> None:
    answered: list[tuple[int, list[str]]] = []
    filled_by = time.monotonic() + FILL_S

    def export() -> None:
        """One export held to the end: a 429 (the export's rate, or a poll that held a slot at that
        moment) is retried at its Retry-After, as a client would, until the test's deadline."""
        with contextlib.suppress(OSError):  # its worker is killed under it: the connection is reset
            while True:
                reply = fetch(demo.port, "POST", "/v1/reports/export", headers=AUTH)
                refused = reply.json().get("violated-policies", []) if reply.status == 429 else []
                answered.append((reply.status, refused))
                wait = float(reply.headers.get("Retry-After") or 1)
                if reply.status != 429 or time.monotonic() + wait >= filled_by:
                    return
                time.sleep(wait)  # the wait the server advised, as a client's backoff

    exports = [threading.Thread(target=export) for _ in range(2)]
    for thread in exports:
        thread.start()
    while True:  # both exports in flight: Acme's concurrency is full
        reply = fetch(demo.port, "GET", "/v1/charges", headers=AUTH)
        if reply.status == 429 and reply.json()["violated-policies"] == ["tier:free:concurrency"]:
            break
        assert time.monotonic() < filled_by, f"the exports never held Acme's slots ({reply.status}, {answered})"
        time.sleep(0.1)  # polling a state no event announces
    # Held past a lease and more: the heartbeat renews the slots of requests that are still running.
    held_until = time.monotonic() + LEASE_S + 1.5
    while time.monotonic() < held_until:
        reply = fetch(demo.port, "GET", "/v1/charges", headers=AUTH)
        assert reply.status == 429, f"a running export's slot lapsed ({reply.status})"
        time.sleep(0.25)  # sampling a state over a span of time
    assert demo.server is not None
    workers = demo.server.children()
    assert workers
    killed = time.monotonic()
    for pid in workers:
        os.kill(pid, signal.SIGKILL)
    served_after = admitted_after = None
    while admitted_after is None:
        elapsed = time.monotonic() - killed
        assert elapsed < GIVE_UP_S, f"Acme still refused {elapsed:.1f} s after its workers died"
        if served_after is None and serving(demo.port):
            served_after = time.monotonic() - killed
        if served_after is not None:
            reply = fetch(demo.port, "GET", "/v1/charges", headers=AUTH)
            if reply.status == 200:
                admitted_after = time.monotonic() - killed
                break
        time.sleep(0.1)
    print(f"\nworkers serving again {served_after:.2f} s after the kill; Acme admitted after {admitted_after:.2f} s")
    assert served_after is not None
    assert admitted_after <= max(served_after, LEASE_S) + MARGIN_S
    for thread in exports:
        thread.join(timeout=15)
