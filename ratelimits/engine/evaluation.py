"""One request through the engine: identify it, resolve its checks, decide them, hold what it takes.

A consuming decision that admits a request holds its slots (and this worker's in-flight count)
until its response is closed (:func:`_hold`); after it, :func:`after_response` catches up on what
an outage left behind.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from asgiref.sync import SyncToAsync, sync_to_async
from django.core.exceptions import SynchronousOnlyOperation
from django.core.signals import request_finished, request_started

from .. import documentation
from .._memo import remember
from .._process import ProcessWide
from ..algorithms import SLOT_RETRY_US
from ..backends.base import in_thread
from ..conf import conf
from ..counters import LIMITED, Usage, UsageRow, usage_row
from ..decisions import UNLIMITED, Decision, Result, Verdict
from ..identity import Identity, SubjectKind, django_request, identify, request_method, subject_of
from ..metrics import Recorder, get_recorder
from ..policies.snapshot import PolicySnapshot
from ..policies.source import PolicySource, get_policy_source
from ..policies.values import Check, KeptChecks, Policy, check_for
from .bodies import receive_body
from .failed_auth import presented_authorization
from .limiter import Limiter, current_limiter, get_limiter
from .shedding import WorkerShedder, get_worker_shedder

if TYPE_CHECKING:
    from django.http import HttpRequest

__all__ = [
    "adecide_checks",
    "aevaluate",
    "after_response",
    "decide_checks",
    "early_refusals",
    "endpoint_of",
    "evaluate",
    "note_response",
    "presented_credential",
    "refuse_early",
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
    #: the time it is released is used).
    endpoint: str | None = None
    admitted_at: float = 0.0
    status: int | None = None
    answered_at: float | None = None


#: ``(source, method) -> policies`` a caller adds on the request's caller (:func:`evaluate`).
CallerPolicies = Callable[[PolicySource, str], Sequence[Policy]]

#: The request attribute that keeps the list of what it holds.
HELD_ATTRIBUTE = "_ratelimit_held"


def evaluate(
    request: HttpRequest,
    *,
    endpoint: str,
    auth: Any = None,
    user: Any = None,
    consume: bool = True,
    checks: Sequence[Check] = (),
    caller_policies: CallerPolicies | None = None,
    tiers: bool = True,
) -> tuple[Identity, Decision]:
    """Identify ``request``, collect its checks and decide them in one backend call.

    ``checks`` are decided with the request's own, in the same call and before them: a view's
    limits of its own (``ratelimits.decorators.ratelimit`` with ``policies=True``).
    ``caller_policies(source, method)`` gives policies added to the request's own on its caller,
    each spending the endpoint's cost (a ``RateLimitThrottle`` subclass's ``scope`` or ``rate``);
    asked once the request is to be decided, and not for an exempt endpoint. ``tiers=False``
    leaves the caller's tier out (its rate, quota and overrides): a view whose throttle classes
    each name a limit of their own is limited by those, as under DRF, and by the project's
    dimensions, endpoint rule and fleet limit, which apply to every request.

    A consuming decision that admits the request holds its slots (and this worker's in-flight
    count) until its response is closed; see :func:`_hold`. With ``RATELIMITS['ENABLED']`` off,
    every request is :data:`~ratelimits.decisions.UNLIMITED`: no policy is loaded, nothing is
    counted, the store is not asked.
    """
    identity, pending = _prepare(request, endpoint, auth, user, consume, checks, caller_policies, tiers)
    if isinstance(pending, Decision):
        return identity, pending
    return identity, _conclude(request, pending, _decided(pending, consume))


async def aevaluate(
    request: HttpRequest,
    *,
    endpoint: str,
    auth: Any = None,
    user: Any = None,
    consume: bool = True,
    checks: Sequence[Check] = (),
    caller_policies: CallerPolicies | None = None,
    tiers: bool = True,
) -> tuple[Identity, Decision]:
    """:func:`evaluate` for async views: the same decision, with the store asked on the event loop
    (``redis.asyncio``) and the policies, if they must be loaded, loaded in a thread."""
    state = _async_state.get()
    if conf.enabled:  # else _prepare admits the request: there is nothing to load
        source = get_policy_source()
        if not _snapshot_in_hand(source, state):
            await sync_to_async(source.snapshot)()  # a database query, as the sync path makes it
            state.loaded_source = source
    identity, pending = await _aprepare(request, endpoint, auth, user, consume, checks, caller_policies, tiers, state)
    if isinstance(pending, Decision):
        return identity, pending
    return identity, _conclude(request, pending, await _adecided(pending, consume))


def decide_checks(request: HttpRequest, checks: Sequence[Check], *, endpoint: str, consume: bool = True) -> Decision:
    """Decide ``checks`` alone for ``request``, in one backend call: none of its policies.

    No tier, dimension, endpoint rule, fleet check or worker shedder: only ``checks`` (a view's
    own limits, ``ratelimits.decorators``). Everything else is as :func:`evaluate` does it: the
    breaker and fail modes, the local path, the metrics (under ``endpoint``), and the policy
    version the store answers with. No usage is counted: usage rows are a caller's, and
    these checks name no caller.
    """
    pending = _prepare_checks(checks, endpoint, consume)
    return _conclude(request, pending, _decided(pending, consume))


async def adecide_checks(
    request: HttpRequest, checks: Sequence[Check], *, endpoint: str, consume: bool = True
) -> Decision:
    """:func:`decide_checks` for async views: the store asked on the event loop."""
    pending = _prepare_checks(checks, endpoint, consume)
    return _conclude(request, pending, await _adecided(pending, consume))


def _decided(pending: _Pending, consume: bool) -> Decision:
    try:
        return pending.limiter.decide(pending.checks, consume=consume, usage=pending.usage)
    except BaseException:
        pending.abandon()
        raise


async def _adecided(pending: _Pending, consume: bool) -> Decision:
    try:
        return await pending.limiter.adecide(pending.checks, consume=consume, usage=pending.usage)
    except BaseException:
        pending.abandon()
        raise


@dataclass(slots=True)
class _AsyncState:
    """What async requests learnt about the project's code, until the settings change."""

    #: A policy source of the project's own (no ``loaded``) whose snapshot was taken once, off the
    #: loop: from then on it is taken not to block. Kept by identity (a source need not hash).
    loaded_source: Any = None
    #: Whether checks are made in a thread: a function of the project's (``POLICIES['TIER_FUNC']``,
    #: ``IDENTITY['ORGANIZATION_FUNC']``, ``IDENTITY['API_KEY_FUNC']``) queried the database on the
    #: loop.
    prepare_in_thread: bool = False


