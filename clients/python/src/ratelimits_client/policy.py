"""When a client retries a 429 or 503, and how long it waits: the server's advice, backoff, budget, throttle. No I/O."""

from __future__ import annotations

import email.utils
import json
import logging
import math
import random
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass, field, replace
from datetime import UTC
from typing import Any, Literal

__all__ = [
    "IDEMPOTENCY_KEY",
    "IDEMPOTENT_METHODS",
    "LONGEST_SLEEP",
    "MAX_PROBLEM_BYTES",
    "AdaptiveThrottle",
    "Advice",
    "ClientError",
    "GiveUp",
    "OverloadedError",
    "RateLimitedError",
    "Retrier",
    "RetryBudget",
    "RetryError",
    "RetryOptions",
    "ThrottledLocally",
    "Verdict",
    "parse_problem",
    "parse_ratelimit_reset",
    "parse_retry_after",
    "problem_retry_after",
    "read_advice",
]

# Named as when the client was ratelimits.client, a module of django-ratelimits: a logging set-up
# written for it (or for the "ratelimits" logger above it) keeps receiving the retries.
logger = logging.getLogger("ratelimits.client")

#: Methods RFC 9110 defines as idempotent: sending one twice has the effect of sending it once.
IDEMPOTENT_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "PUT", "DELETE", "TRACE"})
#: A request carrying this header (any value) asks the server to deduplicate it, so it may be retried.
IDEMPOTENCY_KEY = "Idempotency-Key"
#: The longest wait slept through even with ``max_wait=math.inf`` (about 31 years): beyond it
#: ``time.sleep`` and the event loops' timers overflow.
LONGEST_SLEEP = 1e9
#: Larger 429/503 bodies are still read (to free the connection) but not parsed for advice.
MAX_PROBLEM_BYTES = 64 * 1024

#: Why a client stopped retrying and raised.
GiveUp = Literal["not_retryable", "retries_exhausted", "wait_too_long", "budget_exhausted"]

# Budget tokens are counted in millionths, so that deposits of a fractional ratio add up exactly.
_MICRO = 1_000_000
# The adaptive throttle's window is kept as this many slots (a slot ages out whole).
_SLOTS = 60


# --- Options -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class RetryOptions:
    """How a client retries 429 and 503 answers. Every field is validated on construction."""

    #: Retries after the first attempt (0: never retry, still raise the typed error).
    max_retries: int = 3
    #: Exponential backoff without advice: retry n waits uniform(0, min(cap, base * 2**(n-1))) s.
    backoff_base: float = 0.1
    backoff_cap: float = 20.0
    #: Randomise waits. ``False`` waits exactly the advice (or the backoff ceiling): herds stay herds.
    jitter: bool = True
    #: Jitter on top of advice, as a share of the advised wait (at least backoff_base, at most backoff_cap):
    #: with 0.5, a retry told to wait F seconds comes back between F and 1.5F.
    advice_spread: float = 0.5
    #: Advice longer than this (seconds) is not slept through: the error is raised at once, carrying it.
    max_wait: float = 60.0
    #: Statuses that are retried (and that count as refusals for the adaptive throttle).
    retry_statuses: Collection[int] = frozenset({429, 503})
    #: Retry budget: each original request adds this many tokens, a retry spends one.
    budget_ratio: float = 0.2
    #: The budget's capacity, and what it holds at the start.
    budget_reserve: float = 10.0
    #: Client-side adaptive throttling (Google SRE book, "Handling Overload").
    adaptive: bool = False
    adaptive_k: float = 2.0
    adaptive_window: float = 120.0
    #: Randomness for jitter and the throttle's draws; a fresh ``random.Random()`` when None.
    rng: random.Random | None = field(default=None, compare=False, repr=False)
    #: Monotonic seconds, for the adaptive throttle's window.
    clock: Callable[[], float] = field(default=time.monotonic, compare=False, repr=False)

    def __post_init__(self) -> None:
        _count("max_retries", self.max_retries)
        _number("backoff_base", self.backoff_base, positive=True)
        _number("backoff_cap", self.backoff_cap)
        if self.backoff_cap < self.backoff_base:
            raise ValueError(f"RetryOptions.backoff_cap ({self.backoff_cap!r}) is below backoff_base")
        _flag("jitter", self.jitter)
        _number("advice_spread", self.advice_spread)
        _number("max_wait", self.max_wait, infinite=True)
        object.__setattr__(self, "retry_statuses", _statuses(self.retry_statuses))
        _number("budget_ratio", self.budget_ratio)
        if self.budget_ratio > 1:
            raise ValueError(f"RetryOptions.budget_ratio must be at most 1, not {self.budget_ratio!r}")
        _number("budget_reserve", self.budget_reserve)
        if self.budget_reserve < 1:
            raise ValueError(
                f"RetryOptions.budget_reserve must be at least 1 (a budget that holds less than one "
                f"token never allows a retry), not {self.budget_reserve!r}"
            )
        _flag("adaptive", self.adaptive)
        _number("adaptive_k", self.adaptive_k)
        if self.adaptive_k < 1:
            raise ValueError(
                f"RetryOptions.adaptive_k must be at least 1 (below 1 it rejects requests a healthy "
                f"server accepts), not {self.adaptive_k!r}"
            )
        _number("adaptive_window", self.adaptive_window, positive=True)
        if self.rng is not None and not isinstance(self.rng, random.Random):
            raise TypeError(f"RetryOptions.rng must be a random.Random or None, not {type(self.rng).__name__}")
        if not callable(self.clock):
            raise TypeError(f"RetryOptions.clock must be callable, not {type(self.clock).__name__}")


