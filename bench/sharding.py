"""``python -m bench.sharding``: what hot-key sharding costs in precision.

A sharded budget (``shards: N``) is N sub-buckets of rate/N and burst/N each; every request is
decided by one of them, picked at random. The shards together never admit more than the policy,
but a request may be refused by an empty shard while others still hold tokens: under-admission.
This replays Poisson arrivals at a share of the policy's rate against the in-process reference
(``MemoryBackend`` on a simulated clock: the same arithmetic as the Lua script), for 1, 4 and 16
shards, and prints the share of requests admitted. The figures quoted in docs/scaling.md come
from this script.
"""

from __future__ import annotations

import os
import random

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "bench.support.django_settings")
django.setup()

from ratelimits.backends.memory import MemoryBackend  # noqa: E402  (after django.setup)
from ratelimits.identity import Subject, SubjectKind  # noqa: E402
from ratelimits.policies.values import Policy, check_for  # noqa: E402
from ratelimits.rates import parse_rate  # noqa: E402
from ratelimits.testing import FakeClock  # noqa: E402

#: The policy every run splits: an endpoint-wide 1,000/s, with a burst of one second's worth, and
#: of a tenth of that (where a shard's burst of 6 absorbs little of the arrivals' randomness).
RATE, BURSTS = "1000/s", (1000, 100)
SECONDS = 30
LOADS = (0.5, 0.8, 0.9, 1.0, 1.2, 2.0)
SHARDS = (1, 4, 16)
ENDPOINT = Subject(SubjectKind.ENDPOINT, "POST /v1/search")


def admitted_share(burst: int, shards: int, load: float, seed: str) -> tuple[float, float]:
    """(admitted / offered, admitted / what one bucket would admit) for Poisson arrivals at ``load`` x the rate."""
    rng = random.Random(seed)
    random.seed(seed)  # the shard picks check_for makes
    policy = Policy("endpoint-all:search", parse_rate(RATE), burst, shards=shards)
    whole = Policy("endpoint-all:search", parse_rate(RATE), burst)
    clock, reference_clock = FakeClock(), FakeClock()
    backend, reference = MemoryBackend(clock=clock), MemoryBackend(clock=reference_clock)
    per_us = load * 1000 / 1_000_000
    offered = admitted = reference_admitted = 0
    elapsed = 0.0
    while elapsed < SECONDS * 1_000_000:
        step = rng.expovariate(per_us)
        elapsed += step
        clock.advance(int(step))
        reference_clock.advance(int(step))
        offered += 1
        admitted += backend.decide([check_for(policy, ENDPOINT, 1)]).allowed
        reference_admitted += reference.decide([check_for(whole, ENDPOINT, 1)]).allowed
    return admitted / offered, admitted / reference_admitted


def main() -> int:
    for burst in BURSTS:
        print(f"\n{RATE} burst {burst}, Poisson arrivals for {SECONDS} s (simulated): admitted / offered,")
        print("and in brackets admitted against what one unsharded bucket admitted of the same arrivals")
        print(f"{'load':>6} " + " ".join(f"{f'{n} shards':>22}" for n in SHARDS))
        for load in LOADS:
            cells = []
            for n in SHARDS:
                share, against_one = admitted_share(burst, n, load, f"{burst}-{load}")
                cells.append(f"{share * 100:6.2f}% ({against_one * 100:6.2f}% of 1)")
            print(f"{load * 100:5.0f}% " + " ".join(f"{c:>22}" for c in cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
