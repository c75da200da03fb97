"""The measured calls. Import only after :func:`bench.settings.configure`.

Each scenario is a callable ``call(i)`` doing exactly one decision for subject ``i`` (mod the
pool size); it raises :class:`Invalid` if a decision is a denial, so no figure is ever flattered
by a fast 429 path.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import hiredis
from django.test import override_settings
from rest_framework.request import Request
from rest_framework.test import APIRequestFactory
from rest_framework.throttling import AnonRateThrottle, ScopedRateThrottle, UserRateThrottle

from ratelimits.backends.redis import RedisBackend, Script, make_client
from ratelimits.conf import conf
from ratelimits.engine import get_limiter, get_policy_source
from ratelimits.engine.evaluation import usage_of
from ratelimits.identity import identify
from ratelimits.policies import Check
from ratelimits.policies.values import check_for
from ratelimits.rates import parse_rate
from ratelimits.throttles import RateLimitThrottle

from .settings import DRF_RATES, SCOPE, ratelimits_settings

#: How many distinct callers the requests rotate over (a power of two: ``i & mask`` picks one).
SUBJECTS = 1024
#: Callers share organisations, as in real traffic.
ORGANISATIONS = 64


class Invalid(AssertionError):
    """A decision that would make the figures dishonest: a denial, or a fail-open answer."""


class BenchUser:
    """What DRF's authentication puts in ``request.user``: authenticated, with a ``pk``."""

    __slots__ = ("pk",)
    is_authenticated = True
    is_anonymous = False

    def __init__(self, pk: int) -> None:
        self.pk = pk


class BenchKey:
    """What DRF's authentication puts in ``request.auth``: an API key model with a ``pk``."""

    __slots__ = ("org", "pk", "tier")

    def __init__(self, pk: int, tier: str, org: str) -> None:
        self.pk = pk
        self.tier = tier
        self.org = org


class BenchView:
    """The parts of an ``APIView`` the throttles read: ``throttle_scope`` and ``headers``."""

    throttle_scope = SCOPE

    def __init__(self) -> None:
        self.headers: dict[str, str] = {}


def build_requests(count: int = SUBJECTS) -> list[Request]:
    """One authenticated DRF request per caller: distinct API key, user, client IP; shared orgs."""
    factory = APIRequestFactory()
    requests = []
    for i in range(count):
        django_request = factory.get(
            "/v1/payments", REMOTE_ADDR=f"198.51.{i // 256}.{i % 256}", HTTP_AUTHORIZATION=f"Bearer sk_bench_{i}"
        )
        request = Request(django_request)
        request.user = BenchUser(i + 1)
        request.auth = BenchKey(i + 1, "bench", f"org-{i % ORGANISATIONS}")
        requests.append(request)
    return requests


@dataclass
class Scenario:
    key: str
    label: str
    call: Callable[[int], None]
    #: RATELIMITS to switch to while this scenario runs (``None``: the base four-dimension config).
    ratelimits: dict[str, Any] | None = None
    #: Redis commands that make up one decision (for the server-side cost column).
    commands: tuple[str, ...] = ()
    notes: dict[str, Any] = field(default_factory=dict)
    #: Called after each timed block (untimed) to record facts about the state it left.
    observe: Callable[[], dict[str, Any]] | None = None
    observations: dict[str, Any] = field(default_factory=dict)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        if self.ratelimits is None:
            yield
        else:
            with override_settings(RATELIMITS=self.ratelimits):
                yield


def limiter_client() -> Any:
    """The limiter's redis-py client: the very object ``RedisBackend.from_settings`` uses."""
    return make_client(conf.redis.address[0], conf.redis.socket_timeout, conf.redis.connect_timeout)


def ping(client: Any) -> Callable[[int], None]:
    command = client.ping

    def call(i: int) -> None:
        if command() is not True:
            raise Invalid("PING did not answer PONG")

    return call


def ratelimits_throttle(requests: list[Request], view: BenchView, *, flush: bool = False) -> Callable[[int], None]:
    """What DRF's ``check_throttles`` does with ``throttle_classes = [RateLimitThrottle]``.

    ``flush``: then adds the usage the worker counted, when due, as the end of a response does
    (``USAGE['FLUSH_EVERY']``: its one call a second is in the row's figures).
    """
    mask = len(requests) - 1

    def call(i: int) -> None:
        throttle = RateLimitThrottle()
        if not throttle.allow_request(requests[i & mask], view):
            raise Invalid(f"ratelimits denied a request: {throttle.decision}")
        decision = throttle.decision
        if decision is None or decision.degraded:
            raise Invalid("ratelimits answered without Redis (degraded, fail-open)")
        if flush:
            get_limiter().flush_usage()

    return call