def _count(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"RetryOptions.{name} must be an int, not {type(value).__name__}")
    if value < 0:
        raise ValueError(f"RetryOptions.{name} must be at least 0, not {value!r}")


def _number(name: str, value: object, *, positive: bool = False, infinite: bool = False) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise TypeError(f"RetryOptions.{name} must be a number, not {type(value).__name__}")
    if math.isnan(value) or (math.isinf(value) and not infinite):
        raise ValueError(f"RetryOptions.{name} must be finite, not {value!r}")
    if value < 0 or (positive and value == 0):
        raise ValueError(f"RetryOptions.{name} must be {'above' if positive else 'at least'} 0, not {value!r}")


def _flag(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"RetryOptions.{name} must be a bool, not {type(value).__name__}")


def _statuses(value: object) -> frozenset[int]:
    if isinstance(value, str | bytes) or not isinstance(value, Collection):
        raise TypeError(f"RetryOptions.retry_statuses must be a collection of ints, not {type(value).__name__}")
    for status in value:
        if not isinstance(status, int) or isinstance(status, bool) or not 400 <= status <= 599:
            raise ValueError(f"RetryOptions.retry_statuses must hold statuses from 400 to 599, not {status!r}")
    return frozenset(value)


# --- Errors --------------------------------------------------------------------------------------


class ClientError(Exception):
    """Base of the errors ``ratelimits_client`` raises."""


class ThrottledLocally(ClientError):
    """Adaptive throttling refused the request before it reached the network."""

    def __init__(self, probability: float, requests: int, accepts: int) -> None:
        super().__init__(
            f"rejected locally by adaptive throttling (probability {probability:.2f}: "
            f"{requests} requests, {accepts} accepted in the window)"
        )
        self.probability = probability
        self.requests = requests
        self.accepts = accepts


class RetryError(ClientError):
    """The server answered a retry status and the client stopped retrying.

    ``response`` is the final ``requests.Response`` or ``httpx.Response``, its body read (and its
    connection released); ``problem`` its parsed JSON body when it had one; ``retry_after`` the
    advised wait in seconds (:attr:`Advice.wait`) or None.
    """

    def __init__(
        self,
        *,
        status: int,
        reason: GiveUp,
        attempts: int,
        retry_after: float | None,
        problem: dict[str, Any] | None,
        response: Any,
    ) -> None:
        advised = "no advice" if retry_after is None else f"advised {retry_after:g} s"
        super().__init__(f"HTTP {status} after {attempts} attempt(s), gave up: {reason} ({advised})")
        self.status = status
        self.reason: GiveUp = reason
        self.attempts = attempts
        self.retry_after = retry_after
        self.problem = problem
        self.response = response


class RateLimitedError(RetryError):
    """429: the caller is over its limit."""


class OverloadedError(RetryError):
    """503 (or another configured retry status): the platform is overloaded or unavailable."""


