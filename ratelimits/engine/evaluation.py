"""One request through the engine: identify it, resolve its checks, decide them, hold what it takes.

A consuming decision that admits a request holds its slots (and this worker's in-flight count)
until ``request_finished``, when :func:`release_held` gives them back.
"""

from __future__ import annotations

import contextvars
import logging
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from asgiref.sync import sync_to_async
from django.core.exceptions import SynchronousOnlyOperation
from django.core.signals import request_finished

from ..algorithms import SLOT_RETRY_US
from ..conf import conf
from ..counters import LIMITED, Usage, usage_for
from ..decisions import Decision, Result, Verdict
from ..identity import Identity, SubjectKind, identify, remember, subject_of
from ..metrics import Recorder, get_recorder
from ..policies.snapshot import PolicySnapshot
from ..policies.source import PolicySource, get_policy_source
from ..policies.values import Check
from .failed_auth import presented_authorization
from .limiter import Limiter, current_limiter, get_limiter
from .shedding import WorkerShedder, get_worker_shedder

if TYPE_CHECKING:
    from django.http import HttpRequest

__all__ = [
    "aevaluate",
    "early_refusals",
    "endpoint_of",
    "evaluate",
    "note_response",
    "presented_credential",
    "refuse_early",
    "release_held",
    "usage_of",
]

logger = logging.getLogger("ratelimits")


@dataclass(slots=True)
class _Held:
    """What an admitted request holds until it finishes: its slots, and its place in the worker shedder."""

    limiter: Limiter
    decision: Decision
    shedder: WorkerShedder | None = None
    #: For the adaptive capacity: the endpoint, when its decision ended (monotonic: the view's
    #: latency starts there), and its response's status and time once a middleware saw it (else
    #: request_finished's time is used).
    endpoint: str | None = None
    admitted_at: float = 0.0
    status: int | None = None
    answered_at: float | None = None


#: What the current request holds until it finishes, as :func:`request_finished` finds it: a
#: context variable, not a thread-local, since under ASGI the decision and the signal may run in
#: different threads and asgiref carries context (and so this list) between them. The same list
#: is kept on the request (:func:`_hold`), for when the signal's context is not the decision's.
_held: contextvars.ContextVar[list[_Held] | None] = contextvars.ContextVar("ratelimits_held", default=None)
#: The request attribute that keeps the list.
HELD_ATTRIBUTE = "_ratelimit_held"


def evaluate(
    request: HttpRequest, *, endpoint: str, auth: Any = None, user: Any = None, consume: bool = True
) -> tuple[Identity, Decision]:
    """Identify ``request``, collect its checks and decide them in one backend call.

    A consuming decision that admits the request holds its slots (and this worker's in-flight
    count) until ``request_finished``; see :func:`release_held`.
    """
    pending = _prepare(request, endpoint, auth, user, consume)
    if isinstance(pending, tuple):
        return pending
    try:
        decision = pending.limiter.decide(pending.checks, consume=consume, usage=pending.usage)
    except BaseException:
        pending.abandon()
        raise
    return pending.identity, _conclude(request, pending, decision)


async def aevaluate(
    request: HttpRequest, *, endpoint: str, auth: Any = None, user: Any = None, consume: bool = True
) -> tuple[Identity, Decision]:
    """:func:`evaluate` for async views: the same decision, with the store asked on the event loop
    (``redis.asyncio``) and the policies, if they must be loaded, loaded in a thread."""
    source = get_policy_source()
    if not _snapshot_in_hand(source):
        await sync_to_async(source.snapshot)()  # a database query, as the sync path makes it
        _loaded_sources.add(source)
    pending = await _aprepare(request, endpoint, auth, user, consume)
    if isinstance(pending, tuple):
        return pending
    try:
        decision = await pending.limiter.adecide(pending.checks, consume=consume, usage=pending.usage)
    except BaseException:
        pending.abandon()
        raise
    return pending.identity, _conclude(request, pending, decision)


#: Policy sources of the project's own (no ``loaded``) whose snapshot was taken once, off the loop:
#: from then on they are taken not to block.
_loaded_sources: weakref.WeakSet[Any] = weakref.WeakSet()
#: Whether an async request's checks are made in a thread: once a function of the project's
#: (``TIER_FUNC``, ``ORGANIZATION_FUNC``, ``API_KEY_FUNC``) queried the database on the loop.
_prepare_in_thread = False


