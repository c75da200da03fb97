"""Per-view limits: django-ratelimit's ``ratelimit``, ``is_ratelimited`` and ``get_usage`` on this
engine, and ``throttle``, the whole engine on one plain view.

``@ratelimit(key="ip", rate="5/m")`` limits exactly what it says: ``rate`` per value of ``key``
within ``group``, as a token bucket (GCRA) in the limiter's store, and nothing else. No tier,
dimension, endpoint rule or fleet check applies unless ``policies=True`` adds the request's own
to the same decision. The limits stacked on one view are decided together, in one store call.
docs/decorators.md says what each argument means; docs/migrating-from-django-ratelimit.md what
differs from django-ratelimit.
"""

from __future__ import annotations

import functools
import hashlib
import math
import re
import time
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, NamedTuple, TypedDict, TypeVar, overload

from asgiref.sync import iscoroutinefunction
from django.http import HttpResponse
from django.utils.module_loading import import_string

from ._memo import remember
from .choices import FailMode
from .conf import conf
from .decisions import Decision, Result, Verdict, peek
from .engine.bodies import BodyNotReceived
from .engine.evaluation import adecide_checks, aevaluate, decide_checks, evaluate
from .engine.holding import note_status
from .exceptions import ConfigurationError
from .identity import Subject, SubjectKind, client_ip, subject_of
from .middleware import _auser, _is_drf_view, _set_headers, throttling
from .policies.values import Check, Policy, check_for
from .problems import body_timeout_response, problem_response
from .rates import Rate, check_burst, parse_rate

__all__ = [
    "ALL",
    "UNSAFE",
    "RateLimitUsage",
    "aget_usage",
    "ais_ratelimited",
    "get_usage",
    "is_ratelimited",
    "ratelimit",
    "throttle",
]

View = TypeVar("View", bound=Callable[..., Any])

#: ``method=ALL``: every HTTP method (django-ratelimit's own value, so code written for it works).
ALL: tuple[None] = (None,)
#: ``method=UNSAFE``: the methods that change something.
UNSAFE = ("DELETE", "PATCH", "POST", "PUT")

US = 1_000_000
#: A key's value longer than this is counted by its hash: the subject memos keep the values they
#: are given, and a header or a parameter is as long as the server lets a client make it.
LONGEST_VALUE = 200
#: What ``key=`` may be, for the messages that refuse anything else.
KEY_FORMS = (
    "'ip', 'user', 'user_or_ip', 'header:<name>', 'get:<name>', 'post:<name>', "
    "a callable (group, request) -> str, or the dotted path to one"
)


# -- keys: what a request is counted under ----------------------------------------------------

#: What a key counts a request under: ``(group, request, user) -> subject``.
KeyFunc = Callable[[str, Any, Any], Subject]


def _is_authenticated(user: Any) -> bool:
    return user is not None and bool(getattr(user, "is_authenticated", False))


def _ip(group: str, request: Any, user: Any) -> Subject:
    # The client address as every other limit sees it: trusted proxies, IPv6 networks (docs/security.md).
    return subject_of(SubjectKind.IP, client_ip(request))


def _user(group: str, request: Any, user: Any) -> Subject:
    # Anonymous callers share one bucket, as in django-ratelimit ("user_or_ip" keeps them apart).
    return subject_of(SubjectKind.USER, str(user.pk) if _is_authenticated(user) else "")


def _user_or_ip(group: str, request: Any, user: Any) -> Subject:
    return _user(group, request, user) if _is_authenticated(user) else _ip(group, request, user)


#: The named keys, and whether each reads the request's user (an async view awaits it first).
_NAMED_KEYS: dict[str, tuple[KeyFunc, bool]] = {
    "ip": (_ip, False),
    "user": (_user, True),
    "user_or_ip": (_user_or_ip, True),
}


def _counted(value: object, key: object) -> Subject:
    """The subject a key's value is counted under: hashed into it as identities are, never kept raw."""
    if isinstance(value, bytes):
        value = value.decode("utf-8", "surrogateescape")
    if not isinstance(value, str):
        raise ConfigurationError(f"ratelimit(key={key!r}) gave {value!r}: a key's value must be a str")
    if len(value) > LONGEST_VALUE:
        value = "\x00" + hashlib.blake2b(value.encode("utf-8", "surrogatepass"), digest_size=24).hexdigest()
    return subject_of(SubjectKind.KEY, value)