class BenchUserRateThrottle(UserRateThrottle):
    """DRF's throttles with the bench's rates as their own: the settings hold no DRF rates, which
    RateLimitThrottle would read (and then decide more than ``RATELIMITS`` says)."""

    THROTTLE_RATES = DRF_RATES


class BenchAnonRateThrottle(AnonRateThrottle):
    THROTTLE_RATES = DRF_RATES


class BenchScopedRateThrottle(ScopedRateThrottle):
    THROTTLE_RATES = DRF_RATES


DRF_STACK = (BenchUserRateThrottle, BenchAnonRateThrottle, BenchScopedRateThrottle)


def drf_stack(requests: list[Request], view: BenchView) -> Callable[[int], None]:
    """DRF's ``APIView.check_throttles`` with User + Anon + Scoped throttles, verbatim in effect."""
    mask = len(requests) - 1
    classes = DRF_STACK

    def call(i: int) -> None:
        request = requests[i & mask]
        throttle_durations = []
        for throttle in [throttle_class() for throttle_class in classes]:
            if not throttle.allow_request(request, view):
                throttle_durations.append(throttle.wait())
        if throttle_durations:
            raise Invalid("a DRF throttle denied a request")

    return call


def drf_history(requests: list[Request]) -> Callable[[], dict[str, Any]]:
    """Mean length of DRF's per-user timestamp lists (its cost grows with them)."""
    from django.core.cache import cache

    def observe() -> dict[str, Any]:
        lengths = [len(cache.get(f"throttle_user_{request.user.pk}", [])) for request in requests[:64]]
        return {"mean_user_history_length": round(sum(lengths) / len(lengths), 2)}

    return observe


def decide_only(backend: RedisBackend, check_lists: list[list[Check]]) -> Callable[[int], None]:
    mask = len(check_lists) - 1
    decide = backend.decide

    def call(i: int) -> None:
        if not decide(check_lists[i & mask]).allowed:
            raise Invalid("RedisBackend.decide denied a request")

    return call


def settling_checks(check_lists: list[list[Check]]) -> list[list[Check]]:
    """The four-dimension checks at 10 a second (the same unreachable burst): at the bench's
    million a second a token refills in a microsecond, before any settlement could give it back,
    and a refund would find nothing unpaid to write."""
    slower: dict[int, Any] = {}

    def slow(check: Check) -> Check:
        policy = slower.setdefault(id(check.policy), replace(check.policy, rate=parse_rate("10/s")))
        return check_for(policy, check.subject, check.cost)

    return [[slow(check) for check in checks] for checks in check_lists]


def settle_only(backend: RedisBackend, check_lists: list[list[Check]], *, give_back: bool) -> Callable[[int], None]:
    """An admission of an endpoint that settles after its response (``counts``, ``max_cost``):
    the decide call that records each check's spend, and with ``give_back`` the settlement of a
    response the endpoint does not count, which gives all of it back (docs/charging.md)."""
    check_lists = settling_checks(check_lists)
    mask = len(check_lists) - 1
    decide, settle = backend.decide_to_settle, backend.settle

    def call(i: int) -> None:
        decision = decide(check_lists[i & mask])
        if not decision.allowed or len(decision.spent) != 4:
            raise Invalid("RedisBackend.decide_to_settle denied a request, or recorded no spend")
        if give_back and settle([(spent, -spent.tokens) for spent in decision.spent]) != 4:
            raise Invalid("RedisBackend.settle gave back fewer than the four spends")

    return call


#: The bench's own scripts: the floors a decision is measured against (see bench/README.md).
SCRIPTS = Path(__file__).resolve().parent / "lua"


def bench_script(name: str) -> Script:
    return bench_script_text(name, (SCRIPTS / name).read_text(encoding="utf-8"))


def bench_script_text(name: str, text: str) -> Script:
    """``text`` as a script the backend runs (by EVALSHA, as the floors are)."""
    return Script(name, text, hashlib.sha1(text.encode()).hexdigest())


ScriptCall = tuple[list[str], list[Any]]


def script_floor(backend: RedisBackend, script: Script, calls: list[ScriptCall]) -> Callable[[int], None]:
    """``script`` run as a decision's script is: on the limiter's own connection, with ``calls[i]``'s KEYS and ARGV."""
    mask = len(calls) - 1
    run = backend._run

    def call(i: int) -> None:
        script_keys, args = calls[i & mask]
        if run(script, script_keys, args) is None:
            raise Invalid(f"{script.name} answered nothing")

    return call


