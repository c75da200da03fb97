"""A worker process that takes slots and then hangs, to be killed with SIGKILL by the test.

Lives in its own importable module because the ``spawn`` start method re-imports the target
in the child. The child builds its own Redis client (sockets are never inherited) and needs no
Django settings: the checks' subject digests are computed by the parent before pickling.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import Any

from ratelimits.backends.redis import RedisBackend, make_client
from ratelimits.policies import Check

#: The longest the child hangs if nobody kills it (the test kills it within seconds).
HANG_TIMEOUT = 60.0


def hold_slots(url: str, checks: Sequence[Check], count: int, reports: Any) -> None:
    """Admit ``count`` requests on ``checks`` (Redis server clock), report them, then hang holding them."""
    backend = RedisBackend(make_client(url, 2.0, 2.0), clock=None)
    taken = []
    for _ in range(count):
        decision = backend.decide(checks)
        taken.append((decision.allowed, decision.slot, decision.slot_keys, decision.now_us))
    reports.put((os.getpid(), taken))
    threading.Event().wait(HANG_TIMEOUT)  # "busy with the requests" until SIGKILL
