"""Rate-limit response headers: IETF ``RateLimit``/``RateLimit-Policy`` and GitHub's ``X-RateLimit-*``."""

from __future__ import annotations

import base64
import math
import random
from collections.abc import Sequence
from fractions import Fraction
from typing import NamedTuple

from ._memo import remember
from ._numbers import ceil_div
from .algorithms import Algorithm
from .conf import conf
from .decisions import Decision, Result
from .policies.values import Check, Policy, whole_subject

__all__ = ["advised_wait_us", "quota_and_window", "rate_limit_headers", "retry_after_seconds"]

US = 1_000_000
#: The largest Integer an RFC 9651 structured field can carry.
SF_INTEGER_MAX = 999_999_999_999_999
#: The shortest ``w`` past which :func:`quota_and_window` stops looking for an exact one (seconds).
EXACT_WINDOW_FLOOR_S = 60


def rate_limit_headers(decision: Decision) -> dict[str, str]:
    """Headers describing the decision's policies, in the configured style(s).

    IETF syntax follows draft-ietf-httpapi-ratelimit-headers-10/11: ``RateLimit-Policy``
    gives each policy's quota ``q`` over a window of ``w`` seconds, its rate exactly where whole
    numbers can say it (:func:`quota_and_window`; every enforced policy of
    the request, or with ``HEADERS['POLICIES']`` ``"closest"`` only the closest), ``RateLimit`` the
    remaining quota ``r`` of the policy closest to its limit and the seconds ``t`` until it is
    fully restored; on a refused request, the violated policy with the longest wait, and ``t`` is
    that wait: when this request could pass (a drained bucket admits again long before it is
    full). With ``HEADERS['PARTITION_KEY']`` each item carries ``pk``, its subject's keyed
    hash. GitHub's headers describe the closest policy.
    """
    settings = conf.headers
    style = settings.style
    headers: dict[str, str] = {}
    if decision.degraded:
        headers["X-RateLimit-Degraded"] = "1"
    if decision.local is not None and conf.local_path.header:
        headers["X-RateLimit-Local"] = decision.local
    shadow = decision.shadow_violated
    if shadow:
        # What shadow policies would have done, for operators trying a new limit out.
        headers["X-RateLimit-Shadow"] = ", ".join(f'"{r.policy_name}"' for r in shadow)
    closest = decision.closest
    if closest is None or style == "none":
        return headers
    policy = closest.check.policy
    static = _static_parts(policy, decision.now_us)
    remaining = closest.remaining
    # Refused: when this request could pass, what a client waits for (Retry-After's exact wait).
    # Slots have no window: they come back when requests finish, not at a time we could name.
    reset_us = closest.retry_us if not closest.allowed else 0 if policy.holds_slots else closest.reset_us
    if style != "github":  # "ietf" or "both"
        with_keys = settings.partition_key
        key = _partition_key(closest.check) if with_keys else ""
        if settings.policies == "all":
            headers["RateLimit-Policy"] = _policy_list(decision.results, with_keys, decision.now_us)
        else:
            headers["RateLimit-Policy"] = static.policy + key
        if policy.holds_slots:
            headers["RateLimit"] = f"{static.quoted};r={remaining}{key}"
        else:
            headers["RateLimit"] = f"{static.quoted};r={remaining};t={ceil_div(reset_us, US)}{key}"
    if style != "ietf":  # "github" or "both"
        headers["X-RateLimit-Limit"] = static.limit
        headers["X-RateLimit-Remaining"] = str(remaining)
        headers["X-RateLimit-Reset"] = str(ceil_div(decision.now_us + reset_us, US))
        headers["X-RateLimit-Used"] = str(max(policy.capacity - remaining, 0))
        headers["X-RateLimit-Resource"] = policy.name
    return headers


_PolicyLists = dict[tuple[int, ...], tuple[tuple[Policy | Check, ...], str]]
#: Ids -> (what they are the ids of, the ``RateLimit-Policy`` List), without and with ``pk``.
#: Without ``pk`` the List names policies only, so it is keyed by the policies' ids: callers with
#: the same policies share an entry, and the few entries stay in the CPU's caches (keyed by each
#: caller's checks, 1,024 callers cost about 1 µs more a response in the bench). With ``pk`` it is keyed
#: by the checks' ids: a caller's checks are the same objects request after request
#: (:func:`~ratelimits.policies.values.check_for`). An entry holds its objects, so the ids stay theirs.
_lists: tuple[_PolicyLists, _PolicyLists] = ({}, {})


def _policy_list(results: Sequence[Result], with_keys: bool, now_us: int) -> str:
    """``RateLimit-Policy`` as a List of every enforced policy of the results, each once, in their order."""
    memo = _lists[with_keys]
    named: list[Policy | Check] = (
        [result.check for result in results] if with_keys else [result.check.policy for result in results]
    )
    ids = tuple(map(id, named))
    try:
        return memo[ids][1]
    except KeyError:
        pass
    listed = _join_policies([result.check for result in results], with_keys, now_us)
    if any(result.check.policy.period is not None for result in results):
        return listed  # a billing period's window is the period in force: not kept past it
    return remember(memo, ids, (tuple(named), listed))[1]