# A missing header or parameter counts as "": every request without one shares that bucket, as in
# django-ratelimit. Nothing a client sends can make these fail.


def _header(name: str) -> KeyFunc:
    def value(group: str, request: Any, user: Any) -> Subject:
        return _counted(request.headers.get(name, ""), f"header:{name}")

    return value


def _query(name: str) -> KeyFunc:
    def value(group: str, request: Any, user: Any) -> Subject:
        return _counted(request.GET.get(name, ""), f"get:{name}")

    return value


def _form(name: str) -> KeyFunc:
    def value(group: str, request: Any, user: Any) -> Subject:
        return _counted(request.POST.get(name, ""), f"post:{name}")

    return value


_ACCESSORS: dict[str, Callable[[str], KeyFunc]] = {"header": _header, "get": _query, "post": _form}


def _called(func: Callable[[str, Any], object], key: object) -> KeyFunc:
    def value(group: str, request: Any, user: Any) -> Subject:
        return _counted(func(group, request), key)

    return value


def _key_of(key: object, where: str) -> tuple[KeyFunc, bool]:
    """What ``key=`` counts by, and whether it reads the user; a :class:`ConfigurationError` naming it if nothing."""
    if callable(key):
        return _called(key, key), False
    if not isinstance(key, str):
        raise ConfigurationError(f"{where}(key={key!r}) is not a key; expected {KEY_FORMS}")
    return _named_key(key, where)


@functools.lru_cache(maxsize=256)  # is_ratelimited() parses its key on every call
def _named_key(key: str, where: str) -> tuple[KeyFunc, bool]:
    named = _NAMED_KEYS.get(key)
    if named is not None:
        return named
    accessor, colon, name = key.partition(":")
    if colon:
        make = _ACCESSORS.get(accessor)
        if make is None or not name:
            raise ConfigurationError(f"{where}(key={key!r}) is not a key; expected {KEY_FORMS}")
        return make(name), False
    if "." in key:
        return _called(_imported(key, "key", where), key), False
    raise ConfigurationError(f"{where}(key={key!r}) is not a key; expected {KEY_FORMS}")


def _imported(path: str, argument: str, where: str) -> Callable[[str, Any], Any]:
    try:
        found = import_string(path)
    except ImportError as exc:
        raise ConfigurationError(f"{where}({argument}={path!r}): cannot import it: {exc}") from exc
    if not callable(found):
        raise ConfigurationError(f"{where}({argument}={path!r}) is not a callable")
    return found  # type: ignore[no-any-return]


# -- rates ------------------------------------------------------------------------------------


class _Never(NamedTuple):
    """A rate of 0 (``"0/m"``): nothing is admitted; a refusal names ``period_us`` as its wait."""

    period_us: int


#: A rate once read: ``None`` is no limit.
Parsed = Rate | _Never | None
#: A rate decided per request: ``(group, request) -> a rate, or None for no limit``.
RateFunc = Callable[[str, Any], object]

#: django-ratelimit's "100/300": a period without a unit is in seconds.
_BARE = re.compile(r"[0-9]+/[0-9]+", re.ASCII)
_ZERO = re.compile(r"0+/(.*)", re.ASCII | re.DOTALL)
RATE_FORMS = "'N/period' such as '5/m', '100/h' or '5/10m', a (count, seconds) pair, or None for no limit"


def _parsed(value: object, field: str) -> Parsed:
    """``value`` as a rate: ``"5/m"``, ``"100/300"`` (seconds), ``(count, seconds)``, a count of 0, or ``None``."""
    if value is None or isinstance(value, Rate):
        return value
    if isinstance(value, tuple):
        return _pair(value, field)
    if not isinstance(value, str):
        raise ConfigurationError(f"{field}: {value!r} is not a rate; expected {RATE_FORMS}")
    text = value.strip().lower()
    if _BARE.fullmatch(text):
        text += "s"
    zero = _ZERO.fullmatch(text)
    if zero is None:
        return parse_rate(text, field=field)
    try:
        return _Never(parse_rate(f"1/{zero[1]}").period_us)
    except ConfigurationError:
        raise ConfigurationError(f"{field}: {value!r} is not a rate; expected {RATE_FORMS}") from None