def envoy_style(backend: RedisBackend, descriptors: int) -> Callable[[int], None]:
    """Envoy's ratelimit service, as its Redis sees it: per descriptor an ``INCRBY`` of the window's
    counter and a ``PEXPIRE``, all in one pipeline (inexact fixed windows, no script). Sent on the
    limiter's own connection, packed as a decision is: the transport is the same, only the work differs."""
    names = [f"envoy_{d}" for d in range(descriptors)]

    def call(i: int) -> None:
        subject = i & (SUBJECTS - 1)
        window = int(time.time())
        commands: list[tuple[Any, ...]] = []
        for name in names:
            key = f"bench_{name}_{subject}_{window}"
            commands += [("INCRBY", key, 1), ("PEXPIRE", key, 1000)]
        connection = backend._connection()
        connection.send_packed_command([b"".join(hiredis.pack_command(c) for c in commands)], check_health=False)
        replies = [connection.read_response() for _ in commands]
        if any(count > UNREACHABLE_COUNT for count in replies[::2]):
            raise Invalid("the Envoy-style pipeline counted a window over its limit")

    return call


#: The anchors' limit: as the bench's policies, never reached by one thread.
UNREACHABLE_COUNT = 1_000_000


def limits_fixed_window(redis_url: str) -> Callable[[int], None]:
    """The ``limits`` library's fixed window on its Redis storage, as its users call it: one
    ``hit`` per decision (its ``incr_expire`` script)."""
    from limits import RateLimitItemPerSecond
    from limits.storage import RedisStorage
    from limits.strategies import FixedWindowRateLimiter

    limiter = FixedWindowRateLimiter(RedisStorage(redis_url))
    item = RateLimitItemPerSecond(UNREACHABLE_COUNT)
    hit = limiter.hit

    def call(i: int) -> None:
        if not hit(item, "bench", str(i & (SUBJECTS - 1))):
            raise Invalid("limits' fixed window denied a request")

    return call