_async_state: ProcessWide[_AsyncState] = ProcessWide(_AsyncState)


def _snapshot_in_hand(source: PolicySource, state: _AsyncState) -> bool:
    loaded = getattr(source, "loaded", None)
    return source is state.loaded_source if loaded is None else bool(loaded)


async def _aprepare(
    request: HttpRequest,
    endpoint: str,
    auth: Any,
    user: Any,
    consume: bool,
    extra: Sequence[Check],
    caller_policies: CallerPolicies | None,
    tiers: bool,
    state: _AsyncState,
) -> tuple[Identity, _Pending | Decision]:
    """:func:`_prepare` on the loop, or in a thread once the project's functions showed they query."""
    if not state.prepare_in_thread:
        try:
            return _prepare(request, endpoint, auth, user, consume, extra, caller_policies, tiers)
        except SynchronousOnlyOperation:
            # _prepare undid what it had done (the shedder's count) before raising: made again below.
            state.prepare_in_thread = True
            logger.warning(
                "ratelimits: RATELIMITS['POLICIES']['TIER_FUNC'], RATELIMITS['IDENTITY']['ORGANIZATION_FUNC'] or "
                "RATELIMITS['IDENTITY']['API_KEY_FUNC'] queried the database during an async request; from now on "
                "this process resolves async requests' checks in a thread, which costs a thread hop each "
                f"({documentation.page('async', 'how-it-works')})"
            )
    # Given up before the thread is done, the request counts itself out of the shedder.
    return await in_thread(
        lambda: _prepare(request, endpoint, auth, user, consume, extra, caller_policies, tiers), _abandon
    )


def _abandon(prepared: tuple[Identity, _Pending | Decision]) -> None:
    _, pending = prepared
    if isinstance(pending, _Pending):
        pending.abandon()