# --- Advice --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Advice:
    """When a 429 or 503 said to come back, in seconds from now, per source; None where it said nothing usable."""

    #: ``Retry-After``: delay-seconds or an HTTP-date.
    retry_after: float | None = None
    #: The IETF ``RateLimit`` field: the largest ``t`` among the policies it reports exhausted (``r=0``).
    ratelimit_reset: float | None = None
    #: The problem body's ``retry_after_ms``, in seconds.
    problem: float | None = None

    @property
    def wait(self) -> float | None:
        """The wait the server named: ``Retry-After`` (or ``retry_after_ms``), else ``RateLimit``'s ``t``.

        ``Retry-After`` wins over ``RateLimit`` as the IETF draft says: ``t`` may be the time until
        a limit is whole again, far beyond when the next request passes. ``retry_after_ms`` is the
        same wait to the millisecond when ``Retry-After`` is it rounded up to whole seconds (within
        a second above it): then it is waited, not the rounding. Advice that disagrees beyond
        that (a server's jitter, another hop's header) is waited in full: the longer of the two.
        """
        after, exact = self.retry_after, self.problem
        if after is not None and exact is not None:
            return exact if exact <= after < exact + 1 else max(after, exact)
        if after is not None:
            return after
        return exact if exact is not None else self.ratelimit_reset


# Delay-seconds is digits (RFC 9110); a decimal fraction is accepted too, since some servers send one.
_DELAY = re.compile(r"[0-9]+(?:\.[0-9]+)?", re.ASCII)
# A structured-field integer: at most 15 digits.
_INTEGER = re.compile(r"-?[0-9]{1,15}", re.ASCII)


def parse_retry_after(value: str | None, now: float) -> float | None:
    """``Retry-After`` as seconds from ``now`` (epoch seconds), or None if absent or malformed.

    An HTTP-date in the past means 0.
    """
    if value is None:
        return None
    value = value.strip()
    if _DELAY.fullmatch(value):
        return float(value)  # digits too many for a float are inf: a wait longer than any max_wait
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if when.tzinfo is None:  # "-0000": UTC without a claim about the local zone
        when = when.replace(tzinfo=UTC)
    try:
        return max(when.timestamp() - now, 0.0)
    except (OverflowError, OSError):
        return math.inf  # a date beyond what the platform can count: as far as it gets


def _split(value: str, separator: str) -> list[str] | None:
    """Split on ``separator`` outside double-quoted strings; None if a quote is left open."""
    parts: list[str] = []
    current: list[str] = []
    quoted = escaped = False
    for char in value:
        if quoted:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                quoted = False
            current.append(char)
        elif char == separator:
            parts.append("".join(current))
            current = []
        else:
            quoted = char == '"'
            current.append(char)
    if quoted:
        return None
    parts.append("".join(current))
    return parts


def parse_ratelimit_reset(value: str | None) -> float | None:
    """The largest ``t`` among the ``RateLimit`` field's items with ``r=0``, or None.

    The field may report several policies (``"a";r=0;t=5, "b";r=7;t=60``). Only an exhausted
    policy holds the caller back; a policy with quota left says when it will be *full*, not when
    a request may pass, so its ``t`` is no advice. Malformed items are skipped.
    """
    members = _split(value, ",") if value else None
    waits: list[float] = []
    for member in members or ():
        parts = _split(member, ";") or []
        params: dict[str, str] = {}
        for param in parts[1:]:
            key, _, val = param.partition("=")
            params[key.strip().lower()] = val.strip()
        remaining, reset = params.get("r", ""), params.get("t", "")
        if _INTEGER.fullmatch(remaining) and _INTEGER.fullmatch(reset) and int(remaining) == 0 and int(reset) >= 0:
            waits.append(float(reset))
    return max(waits) if waits else None


def parse_problem(content_type: str | None, body: bytes) -> dict[str, Any] | None:
    """The JSON object of an ``application/problem+json`` (or other JSON) body, or None."""
    if not content_type or len(body) > MAX_PROBLEM_BYTES:
        return None
    media = content_type.partition(";")[0].strip().lower()
    if media != "application/json" and not media.endswith("+json"):
        return None
    try:
        document = json.loads(body)
    except (ValueError, RecursionError):
        return None
    return document if isinstance(document, dict) else None


def problem_retry_after(problem: dict[str, Any] | None) -> float | None:
    """The problem body's ``retry_after_ms`` in seconds, or None if absent or not a non-negative number.

    A number too large for a float (``1e999``, 400 digits) is an infinite wait: the client gives
    up with ``wait_too_long``, rather than reading it as no advice and retrying at once.
    """
    value = problem.get("retry_after_ms") if problem else None
    if not isinstance(value, int | float) or isinstance(value, bool) or value != value:  # NaN
        return None
    try:
        seconds = float(value) / 1000
    except OverflowError:
        seconds = math.inf if value > 0 else -math.inf
    return seconds if seconds >= 0 else None


