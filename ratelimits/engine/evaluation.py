"""One request through the engine: identify it, resolve its checks, decide them, hold what it takes.

A consuming decision that admits a request holds its slots (and this worker's in-flight count)
until its response is closed: :mod:`.holding` keeps and gives them back, and catches up after
each response on what an outage left behind.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from asgiref.sync import sync_to_async
from django.core.exceptions import SynchronousOnlyOperation

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
from ..policies.values import Check, EndpointRule, KeptChecks, Policy, check_for
from ..thresholds import observe as observe_thresholds
from .bodies import receive_body
from .failed_auth import presented_authorization
from .holding import Held, hold, holds_anything
from .limiter import Limiter, current_limiter, get_limiter
from .local import LocalPath
from .settling import Settlement, tell_once
from .shedding import WorkerShedder, get_worker_shedder

if TYPE_CHECKING:
    from django.http import HttpRequest

__all__ = [
    "adecide_checks",
    "aevaluate",
    "decide_checks",
    "early_refusals",
    "endpoint_of",
    "evaluate",
    "presented_credential",
    "refuse_early",
    "usage_of",
]

logger = logging.getLogger("ratelimits")


#: ``(source, method) -> policies`` a caller adds on the request's caller (:func:`evaluate`).
CallerPolicies = Callable[[PolicySource, str], Sequence[Policy]]


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
    count) until its response is closed; see :func:`.holding.hold`. With ``RATELIMITS['ENABLED']`` off,
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
        return pending.limiter.decide(
            pending.checks, consume=consume, usage=pending.usage, settle=pending.settles is not None
        )
    except BaseException:
        pending.abandon()
        raise


async def _adecided(pending: _Pending, consume: bool) -> Decision:
    try:
        return await pending.limiter.adecide(
            pending.checks, consume=consume, usage=pending.usage, settle=pending.settles is not None
        )
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


@dataclass(slots=True, kw_only=True)
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
    #: The endpoint's rule, where a request's charge is settled after its response (:mod:`.settling`).
    settles: EndpointRule | None = None

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
    rule = source.endpoint_rule(endpoint, method)
    if shedder is not None:
        priority = rule.priority
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
        if caller_policies is not None and not rule.exempt:
            checks = _with_caller_policies(checks, caller_policies(source, method), identity, rule.cost)
        # The request's usage is its own checks' (their cost), whatever else is decided with them.
        usage = usage_of(identity, checks) if consume and limiter.counts_usage else None
        if extra:
            checks = [*extra, *checks]
    except BaseException:
        if shedder is not None:
            shedder.finish()  # counted in above, and nothing is held to count it out
        raise
    return identity, _Pending(
        identity=identity,
        endpoint=endpoint,
        consume=consume,
        source=source,
        limiter=limiter,
        shedder=shedder,
        recorder=recorder,
        checks=checks,
        usage=usage,
        generation=generation,
        snapshot=snapshot,
        started=time.perf_counter() if recorder is not None else 0.0,  # what the metrics time the decision from
        settles=rule if consume and rule.settles and not rule.exempt else None,
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
        identity=None,
        endpoint=endpoint,
        consume=consume,
        source=get_policy_source(),
        limiter=get_limiter(),
        shedder=None,
        recorder=get_recorder() if consume else None,
        checks=list(checks),
        usage=None,
        generation=0,
        snapshot=None,
        started=time.perf_counter(),
    )


def _conclude(request: HttpRequest, pending: _Pending, decision: Decision) -> Decision:
    """The steps after a decision, in this order: hold what it took (or let its shedder's place
    go), record it in the metrics, tell the policy source, report the quota thresholds it shows
    crossed, log what shadow policies would deny, and teach the local path a refused credential."""
    _hold_what_it_took(request, pending, decision)
    shadow = decision.shadow_violated
    if pending.recorder is not None:
        _record(pending.recorder, request, pending.endpoint, decision, time.perf_counter() - pending.started, shadow)
    # After holding: if observing fails, closing the response still releases what this request holds.
    pending.source.observe(decision)
    if pending.consume and pending.identity is not None:
        observe_thresholds(decision)
    if shadow:
        _log_shadow(pending, shadow)
    local = pending.limiter.local_path
    if local is not None:
        _teach_local_path(local, request, pending, decision)
    return decision


def _hold_what_it_took(request: HttpRequest, pending: _Pending, decision: Decision) -> None:
    """An admitted request holds its slots and its shedder's place until its response closes; a
    refused one lets the shedder's place go now (the view never ran), and holds only a slot a
    store call may still have taken (``stray_slot``), to give it back."""
    shedder = pending.shedder
    if decision.allowed and pending.consume:
        settlement = None
        if pending.settles is not None and decision.spent:
            settlement = Settlement(
                pending.endpoint,
                pending.settles,
                pending.usage,
                weakref.ref(request),
                counted_by=pending.checks[0] if pending.checks else None,
            )
        elif pending.settles is not None and pending.limiter.settler is None:
            tell_once(
                pending.endpoint,
                "the backend cannot settle a charge (no SettleSupport): it costs what it was admitted at",
            )
        if holds_anything(decision, shedder) or settlement is not None:  # else nothing is made (the usual request)
            # The adaptive capacity times the view, not the store: a slow Redis is the breaker's
            # business, and must not read as every endpoint slowing down.
            hold(
                request,
                Held(
                    limiter=pending.limiter,
                    decision=decision,
                    shedder=shedder,
                    endpoint=pending.endpoint,
                    admitted_at=time.monotonic(),
                    settlement=settlement,
                ),
            )
        return
    if shedder is not None:
        shedder.finish()  # refused by the limiter: the view never ran, so nothing to learn from
    if decision.stray_slot is not None:
        hold(request, Held(limiter=pending.limiter, decision=decision))


def _log_shadow(pending: _Pending, shadow: Sequence[Result]) -> None:
    identity = pending.identity
    logger.info(
        "ratelimits: shadow policies would deny %s: %s",
        identity.caller if identity is not None else f"a request to {pending.endpoint}",
        ", ".join(r.policy_name for r in shadow),
    )


def _teach_local_path(local: LocalPath, request: HttpRequest, pending: _Pending, decision: Decision) -> None:
    """Log an answer from memory (``LOCAL_PATH['HEADER']``), and remember a refused API key's
    credential so that its next requests are refused before authentication."""
    identity = pending.identity
    if decision.local is not None and conf.local_path.header:
        logger.debug(
            "ratelimits: %s answered from memory (%s)",
            identity.caller if identity is not None else f"a request to {pending.endpoint}",
            decision.local,
            extra={"ratelimit_local": decision.local},
        )
    if (
        decision.verdict is Verdict.LIMITED
        and identity is not None
        and identity.api_key is not None
        and pending.consume
    ):
        credential = presented_credential(request)
        if credential is not None:
            usage = pending.usage
            local.note_credential(
                credential,
                pending.endpoint,
                request.method or "GET",
                decision,
                snapshot=pending.snapshot,
                generation=pending.generation,
                usage_field=usage.field if usage is not None else "",
                tokens=usage.tokens if usage is not None else 1,
            )


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