def _join_policies(checks: Sequence[Check], with_keys: bool, now_us: int) -> str:
    # Names are the List's keys: a policy checked twice (two subjects of one policy) is listed once.
    items: list[str] = []
    names: list[str] = []
    for check in checks:
        static = _static_parts(check.policy, now_us)
        if static.listed and static.quoted not in names:
            names.append(static.quoted)
            items.append(static.policy + _partition_key(check) if with_keys else static.policy)
    return ", ".join(items)


class _Static(NamedTuple):
    """What a policy's headers say whatever the request: built once per policy."""

    quoted: str
    policy: str
    limit: str
    #: Whether ``RateLimit-Policy`` lists it: shadow policies never deny, and the fleet's
    #: in-flight limit is the platform's, not the caller's (as :attr:`Decision.closest` says).
    listed: bool


#: Policy id -> (policy, its parts). An entry holds its policy, so the id stays its own.
_parts: dict[int, tuple[Policy, _Static]] = {}


def _static_parts(policy: Policy, now_us: int) -> _Static:
    try:
        return _parts[id(policy)][1]
    except KeyError:
        pass
    quoted = f'"{policy.name}"'
    listed = not policy.shadow and policy.algorithm is not Algorithm.FLEET
    if policy.period is not None:
        # The quota over the period in force (a month of 28 to 31 days): made per response, not kept.
        length = policy.period.length_us(now_us)
        return _Static(quoted, f"{quoted};q={policy.capacity};w={ceil_div(length, US)}", str(policy.capacity), listed)
    if policy.holds_slots:
        described = f'{quoted};q={policy.capacity};qu="concurrent-requests"'
    else:
        quota, window = quota_and_window(policy)
        described = f"{quoted};q={quota};w={window}"
    static = _Static(quoted, described, str(policy.capacity), listed)
    remember(_parts, id(policy), (policy, static))
    return static


def quota_and_window(policy: Policy) -> tuple[int, int]:
    """``RateLimit-Policy``'s ``q`` and ``w`` for a policy that refills with time: ``q / w`` is its rate.

    ``w`` is the smallest whole number of seconds over which the rate grants a whole number of
    requests, ``q``, and that is no shorter than the time the policy grants its capacity in (a
    token bucket's refill from empty, a window's period): so ``q`` is never below the capacity,
    and ``RateLimit``'s ``r`` never above ``q``. ``10/s`` with a burst of 20 is ``q=20;w=2``,
    ``2/s`` with a burst of 5 ``q=6;w=3``, ``1/1500ms`` ``q=2;w=3``, ``2/500ms`` ``q=4;w=1``.

    Such a ``w`` is a multiple of the denominator of the rate in requests per second, and is
    looked for up to a bound: twice the longest of that time, the period and a minute (each in
    whole seconds, rounded up), which every period of whole seconds stays below. Past it (a
    period like ``1001ms``, whose rate is 1000/1001 a second), ``w`` is the bound and ``q`` the
    rate times it, rounded to the nearest: within half a request of the policy's over ``w``.
    ``q`` is at most the field's largest Integer, which only rates of trillions a second reach.
    """
    rate = Fraction(policy.rate.limit * US, policy.rate.period_us)  # per second
    shortest = max(math.ceil(policy.capacity / rate), 1)
    step = rate.denominator  # the rate grants whole requests over multiples of it
    window = ceil_div(shortest, step) * step
    bound = 2 * max(shortest, ceil_div(policy.rate.period_us, US), EXACT_WINDOW_FLOOR_S)
    if window <= bound:
        quota = rate.numerator * (window // step)
    else:
        window = bound
        quota = math.floor(rate * window + Fraction(1, 2))
    return min(quota, SF_INTEGER_MAX), window


#: Check id -> (check, its ``pk`` parameter). An entry holds its check, so the id stays its own.
_keys: dict[int, tuple[Check, str]] = {}


def _partition_key(check: Check) -> str:
    """``;pk=``, the Byte Sequence of the keyed hash of the check's subject (:attr:`Subject.digest`).

    The hash key names carry: 12 bytes of a keyed BLAKE2b, so it names the subject without
    saying who it is. A sharded policy's check names its whole subject, not the shard the
    request was counted in, so a caller's partition stays the same from request to request.
    """
    try:
        return _keys[id(check)][1]
    except KeyError:
        pass
    raw = base64.urlsafe_b64decode(whole_subject(check).digest)
    key = f";pk=:{base64.b64encode(raw).decode('ascii')}:"
    remember(_keys, id(check), (check, key))
    return key


def retry_after_seconds(decision: Decision) -> int:
    """``Retry-After`` in whole seconds: the exact wait plus optional jitter, rounded up, at least 1.

    The one rule for the header: the problem responses write it, and a 503 raised to DRF's own
    exception handler carries it (``ratelimits.drf.RateLimitUnavailable.wait``); a 429 that
    handler writes rounds up the throttle's ``wait()``, :func:`advised_wait_us` in seconds, which
    comes to the same. Jitter only ever adds, so a client that obeys the header is never early.
    """
    return max(ceil_div(advised_wait_us(decision), US), 1)


def advised_wait_us(decision: Decision) -> int:
    """The wait a denied caller is told (us): the exact wait, plus a random jitter of up to
    ``HEADERS['RETRY_AFTER_JITTER']`` if set, so that refused clients do not all come back at once."""
    jitter = conf.headers.retry_after_jitter_us
    return decision.retry_after_us + (random.randint(0, jitter) if jitter else 0)