def _snapshot_in_hand(source: PolicySource) -> bool:
    loaded = getattr(source, "loaded", None)
    return source in _loaded_sources if loaded is None else bool(loaded)


async def _aprepare(
    request: HttpRequest, endpoint: str, auth: Any, user: Any, consume: bool
) -> _Pending | tuple[Identity, Decision]:
    """:func:`_prepare` on the loop, or in a thread once the project's functions showed they query."""
    global _prepare_in_thread
    if not _prepare_in_thread:
        try:
            return _prepare(request, endpoint, auth, user, consume)
        except SynchronousOnlyOperation:
            # _prepare undid what it had done (the shedder's count) before raising: made again below.
            _prepare_in_thread = True
            logger.warning(
                "ratelimits: a function of RATELIMITS (TIER_FUNC, ORGANIZATION_FUNC or API_KEY_FUNC) queried "
                "the database in an async view; async requests' checks are made in a thread from now on "
                "(docs/async.md)"
            )
    return await sync_to_async(_prepare)(request, endpoint, auth, user, consume)


@dataclass(slots=True)
class _Pending:
    """A request between its checks and its decision: what concluding it needs."""

    identity: Identity
    endpoint: str
    consume: bool
    source: PolicySource
    limiter: Limiter
    shedder: WorkerShedder | None
    recorder: Recorder | None
    checks: list[Check]
    usage: Usage | None
    #: What a refusal is remembered under, for refusals before authentication (taken before the checks).
    generation: int
    snapshot: PolicySnapshot | None
    started: float

    def abandon(self) -> None:
        """The decision raised: the shedder counted the request in, and nothing is held to count it out."""
        if self.shedder is not None:
            self.shedder.finish()


def _prepare(
    request: HttpRequest, endpoint: str, auth: Any, user: Any, consume: bool
) -> _Pending | tuple[Identity, Decision]:
    """The request's checks, ready to decide; or the worker shedder's refusal."""
    identity = identify(request, endpoint=endpoint, auth=auth, user=user)
    source = get_policy_source()
    if consume:
        # What refuse_early looks the path up as: exactly what this view is limited as.
        remember(_endpoints, (getattr(request, "urlconf", None), request.path_info), endpoint)
    shedder = get_worker_shedder() if consume else None
    recorder = get_recorder() if consume else None
    if shedder is not None:
        priority = source.endpoint_rule(endpoint, request.method or "GET").priority
        if not shedder.admit(priority):
            if recorder is not None:
                recorder.decision(endpoint, "shed", "shedder", 0.0)
                recorder.count("ratelimits_shed", priority.value, "worker")
            return identity, Decision(Verdict.SHED, (), retry_after_us=SLOT_RETRY_US)
    try:
        limiter = get_limiter()
        local = limiter.local_path
        generation = local.generation if local is not None else 0
        snapshot = source.snapshot() if local is not None else None
        checks = source.checks_for(request, identity)
        usage = usage_of(identity, checks) if consume and conf.usage_counting else None
    except BaseException:
        if shedder is not None:
            shedder.finish()  # counted in above, and nothing is held for request_finished to count out
        raise
    return _Pending(
        identity,
        endpoint,
        consume,
        source,
        limiter,
        shedder,
        recorder,
        checks,
        usage,
        generation,
        snapshot,
        time.perf_counter(),
    )


def _conclude(request: HttpRequest, pending: _Pending, decision: Decision) -> Decision:
    """Hold what the decision took, count it, and tell the policy source and the local path of it."""
    # The adaptive capacity times the view, not the store: a slow Redis is the breaker's
    # business, and must not read as every endpoint slowing down.
    admitted_at = time.monotonic()
    endpoint, consume, shedder, limiter = pending.endpoint, pending.consume, pending.shedder, pending.limiter
    if decision.allowed and consume:
        _hold(request, _Held(limiter, decision, shedder, endpoint, admitted_at))
    else:
        if shedder is not None:
            shedder.finish()  # refused by the limiter: the view never ran, so nothing to learn from
        if decision.stray_slot is not None:
            _hold(request, _Held(limiter, decision))
    shadow = decision.shadow_violated
    if pending.recorder is not None:
        _record(pending.recorder, request, endpoint, decision, time.perf_counter() - pending.started, shadow)
    # After holding: if observing fails, request_finished still releases what this request holds.
    pending.source.observe(decision)
    identity = pending.identity
    if shadow:
        logger.info(
            "ratelimits: shadow policies would deny %s: %s",
            identity.caller,
            ", ".join(r.policy_name for r in shadow),
        )
    local = limiter.local_path
    if local is not None:
        if decision.local is not None and conf.local_path.header:
            logger.debug(
                "ratelimits: %s answered from memory (%s)",
                identity.caller,
                decision.local,
                extra={"ratelimit_local": decision.local},
            )
        if decision.verdict is Verdict.LIMITED and identity.api_key is not None and consume:
            credential = presented_credential(request)
            if credential is not None:
                usage = pending.usage
                local.note_credential(
                    credential,
                    endpoint,
                    request.method or "GET",
                    decision,
                    snapshot=pending.snapshot,
                    generation=pending.generation,
                    usage_field=usage.field if usage is not None else "",
                    tokens=usage.tokens if usage is not None else 1,
                )
    return decision