def _pair(pair: tuple[Any, ...], field: str) -> Parsed:
    if len(pair) != 2 or not all(type(n) is int for n in pair) or pair[0] < 0 or pair[1] < 1:
        raise ConfigurationError(f"{field}: {pair!r} is not a rate; a pair is (count, seconds) in whole numbers")
    count, seconds = pair
    try:
        return _Never(Rate(1, seconds * US).period_us) if count == 0 else Rate(count, seconds * US)
    except ConfigurationError as exc:
        raise ConfigurationError(f"{field}: {pair!r}: {exc}") from None


def _rate_of(rate: object, where: str) -> Parsed | RateFunc:
    """What ``rate=`` is: a rate read now, or the callable that gives one per request."""
    if callable(rate):
        return rate
    if isinstance(rate, str) and "/" not in rate and "." in rate:
        return _imported(rate, "rate", where)
    return _parsed(rate, f"{where}(rate=...)")


#: What rate callables returned, read: they return the same few values request after request.
_returned: dict[object, Parsed] = {}


def _returned_rate(func: RateFunc, group: str, request: Any) -> Parsed:
    value = func(group, request)
    try:
        return _returned[value]
    except (KeyError, TypeError):  # TypeError: unhashable, so no rate (read below, and refused)
        pass
    parsed = _parsed(value, f"ratelimit(rate={func!r}) returned {value!r}")
    return remember(_returned, value, parsed)


def _methods_of(method: object, where: str) -> frozenset[str] | None:
    """The methods ``method=`` limits (``None``: every one)."""
    if method is None or method == ALL:
        return None
    names = [method] if isinstance(method, str) else method if isinstance(method, (list, tuple, set, frozenset)) else []
    if not names or not all(isinstance(name, str) and name.isascii() and name.isalpha() for name in names):
        raise ConfigurationError(
            f"{where}(method={method!r}) names no method; expected one such as 'POST', a list of them, ALL or UNSAFE"
        )
    return frozenset(name.upper() for name in names)


def _burst_of(burst: object, rate: Parsed | RateFunc, where: str) -> int | None:
    if burst is None:
        return None
    if isinstance(rate, Rate):
        return check_burst(rate, burst, field=f"{where}(burst=...)")
    if isinstance(burst, bool) or not isinstance(burst, int) or burst < 1:
        raise ConfigurationError(f"{where}(burst={burst!r}) must be a positive integer")
    return burst


# -- policies ---------------------------------------------------------------------------------

_NOT_IN_NAMES = re.compile(r"[^A-Za-z0-9_.:/-]", re.ASCII)
MAX_NAME = 200


def _policy_name(group: str, rate: Rate, burst: int, methods: frozenset[str] | None) -> str:
    """``group:<group>:<rate>``, then the burst and methods if given: what headers, bodies and keys name.

    A group with characters a policy name cannot carry (``<locals>``), or too long, keeps a hash
    of itself, so two groups never share a name.
    """
    tail = f":{rate}"
    if burst != rate.limit:
        tail += f":burst{burst}"
    if methods is not None:
        tail += ":" + "-".join(sorted(methods))
    shown = _NOT_IN_NAMES.sub("_", group)
    if shown != group or len("group:") + len(shown) + len(tail) > MAX_NAME:
        digest = hashlib.blake2b(group.encode("utf-8", "surrogatepass"), digest_size=5).hexdigest()
        shown = f"{shown[: max(MAX_NAME - len('group:') - len(tail) - 11, 0)]}-{digest}"
    return f"group:{shown}{tail}"


#: (group, rate, burst, methods, block, fail mode) -> its policy, made once: checks and headers
#: are remembered by their policy object.
_policies: dict[tuple[Any, ...], Policy] = {}


def _policy(group: str, rate: Rate, burst: int, methods: frozenset[str] | None, block: bool) -> Policy:
    # A limit that never refuses cannot fail closed.
    mode = conf.failure.default_mode if block else FailMode.OPEN
    memo = (group, rate, burst, methods, block, mode)
    try:
        return _policies[memo]
    except KeyError:
        pass
    # block=False is a shadow check: spent when the request is admitted, reported when over, never refusing.
    policy = Policy(_policy_name(group, rate, burst, methods), rate, burst, fail_mode=mode, shadow=not block)
    return remember(_policies, memo, policy)