@dataclass(slots=True)
class _Pending:
    """A request between its checks and its decision: what concluding it needs."""

    #: ``None`` when only given checks are decided (:func:`decide_checks`): no caller is identified.
    identity: Identity | None
    endpoint: str
    consume: bool
    source: PolicySource
    limiter: Limiter
    shedder: WorkerShedder | None
    recorder: Recorder | None
    checks: Sequence[Check]
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
    request: HttpRequest,
    endpoint: str,
    auth: Any,
    user: Any,
    consume: bool,
    extra: Sequence[Check] = (),
    caller_policies: CallerPolicies | None = None,
    tiers: bool = True,
) -> tuple[Identity, _Pending | Decision]:
    """The request's identity, and its checks (after ``extra``) ready to decide; or the worker
    shedder's refusal, or (the limiter off) its admission."""
    identity = identify(request, endpoint=endpoint, auth=auth, user=user)
    if not conf.enabled:
        return identity, UNLIMITED
    http = django_request(request)
    method = request_method(request)
    if consume:
        receive_body(http)  # counted in flight only once it can run
    source = get_policy_source()
    if consume:
        # What refuse_early looks the path up as: exactly what this view is limited as.
        path = (getattr(http, "urlconf", None), http.path_info)
        if _endpoints.get(path) != endpoint:
            remember(_endpoints, path, endpoint)
    shedder = get_worker_shedder() if consume else None
    recorder = get_recorder() if consume else None
    if shedder is not None:
        priority = source.endpoint_rule(endpoint, method).priority
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
        if not tiers:
            checks = [check for check in checks if check.policy.tier is None]
        if caller_policies is not None:
            rule = source.endpoint_rule(endpoint, method)
            if not rule.exempt:
                checks = _with_caller_policies(checks, caller_policies(source, method), identity, rule.cost)
        # The request's usage is its own checks' (their cost), whatever else is decided with them.
        usage = usage_of(identity, checks) if consume and conf.usage.enabled else None
        if extra:
            checks = [*extra, *checks]
    except BaseException:
        if shedder is not None:
            shedder.finish()  # counted in above, and nothing is held to count it out
        raise
    return identity, _Pending(
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
        time.perf_counter() if recorder is not None else 0.0,  # what the metrics time the decision from
    )


def _with_caller_policies(
    checks: Sequence[Check], policies: Sequence[Policy], identity: Identity, cost: int
) -> Sequence[Check]:
    """``checks`` and a check of each of ``policies`` on the caller, but those already among them:
    one policy on one subject is one bucket, spent once."""
    if not policies:  # RateLimitThrottle itself names none: the common case
        return checks
    have = {(check.policy.name, check.subject) for check in checks}
    found = list(checks)
    for policy in policies:
        if (policy.name, identity.caller) not in have:  # two classes of one scope: its one bucket
            have.add((policy.name, identity.caller))
            found.append(check_for(policy, identity.caller, cost))
    return found


def _prepare_checks(checks: Sequence[Check], endpoint: str, consume: bool) -> _Pending:
    """``checks`` alone, ready to decide: no identity, shedder or usage (:func:`decide_checks`)."""
    return _Pending(
        None,
        endpoint,
        consume,
        get_policy_source(),
        get_limiter(),
        None,
        get_recorder() if consume else None,
        list(checks),
        None,
        0,
        None,
        time.perf_counter(),
    )


def _conclude(request: HttpRequest, pending: _Pending, decision: Decision) -> Decision:
    """Hold what the decision took, count it, and tell the policy source and the local path of it."""
    endpoint, consume, shedder, limiter = pending.endpoint, pending.consume, pending.shedder, pending.limiter
    if decision.allowed and consume:
        if _holds_anything(decision, shedder):  # else nothing is made for it (the usual request)
            # The adaptive capacity times the view, not the store: a slow Redis is the breaker's
            # business, and must not read as every endpoint slowing down.
            _hold(request, _Held(limiter, decision, shedder, endpoint, time.monotonic()))
    else:
        if shedder is not None:
            shedder.finish()  # refused by the limiter: the view never ran, so nothing to learn from
        if decision.stray_slot is not None:
            _hold(request, _Held(limiter, decision))
    shadow = decision.shadow_violated
    if pending.recorder is not None:
        _record(pending.recorder, request, endpoint, decision, time.perf_counter() - pending.started, shadow)
    # After holding: if observing fails, closing the response still releases what this request holds.
    pending.source.observe(decision)
    identity = pending.identity
    if shadow:
        logger.info(
            "ratelimits: shadow policies would deny %s: %s",
            identity.caller if identity is not None else f"a request to {endpoint}",
            ", ".join(r.policy_name for r in shadow),
        )
    local = limiter.local_path
    if local is not None:
        if decision.local is not None and conf.local_path.header:
            logger.debug(
                "ratelimits: %s answered from memory (%s)",
                identity.caller if identity is not None else f"a request to {endpoint}",
                decision.local,
                extra={"ratelimit_local": decision.local},
            )
        if decision.verdict is Verdict.LIMITED and identity is not None and identity.api_key is not None and consume:
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
    if type(checks) is KeptChecks:
        # Its row is made once: a resolution the snapshot keeps is one caller's, on one endpoint.
        try:
            kept = _rows[(id(identity), id(checks))][2]
        except KeyError:
            kept = _row_of(identity, checks)
            remember(_rows, (id(identity), id(checks)), (identity, checks, kept))
        return kept.now()
    return _row_of(identity, checks).now()