def _record(
    recorder: Recorder,
    request: HttpRequest,
    endpoint: str,
    decision: Decision,
    seconds: float,
    shadow: tuple[Result, ...] = (),
) -> None:
    """Count a consuming decision in the metrics: its verdict and path, the policies it was over
    (``shadow``: the shadow policies it was over, as the caller found them)."""
    path = "memory" if decision.local is not None else "degraded" if decision.degraded else "store"
    verdict = decision.verdict
    if verdict is Verdict.ALLOW:
        # Labels as plain strings: an enum member hashes in Python, and every decision hashes its key.
        recorder.decision(endpoint, "allow", path, seconds)
        if decision.slot is not None:
            recorder.count("ratelimits_slots_held")
    else:
        recorder.decision(endpoint, verdict.value, path, seconds, (r.policy_name for r in decision.violated))
        if decision.verdict is Verdict.SHED:
            priority = get_policy_source().endpoint_rule(endpoint, request.method or "GET").priority
            recorder.count("ratelimits_shed", priority.value, "fleet")
    if shadow:
        recorder.count_policies("ratelimits_shadow_over_limit", endpoint, (r.policy_name for r in shadow))


def presented_credential(request: HttpRequest) -> str | None:
    """The keyed hash of the request's ``Authorization`` header (as subjects are hashed); ``None`` without one."""
    header = presented_authorization(request)
    return subject_of(SubjectKind.CREDENTIAL, header).digest if header is not None else None


#: (urlconf, path) -> the endpoint a consuming decision limited it as: what refuse_early reads.
_endpoints: dict[tuple[Any, str], str] = {}


def endpoint_of(request: HttpRequest) -> str | None:
    """The endpoint ``request``'s path was last limited as, if a request to it was (else: not limited here)."""
    return _endpoints.get((getattr(request, "urlconf", None), request.path_info))


def early_refusals() -> bool:
    """Whether :func:`refuse_early` may refuse anything now (a shedder, or a credential remembered as refused)."""
    if get_worker_shedder() is not None:
        return True
    limiter = current_limiter()
    return limiter is not None and limiter.local_path is not None and limiter.local_path.refuses_credentials