@dataclass(frozen=True, slots=True)
class _Limit:
    """One ``@ratelimit`` (or one ``is_ratelimited`` call): ``rate`` per value of ``key`` within ``group``."""

    group: str
    key: KeyFunc
    rate: Parsed | RateFunc
    #: ``None``: every method.
    methods: frozenset[str] | None
    block: bool
    burst: int | None
    #: Whether ``key`` reads the request's user (an async view awaits it first).
    reads_user: bool

    def check(self, request: Any, user: Any) -> Check | _Never | None:
        """This limit's check of ``request``, or :class:`_Never` if its rate admits no request, or ``None``
        if it does not apply (another method, no rate)."""
        if self.methods is not None and request.method not in self.methods:
            return None
        rate = self.rate
        if callable(rate):
            rate = _returned_rate(rate, self.group, request)
        if rate is None or isinstance(rate, _Never):
            return rate
        burst = rate.limit if self.burst is None else check_burst(rate, self.burst, field="ratelimit(burst=...)")
        policy = _policy(self.group, rate, burst, self.methods, self.block)
        return check_for(policy, self.key(self.group, request, user), 1)


def _limit(where: str, group: str, key: object, rate: object, method: object, block: bool, burst: object) -> _Limit:
    """The limit these arguments describe; a :class:`ConfigurationError` naming the first one that is wrong."""
    if key is None:
        raise ConfigurationError(f"{where}(key=...) is required: {KEY_FORMS}")
    key_func, reads_user = _key_of(key, where)
    parsed = _rate_of(rate, where)
    if not isinstance(block, bool):
        raise ConfigurationError(f"{where}(block={block!r}) must be True or False")
    return _Limit(
        group, key_func, parsed, _methods_of(method, where), block, _burst_of(burst, parsed, where), reads_user
    )


def _group_given(group: object, where: str) -> str | None:
    if group is None or (isinstance(group, str) and group):
        return group
    raise ConfigurationError(f"{where}(group={group!r}) must be a non-empty str: the name the counts are shared under")


def _group_of(view: Any) -> str:
    """A view's default group, as django-ratelimit names it: its module and qualified name."""
    view = getattr(view, "view_class", None) or view  # as_view()'s function is named the same for every class
    while isinstance(view, functools.partial) and not hasattr(view, "__qualname__"):
        view = view.func
    view = getattr(view, "__func__", view)  # a bound method: its function, whose name has its class
    qualname = getattr(view, "__qualname__", None) or type(view).__qualname__
    return f"{getattr(view, '__module__', None) or type(view).__module__}.{qualname}"


def _endpoint(request: Any, group: str) -> str:
    """What a request is limited as: its route's name, else ``group`` (the metrics' label; with
    ``policies=True``, the endpoint whose rule applies)."""
    match = getattr(request, "resolver_match", None)
    return str(match.view_name) if match is not None and match.view_name else group


# -- deciding ---------------------------------------------------------------------------------


class _Asked(NamedTuple):
    """What a request's limits ask the store, and what is known without asking."""

    checks: list[Check]
    #: A refusal by a limit that admits nothing (``"0/m"``) and blocks: nothing is asked then.
    refusal: Decision | None
    #: Whether a limit that admits nothing applies: the request is limited, whatever the store says.
    never: bool


