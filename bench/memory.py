"""Redis memory per idle subject: what one caller seen once costs the store until its state expires.

Import only after :func:`bench.settings.configure`.
"""

from __future__ import annotations

from typing import Any

import redis

from ratelimits.backends.redis import RedisBackend, make_client
from ratelimits.counters import usage_for
from ratelimits.identity import SubjectKind, subject_of
from ratelimits.policies import Policy, check_for
from ratelimits.rates import parse_rate

#: Callers measured: each makes one decision. Per key the figure includes the share of Redis'
#: two hash tables (keys and expiries); 10,000 keys fill 16,384 buckets each.
SUBJECTS = 10_000
#: The database the measurement writes to (the scenarios use 0 and 1) and empties afterwards.
DATABASE = 3
#: A tier's token bucket (the default algorithm), as the one-dimension row's caller has, with a
#: state TTL (61 s) no measurement outlasts.
POLICY = Policy("tier:bench", parse_rate("100/m"), 100, tier="bench")


def used_memory(admin: redis.Redis) -> int:
    info: dict[str, Any] = admin.info("memory")
    return int(info["used_memory"])


def memory_per_subject(port: int, admin: redis.Redis) -> dict[str, Any]:
    """``SUBJECTS`` new callers decide once each (usage counting on); the store's growth per caller.

    ``state_bytes``: the limiter state a caller leaves (one token bucket key with its TTL).
    ``usage_row_bytes``: its row in this minute's usage hash, until the drain takes the minute.
    """
    url = f"redis://127.0.0.1:{port}/{DATABASE}"
    store = redis.Redis.from_url(url, socket_timeout=5)
    store.flushdb()
    backend = RedisBackend(make_client(url, 2.0, 2.0))
    callers = [subject_of(SubjectKind.API_KEY, f"ApiKey:memory-{i}") for i in range(SUBJECTS)]
    work = [(check_for(POLICY, caller, 1), usage_for(caller, None, "bench", "payments", 1)) for caller in callers]
    for check, _ in work:
        check.key(backend.prefix)  # the key strings exist before the first reading, as the digests do
    backend.decide([check_for(POLICY, subject_of(SubjectKind.API_KEY, "warm-up"), 1)])  # the script is loaded
    before = used_memory(admin)
    for check, usage in work:
        if not backend.decide([check], usage=usage).allowed:
            raise RuntimeError("a memory-measurement decision was denied")
    with_usage = used_memory(admin)
    usage_keys = [key for key in store.scan_iter(match="rl:usage:*")]
    store.delete(*usage_keys)
    state_only = used_memory(admin)
    keys = store.dbsize()
    sample = store.memory_usage(work[0][0].key(backend.prefix))
    store.flushdb()
    return {
        "subjects": SUBJECTS,
        "policy": POLICY.describe(),
        "state_keys": keys - 1,  # less the warm-up caller's
        "state_bytes": round((state_only - before) / SUBJECTS, 1),
        "usage_row_bytes": round((with_usage - state_only) / SUBJECTS, 1),
        "memory_usage_of_one_key": sample,
    }
