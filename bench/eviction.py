"""``python -m bench.eviction``: how far past its limit a caller gets while Redis evicts the limiter's keys.

A caller limited to 20/s with a burst of 20 sends 200 requests a second for 5 s; meanwhile a flood
of new subjects (a decision each, as a crowd of new client IPs makes) fills a private
``redis-server`` with ``maxmemory-policy allkeys-lru``, which evicts to make room. Each run prints
what the caller got admitted against what its limit allows, and how fast the server evicted.
Every server is private (a free loopback port, stopped by PID); nothing touches port 6379.
The figures quoted in docs/failure-modes.md come from this script.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "bench.support.django_settings")
django.setup()

from ratelimits.backends.redis import RedisBackend, make_client  # noqa: E402  (after django.setup)
from ratelimits.identity import Subject, SubjectKind  # noqa: E402
from ratelimits.policies.values import Check, Policy  # noqa: E402
from ratelimits.rates import parse_rate  # noqa: E402

from .support.redis_server import RedisServer  # noqa: E402

SECONDS = 5.0
ASKED_PER_SECOND = 200
#: New subjects decided between two of the caller's requests.
FLOOD_PER_REQUEST = 5


@dataclass(frozen=True)
class Run:
    label: str
    #: Bytes the keys may take: ``maxmemory`` is set this far above what the server uses once the
    #: decide function is loaded (code no eviction can free: a bare ``maxmemory`` this small would
    #: leave no room at all, and every write would be refused). ``None``: no ``maxmemory``.
    room: int | None


RUNS = [
    Run("no eviction (no maxmemory)", None),
    Run("allkeys-lru, 3 MB for keys", 3_000_000),
    Run("allkeys-lru, 300 kB for keys", 300_000),
]


def measure(run: Run) -> str:
    config = ("--maxmemory-policy", "allkeys-lru") if run.room else ()
    with RedisServer(config=config) as server:
        # Generous timeouts: a figure of admissions, not of latency (a busy machine may stall the server).
        backend = RedisBackend(make_client(server.url, 10.0, 10.0))
        caller = Check(Policy("tier:caller", parse_rate("20/s"), 20), Subject(SubjectKind.API_KEY, "caller"))
        crowd = Policy("tier:crowd", parse_rate("20/s"), 20)
        client = server.client()
        backend.decide([caller], consume=False)  # the decide function loaded: what no eviction frees
        if run.room:
            client.config_set("maxmemory", int(client.info("memory")["used_memory"]) + run.room)
        filled = 0
        while run.room and int(client.info("stats")["evicted_keys"]) == 0:  # full before measuring
            with client.pipeline(transaction=False) as pipe:
                for _ in range(2000):
                    pipe.set(f"rl:{{fill{filled}}}:x", "1" * 40, px=3_600_000)
                    filled += 1
                pipe.execute()
        keys, evicted_before = client.dbsize(), int(client.info("stats")["evicted_keys"])
        admitted = sent = subject = 0
        start = time.monotonic()
        due = start
        while (now := time.monotonic()) - start < SECONDS:
            if now >= due:
                due += 1 / ASKED_PER_SECOND
                sent += 1
                admitted += backend.decide([caller]).allowed
            for _ in range(FLOOD_PER_REQUEST):
                backend.decide([Check(crowd, Subject(SubjectKind.IP, f"198.18.{subject}"))])
                subject += 1
        elapsed = time.monotonic() - start
        evicted = int(client.info("stats")["evicted_keys"]) - evicted_before
        client.close()
    allowed = 20 + 20 * elapsed
    return (
        f"{run.label:<28} keys {keys:>6}, evicting {evicted / elapsed:>5.0f}/s: "
        f"asked {sent}, admitted {admitted}, the limit allows {allowed:.0f} ({admitted / allowed:.1f}x)"
    )


def main() -> int:
    print(f"a 20/s (burst 20) caller asking {ASKED_PER_SECOND}/s for {SECONDS:g} s, new subjects in between")
    for run in RUNS:
        print(measure(run), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