def _row_of(identity: Identity, checks: Sequence[Check]) -> UsageRow:
    caller = identity.caller
    tier = ""
    tokens = 1
    for check in checks:
        policy = check.policy
        if not policy.holds_slots:
            tokens = check.cost  # every rate check of a request spends the endpoint's cost
        if policy.tier is not None and (not tier or check.subject is caller):  # the resolver's own object
            tier = policy.tier
    return usage_row(caller, identity.organization, tier, identity.endpoint.value, tokens)


#: (identity id, kept checks id) -> (identity, checks, their row): each entry holds what its key is the ids of.
_rows: dict[tuple[int, int], tuple[Identity, KeptChecks, UsageRow]] = {}


def _holds_anything(decision: Decision, shedder: WorkerShedder | None) -> bool:
    """Whether a request so decided has anything to give back when it finishes: slots, or its place in the shedder."""
    return decision.slot is not None or decision.stray_slot is not None or shedder is not None


def _hold(request: HttpRequest, item: _Held) -> None:
    """Keep ``item`` (which holds something: :func:`_holds_anything`) until the request's response
    is closed, or the request is over.

    The list is kept on the request, and the request's ``close`` releases it: Django calls it when
    it closes the response, under WSGI and ASGI alike, sync or async, after a streaming body too.
    (Not a context variable: Django 5.2's ASGI handler decides a request in a task of its own,
    with a copy of its context, and closes the response from its own context.)

    When no response is closed, because the client went away under ASGI and Django cancelled the
    view, Django still sends ``request_finished``, within the request's ``ThreadSensitiveContext``:
    :func:`after_response` releases the list it finds kept under that context. Whatever is left
    after that (work the view left in a thread of its own, an outer context shared by several
    requests) is released when the request is collected.
    """
    http_request: Any = getattr(request, "_request", request)  # DRF's Request wraps Django's
    held: list[_Held] | None = getattr(http_request, HELD_ATTRIBUTE, None)
    if held is None:
        held = []
        setattr(http_request, HELD_ATTRIBUTE, held)
        _release_on_close(http_request, held)
        weakref.finalize(http_request, _release_abandoned, held).atexit = False
        if _releaser is None:
            _start_releaser()
        context = _request_context()
        if context is not None:
            _held_in[context] = (held, weakref.ref(http_request))
    held.append(item)


#: The context variable asgiref keeps the current ``ThreadSensitiveContext`` in. Django's ASGI
#: handler opens one per request, around all of it (an asgiref detail, read defensively).
_THREAD_SENSITIVE: Any = getattr(SyncToAsync, "thread_sensitive_context", None)
#: How many requests each such context saw start: one, or it is not one request's own (an outer
#: one, opened around a server), and what is kept under it cannot be told apart.
_started_in: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
_started_lock = threading.Lock()
#: Request context -> the list of what its request holds, and the request.
_held_in: weakref.WeakKeyDictionary[Any, tuple[list[_Held], weakref.ref[Any]]] = weakref.WeakKeyDictionary()


def _thread_sensitive_context() -> Any:
    """The current ``ThreadSensitiveContext``, if any."""
    return _THREAD_SENSITIVE.get(None) if _THREAD_SENSITIVE is not None else None


def _request_context() -> Any:
    """The current ``ThreadSensitiveContext`` if it is one ASGI request's own, else ``None``."""
    context = _thread_sensitive_context()
    return context if context is not None and _started_in.get(context) == 1 else None


def _request_started(**kwargs: Any) -> None:
    """Count the request in its ``ThreadSensitiveContext`` (connected to ``request_started``)."""
    context = _thread_sensitive_context()
    if context is not None:
        with _started_lock:
            _started_in[context] = _started_in.get(context, 0) + 1


def _release_on_close(request: Any, held: list[_Held]) -> None:
    """Make ``request.close`` release ``held`` first.

    The wrapper holds the request: the response's closers then keep it alive until the body is
    sent, as Django's own ``request.close`` does, so the finalizer cannot release early. The cycle
    it makes is undone once it has run; a request no response closes waits for the collector.
    """
    close = request.close

    def release_then_close() -> None:
        try:
            _release(held)
        finally:
            if request.__dict__.get("close") is release_then_close:
                del request.close
            close()

    release_then_close.releases_held = True  # type: ignore[attr-defined]
    request.close = release_then_close