def read_advice(
    *, retry_after: str | None, ratelimit: str | None, content_type: str | None, body: bytes, now: float
) -> tuple[Advice, dict[str, Any] | None]:
    """Everything a 429 or 503 said about when to come back, and its problem body."""
    problem = parse_problem(content_type, body)
    advice = Advice(parse_retry_after(retry_after, now), parse_ratelimit_reset(ratelimit), problem_retry_after(problem))
    return advice, problem


# --- Budget and throttle -------------------------------------------------------------------------


class RetryBudget:
    """A token bucket of retries, shared by every request of one client (thread-safe).

    It holds ``reserve`` tokens at the start and never more. Each original request adds
    ``ratio`` tokens; a retry takes one, and without a whole token there is no retry. Over any
    stretch of time, retries are at most ``reserve + ratio * originals`` in it.
    """

    def __init__(self, ratio: float, reserve: float) -> None:
        # Rounded down: the budget never grants more than the ratio says.
        self._deposit = math.floor(ratio * _MICRO)
        self._capacity = math.floor(reserve * _MICRO)
        self._tokens = self._capacity
        self._lock = threading.Lock()

    @property
    def tokens(self) -> float:
        """What the budget holds now."""
        return self._tokens / _MICRO

    def deposit(self) -> None:
        """An original request was sent."""
        with self._lock:
            self._tokens = min(self._tokens + self._deposit, self._capacity)

    def withdraw(self) -> bool:
        """Take one token for a retry; False (and nothing taken) if there is not a whole one."""
        with self._lock:
            if self._tokens < _MICRO:
                return False
            self._tokens -= _MICRO
            return True


class AdaptiveThrottle:
    """Client-side adaptive throttling, from the Google SRE book's chapter "Handling Overload".

    Over the last ``window`` seconds it counts ``requests`` (attempts sent, plus original requests
    it rejected) and ``accepts`` (answers that were not a retry status). An original request is
    rejected locally with probability ``max(0, (requests - k * accepts) / (requests + 1))``. The
    window is kept in 60 slots, so it slides in steps of ``window / 60``. Thread-safe.
    """

    def __init__(self, k: float, window: float, clock: Callable[[], float]) -> None:
        self.k = k
        self._slot = window / _SLOTS
        self._clock = clock
        self._lock = threading.Lock()
        #: [slot index, requests, accepts], oldest first.
        self._slots: deque[list[int]] = deque()

    def _current(self) -> list[int]:
        index = math.floor(self._clock() / self._slot)
        while self._slots and self._slots[0][0] <= index - _SLOTS:
            self._slots.popleft()
        if not self._slots or self._slots[-1][0] < index:
            self._slots.append([index, 0, 0])
        return self._slots[-1]

    def counts(self) -> tuple[int, int]:
        """(requests, accepts) in the window."""
        with self._lock:
            self._current()
            return sum(slot[1] for slot in self._slots), sum(slot[2] for slot in self._slots)

    def probability(self, requests: int, accepts: int) -> float:
        """The chance of rejecting the next original request, given the window's counts."""
        return max(0.0, (requests - self.k * accepts) / (requests + 1))

    def admit(self, rng: random.Random) -> None:
        """Count an original request; reject it (raise :class:`ThrottledLocally`) with the throttle's probability."""
        with self._lock:
            slot = self._current()
            requests = sum(s[1] for s in self._slots)
            accepts = sum(s[2] for s in self._slots)
            slot[1] += 1
        chance = self.probability(requests, accepts)
        if chance and rng.random() < chance:
            raise ThrottledLocally(chance, requests, accepts)

    def sent(self) -> None:
        """Count a retry sent."""
        with self._lock:
            self._current()[1] += 1

    def accepted(self) -> None:
        """Count an answer that was not a retry status."""
        with self._lock:
            self._current()[2] += 1


# --- The retrier ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Verdict:
    """What to do after a retry status: wait ``delay`` seconds and retry, or give up for ``reason``."""

    delay: float | None
    reason: GiveUp | None
    advice: Advice
    problem: dict[str, Any] | None