def refuse_early(request: HttpRequest, endpoint: str) -> Decision | None:
    """The 503 or 429 ``request`` would get from the engine, if this worker knows it before authentication.

    A 503 if the worker shedder would shed the endpoint's priority class now; a 429 if the
    request's credential was refused on this endpoint and its denial has not ended (each such
    refusal is counted in usage as the authenticated request was). ``None`` otherwise: unknown
    credentials, invalid ones and everything else take the normal path.
    """
    method = request.method or "GET"
    shedder = get_worker_shedder()
    if shedder is not None:
        priority = get_policy_source().endpoint_rule(endpoint, method).priority
        if shedder.sheds(priority):
            recorder = get_recorder()
            if recorder is not None:
                recorder.decision(endpoint, "shed", "early", 0.0)
                recorder.count("ratelimits_shed", priority.value, "early")
            return Decision(Verdict.SHED, (), retry_after_us=SLOT_RETRY_US)
    limiter = current_limiter()
    local = limiter.local_path if limiter is not None else None
    if limiter is None or local is None or not local.refuses_credentials:
        return None
    credential = presented_credential(request)
    found = local.refuse_credential(credential, endpoint, method) if credential is not None else None
    if found is None:
        return None
    decision, early = found
    recorder = get_recorder()
    if recorder is not None:
        recorder.decision(endpoint, decision.verdict.value, "early", 0.0, (r.policy_name for r in decision.violated))
    if early.usage_field:
        limiter.count_local(Usage(int(time.time() // 60), early.usage_field, early.tokens, ""), LIMITED)
    return decision


def usage_of(identity: Identity, checks: Sequence[Check]) -> Usage:
    """Where a request's usage is counted: its caller, organisation, the caller's tier, its endpoint."""
    caller = identity.caller
    tier = ""
    tokens = 1
    for check in checks:
        policy = check.policy
        if not policy.holds_slots:
            tokens = check.cost  # every rate check of a request spends the endpoint's cost
        if policy.tier is not None and (not tier or check.subject is caller):  # the resolver's own object
            tier = policy.tier
    return usage_for(caller, identity.organization, tier, identity.endpoint.value, tokens)


def _hold(request: HttpRequest, item: _Held) -> None:
    """Keep ``item`` until the request's response is closed.

    Django's ASGI handler decides a request in a task of its own (a copy of its context) and
    closes the response from its own context: a list set in the first is not seen by the
    ``request_finished`` of the second. So the list is kept on the request too, and the request's
    ``close``, which the handler calls when it closes the response (sync or async, a streaming
    body's end included), releases it. Under WSGI both find the same list; the first empties it.
    """
    if item.decision.slot is None and item.decision.stray_slot is None and item.shedder is None:
        return
    http_request: Any = getattr(request, "_request", request)  # DRF's Request wraps Django's
    held: list[_Held] | None = getattr(http_request, HELD_ATTRIBUTE, None)
    if held is None:
        held = []
        setattr(http_request, HELD_ATTRIBUTE, held)
        _release_on_close(http_request, held)
    if _held.get() is not held:
        _held.set(held)
    held.append(item)


def _release_on_close(request: Any, held: list[_Held]) -> None:
    close = request.close

    def release_then_close() -> None:
        try:
            _release(held)
        finally:
            close()

    request.close = release_then_close


def _held_by(request: HttpRequest) -> list[_Held] | None:
    http_request = getattr(request, "_request", request)
    held: list[_Held] | None = getattr(http_request, HELD_ATTRIBUTE, None)
    return held if held is not None else _held.get()


def note_response(request: HttpRequest, status: int, *, streaming: bool = False) -> None:
    """Tell the adaptive capacity how the request's view answered: its status, and now.

    Called by :class:`~ratelimits.middleware.EarlyRejectionMiddleware` on the way out. A request
    this app refused in the end (a later decision, after the shedder admitted it) never ran its
    view: it teaches nothing. A streaming response is timed to ``request_finished``, when its body
    has been made.
    """
    held = _held_by(request)
    if not held:
        return
    refused = getattr(request, "ratelimit", None)
    view_ran = not (isinstance(refused, Decision) and not refused.allowed)
    now = None if streaming else time.monotonic()
    for item in held:
        if item.shedder is None or item.status is not None or item.endpoint is None:
            continue
        if view_ran:
            item.status, item.answered_at = status, now
        else:
            item.endpoint = None


def release_held(**kwargs: Any) -> None:
    """Release what the finished request holds (connected to ``request_finished``).

    The signal is sent when the response has been closed, after a streaming body too, so slots
    are held exactly as long as the worker is busy with the request. A release that cannot reach
    the store is retried after later requests (the slot's expiry is the last resort), and usage
    counted during an outage is added to the store's counters once it answers.
    """
    held = _held.get()
    if held:
        _release(held)
    # After the response, off the decision path: catch up on what an outage left behind.
    current = current_limiter()
    if current is not None:
        current.retry_releases()
        current.return_leases()
        current.flush_usage()
        shedder = get_worker_shedder()
        if shedder is not None and shedder.controller is not None:
            current.publish_worker_state(shedder.state)


def _release(held: list[_Held]) -> None:
    """Give back what ``held`` holds, once: emptied in place, as every context copied from the
    request's and the request itself share the list."""
    items = list(held)
    held.clear()
    now = time.monotonic()
    for item in items:
        try:
            if item.shedder is not None:
                latency = (item.answered_at or now) - item.admitted_at
                error = item.status is not None and item.status >= 500
                item.shedder.finish(item.endpoint, latency, error=error, admitted_at=item.admitted_at)
        finally:
            item.limiter.release(item.decision)  # whatever the shedder did


request_finished.connect(release_held, dispatch_uid="ratelimits.engine.release_held")