def _release_abandoned(held: list[_Held]) -> None:
    """Release what a request no response closed still holds, once it is collected.

    A finalizer runs wherever a collection starts, maybe with a lock held or on an event loop:
    it only hands the list to the releasing thread (``SimpleQueue.put`` is safe there)."""
    if held:
        _abandoned.put(held)


#: Lists of collected requests, for :func:`_releasing` to release.
_abandoned: queue.SimpleQueue[list[_Held]] = queue.SimpleQueue()
_releaser: threading.Thread | None = None
_releaser_lock = threading.Lock()


def _start_releaser() -> None:
    """Start the thread that releases collected requests' lists, once per process."""
    global _releaser
    with _releaser_lock:
        if _releaser is None:
            _releaser = threading.Thread(target=_releasing, name="ratelimits-release", daemon=True)
            _releaser.start()


def _releasing() -> None:
    while True:
        held = _abandoned.get()
        try:
            _release(held)
        except Exception:  # _release logs its own; this thread must outlive anything
            logger.exception("ratelimits: a collected request's holdings could not be released")


def _after_fork() -> None:
    """A forked child has none of the parent's threads, and the parent's lists are the parent's."""
    global _releaser, _releaser_lock, _abandoned, _started_lock
    _releaser, _releaser_lock, _abandoned, _started_lock = None, threading.Lock(), queue.SimpleQueue(), threading.Lock()


os.register_at_fork(after_in_child=_after_fork)


def _held_by(request: HttpRequest) -> list[_Held] | None:
    held: list[_Held] | None = getattr(getattr(request, "_request", request), HELD_ATTRIBUTE, None)
    return held


def note_response(request: HttpRequest, status: int, *, streaming: bool = False) -> None:
    """Tell the adaptive capacity how the request's view answered: its status, and now.

    Called by :class:`~ratelimits.middleware.EarlyRejectionMiddleware` on the way out. A request
    this app refused in the end (a later decision, after the shedder admitted it) never ran its
    view: it teaches nothing. A streaming response is timed to its release, when its body
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


def after_response(**kwargs: Any) -> None:
    """After a response (connected to ``request_finished``), off the decision path: catch up on
    what an outage left behind.

    Releases that could not reach the store are retried (the slot's expiry is the last resort),
    ended leases give their unused tokens back, usage counted during an outage or answered from
    memory is added to the store's counters, and an adaptive capacity is published for the admin.
    First, what the request still holds is released: under ASGI, when its client went away and
    no response was closed (see :func:`_hold`).
    """
    # Only a handler's: a response a view made and closed itself sends the signal too (sender None).
    context = _request_context() if kwargs.get("sender") is not None else None
    kept = _held_in.pop(context, None) if context is not None else None
    if kept is not None:
        held, request = kept
        if held:
            _release(held)
        alive = request()
        if alive is not None and getattr(alive.__dict__.get("close"), "releases_held", False):
            del alive.close  # our wrapper, which keeps the request in a cycle
    current = current_limiter()
    if current is not None:
        current.retry_releases()
        current.return_leases()
        current.flush_usage()
        shedder = get_worker_shedder()
        if shedder is not None and shedder.controller is not None:
            current.publish_worker_state(shedder.state)


def _release(held: list[_Held]) -> None:
    """Give back what ``held`` holds, once: emptied in place, as the request's ``close`` and its
    finalizer share the list. One item's failure is logged; the others are released all the same."""
    items = []
    try:
        while True:
            items.append(held.pop())  # each pop atomic: two callers never release one item twice
    except IndexError:
        pass
    now = time.monotonic()
    for item in reversed(items):
        try:
            if item.shedder is not None:
                latency = (item.answered_at or now) - item.admitted_at
                error = item.status is not None and item.status >= 500
                item.shedder.finish(item.endpoint, latency, error=error, admitted_at=item.admitted_at)
        except Exception:
            logger.exception("ratelimits: the worker shedder could not count a request out")
        try:
            item.limiter.release(item.decision)  # whatever the shedder did
        except Exception:
            logger.exception("ratelimits: a request's slots could not be released (they expire)")


request_started.connect(_request_started, dispatch_uid="ratelimits.engine.request_started")
request_finished.connect(after_response, dispatch_uid="ratelimits.engine.after_response")