class Retrier:
    """One client's retry state (options, budget, throttle, randomness), shared by all its requests.

    The transports drive it: :meth:`begin` before a request's first attempt, :meth:`refused` on
    every answer, :meth:`assess` on a refusal, :meth:`error` to give up. Thread-safe.
    """

    def __init__(self, options: RetryOptions | None = None, **overrides: Any) -> None:
        options = options or RetryOptions()
        self.options = replace(options, **overrides) if overrides else options
        self.budget = RetryBudget(self.options.budget_ratio, self.options.budget_reserve)
        self.throttle = (
            AdaptiveThrottle(self.options.adaptive_k, self.options.adaptive_window, self.options.clock)
            if self.options.adaptive
            else None
        )
        self.rng = self.options.rng or random.Random()

    def begin(self) -> None:
        """Before a request's first attempt: maybe reject it locally, else credit the budget."""
        if self.throttle is not None:
            self.throttle.admit(self.rng)
        self.budget.deposit()

    def refused(self, status: int) -> bool:
        """Whether an answer is a retry status (counted by the throttle either way)."""
        if status in self.options.retry_statuses:
            return True
        if self.throttle is not None:
            self.throttle.accepted()
        return False

    def retryable(self, method: str, has_idempotency_key: bool, replayable: bool) -> bool:
        """Whether sending the request again is safe: idempotent (or keyed) and its body can be sent again."""
        return replayable and (method.upper() in IDEMPOTENT_METHODS or has_idempotency_key)

    def assess(
        self,
        *,
        attempts: int,
        retryable: bool,
        retry_after: str | None,
        ratelimit: str | None,
        content_type: str | None,
        body: bytes,
    ) -> Verdict:
        """After ``attempts`` attempts ended in a retry status: how long to wait, or why to give up.

        A retry is granted last, after every other reason to give up, so that only a retry that
        will be sent takes a budget token.
        """
        advice, problem = read_advice(
            retry_after=retry_after, ratelimit=ratelimit, content_type=content_type, body=body, now=time.time()
        )
        wait = advice.wait
        reason: GiveUp | None = None
        if not retryable:
            reason = "not_retryable"
        elif attempts > self.options.max_retries:
            reason = "retries_exhausted"
        elif wait is not None and wait > min(self.options.max_wait, LONGEST_SLEEP):
            reason = "wait_too_long"  # (a longer sleep than the platform's timers allow would raise)
        elif not self.budget.withdraw():
            reason = "budget_exhausted"
        if reason is not None:
            return Verdict(None, reason, advice, problem)
        if self.throttle is not None:
            self.throttle.sent()
        return Verdict(self.delay(attempts, wait), None, advice, problem)

    def delay(self, retry: int, advised: float | None) -> float:
        """The wait before retry number ``retry`` (1 for the first).

        With advice: the advice plus uniform(0, spread), spread = advice_spread * advice within
        [backoff_base, backoff_cap]. Without: uniform(0, min(backoff_cap, backoff_base * 2**(retry-1))).
        Without jitter, the advice itself or that ceiling.
        """
        options = self.options
        if advised is None:
            ceiling = min(options.backoff_cap, options.backoff_base * 2.0 ** min(retry - 1, 64))
            return self.rng.uniform(0, ceiling) if options.jitter else ceiling
        if not options.jitter:
            return advised
        spread = min(options.backoff_cap, max(options.backoff_base, options.advice_spread * advised))
        return advised + self.rng.uniform(0, spread)

    def error(self, status: int, verdict: Verdict, attempts: int, response: Any) -> RetryError:
        """The error for giving up on ``response``: :class:`RateLimitedError` (429) or :class:`OverloadedError`."""
        if verdict.reason is None:
            raise ValueError("this verdict is a retry, not a reason to give up")
        kind = RateLimitedError if status == 429 else OverloadedError
        return kind(
            status=status,
            reason=verdict.reason,
            attempts=attempts,
            retry_after=verdict.advice.wait,
            problem=verdict.problem,
            response=response,
        )

    @staticmethod
    def log_retry(method: str, url: object, status: int, attempts: int, verdict: Verdict) -> None:
        """One DEBUG line per retry."""
        logger.debug(
            "%s %s answered %d (attempt %d): retrying in %.3f s (advised %s)",
            method,
            url,
            status,
            attempts,
            verdict.delay,
            "nothing" if verdict.advice.wait is None else f"{verdict.advice.wait:g} s",
        )