def bare_bucket(backend: RedisBackend) -> Callable[[int], None]:
    """``bench/lua/token_bucket.lua``: one exact token bucket, on the limiter's own connection."""
    script = bench_script("token_bucket.lua")
    rate = 1_000_000  # per second: 1 us apart, a burst of a second's worth
    args = [str(1_000_000 // rate), str(1_000_000), "2000"]
    keys = [[f"bench_bucket:{i}"] for i in range(SUBJECTS)]
    run = backend._run

    def call(i: int) -> None:
        if run(script, keys[i & (SUBJECTS - 1)], args)[0] != 1:
            raise Invalid("the bare token bucket denied a request")

    return call


def checks_for(request: Request, view: BenchView) -> list[Check]:
    identity = identify(request, endpoint=SCOPE, auth=request.auth, user=request.user)
    return get_policy_source().checks_for(request, identity)


def decision_calls(backend: RedisBackend, requests: list[Request], check_lists: list[list[Check]]) -> list[ScriptCall]:
    """The KEYS and ARGV of the 4-dimension throttle's decisions, usage row and all, one per caller."""
    identities = [identify(request, endpoint=SCOPE, auth=request.auth, user=request.user) for request in requests]
    return [
        backend.decide_call(checks, consume=True, usage=usage_of(identity, checks), slot=None)
        for identity, checks in zip(identities, check_lists, strict=True)
    ]


def build(redis_url: str) -> list[Scenario]:
    """The scenarios, after checking each one measures what its label says."""
    requests = build_requests()
    view = BenchView()
    one_dimension = ratelimits_settings(redis_url, dimensions=1)

    backend = get_limiter().backend
    if not isinstance(backend, RedisBackend):
        raise RuntimeError(f"expected the Redis backend, got {type(backend).__name__}")
    client = limiter_client()
    if client is not backend.client:
        raise RuntimeError("the PING client is not the limiter's client")

    check_lists = [checks_for(request, view) for request in requests]
    names = [check.policy.name for check in check_lists[0]]
    if names != ["tier:bench", "ip", "org", f"endpoint:{SCOPE}"]:
        raise RuntimeError(f"four-dimension config yields checks {names}")
    for checks in check_lists:
        for check in checks:
            check.key(backend.prefix)  # digests computed once, as a caller holding checks would
    with override_settings(RATELIMITS=one_dimension):
        names_one = [check.policy.name for check in checks_for(requests[0], view)]
    if names_one != ["tier:bench"]:
        raise RuntimeError(f"one-dimension config yields checks {names_one}")

    floor_calls = decision_calls(backend, requests, check_lists)
    noop_calls: list[ScriptCall] = [([], [])]
    # The same decisions sent as a script (EVALSHA), as to a store without Redis Functions.
    by_script = RedisBackend(backend.client, prefix=backend.prefix, timeouts=backend.timeouts)
    by_script.functions.enabled = False

    subjects = {"subjects": len(requests), "organisations": ORGANISATIONS}
    return [
        Scenario(
            "ping",
            "PING (limiter's redis-py client)",
            ping(client),
            commands=("ping",),
            notes={"client": "ratelimits.backends.redis.make_client(REDIS['URL'], 50ms, 50ms)"},
        ),
        Scenario(
            "ratelimits_1dim",
            "ratelimits throttle, 1 dimension",
            ratelimits_throttle(requests, view),
            ratelimits=one_dimension,
            commands=("fcall", "evalsha", "eval"),
            notes={"checks": names_one, **subjects},
        ),
        Scenario(
            "ratelimits_4dim",
            "ratelimits throttle, 4 dimensions",
            ratelimits_throttle(requests, view),
            commands=("fcall", "evalsha", "eval"),
            notes={"checks": names, **subjects},
        ),
        Scenario(
            "ratelimits_4dim_no_usage",
            "ratelimits throttle, 4 dimensions, usage counting off",
            ratelimits_throttle(requests, view),
            ratelimits={**ratelimits_settings(redis_url, dimensions=4), "USAGE": False},
            commands=("fcall", "evalsha", "eval"),
            notes={"checks": names, "usage": False, **subjects},
        ),
        Scenario(
            "ratelimits_4dim_worker_usage",
            "ratelimits throttle, 4 dimensions, usage counted by the worker",
            ratelimits_throttle(requests, view, flush=True),
            ratelimits={**ratelimits_settings(redis_url, dimensions=4), "USAGE": {"FLUSH_EVERY": "1s"}},
            commands=("fcall", "evalsha", "eval"),
            notes={
                "checks": names,
                "usage": "USAGE['FLUSH_EVERY'] = '1s', added after a decision when due",
                **subjects,
            },
        ),
        Scenario(
            "drf_stack",
            "DRF User+Anon+Scoped on django-redis",
            drf_stack(requests, view),
            commands=("get", "set"),
            notes={"throttles": [cls.__name__ for cls in DRF_STACK], **subjects},
            observe=drf_history(requests),
        ),
        Scenario(
            "decide_4",
            "RedisBackend.decide, 4 checks",
            decide_only(backend, check_lists),
            commands=("fcall", "evalsha", "eval"),
            notes={"checks": names, **subjects},
        ),
        Scenario(
            "decide_4_script",
            "RedisBackend.decide, 4 checks, by EVALSHA",
            decide_only(by_script, check_lists),
            commands=("evalsha", "eval"),
            notes={"checks": names, "sent_as": "script", **subjects},
        ),
        Scenario(
            "decide_4_settling",
            "RedisBackend.decide_to_settle, 4 checks",
            settle_only(backend, check_lists, give_back=False),
            commands=("fcall", "evalsha", "eval"),
            notes={"checks": names, "records": "each check's spend, for a settlement", **subjects},
        ),
        Scenario(
            "settle_4_refund",
            "decide_to_settle + settle, 4 checks, all given back",
            settle_only(backend, check_lists, give_back=True),
            commands=("fcall", "evalsha", "eval"),
            notes={"checks": names, "settlement": "lua/refund.lua gives the whole cost back", **subjects},
        ),
        Scenario(
            "envoy_1",
            "anchor: Envoy-style pipeline, 1 descriptor",
            envoy_style(backend, 1),
            commands=("incrby", "pexpire"),
            notes={"per_descriptor": "INCRBY + PEXPIRE, one pipeline", **subjects},
        ),
        Scenario(
            "envoy_4",
            "anchor: Envoy-style pipeline, 4 descriptors",
            envoy_style(backend, 4),
            commands=("incrby", "pexpire"),
            notes={"per_descriptor": "INCRBY + PEXPIRE, one pipeline", **subjects},
        ),
        Scenario(
            "limits_fixed_1",
            "anchor: limits fixed window, 1 dimension",
            limits_fixed_window(redis_url),
            commands=("evalsha", "eval"),
            notes={"library": "limits", "strategy": "FixedWindowRateLimiter", **subjects},
        ),
        Scenario(
            "lua_bucket_1",
            "anchor: bare Lua token bucket, 1 dimension",
            bare_bucket(backend),
            commands=("evalsha", "eval"),
            notes={"script": "bench/lua/token_bucket.lua", **subjects},
        ),
        Scenario(
            "floor_noop",
            "floor: no-op EVALSHA",
            script_floor(backend, bench_script("noop.lua"), noop_calls),
            commands=("evalsha", "eval"),
            notes={"script": "bench/lua/noop.lua"},
        ),
        Scenario(
            "floor_4",
            "floor: a 4-check decision's reads+writes",
            script_floor(backend, bench_script("floor_decide.lua"), floor_calls),
            commands=("evalsha", "eval"),
            notes={"script": "bench/lua/floor_decide.lua", "keys_and_args": "the 4-dimension throttle's", **subjects},
        ),
    ]