def _ask(request: Any, limits: Sequence[_Limit], user: Any) -> _Asked:
    checks: list[Check] = []
    never = False
    for limit in limits:
        found = limit.check(request, user)
        if isinstance(found, _Never):
            if limit.block:
                refusal = Decision(Verdict.LIMITED, (), found.period_us, time.time_ns() // 1000)
                return _Asked([], refusal, True)
            never = True
        elif found is not None:
            checks.append(found)
    return _Asked(checks, None, never)


def _own_policies(request: Any, policies: bool) -> bool:
    """Whether this decision takes the request's own policies in: asked for, and not decided yet
    (by ``RateLimitMiddleware``, which runs before the view)."""
    return policies and not isinstance(getattr(request, "ratelimit", None), Decision)


def _decided(
    request: Any, asked: _Asked, *, consume: bool, policies: bool, endpoint: str, user: Any
) -> Decision | None:
    """The store's decision on ``asked`` (one call), with the request's policies if ``policies``;
    ``None`` if there is nothing to ask."""
    if asked.refusal is not None:
        return asked.refusal
    if _own_policies(request, policies):
        _, decision = evaluate(request, endpoint=endpoint, user=user, consume=consume, checks=asked.checks)
        return _kept(request, decision, consume)
    if asked.checks:
        return decide_checks(request, asked.checks, endpoint=endpoint, consume=consume)
    return None


async def _adecided(
    request: Any, asked: _Asked, *, consume: bool, policies: bool, endpoint: str, user: Any
) -> Decision | None:
    """:func:`_decided` on the event loop."""
    if asked.refusal is not None:
        return asked.refusal
    if _own_policies(request, policies):
        _, decision = await aevaluate(request, endpoint=endpoint, user=user, consume=consume, checks=asked.checks)
        return _kept(request, decision, consume)
    if asked.checks:
        return await adecide_checks(request, asked.checks, endpoint=endpoint, consume=consume)
    return None


def _kept(request: Any, decision: Decision, consume: bool) -> Decision:
    # The request's policies are decided: as the throttle does, said on the request, where the
    # middlewares read it (RateLimitMiddleware then decides nothing more).
    if consume:
        getattr(request, "_request", request).ratelimit = decision
    return decision


class _Outcome(NamedTuple):
    """What a request's limits decided."""

    #: ``None`` when nothing was asked (no limit applied to the request).
    decision: Decision | None
    #: Over one of the limits, or refused: what ``request.limited`` says.
    limited: bool

    @property
    def refused(self) -> bool:
        """Whether the request is answered 429 (or 503) instead of running the view."""
        return self.decision is not None and not self.decision.allowed


def _outcome(asked: _Asked, decision: Decision | None) -> _Outcome:
    if decision is None or not decision.allowed:
        return _Outcome(decision, asked.never or decision is not None)
    shadow = decision.shadow_violated
    over = False
    if shadow:  # block=False limits over their limit (and not a shadow policy of the request's)
        ours = {(check.policy.name, check.subject) for check in asked.checks}
        over = any((result.policy_name, result.check.subject) in ours for result in shadow)
    return _Outcome(decision, asked.never or over)


# -- the decorator ----------------------------------------------------------------------------


class _Stack(NamedTuple):
    """What a ``@ratelimit`` wrapper decides: its limits, outermost first, and the view it calls."""

    limits: tuple[_Limit, ...]
    view: Callable[..., Any]
    policies: bool


#: Each wrapper ``@ratelimit`` made -> its stack: a ``@ratelimit`` put over it decides both.
_stacks: weakref.WeakKeyDictionary[Callable[..., Any], _Stack] = weakref.WeakKeyDictionary()


def _stack_of(view: Any) -> _Stack | None:
    try:
        return _stacks.get(view)
    except TypeError:  # not weakly referable, so no wrapper made here
        return None


def ratelimit(
    group: str | None = None,
    key: str | Callable[[str, Any], str] | None = None,
    rate: str | tuple[int, int] | Callable[[str, Any], Any] | None = None,
    method: str | Sequence[str] | tuple[None] | None = ALL,
    block: bool = True,
    *,
    burst: int | None = None,
    policies: bool = False,
    scope: str | None = None,
) -> Callable[[View], View]:
    """Limit a view, sync or async, to ``rate`` requests per value of ``key`` within ``group``.

    django-ratelimit's decorator and arguments, on this engine (docs/decorators.md):

    - ``key``: ``"ip"`` (the client address, behind trusted proxies), ``"user"`` (the user's pk),
      ``"user_or_ip"``, ``"header:<name>"``, ``"get:<name>"``, ``"post:<name>"`` (a missing one
      counts as ``""``), or a callable ``(group, request) -> str``, or the dotted path to one.
    - ``rate``: ``"5/m"``, ``"100/h"``, ``"5/10m"``, ``"100/300"`` (seconds), ``(count, seconds)``,
      ``None`` (no limit), a count of 0 (nothing admitted), or a callable ``(group, request) ->``
      one of those, or its dotted path.
    - ``group``: the name the counts are shared under (default: the view's module and name).
    - ``method``: a method, a list of them, :data:`ALL` or :data:`UNSAFE`; others are not counted.
    - ``block``: ``True`` answers a request over the limit with the 429 the throttle gives;
      ``False`` runs the view. ``request.limited`` says which, either way.
    - ``burst``: the bucket's size (default: the rate's count).
    - ``policies``: also decide the request's own policies (its caller's tier, dimensions, the
      endpoint's rule, the fleet), as ``RateLimitThrottle`` does, in the same decision.

    Bad arguments raise a :class:`~ratelimits.exceptions.ConfigurationError` naming the argument
    here, at import. ``scope=`` is the old whole-engine decorator's (deprecated: :func:`throttle`).
    """
    if scope is not None:
        if group is not None or key is not None or rate is not None:
            raise ConfigurationError(
                "ratelimit(scope=...) is the old whole-engine decorator, which takes no group, key or rate: "
                "use throttle(endpoint=...) for the engine, and ratelimit(key=..., rate=...) for a limit of its own"
            )
        warnings.warn(
            "ratelimit(scope=...) is deprecated: use ratelimits.decorators.throttle(endpoint=...), the same decorator",
            DeprecationWarning,
            stacklevel=2,
        )
        return throttling(scope)
    given = _group_given(group, "ratelimit")
    if key is None:
        raise ConfigurationError(
            f"ratelimit(key=...) is required: {KEY_FORMS}. For the whole engine on a view, with no limit of "
            "its own, use ratelimits.decorators.throttle()"
        )
    limit = _limit("ratelimit", given or "", key, rate, method, block, burst)
    if not isinstance(policies, bool):
        raise ConfigurationError(f"ratelimit(policies={policies!r}) must be True or False")

    def decorate(view: View) -> View:
        own = limit if given else replace(limit, group=_group_of(view))
        inner = _stack_of(view)
        if inner is None:
            stack = _Stack((own,), view, policies)
        else:
            # Stacked on another @ratelimit: both decided together, in one store call.
            stack = _Stack((own, *inner.limits), inner.view, policies or inner.policies)
        if stack.policies and _is_drf_view(stack.view):
            raise ConfigurationError(
                "ratelimit(policies=True) around a DRF view: its throttle decides the request's policies after "
                "the decorator, which would charge them twice. Leave policies off, or put @ratelimit below @api_view"
            )
        wrapper = _wrapped(view, stack, _group_of(view))
        _stacks[wrapper] = stack
        return wrapper

    return decorate


def _wrapped(view: View, stack: _Stack, group: str) -> View:
    """``view`` wrapped to decide ``stack`` first (calling ``stack.view``, below any other ``@ratelimit``)."""
    limits, target, policies = stack
    reads_user = policies or any(limit.reads_user for limit in limits)

    if iscoroutinefunction(target):

        @functools.wraps(view)
        async def awrapper(request: Any, *args: Any, **kwargs: Any) -> HttpResponse:
            outcome = _Outcome(None, False)
            if conf.enabled:
                user = await _auser(request) if reads_user else None
                asked = _ask(request, limits, user)
                endpoint = _endpoint(request, group)
                decision = await _adecided(
                    request, asked, consume=True, policies=policies, endpoint=endpoint, user=user
                )
                outcome = _outcome(asked, decision)
            refused = _before(request, outcome)
            if refused is not None:
                return refused
            try:
                response = await target(request, *args, **kwargs)
            except Exception:
                _failed(request, outcome)
                raise
            return _after(request, outcome, response)

        return awrapper  # type: ignore[return-value]

    @functools.wraps(view)
    def wrapper(request: Any, *args: Any, **kwargs: Any) -> HttpResponse:
        outcome = _Outcome(None, False)
        if conf.enabled:
            user = getattr(request, "user", None) if reads_user else None
            asked = _ask(request, limits, user)
            endpoint = _endpoint(request, group)
            try:
                decision = _decided(request, asked, consume=True, policies=policies, endpoint=endpoint, user=user)
            except BodyNotReceived as exc:
                return body_timeout_response(exc.received, exc.expected, exc.timeout)
            outcome = _outcome(asked, decision)
        refused = _before(request, outcome)
        if refused is not None:
            return refused
        try:
            response = target(request, *args, **kwargs)
        except Exception:
            _failed(request, outcome)
            raise
        return _after(request, outcome, response)

    return wrapper  # type: ignore[return-value]


def _before(request: Any, outcome: _Outcome) -> HttpResponse | None:
    """``request.limited`` set (once limited, it stays so); the 429 or 503 if the request is refused."""
    request.limited = bool(getattr(request, "limited", False)) or outcome.limited
    if outcome.decision is not None and outcome.refused:
        return problem_response(outcome.decision)
    return None


def _failed(request: Any, outcome: _Outcome) -> None:
    """The view raised: Django answers 500, which the request's settlement must know."""
    if outcome.decision is not None and outcome.decision.spent:
        note_status(request, 500)


def _after(request: Any, outcome: _Outcome, response: HttpResponse) -> HttpResponse:
    decision = outcome.decision
    if decision is not None:
        _set_headers(response, decision)
        if decision.spent:  # its endpoint charges by outcome, or trues its cost up
            note_status(request, response.status_code)
    return response


# -- from any code ----------------------------------------------------------------------------


class RateLimitUsage(TypedDict):
    """What :func:`get_usage` says of one limit, in django-ratelimit's shape."""

    #: Tokens in use in the bucket (at most ``limit``), this request's included if it was counted.
    count: int
    #: The bucket's size: the burst (the rate's count unless ``burst=`` says otherwise).
    limit: int
    #: Whether the request is (``increment=True``) or would be (``increment=False``) refused.
    should_limit: bool
    #: Seconds until the request would be admitted if it is limited; else until the bucket is whole.
    time_left: int


def _call_limit(where: str, group: object, fn: Any, key: object, rate: object, method: object, burst: object) -> _Limit:
    given = _group_given(group, where)
    if given is None:
        if fn is None:
            raise ConfigurationError(f"{where}() needs group= or fn=: the group whose counts it reads")
        given = _group_of(fn)
    return _limit(where, given, key, rate, method, True, burst)


def is_ratelimited(
    request: Any,
    group: str | None = None,
    fn: Callable[..., Any] | None = None,
    key: str | Callable[[str, Any], str] | None = None,
    rate: str | tuple[int, int] | Callable[[str, Any], Any] | None = None,
    method: str | Sequence[str] | tuple[None] | None = ALL,
    increment: bool = False,
    *,
    burst: int | None = None,
    policies: bool = False,
) -> bool:
    """Whether ``request`` is over ``rate`` per value of ``key`` within ``group`` (or ``fn``'s group).

    ``increment=True`` counts the request if it is admitted (a refused one spends nothing);
    ``increment=False`` spends nothing and says whether a request counted now would be refused.
    ``policies=True`` decides the request's own policies too. ``False`` whenever no limit applies
    (another method, no rate, ``RATELIMITS['ENABLED']`` off).
    """
    limit = _call_limit("is_ratelimited", group, fn, key, rate, method, burst)
    if not conf.enabled:
        return False
    user = getattr(request, "user", None) if limit.reads_user or policies else None
    asked = _ask(request, (limit,), user)
    endpoint = _endpoint(request, limit.group)
    return _outcome(
        asked, _decided(request, asked, consume=increment, policies=policies, endpoint=endpoint, user=user)
    ).limited


async def ais_ratelimited(
    request: Any,
    group: str | None = None,
    fn: Callable[..., Any] | None = None,
    key: str | Callable[[str, Any], str] | None = None,
    rate: str | tuple[int, int] | Callable[[str, Any], Any] | None = None,
    method: str | Sequence[str] | tuple[None] | None = ALL,
    increment: bool = False,
    *,
    burst: int | None = None,
    policies: bool = False,
) -> bool:
    """:func:`is_ratelimited` for async code: the store asked on the event loop."""
    limit = _call_limit("ais_ratelimited", group, fn, key, rate, method, burst)
    if not conf.enabled:
        return False
    user = await _auser(request) if limit.reads_user or policies else None
    asked = _ask(request, (limit,), user)
    endpoint = _endpoint(request, limit.group)
    decision = await _adecided(request, asked, consume=increment, policies=policies, endpoint=endpoint, user=user)
    return _outcome(asked, decision).limited


def get_usage(
    request: Any,
    group: str | None = None,
    fn: Callable[..., Any] | None = None,
    key: str | Callable[[str, Any], str] | None = None,
    rate: str | tuple[int, int] | Callable[[str, Any], Any] | None = None,
    method: str | Sequence[str] | tuple[None] | None = ALL,
    increment: bool = False,
    *,
    burst: int | None = None,
) -> RateLimitUsage | None:
    """What one limit holds for ``request``: :class:`RateLimitUsage`, or ``None`` when none applies.

    ``None`` for another method, no rate, ``RATELIMITS['ENABLED']`` off, or a store that could not
    answer and failed open. ``increment`` as in :func:`is_ratelimited`.
    """
    limit = _call_limit("get_usage", group, fn, key, rate, method, burst)
    if not conf.enabled:
        return None
    user = getattr(request, "user", None) if limit.reads_user else None
    asked = _ask(request, (limit,), user)
    endpoint = _endpoint(request, limit.group)
    decision = _decided(request, asked, consume=increment, policies=False, endpoint=endpoint, user=user)
    return _usage(asked, decision, consume=increment)


async def aget_usage(
    request: Any,
    group: str | None = None,
    fn: Callable[..., Any] | None = None,
    key: str | Callable[[str, Any], str] | None = None,
    rate: str | tuple[int, int] | Callable[[str, Any], Any] | None = None,
    method: str | Sequence[str] | tuple[None] | None = ALL,
    increment: bool = False,
    *,
    burst: int | None = None,
) -> RateLimitUsage | None:
    """:func:`get_usage` for async code: the store asked on the event loop."""
    limit = _call_limit("aget_usage", group, fn, key, rate, method, burst)
    if not conf.enabled:
        return None
    user = await _auser(request) if limit.reads_user else None
    asked = _ask(request, (limit,), user)
    endpoint = _endpoint(request, limit.group)
    decision = await _adecided(request, asked, consume=increment, policies=False, endpoint=endpoint, user=user)
    return _usage(asked, decision, consume=increment)


def _usage(asked: _Asked, decision: Decision | None, *, consume: bool) -> RateLimitUsage | None:
    if decision is None:
        return None
    result = _result_of(asked, decision)
    if result is None:
        # Nothing of the limit's own was decided: a rate that admits nothing, or a store that
        # could not answer (open: no limit applied; closed: refused).
        if decision.allowed:
            return None
        return {"count": 0, "limit": 0, "should_limit": True, "time_left": _seconds(decision.retry_after_us)}
    if not result.allowed:
        count, time_left = result.used, _seconds(result.retry_us)
    elif consume:
        count, time_left = result.used, _seconds(result.reset_us)
    else:
        left = peek(result, now_us=decision.now_us)  # the peek looked one request ahead: taken back
        count, time_left = left.used, left.reset_after_seconds or 0
    return {"count": count, "limit": result.limit, "should_limit": not result.allowed, "time_left": time_left}


def _result_of(asked: _Asked, decision: Decision) -> Result | None:
    """The decision's result for the one check asked (by name and subject: a degraded decision
    made in memory checks a scaled copy of the policy)."""
    if not asked.checks:
        return None
    check = asked.checks[0]
    for result in decision.results:
        if result.policy_name == check.policy.name and result.check.subject == check.subject:
            return result
    return None


def _seconds(us: int) -> int:
    return math.ceil(us / US)


# django-ratelimit's spellings: ratelimit.ALL, is_ratelimited.UNSAFE, ...
for _function in (ratelimit, is_ratelimited, ais_ratelimited, get_usage, aget_usage):
    _function.__dict__.update(ALL=ALL, UNSAFE=UNSAFE)


# -- the whole engine -------------------------------------------------------------------------


@overload
def throttle(view: View, /) -> View: ...
@overload
def throttle(*, endpoint: str | None = None) -> Callable[[View], View]: ...
def throttle(view: View | None = None, /, *, endpoint: str | None = None) -> View | Callable[[View], View]:
    """Limit a plain view, sync or async, with the whole engine, as ``RateLimitThrottle`` limits a DRF view.

    Its caller's tier (and overrides), ``DIMENSIONS``, the endpoint's rule and the fleet, decided
    in one round trip; 429 or 503 with the problem+json body, and the headers on every response.
    ``endpoint`` names it in ``RATELIMITS['ENDPOINTS']`` (default: its route's name). Write
    ``@throttle`` or ``@throttle(endpoint="exports")``.
    """
    if view is not None and not callable(view):
        raise ConfigurationError(f"throttle({view!r}): name the endpoint by keyword, throttle(endpoint={view!r})")
    decorate = throttling(endpoint)
    return decorate if view is None else decorate(view)
