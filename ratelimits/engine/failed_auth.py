"""The limit on failed authentication, per client IP and per credential prefix (``IDENTITY['FAILED_AUTH']``).

Authentication runs before any throttle, and a guessed credential costs a database lookup, so
the ordinary limits never see a key-guessing client. This limit counts failures only: a request
that authenticates costs nothing, a failed one spends a token in the store (one round trip). An
address whose bucket is empty is remembered by the worker until its wait runs out, and its
requests with credentials are then refused before authentication, with no round trip and no
database query.

That memory is exact. Only failures spend from these buckets and nothing gives tokens back, so
no request can end a denial early: a request refused from memory is one the store would refuse
too (an admin deleting the keys by hand aside). The memory is bounded (:data:`REMEMBERED`).

Only addresses are refused from memory. Anyone can send failures under someone else's credential
prefix, and the valid key must still get in: a prefix over its limit turns its failed attempts'
401s into 429s, once the store has said so.
"""

from __future__ import annotations

import math
import threading
import time
from typing import TYPE_CHECKING

from .._process import ProcessWide
from ..algorithms import Algorithm
from ..choices import FailMode
from ..conf import FailedAuthLimit, conf
from ..decisions import Decision, Result
from ..identity import Subject, SubjectKind, client_ip
from ..policies.values import Check, Policy, Role
from .limiter import get_limiter

if TYPE_CHECKING:
    from django.http import HttpRequest

__all__ = ["FailedAuthentication", "get_failed_authentication", "presented_authorization"]

#: Denials each worker remembers at most; beyond it the soonest to end are forgotten first (their
#: subjects then cost one more failed attempt's round trip, which the store refuses just the same).
REMEMBERED = 10_000
US = 1_000_000


class FailedAuthentication:
    """Counts failed authentications and refuses, from memory, subjects that are over the limit."""

    def __init__(self, limit: FailedAuthLimit) -> None:
        # Fails open: without the store, authentication goes on as it would without this limit.
        self.policy = Policy(
            "failed-auth", limit.rate, limit.burst, Algorithm.TOKEN_BUCKET, FailMode.OPEN, role=Role.FAILED_AUTH
        )
        self.prefix_length = limit.prefix_length
        #: Address -> (monotonic second its denial ends, the store's result when it denied).
        self._denied: dict[Subject, tuple[float, Result]] = {}
        #: When the last remembered denial ends: after it, the memory is emptied at once.
        self._last_end = 0.0
        self._lock = threading.Lock()

    def subjects(self, request: HttpRequest) -> list[Subject]:
        """What a failure of ``request`` counts against: its client IP and its credential's prefix.

        Empty for a request that presents no credential (an ``Authorization`` header): a caller
        who never tried to authenticate has not failed to.
        """
        header = presented_authorization(request)
        if header is None:
            return []
        subjects = [Subject(SubjectKind.IP, client_ip(request))]
        _, _, credential = header.partition(" ")
        prefix = credential.strip()[: self.prefix_length]
        if prefix:
            subjects.append(Subject(SubjectKind.CREDENTIAL, prefix))
        return subjects

    def refused(self, request: HttpRequest) -> Decision | None:
        """The 429 for ``request`` if it presents credentials from an address over the limit; else ``None``."""
        if not self._denied:
            return None  # the common case: nobody is being refused
        now = time.monotonic()
        if now >= self._last_end:
            with self._lock:
                if now >= self._last_end:
                    self._denied.clear()  # every denial has run out
            return None
        if presented_authorization(request) is None:
            return None
        entry = self._denied.get(Subject(SubjectKind.IP, client_ip(request)))
        if entry is None or entry[0] <= now:
            return None
        ends, result = entry
        left_us = math.ceil((ends - now) * US)
        elapsed_us = result.retry_us - left_us
        refusal = Result(result.check, False, 0, max(result.reset_us - elapsed_us, left_us), left_us)
        return Decision.from_results([refusal], now_us=time.time_ns() // 1000)

    def failed(self, request: HttpRequest) -> Decision | None:
        """Count a failed authentication of ``request``; the decision, remembered if it denies.

        ``None`` if the request presented no credential (nothing is counted).
        """
        checks = [Check(self.policy, subject) for subject in self.subjects(request)]
        return self._counted(get_limiter().decide(checks)) if checks else None

    async def afailed(self, request: HttpRequest) -> Decision | None:
        """:meth:`failed` for async code."""
        checks = [Check(self.policy, subject) for subject in self.subjects(request)]
        return self._counted(await get_limiter().adecide(checks)) if checks else None

    def _counted(self, decision: Decision) -> Decision:
        """``decision`` on a failure, its denials of client addresses remembered."""
        if not decision.allowed:
            now = time.monotonic()
            with self._lock:
                for result in decision.violated:
                    if result.check.subject.kind is SubjectKind.IP:  # a prefix is never refused unseen
                        self._remember(result, now + result.retry_us / US)
        return decision

    def _remember(self, result: Result, ends: float) -> None:
        denied = self._denied
        if len(denied) >= REMEMBERED:
            for subject, (_, _) in sorted(denied.items(), key=lambda item: item[1][0])[: REMEMBERED // 10]:
                del denied[subject]
        denied[result.check.subject] = (ends, result)
        self._last_end = max(self._last_end, ends)


def presented_authorization(request: HttpRequest) -> str | None:
    """The ``Authorization`` header the request presented, stripped; ``None`` if it presented none."""
    header = request.META.get("HTTP_AUTHORIZATION", "")
    return (header.strip() or None) if isinstance(header, str) else None


def _build() -> FailedAuthentication | None:
    limit = conf.identity.failed_auth
    return FailedAuthentication(limit) if limit is not None and conf.enabled else None


_failed_authentication: ProcessWide[FailedAuthentication | None] = ProcessWide(_build)


def get_failed_authentication() -> FailedAuthentication | None:
    """The process's failed-authentication limit: ``None`` without ``IDENTITY['FAILED_AUTH']``, or ``ENABLED`` off."""
    return _failed_authentication.get()
